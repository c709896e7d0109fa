"""Budget mode (``vllm_magicpig/budget.py``): the collision model, the (K, L) choice, and the
fraction the real kernel samples with the chosen (K, L) on keys with a controlled angle
distribution. No vLLM engine; the SmolLM2 test is ``test_budget_e2e.py``.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vllm_magicpig import budget as bm
from vllm_magicpig import kernel as kx
from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.index import segment_owner
from vllm_magicpig.layer import SparseLayer
from vllm_magicpig.planner import StepPlanner, StepSettings

from helpers import FakeCam, make_runtime, to_paged

TOLERANCE = 0.25  # the target: within +-25% of the target fraction
TARGETS = (0.01, 0.02, 0.04)


# --------------------------------------------------------------------------- the collision model


def test_sample_probability_is_the_binomial_tail():
    theta = torch.tensor([0.0, 0.3, 1.0, math.pi / 2, 2.5, math.pi], dtype=torch.float64)
    for K, L in ((1, 2), (10, 150), (16, 1024)):
        p = (1 - theta / math.pi) ** K
        want = 1 - (1 - p) ** L - L * p * (1 - p) ** (L - 1)
        got = bm.sample_probability(theta, K, L)
        assert torch.allclose(got, want.clamp(0, 1), atol=1e-12), (K, L, got, want)
    assert float(bm.sample_probability(torch.tensor([0.0]), 10, 150)) == 1.0  # identical direction
    assert float(bm.sample_probability(torch.tensor([math.pi]), 1, 2)) == 0.0  # opposite


def test_sample_probability_matches_simhash_collisions():
    """Monte Carlo with the kernel's own hashing: keys at a fixed angle from the query."""
    g = torch.Generator().manual_seed(3)
    D, K, L, n = 64, 6, 40, 4000
    q = torch.randn(D, generator=g)
    q /= q.norm()
    for theta in (0.6, 1.0, 1.4):
        u = torch.randn(n, D, generator=g)
        u -= (u @ q)[:, None] * q  # orthogonal to q
        u /= u.norm(dim=1, keepdim=True)
        keys = math.cos(theta) * q + math.sin(theta) * u
        hits = torch.zeros(n)
        trials = 6
        for _ in range(trials):
            W = torch.randn(D, K * L, generator=g)
            kc = kx.hash_codes(keys, W, K, L)
            qc = kx.hash_codes(q[None], W, K, L)
            hits += ((kc == qc).sum(1) >= 2).float()
        got = float(hits.mean()) / trials
        want = float(bm.sample_probability(torch.tensor([theta]), K, L))
        assert abs(got - want) < 0.02 + 0.1 * want, (theta, got, want)


def _hist(thetas):
    return torch.histc(torch.as_tensor(thetas, dtype=torch.float64), bins=bm.THETA_BINS, min=0, max=math.pi)


@pytest.mark.parametrize("target", TARGETS + (0.003, 0.1))
def test_choice_is_the_largest_K_then_the_nearest_L(target):
    torch.manual_seed(5)
    thetas = (math.pi / 2 - torch.distributions.Gamma(2.0, 6.0).sample((20000,))).clamp(0.05, math.pi)
    hist = _hist(thetas)
    c = bm.choose_kl(hist, target, max_L=150)
    assert 2 <= c.L <= 150
    assert abs(c.model_fraction / target - 1) < 0.05, c  # integer L lands within a few percent
    assert bm.expected_fraction(hist, c.K, c.L) == pytest.approx(c.model_fraction)
    if c.K < 16:  # a sharper K cannot reach the target within max_L
        assert bm.expected_fraction(hist, c.K + 1, 150) < target


def test_choice_when_unreachable_takes_all_it_may():
    hist = _hist(torch.full((100,), 3.1))  # keys pointing away from every query
    c = bm.choose_kl(hist, 0.5, max_L=64)
    assert (c.K, c.L) == (1, 64)


def test_angle_histogram_counts_every_pair_and_centres_nothing_itself():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 64, generator=g)
    keys = torch.randn(100, 2, 64, generator=g)
    h = bm.angle_histogram(q, keys)
    assert h.dtype == torch.float64 and float(h.sum()) == 6 * 100
    # a key equal to its query head sits in the first bin; its negation in the last
    keys[0, 0] = q[0]
    keys[1, 0] = -q[0]
    h = bm.angle_histogram(q[:1], keys[:2, :1])
    assert float(h[0]) == 1 and float(h[-1]) == 1 and float(h.sum()) == 2


def _gamma_hist():
    torch.manual_seed(8)
    return _hist((math.pi / 2 - torch.distributions.Gamma(2.0, 6.0).sample((20000,))).clamp(0.05, 3))


def test_feedback_learns_the_model_bias_for_later_requests():
    target, hist = 0.02, _gamma_hist()
    b = bm.Budget()
    c0 = b.choose("l", 1, target, hist)
    assert abs(c0.model_fraction / target - 1) < 0.05 and b.request_choice("l", 1, target) == c0
    # the kernel samples 30% less than the model expects (later queries differ from the first)
    for _ in range(bm.FEEDBACK_WINDOW - 1):
        b.add_sampled(target, "l", int(0.7 * c0.model_fraction * 10000), 10000, c0.model_fraction * 10000)
    assert b.bias("l", target) == 1.0  # a window is not complete yet
    b.add_sampled(target, "l", int(0.7 * c0.model_fraction * 10000), 10000, c0.model_fraction * 10000)
    assert b.bias("l", target) == pytest.approx(math.sqrt(0.7), rel=0.01)  # half-way, geometrically
    for _ in range(6 * bm.FEEDBACK_WINDOW):
        b.add_sampled(target, "l", int(0.7 * c0.model_fraction * 10000), 10000, c0.model_fraction * 10000)
    assert b.bias("l", target) == pytest.approx(0.7, rel=0.1)
    assert b.request_choice("l", 1, target) == c0  # an indexed request keeps its (K, L)
    c2 = b.choose("l", 2, target, hist)  # a new request aims higher by the bias
    assert c2.model_fraction == pytest.approx(target / b.bias("l", target), rel=0.05)
    entry = b.snapshot()["budget"]["layers"]["l"]["0.02"]
    assert entry["requests"] == 2 and entry["corrections"] >= 2 and entry["model_bias"] == pytest.approx(
        b.bias("l", target), abs=1e-4)
    assert "budget[target 2.00%" in b.summary()


def test_feedback_can_be_switched_off():
    b = bm.Budget(feedback=False)
    c0 = b.choose("l", 1, 0.02, _gamma_hist())
    for _ in range(4 * bm.FEEDBACK_WINDOW):
        b.add_sampled(0.02, "l", 1, 10000, c0.model_fraction * 10000)
    assert b.bias("l", 0.02) == 1.0


# --------------------------------------------------------------------------- synthetic keys, real kernel


def synthetic_context(gen, n, hkv, D, topics, spread):
    """Centred keys near a few topic directions (strength ~ Exp(``spread``)) plus isotropic noise, and
    a strong common offset (the centre): the angle distribution has a tail of aligned keys, as
    attention keys do."""
    U = torch.nn.functional.normalize(torch.randn(hkv, topics, D, generator=gen), dim=-1)
    t = torch.randint(topics, (n, hkv), generator=gen)
    s = torch.empty(n, hkv, 1).exponential_(1 / spread, generator=gen) if spread else torch.zeros(n, hkv, 1)
    kc = s * U[torch.arange(hkv)[None, :], t] + torch.randn(n, hkv, D, generator=gen) / math.sqrt(D)
    centre = torch.randn(hkv, D, generator=gen) * 0.5
    keys = (kc + centre).bfloat16()
    vals = torch.randn(n, hkv, D, generator=gen).bfloat16()
    return keys, vals, centre, U


def synthetic_queries(gen, R, hkv, G, D, U):
    topics = U.shape[1]
    tq = torch.randint(topics, (R, hkv, G), generator=gen)
    q = 1.5 * U[torch.arange(hkv)[None, :, None], tq] + torch.randn(R, hkv, G, D, generator=gen) / math.sqrt(D)
    return q.reshape(R, hkv * G, D).bfloat16()


def kernel_fraction(keys, vals, centre, queries, K, L, seed=0):
    """The fraction of the context the real kernel samples for each query (one segment, no dense part)."""
    R, H, D = queries.shape
    n, hkv, _ = keys.shape
    W = torch.randn(D, K * L, generator=torch.Generator().manual_seed(seed))
    seg = kx.build_segment(keys, vals, centre, W, K, L)
    kview, vview, bt, _ = to_paged([(keys[:16], vals[:16])] * R, 16)
    codes = kx.hash_codes(queries.reshape(R * H, D), W, K, L).view(R, H, L)
    qdc = (queries.float().view(R, hkv, H // hkv, D) * centre[None, :, None]).sum(-1).view(R, H)
    out = torch.empty(R, H, D, dtype=queries.dtype)
    cnt = torch.zeros(R, H, dtype=torch.int64)
    kx.sparse_decode_attention(queries, codes, qdc, [[seg]] * R, kview, vview, block_table=bt,
                               dense_ranges=torch.zeros(R, 2, 2, dtype=torch.int32), scale=D ** -0.5, K=K, L=L,
                               out=out, sampled_counts=cnt)
    return float(cnt.sum()) / (R * H * n)


@pytest.mark.parametrize("spread", [0.0, 0.3, 0.8])
def test_kernel_fraction_lands_on_target_with_chosen_KL(spread):
    """Choose (K, L) from some queries' angles, run the real kernel on other queries of the same
    distribution: the measured fraction is within +-25% of every target. A fixed (10, 150) misses at
    least one target by more than that (the check can fail)."""
    g = torch.Generator().manual_seed(11)
    n, hkv, G, D = 8192, 2, 3, 64
    keys, vals, centre, U = synthetic_context(g, n, hkv, D, topics=6, spread=spread)
    calib = synthetic_queries(g, 8, hkv, G, D, U)
    test_q = synthetic_queries(g, 12, hkv, G, D, U)
    hist = sum(bm.angle_histogram(calib[r], keys.float() - centre) for r in range(calib.shape[0]))
    b = bm.Budget(max_L=150)
    got = {}
    for target in TARGETS:
        c = b.choose("layer", 1, target, hist)
        frac = kernel_fraction(keys, vals, centre, test_q, c.K, c.L)
        got[target] = (c.K, c.L, round(c.model_fraction, 4), round(frac, 4))
        assert abs(frac / target - 1) <= TOLERANCE, got
    default = kernel_fraction(keys, vals, centre, test_q, 10, 150)
    assert any(abs(default / t - 1) > TOLERANCE for t in TARGETS), (default, got)


def test_kernel_matches_the_model_on_the_calibration_queries():
    """Same queries: the kernel's realised fraction is the model's expectation up to sampling noise."""
    g = torch.Generator().manual_seed(12)
    n, hkv, G, D = 8192, 2, 2, 64
    keys, vals, centre, U = synthetic_context(g, n, hkv, D, topics=4, spread=0.5)
    q = synthetic_queries(g, 10, hkv, G, D, U)
    hist = sum(bm.angle_histogram(q[r], keys.float() - centre) for r in range(q.shape[0]))
    for K, L in ((8, 60), (10, 150), (12, 150)):
        model = bm.expected_fraction(hist, K, L)
        frac = kernel_fraction(keys, vals, centre, q, K, L, seed=K)
        assert abs(frac / model - 1) < 0.1, (K, L, frac, model)


# --------------------------------------------------------------------------- through the layer


def _layer_setup(spreads=(0.5,), lens=(3000,), target=0.02):
    g = torch.Generator().manual_seed(21)
    hkv, D, bs = 1, 64, 16
    cfg = MagicPigConfig(target_cost=target, min_sparse_context=64, segment_tokens=256, local_window=32,
                         log_stats_interval=0, given=frozenset({"target_cost"}))
    contexts, topics = [], []
    for spread, n in zip(spreads, lens):
        keys, vals, _, U = synthetic_context(g, n, hkv, D, topics=4, spread=spread)
        contexts.append((keys, vals))
        topics.append(U)
    kview, vview, bt, cache = to_paged(contexts, bs, generator=g)
    return g, cfg, cache, bt, topics, contexts


def _layer(cfg):
    rt = make_runtime(cfg)
    return rt, SparseLayer(LayerContext("model.layers.1.self_attn.attn", 1, 3, 1, 64, 64 ** -0.5, rt))


def _step(layer, planner, cache, bt, lens, settings, q):
    seq = torch.tensor(lens, dtype=torch.int32)
    plan = planner.plan(FakeCam(seq, bt), len(lens), settings)
    out = torch.full((len(lens), 3, 64), float("nan"), dtype=torch.bfloat16)
    layer.forward(q, layer.begin(cache, plan), plan, out)
    assert not out.isnan().any()
    return plan, out


def _queries(g, topics):
    return torch.cat([synthetic_queries(g, 1, 1, 3, 64, U) for U in topics])


def test_each_request_gets_its_own_KL_and_the_batch_equals_each_alone():
    g, cfg, cache, bt, topics, contexts = _layer_setup(spreads=(0.0, 0.8), lens=(3000, 2000))
    lens = [3000, 2000]
    rt, layer = _layer(cfg)
    planner = StepPlanner(cfg, 16, rt.index)
    settings = StepSettings.from_config(rt.cfg)
    assert settings.target_cost == 0.02
    qs = [_queries(g, topics) for _ in range(3)]
    outs = [_step(layer, planner, cache, bt, lens, settings, q)[1] for q in qs]
    plan = planner.plan(FakeCam(torch.tensor(lens, dtype=torch.int32), bt), 2, settings)
    c = [rt.budget.request_choice(layer.ctx.name, plan.centres[r].cid, 0.02) for r in range(2)]
    assert (c[0].K, c[0].L) != (c[1].K, c[1].L)  # different angle distributions, different choices
    st = rt.stats.snapshot()
    assert st["decode_sparse"] == 6 and st["decode_exact"] == {}
    # every segment was hashed with its own request's (K, L) and is stored under it
    for (owner, key), seg in rt.index._segments.items():
        r = next(i for i in range(2) if plan.centres[i].cid == key[0])
        assert owner == segment_owner(layer.ctx.name, c[r].K, c[r].L) and (seg.K, seg.L) == (c[r].K, c[r].L)
    # the grouped batch equals each request decoded alone (its own runtime, same choices)
    for r in range(2):
        rt1, layer1 = _layer(cfg)
        planner1 = StepPlanner(cfg, 16, rt1.index)
        for q, o in zip(qs, outs):
            _, alone = _step(layer1, planner1, cache, bt[r : r + 1], [lens[r]], settings, q[r : r + 1])
            assert torch.equal(alone[0], o[r]), r
    entry = st["budget"]["layers"][layer.ctx.name]["0.02"]
    assert entry["requests"] == 2 and entry["K_range"] == sorted([c[0].K, c[1].K])
    assert entry["sampled_fraction"] == pytest.approx(st["sampled_fraction_per_layer"][layer.ctx.name])


def test_exact_requests_ride_along_with_a_group():
    g, cfg, cache, bt, topics, contexts = _layer_setup(spreads=(0.0, 0.8, 0.3), lens=(3000, 2000, 40))
    rt, layer = _layer(cfg)
    planner = StepPlanner(cfg, 16, rt.index)
    plan, out = _step(layer, planner, cache, bt, [3000, 2000, 40], StepSettings.from_config(cfg), _queries(g, topics))
    assert plan.sparse == [0, 1] and plan.exact_reason == {2: "short_context"}
    assert rt.stats.decode_sparse == 2 and rt.stats.decode_exact == {"short_context": 1}


def test_a_second_target_chooses_again_and_never_reuses_segments():
    g, cfg, cache, bt, topics, contexts = _layer_setup()
    rt, layer = _layer(cfg)
    planner = StepPlanner(cfg, 16, rt.index)
    base = StepSettings.from_config(rt.cfg)
    for target in (0.02, 0.04, 0.02):
        settings = dataclasses.replace(base, target_cost=target)
        plan, _ = _step(layer, planner, cache, bt, [3000], settings, _queries(g, topics))
    cid = plan.centres[0].cid
    a, b = rt.budget.request_choice(layer.ctx.name, cid, 0.02), rt.budget.request_choice(layer.ctx.name, cid, 0.04)
    assert (a.K, a.L) != (b.K, b.L)
    owners = {owner for owner, _ in rt.index._segments}
    assert owners == {segment_owner(layer.ctx.name, a.K, a.L), segment_owner(layer.ctx.name, b.K, b.L)}
    for (owner, _), seg in rt.index._segments.items():
        assert (seg.K, seg.L) == owner[1:]


def test_without_a_target_nothing_changes():
    rt = make_runtime()
    assert StepSettings.from_config(rt.cfg).target_cost is None
    assert "budget" not in rt.stats.summary_line()
    assert rt.stats.snapshot()["budget"]["layers"] == {}


def test_split_decode_in_budget_mode_groups_requests_too():
    """The CUDA path's split decode (exact part next to the cache, samples on the host), run on the
    CPU: each request's segments carry its own (K, L), and the batch equals the CPU path's."""
    pytest.importorskip("vllm")
    from vllm_magicpig.backend_cuda import make_cuda_runtime
    from vllm_magicpig.kv_layout import FlashLayout

    from helpers import paged_attention_with_lse

    g = torch.Generator().manual_seed(33)
    # sinks in whole blocks, as the split decode needs them: both paths then sample the same ranges
    cfg = MagicPigConfig(target_cost=0.02, min_sparse_context=64, segment_tokens=256, local_window=32,
                         sink_tokens=16, log_stats_interval=0, given=frozenset({"target_cost"}))
    contexts, topics = [], []
    for spread, n in ((0.0, 3000), (0.8, 2000)):
        keys, vals, _, U = synthetic_context(g, n, 1, 64, topics=4, spread=spread)
        contexts.append((keys, vals))
        topics.append(U)
    _, _, bt, flash_cache = to_paged(contexts, 16, generator=g, layout=FlashLayout())
    q = _queries(g, topics)
    outs = {}
    for name in ("split", "cpu"):
        if name == "split":
            rt = make_cuda_runtime(cfg, num_layers=4, block_size=16, dense_attention=paged_attention_with_lse)
        else:
            rt = make_runtime(cfg)
            rt.layout = FlashLayout()  # same cache, read through the same views
        layer = SparseLayer(LayerContext("model.layers.1.self_attn.attn", 1, 3, 1, 64, 64 ** -0.5, rt))
        planner = StepPlanner(rt.cfg, 16, rt.index)
        plan, outs[name] = _step(layer, planner, flash_cache, bt, [3000, 2000], rt.step_settings(), q)
        c = [rt.budget.request_choice(layer.ctx.name, plan.centres[r].cid, 0.02) for r in range(2)]
        assert (c[0].K, c[0].L) != (c[1].K, c[1].L)
        for (owner, key), seg in rt.index._segments.items():
            r = next(i for i in range(2) if plan.centres[i].cid == key[0])
            assert owner[1:] == (c[r].K, c[r].L) == (seg.K, seg.L)
        assert rt.stats.decode_sparse == 2
    torch.testing.assert_close(outs["split"].float(), outs["cpu"].float(), rtol=2e-2, atol=2e-2)
