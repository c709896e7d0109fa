"""Budget mode (``vllm_magicpig/budget.py``): the collision model, the (K, L) choice, and the
fraction the real kernel samples with the chosen (K, L) on keys with a controlled angle
distribution. No vLLM engine; the SmolLM2 test is ``test_budget_e2e.py``.
"""
from __future__ import annotations

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
from vllm_magicpig.stats import EXACT_CALIBRATING

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


def _calibrated(target=0.02, **kw):
    torch.manual_seed(8)
    b = bm.Budget(calibration_decodes=1, **kw)
    b.observe("l", _hist((math.pi / 2 - torch.distributions.Gamma(2.0, 6.0).sample((20000,))).clamp(0.05, 3)), 1)
    return b, b.choice("l", target)


def test_feedback_learns_the_model_bias_once_and_then_holds():
    target = 0.02
    b, c0 = _calibrated(target)
    # the kernel samples 30% less than the model expects (e.g. the workload's text differs)
    for _ in range(bm.FEEDBACK_WINDOW - 1):
        b.add_sampled(target, "l", int(0.7 * c0.model_fraction * 10000), 10000)
    assert b.choice("l", target) == c0  # a window is not complete yet
    b.add_sampled(target, "l", int(0.7 * c0.model_fraction * 10000), 10000)
    c1 = b.choice("l", target)
    assert c1 != c0 and c1.model_fraction == pytest.approx(target / 0.7, rel=0.05)
    entry = b.snapshot()["budget"]["layers"]["l"]["0.02"]
    assert entry["adjustments"] == 1 and entry["model_bias"] == pytest.approx(0.7, rel=0.01)
    # on target now (within the band): nothing changes, however long it runs
    for _ in range(20 * bm.FEEDBACK_WINDOW):
        b.add_sampled(target, "l", int(0.7 * c1.model_fraction * 10000), 10000)
    assert b.choice("l", target) == c1


def test_feedback_can_be_switched_off():
    b, c0 = _calibrated(feedback=False)
    for _ in range(4 * bm.FEEDBACK_WINDOW):
        b.add_sampled(0.02, "l", 1, 10000)
    assert b.choice("l", 0.02) == c0


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
def test_kernel_fraction_lands_on_target_with_calibrated_KL(spread):
    """Calibrate on some queries' angles, choose (K, L), run the real kernel on other queries of the
    same distribution: the measured fraction is within +-25% of every target. A fixed (10, 150)
    misses at least one target by more than that (the check can fail)."""
    g = torch.Generator().manual_seed(11)
    n, hkv, G, D = 8192, 2, 3, 64
    keys, vals, centre, U = synthetic_context(g, n, hkv, D, topics=6, spread=spread)
    calib = synthetic_queries(g, 8, hkv, G, D, U)
    test_q = synthetic_queries(g, 12, hkv, G, D, U)
    b = bm.Budget(max_L=150, calibration_decodes=8)
    for r in range(calib.shape[0]):  # as the layer does: one histogram per decode
        b.observe("layer", bm.angle_histogram(calib[r], keys.float() - centre), 1)
    assert not b.calibrating("layer")
    got = {}
    for target in TARGETS:
        c = b.choice("layer", target)
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


def _layer_setup(target=0.02, calibration_decodes=2, n=3000):
    g = torch.Generator().manual_seed(21)
    hkv, G, D, bs = 1, 3, 64, 16
    cfg = MagicPigConfig(target_cost=target, calibration_decodes=calibration_decodes, min_sparse_context=64,
                         segment_tokens=256, local_window=32, log_stats_interval=0,
                         given=frozenset({"target_cost", "calibration_decodes"}))
    rt = make_runtime(cfg)
    keys, vals, centre, U = synthetic_context(g, n, hkv, D, topics=4, spread=0.5)
    kview, vview, bt, cache = to_paged([(keys, vals)], bs, generator=g)
    layer = SparseLayer(LayerContext("model.layers.1.self_attn.attn", 1, hkv * G, hkv, D, D ** -0.5, rt))
    planner = StepPlanner(cfg, bs, rt.index)
    return g, rt, layer, planner, cache, bt, U, n


def test_layer_calibrates_exactly_then_samples_with_its_own_KL():
    g, rt, layer, planner, cache, bt, U, n = _layer_setup()
    settings = StepSettings.from_config(rt.cfg)
    assert settings.target_cost == 0.02
    seq = torch.tensor([n], dtype=torch.int32)
    kls = []
    for _ in range(5):
        plan = planner.plan(FakeCam(seq, bt), 1, settings)
        assert plan.sparse == [0]
        q = synthetic_queries(g, 1, 1, 3, 64, U)
        out = torch.full((1, 3, 64), float("nan"), dtype=torch.bfloat16)
        layer.forward(q, layer.begin(cache, plan), plan, out)
        assert not out.isnan().any()
        kls.append((layer.ctx.settings.K, layer.ctx.settings.L))
    st = rt.stats.snapshot()
    # two calibration decodes (config K/L bound, nothing hashed), then three sparse ones at the choice
    assert st["decode_exact"] == {EXACT_CALIBRATING: 2}
    assert st["decode_sparse"] == 3
    choice = rt.budget.choice(layer.ctx.name, 0.02)
    assert kls[:2] == [(10, 150)] * 2 and kls[2:] == [(choice.K, choice.L)] * 3
    layer_st = st["budget"]["layers"][layer.ctx.name]
    assert layer_st["calibrated"] and layer_st["0.02"]["K"] == choice.K and layer_st["0.02"]["L"] == choice.L
    assert layer_st["0.02"]["sampled_fraction"] == pytest.approx(st["sampled_fraction_per_layer"][layer.ctx.name])
    assert abs(layer_st["0.02"]["sampled_fraction"] / 0.02 - 1) < 0.5  # 9 query heads: a loose check only
    assert "budget[calibrated 1/1 layers" in rt.stats.summary_line()
    # every segment in the index was hashed with the layer's chosen (K, L), and is stored under it
    owners = {owner for owner, _ in rt.index._segments}
    assert owners == {segment_owner(layer.ctx.name, choice.K, choice.L)}
    assert all((s.K, s.L) == (choice.K, choice.L) for s in rt.index._segments.values())


def test_a_second_target_reuses_the_calibration_and_never_the_segments():
    g, rt, layer, planner, cache, bt, U, n = _layer_setup()
    seq = torch.tensor([n], dtype=torch.int32)
    out = torch.empty(1, 3, 64, dtype=torch.bfloat16)
    for target, steps in ((0.02, 3), (0.04, 1), (0.02, 1)):
        settings = StepSettings.from_config(rt.cfg)
        settings = StepSettings(settings.method, settings.K, settings.L, settings.centering, settings.options, target)
        for _ in range(steps):
            plan = planner.plan(FakeCam(seq, bt), 1, settings)
            layer.forward(synthetic_queries(g, 1, 1, 3, 64, U), layer.begin(cache, plan), plan, out)
    a, b = rt.budget.choice(layer.ctx.name, 0.02), rt.budget.choice(layer.ctx.name, 0.04)
    assert (a.K, a.L) != (b.K, b.L)
    assert rt.stats.decode_exact[EXACT_CALIBRATING] == 2  # calibrated once, for both targets
    owners = {owner for owner, _ in rt.index._segments}
    assert owners == {segment_owner(layer.ctx.name, a.K, a.L), segment_owner(layer.ctx.name, b.K, b.L)}
    for (owner, _), seg in rt.index._segments.items():
        assert (seg.K, seg.L) == owner[1:]


def test_without_a_target_nothing_changes():
    rt = make_runtime()
    assert StepSettings.from_config(rt.cfg).target_cost is None
    assert "budget" not in rt.stats.summary_line()
    assert rt.stats.snapshot()["budget"]["calibrated_layers"] == 0
