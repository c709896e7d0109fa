"""The evaluation baselines (exact TopK, Quest) against deliberately naive references.

The references below loop over heads and pages in float64 and share no code with
``vllm_magicpig.eval.decode.baselines``. Quest (Tang et al. 2024): pages of ``page`` tokens on the
absolute token grid, clipped to the indexed range [lo, hi); a page's score is
sum_d max(q_d * min_d, q_d * max_d) over its valid keys; the ceil(budget / page)
best pages (all of them when budget >= hi - lo) are attended in full, so edge pages
may contribute fewer than ``page`` keys.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_magicpig.eval.decode import baselines
from vllm_magicpig.eval.decode.baselines import BaselineDecode, _select
from vllm_magicpig.kv_layout import KVViews
from vllm_magicpig.planner import DecodePlan


# --------------------------------------------------------------------------- references
def naive_pages(lo: int, hi: int, page: int) -> list[list[int]]:
    """Valid absolute positions of every page that meets [lo, hi), in page order."""
    out = []
    p = lo // page
    while p * page < hi:
        out.append([t for t in range(p * page, (p + 1) * page) if lo <= t < hi])
        p += 1
    return out


def naive_bounds(keys: torch.Tensor, q: torch.Tensor, lo: int, hi: int, page: int) -> torch.Tensor:
    """[H, pages] Quest bound in float64, one page at a time."""
    q64 = q.double()
    pages = naive_pages(lo, hi, page)
    b = torch.empty(q.shape[0], len(pages), dtype=torch.float64)
    for i, toks in enumerate(pages):
        kp = keys[toks].double()  # [n_valid, H, D]
        mn, mx = kp.min(0).values, kp.max(0).values
        b[:, i] = torch.maximum(q64 * mn, q64 * mx).sum(-1)
    return b


def naive_take(lo: int, hi: int, budget: int, page: int) -> int:
    n_pages = len(naive_pages(lo, hi, page))
    if budget >= hi - lo:
        return n_pages
    return min(n_pages, max(1, -(-budget // page)))


def naive_quest(keys, q, lo, hi, budget, page) -> list[set[int]]:
    """Chosen absolute positions per head."""
    pages = naive_pages(lo, hi, page)
    b = naive_bounds(keys, q, lo, hi, page)
    take = naive_take(lo, hi, budget, page)
    out = []
    for h in range(q.shape[0]):
        row = b[h].tolist()
        order = sorted(range(len(pages)), key=lambda i: -row[i])
        out.append({t for i in order[:take] for t in pages[i]})
    return out


def naive_topk(logits, lo, hi, budget) -> list[set[int]]:
    out = []
    for h in range(logits.shape[0]):
        row = logits[h].tolist()
        order = sorted(range(lo, hi), key=lambda t: -row[t])
        out.append(set(order[:budget]))
    return out


def chosen_sets(mask: torch.Tensor) -> list[set[int]]:
    return [set(mask[h].nonzero().flatten().tolist()) for h in range(mask.shape[0])]


def make_inputs(seed: int, H: int, s: int, D: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(s, H, D, generator=g).to(dtype)
    q = torch.randn(H, D, generator=g)
    logits = torch.einsum("shd,hd->hs", keys.float(), q)
    return keys, q, logits


# (H, s, D, lo, hi, budget, page)
CASES = [
    pytest.param(9, 300, 16, 4, 250, 20, 16, id="edges-not-aligned"),
    pytest.param(9, 300, 16, 5, 203, 500, 16, id="budget-over-range"),
    pytest.param(9, 300, 16, 5, 203, 198, 16, id="budget-equals-range"),
    pytest.param(9, 300, 16, 7, 250, 5, 16, id="budget-under-one-page"),
    pytest.param(9, 300, 16, 18, 30, 3, 16, id="one-page-only"),
    pytest.param(5, 200, 8, 3, 197, 17, 8, id="page8"),
    pytest.param(9, 128, 16, 0, 128, 40, 16, id="aligned-full"),
    pytest.param(9, 100, 16, 4, 100, 10, 16, id="hi-equals-s-partial-last-page"),
    pytest.param(3, 64, 8, 10, 11, 1, 8, id="single-key"),
    pytest.param(7, 1000, 32, 4, 896, 27, 16, id="3pct-like"),
]


# --------------------------------------------------------------------------- TopK
@pytest.mark.parametrize("H,s,D,lo,hi,budget,page", CASES)
def test_topk_matches_naive(H, s, D, lo, hi, budget, page):
    keys, q, logits = make_inputs(1000 + s + lo + budget, H, s, D)
    mask = _select("topk", logits, keys, q, lo, hi, budget, page)
    assert mask.shape == (H, s) and mask.dtype == torch.bool
    assert not mask[:, :lo].any() and not mask[:, hi:].any()
    assert (mask.sum(1) == min(budget, hi - lo)).all()
    assert chosen_sets(mask) == naive_topk(logits, lo, hi, budget)


# --------------------------------------------------------------------------- Quest
@pytest.mark.parametrize("H,s,D,lo,hi,budget,page", CASES)
def test_quest_matches_naive(H, s, D, lo, hi, budget, page):
    keys, q, logits = make_inputs(2000 + s + lo + budget, H, s, D)
    mask = _select("quest", logits, keys, q, lo, hi, budget, page)
    assert mask.shape == (H, s) and mask.dtype == torch.bool
    assert not mask[:, :lo].any() and not mask[:, hi:].any()
    got = chosen_sets(mask)
    want = naive_quest(keys, q, lo, hi, budget, page)
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quest_half_precision_keys(dtype):
    """finfo(keys.dtype).max padding must not leak into the bound with 16-bit keys."""
    H, s, D, lo, hi, budget, page = 9, 300, 16, 4, 250, 20, 16
    keys, q, logits = make_inputs(7, H, s, D, dtype)
    mask = _select("quest", logits, keys, q, lo, hi, budget, page)
    assert chosen_sets(mask) == naive_quest(keys.float(), q, lo, hi, budget, page)


@pytest.mark.parametrize("H,s,D,lo,hi,budget,page", CASES)
def test_quest_bound_is_upper_bound(H, s, D, lo, hi, budget, page, monkeypatch):
    """Capture the bound tensor the code ranks and check it against every page's keys."""
    keys, q, logits = make_inputs(3000 + s + lo + budget, H, s, D)
    seen = []
    real_topk = torch.topk

    def spy(x, k, *a, **kw):
        seen.append(x.detach().clone())
        return real_topk(x, k, *a, **kw)

    monkeypatch.setattr(baselines.torch, "topk", spy)
    _select("quest", logits, keys, q, lo, hi, budget, page)
    monkeypatch.undo()
    assert len(seen) == 1
    bound = seen[0].double()
    pages = naive_pages(lo, hi, page)
    assert bound.shape == (H, len(pages))
    torch.testing.assert_close(bound, naive_bounds(keys, q, lo, hi, page), rtol=1e-5, atol=1e-4)
    logits64 = torch.einsum("shd,hd->hs", keys.double(), q.double())
    for i, toks in enumerate(pages):
        best = logits64[:, toks].max(1).values
        assert (bound[:, i] >= best - 1e-4).all(), i


@pytest.mark.parametrize("H,s,D,lo,hi,budget,page", CASES)
def test_quest_key_count_rule(H, s, D, lo, hi, budget, page):
    """ceil(budget / page) whole pages (all when budget >= range); edge pages are partial."""
    keys, q, logits = make_inputs(4000 + s + lo + budget, H, s, D)
    mask = _select("quest", logits, keys, q, lo, hi, budget, page)
    n = hi - lo
    take = naive_take(lo, hi, budget, page)
    pages = naive_pages(lo, hi, page)
    for h in range(H):
        chosen = set(mask[h].nonzero().flatten().tolist())
        # the chosen set is a union of whole (clipped) pages, exactly `take` of them
        hit = [i for i, toks in enumerate(pages) if chosen & set(toks)]
        assert len(hit) == take
        assert all(set(pages[i]) <= chosen for i in hit)
        assert len(chosen) == sum(len(pages[i]) for i in hit)
        if budget >= n:
            assert len(chosen) == n
        else:
            assert budget - 2 * (page - 1) <= len(chosen) <= take * page


def test_quest_page1_equals_topk():
    """With one-token pages the bound is q.k itself, so Quest is exact TopK."""
    H, s, D, lo, hi, budget = 9, 400, 16, 4, 350, 23
    keys, q, logits = make_inputs(11, H, s, D)
    quest = _select("quest", logits, keys, q, lo, hi, budget, 1)
    topk = _select("topk", logits, keys, q, lo, hi, budget, 1)
    assert torch.equal(quest, topk)


@pytest.mark.parametrize("method", ["topk", "quest"])
@pytest.mark.parametrize("H,s,D,lo,hi,budget,page", CASES)
def test_needle_is_found(method, H, s, D, lo, hi, budget, page):
    keys, q, _ = make_inputs(5000 + s + lo + budget, H, s, D)
    g = torch.Generator().manual_seed(s + hi)
    # one needle in the middle, and the two edge keys of the range (partial edge pages)
    for j in sorted({lo, hi - 1, int(torch.randint(lo, hi, (1,), generator=g))}):
        k = keys.clone()
        k[j] = 10 * math.sqrt(D) * q / q.norm(dim=1, keepdim=True)  # q.k ~ 10 sqrt(D) |q|
        logits = torch.einsum("shd,hd->hs", k, q)
        others = torch.cat([logits[:, lo:j], logits[:, j + 1 : hi]], 1)
        if others.numel():
            assert (logits[:, j][:, None] > others).all()
        mask = _select(method, logits, k, q, lo, hi, budget, page)
        assert mask[:, j].all(), (method, j)


# --------------------------------------------------------------------------- realistic keys
def _rope(x: torch.Tensor, pos: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    D = x.shape[-1]
    half = D // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    ang = pos[:, None].double() * inv[None]
    c, sn = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * sn, x1 * sn + x2 * c], -1)


def _realistic(seed: int, z: float, H=9, D=64, s=4096, mean_scale=3.0):
    """Keys = large shared mean + noise, RoPE-rotated by position; q RoPE'd at s; one
    needle pushed along q until its logit is z standard deviations above the mean."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 4, ((s - 64) // 512) * 512  # sinks 4, local window 64, 512-token segments
    mu = torch.randn(H, D, generator=g, dtype=torch.float64) * mean_scale
    keys = _rope(mu[None] + torch.randn(s, H, D, generator=g, dtype=torch.float64), torch.arange(s))
    q = _rope(torch.randn(1, H, D, generator=g, dtype=torch.float64), torch.tensor([s]))[0]
    j = int(torch.randint(lo + 16, hi - 16, (1,), generator=g))
    base = torch.einsum("shd,hd->hs", keys, q)[:, lo:hi]
    target = base.mean(1) + z * base.std(1)
    keys[j] += ((target - keys[j].mul(q).sum(1)) / q.norm(dim=1) ** 2)[:, None] * q
    logits = torch.einsum("shd,hd->hs", keys, q)
    return keys.float(), q.float(), logits.float(), lo, hi, j


@pytest.mark.parametrize("z", [4.0, 8.0, 16.0])
def test_realistic_needle_3pct_page16(z):
    """TopK always finds the needle. Quest finds it exactly when the needle's page bound is
    among the ceil(budget/16) best (asserted against the float64 reference); whether that
    happens depends on the needle's strength (see the printed rate), not a must-have."""
    found = []
    for seed in range(3):
        keys, q, logits, lo, hi, j = _realistic(seed, z)
        budget = math.ceil(0.03 * (hi - lo))
        page = 16
        topk = _select("topk", logits, keys, q, lo, hi, budget, page)
        assert topk[:, j].all()
        quest = _select("quest", logits, keys, q, lo, hi, budget, page)
        b = naive_bounds(keys, q, lo, hi, page)
        take = naive_take(lo, hi, budget, page)
        pj = j // page - lo // page
        kth = b.topk(take, dim=1).values[:, -1]
        assert torch.equal(quest[:, j], b[:, pj] >= kth)
        found.append(quest[:, j].float().mean().item())
    print(f"\nrealistic z={z}: Quest (page 16, 3%: {take} pages) found the needle in "
          f"{sum(found) / len(found):.0%} of heads")
    if z >= 16:
        assert all(f == 1.0 for f in found)


# --------------------------------------------------------------------------- forward()
def _fake(method, frac, page, H=9, Hkv=3, D=16, bs=16, seq_lens=(300, 260, 40), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = sum((s + bs - 1) // bs for s in seq_lens) + 3
    kview = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    vview = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    maxb = max((s + bs - 1) // bs for s in seq_lens)
    bt = torch.zeros(len(seq_lens), maxb, dtype=torch.int32)
    used = 0
    for r, s in enumerate(seq_lens):
        k = (s + bs - 1) // bs
        bt[r, :k] = perm[used : used + k]
        used += k
    dense = torch.empty(len(seq_lens), 2, 2, dtype=torch.int32)
    sparse = []
    for r, s in enumerate(seq_lens):
        if s >= 100:  # sinks 4, indexed [4, hi), local tail [hi, s) with a non-page-aligned hi
            hi = s - 37
            dense[r] = torch.tensor([[0, 4], [hi, s]])
            sparse.append(r)
        else:
            dense[r] = torch.tensor([[0, s], [s, s]])
    settings = SimpleNamespace(method=method, budget_fraction=frac, quest_page_size=page, measure_error=False)
    state = SimpleNamespace(settings=settings, num_kv_heads=Hkv, scale=D ** -0.5, name="layer.test")
    plan = DecodePlan(None, len(seq_lens), bt, list(seq_lens), dense, sparse)
    q = torch.randn(len(seq_lens), H, D, generator=g).to(dtype)
    return state, plan, q, kview, vview


def _naive_forward(state, plan, q, kview, vview, H):
    st, bs = state.settings, kview.shape[1]
    group = H // state.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, s in enumerate(plan.seq_lens):
        pos = [(int(plan.block_table[r, t // bs]), t % bs) for t in range(s)]
        K = torch.stack([kview[b, o] for b, o in pos]).double()  # [s, Hkv, D]
        V = torch.stack([vview[b, o] for b, o in pos]).double()
        Kh = torch.stack([K[:, h // group] for h in range(H)], 1)  # [s, H, D]
        qr = q[r].double()
        logits = torch.einsum("shd,hd->hs", Kh, qr) * state.scale
        if r in plan.sparse:
            lo, hi = int(plan.dense_ranges[r, 0, 1]), int(plan.dense_ranges[r, 1, 0])
            budget = math.ceil(st.budget_fraction * (hi - lo))
            if st.method == "topk":
                sel = naive_topk(logits, lo, hi, budget)
            else:
                sel = naive_quest(Kh, qr, lo, hi, budget, st.quest_page_size)
        for h in range(H):
            keep = list(range(s)) if r not in plan.sparse else sorted(set(range(lo)) | set(range(hi, s)) | sel[h])
            w = torch.softmax(logits[h, keep], 0)
            out[r, h] = w @ V[keep, h // group]
    return out


def _forward(state, plan, q, kview, vview, out):
    """The baseline decode method on this fake layer (its settings as the method reads them)."""
    st = state.settings
    ctx = SimpleNamespace(settings=SimpleNamespace(options={"budget_fraction": st.budget_fraction,
                                                            "quest_page_size": st.quest_page_size}),
                          num_kv_heads=state.num_kv_heads, scale=state.scale, name=state.name)
    return BaselineDecode(st.method).forward(ctx, q, KVViews(kview, vview), plan, out)


@pytest.mark.parametrize("method,page", [("topk", 16), ("quest", 16), ("quest", 8)])
def test_forward_matches_naive(method, page):
    H = 9
    state, plan, q, kview, vview = _fake(method, 0.05, page, H=H)
    out = torch.zeros(q.shape, dtype=torch.float32)
    _forward(state, plan, q, kview, vview, out)
    torch.testing.assert_close(out.double(), _naive_forward(state, plan, q, kview, vview, H), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["topk", "quest"])
def test_forward_full_budget_is_exact_attention(method):
    H = 9
    state, plan, q, kview, vview = _fake(method, 1.0, 16, H=H, seed=3)
    out = torch.zeros(q.shape, dtype=torch.float32)
    _forward(state, plan, q, kview, vview, out)
    state.settings.budget_fraction = 1.0
    plan_exact = DecodePlan(None, plan.num_decodes, plan.block_table, plan.seq_lens, plan.dense_ranges, [])
    ref = _naive_forward(state, plan_exact, q, kview, vview, H)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    # and a small budget really differs from exact attention on the sparse requests
    state2, plan2, *_ = _fake(method, 0.02, 16, H=H, seed=3)
    out2 = torch.zeros(q.shape, dtype=torch.float32)
    _forward(state2, plan2, q, kview, vview, out2)
    assert not torch.allclose(out2[0].double(), ref[0], atol=1e-3)
    torch.testing.assert_close(out2[2].double(), ref[2], rtol=1e-4, atol=1e-4)  # short request: exact
