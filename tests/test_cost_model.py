"""The cost model that serves a decode exactly where sampling would be slower (cost_model.py):
its fit, its decision and exploration, the planner's use of it, and the timings the backend feeds
it at the vLLM seam. Timings here are synthetic (the fit is deterministic), except in the seam
test, which checks only that real timings arrive."""
from __future__ import annotations

import math
import random

import pytest
import torch

from vllm_magicpig.answer_bounds import ListedBounds
from vllm_magicpig.answer_lengths import AnswerLengths
from vllm_magicpig.config import MagicPigConfig, parse_config
from vllm_magicpig.cost_model import DecodeCostModel, LinearCost
from vllm_magicpig.index import IndexStore
from vllm_magicpig.planner import StepPlanner, StepSettings
from vllm_magicpig.stats import Stats

from helpers import FakeCam

# per (request, layer): exact 1 us + 40 ns per key; sampling 60 us + 2 ns per key -> crossover ~1553 keys
EXACT = (1e-6, 4e-8)
SPARSE = (60e-6, 2e-9)


def cost(coef, requests, keys):
    return coef[0] * requests + coef[1] * keys


def trained(steps=32, seed=0, noise=0.0) -> DecodeCostModel:
    rng = random.Random(seed)
    m = DecodeCostModel(min_steps=16, explore_every=16)
    for _ in range(steps):
        r = rng.randint(1, 4)
        keys = sum(rng.randint(500, 20000) for _ in range(r))
        m.observe_exact(r, keys, cost(EXACT, r, keys) * (1 + noise * rng.uniform(-1, 1)))
        m.observe_sparse(r, keys, cost(SPARSE, r, keys) * (1 + noise * rng.uniform(-1, 1)))
    return m


def test_linear_fit_recovers_per_request_and_per_key_costs():
    fit = LinearCost(decay=1.0)
    rng = random.Random(1)
    for _ in range(50):
        r = rng.randint(1, 8)
        keys = sum(rng.randint(100, 30000) for _ in range(r))
        fit.add(r, keys, cost(SPARSE, r, keys))
    a, b = fit.coefficients()
    assert a == pytest.approx(SPARSE[0], rel=1e-3) and b * 1e-4 == pytest.approx(SPARSE[1], rel=1e-3)
    assert fit.per_request(8000) == pytest.approx(cost(SPARSE, 1, 8000), rel=1e-3)


def test_forgetting_follows_a_machine_that_changed():
    fit = LinearCost(decay=0.9)
    for keys in range(1000, 50000, 1000):  # a step each
        fit.forget()
        fit.add(1, keys, cost(SPARSE, 1, keys))
    for keys in range(1000, 50000, 1000):  # three times slower now
        fit.forget()
        fit.add(1, keys, 3 * cost(SPARSE, 1, keys))
    assert fit.per_request(10000) == pytest.approx(3 * cost(SPARSE, 1, 10000), rel=0.02)


@pytest.mark.parametrize("seed", range(4))
def test_a_steps_many_layers_do_not_erase_what_earlier_steps_taught(seed):
    """Forgetting is per step: 60 steps of 30 layers' noisy timings at one context (as an engine
    decoding one 4K prompt gives) must not wipe out 100 earlier steps across contexts. Forgetting
    per observation kept ~3 steps, and the fit at 16K went wherever the noise at 4K pointed."""
    rng = random.Random(seed)
    m = DecodeCostModel(min_steps=16, decay=0.99)
    for _ in range(100):
        m.begin_step()
        keys = rng.randint(500, 20000)
        for _ in range(30):
            m.observe_exact(1, keys, cost(EXACT, 1, keys))
            m.observe_sparse(1, keys, cost(SPARSE, 1, keys))
    for _ in range(60):
        m.begin_step()
        for _ in range(30):
            keys = rng.randint(4096, 4140)
            m.observe_exact(1, keys, cost(EXACT, 1, keys) * (1 + 0.3 * rng.uniform(-1, 1)))
            m.observe_sparse(1, keys, cost(SPARSE, 1, keys) * (1 + 0.3 * rng.uniform(-1, 1)))
    exact, sparse = m.predicted(16384)
    assert exact == pytest.approx(cost(EXACT, 1, 16384), rel=0.1)
    assert sparse == pytest.approx(cost(SPARSE, 1, 16384), rel=0.1)


def test_samples_until_both_sides_are_measured():
    m = DecodeCostModel(min_steps=16)
    for _ in range(15):
        m.observe_exact(1, 1000, cost(EXACT, 1, 1000))
        m.observe_sparse(1, 1000, cost(SPARSE, 1, 1000))
    assert m.predicted(1000) is None and m.sampling_pays(1000)


@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_decides_by_the_crossover_and_keeps_exploring(noise):
    m = trained(noise=noise)
    # 20% timing noise moves the fitted crossover (~1.55K keys) by a few hundred keys: decide well away from it
    assert all(m.sampling_pays(n) for n in (3000, 4096, 65536))
    declined = []
    for _ in range(64):
        m.begin_step()
        declined.append(m.sampling_pays(500))
    assert declined.count(True) == 4  # one step in explore_every=16 samples anyway
    exact, sparse = m.predicted(500)
    assert sparse > exact
    snap = m.snapshot()
    assert snap["sparse_steps"] == 32 and snap["exact_us@16384"] > snap["sparse_us@16384"]


def test_planner_serves_exactly_where_sampling_is_slower():
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    planner = StepPlanner(cfg, 16, IndexStore(Stats(), cfg.segment_tokens), cost=trained())
    seq = torch.tensor([1000, 5000], dtype=torch.int32)
    table = torch.arange(2 * 320, dtype=torch.int32).view(2, 320)
    plan = planner.plan(FakeCam(seq, table), 2, StepSettings.from_config(cfg))
    assert plan.exact_reason == {0: "sampling_slower"} and plan.sparse == [1]


def test_an_exploring_step_samples_the_whole_batch():
    """Exploration is per step: the declined requests of a batch are all sampled in one step in 16
    (timed, so the model learns) and all exact in the others (the platform kernel serves them),
    never one sampled beside exact ones that would ride in the sampling kernel."""
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    planner = StepPlanner(cfg, 16, IndexStore(Stats(), cfg.segment_tokens), cost=trained())
    seq = torch.tensor([400, 500, 450, 480], dtype=torch.int32)  # all below the ~1.55K-key crossover
    table = torch.arange(4 * 40, dtype=torch.int32).view(4, 40)
    sparse_per_step = [len(planner.plan(FakeCam(seq, table), 4, StepSettings.from_config(cfg)).sparse)
                       for _ in range(32)]
    assert sorted(set(sparse_per_step)) == [0, 4] and sparse_per_step.count(4) == 2, sparse_per_step


def test_config_switch():
    assert parse_config({"magicpig": {}}).cost_model is True
    assert parse_config({"magicpig": {"cost_model": False}}).cost_model is False
    from vllm_magicpig.config import MagicPigConfigError

    with pytest.raises(MagicPigConfigError, match="'cost_model' must be true or false"):
        parse_config({"magicpig": {"cost_model": "no"}})


# --------------------------------------------------------------------------- whether an index pays

BUILD_PER_TOKEN = 3e-6  # seconds to index one token in one layer (synthetic)


def measured(build_per_token=BUILD_PER_TOKEN) -> DecodeCostModel:
    m = trained()
    for keys in (300, 400, 70_000):  # sampling timed at the contexts below too (exact data: the same fit)
        m.observe_sparse(1, keys, cost(SPARSE, 1, keys))
    m.observe_build(4096, 4096 * build_per_token)
    return m


def steps_until_built(m: DecodeCostModel, cid: int, context: int, limit: int = 10_000) -> int:
    """Decode steps over prompt ``cid`` served before its build starts (the last one builds)."""
    for step in range(1, limit + 1):
        if m.index_pays(cid, context):
            return step
    raise AssertionError(f"not built in {limit} steps")


@pytest.mark.parametrize("context", [3000, 8192, 65536])
def test_a_prompt_is_built_once_its_exact_decodes_would_have_saved_the_build(context):
    m = measured()
    exact, sparse = m.predicted(context)
    build = BUILD_PER_TOKEN * context
    expected = build / (exact - sparse)  # steps of savings that add up to the build
    assert abs(expected - round(expected)) > 0.01, "keep the crossing away from an integer"
    assert steps_until_built(m, cid=1, context=context) == math.ceil(expected)
    assert m.snapshot()["deferred_prompts"] == 0  # the account closes when the build starts
    assert m.snapshot()["build_ms_per_1k_tokens"] == pytest.approx(BUILD_PER_TOKEN * 1e6)


def test_requests_over_the_same_prompt_share_its_account():
    m = measured()
    alone = steps_until_built(measured(), cid=1, context=8192)
    assert alone >= 4
    paid = []
    for _ in range(alone - 1):  # two requests over prompt 7 each step (until built), one over prompt 8
        for _ in range(2):
            if True not in paid:
                paid.append(m.index_pays(7, 8192))
        m.index_pays(8, 8192)
    assert paid.index(True) == alone - 1  # in about half the steps: the two paid together
    assert m.snapshot()["deferred_prompts"] == 1  # prompt 8 still waits


def test_built_at_once_until_the_decode_and_build_costs_are_measured():
    assert DecodeCostModel().index_pays(1, 65536)  # nothing measured
    assert trained().index_pays(1, 65536)  # decodes measured, no build yet
    m = DecodeCostModel(min_steps=16)
    m.observe_build(4096, 1.0)  # a build measured, decodes not
    assert m.index_pays(1, 65536)


def test_a_prompt_sampling_saves_nothing_on_is_never_built():
    m = measured()
    assert m.predicted(500)[1] > m.predicted(500)[0]  # below the crossover
    assert not any(m.index_pays(1, 500) for _ in range(1000))
    # asked in an exploring step, the reason is the cause (not a bound or the account), bounded or not,
    # and the prompt's account is left as it was
    assert {m.index_decision(1, 500, remaining) for remaining in (None, 4, 10_000)} == {"sampling_slower"}
    assert m.index_decision(2, 8000) == "index_deferred"  # above the crossover: its account opens
    saved = dict(m._saved)
    assert saved[2] > 0
    assert m.index_decision(2, 500) == "sampling_slower" and m._saved == saved


def test_the_build_cost_follows_this_workers_builds():
    m = measured()
    for _ in range(400):  # builds became 4x dearer (a loaded machine): forgetting follows
        m.observe_build(1024, 1024 * 4 * BUILD_PER_TOKEN)
    assert m.build.per_token() == pytest.approx(4 * BUILD_PER_TOKEN, rel=0.05)
    m.observe_build(0, 1.0)  # an empty build tells nothing
    assert m.build.per_token() == pytest.approx(4 * BUILD_PER_TOKEN, rel=0.05)


def test_planner_defers_a_new_prompts_index_until_it_pays():
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    index = IndexStore(Stats(), cfg.segment_tokens)
    m = measured()
    planner = StepPlanner(cfg, 16, index, cost=m)
    seq = torch.tensor([8192], dtype=torch.int32)
    table = torch.arange(520, dtype=torch.int32).view(1, 520)
    expected = steps_until_built(measured(), cid=1, context=8192)
    reasons = [planner.plan(FakeCam(seq, table), 1, StepSettings.from_config(cfg)).exact_reason.get(0)
               for _ in range(expected)]
    assert reasons == ["index_deferred"] * (expected - 1) + [None], reasons  # the last step builds
    # a prompt with an index is never deferred: no account is opened for it
    (cid,) = index._centre_specs
    index._keys_by_cid[cid] = {("layer", None)}  # as if a layer held one of its segments
    assert planner.plan(FakeCam(seq, table), 1, StepSettings.from_config(cfg)).sparse == [0]
    assert m.snapshot()["deferred_prompts"] == 0


@pytest.mark.parametrize("context", [3000, 8192])
def test_a_build_that_cannot_pay_back_before_the_answer_ends_waits(context):
    """With the request's bound on its remaining decodes, the account that has saved the build's
    cost builds only if the remaining decodes can save it again; else it stays open (the prompt's
    later requests may still pay), and the build follows once a request with room comes."""
    exact, sparse = measured().predicted(context)
    build = BUILD_PER_TOKEN * context
    decodes_to_pay = build / (exact - sparse)
    ski = steps_until_built(measured(), cid=1, context=context)
    m = measured()
    short = math.floor(decodes_to_pay)  # one decode too few to pay back
    assert not any(m.index_pays(1, context, remaining=short) for _ in range(3 * ski))
    assert m.snapshot()["deferred_prompts"] == 1  # still deferred, its savings kept
    assert m.index_pays(1, context, remaining=short + 1)  # the next request over it has room: built at once
    # a bound large enough changes nothing: built when the decodes have saved the build
    m = measured()
    assert next(i for i in range(1, 10_000) if m.index_pays(2, context, remaining=10 ** 6)) == ski
    # until the costs are measured nothing can be judged: built at once, as without a bound
    assert all(DecodeCostModel().index_pays(1, context, remaining=r) for r in (0, 1))


def test_planner_serves_a_request_whose_build_cannot_pay_back_exactly_with_its_reason():
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    index = IndexStore(Stats(), cfg.segment_tokens)
    m = measured()
    planner = StepPlanner(cfg, 16, index, cost=m)
    seq = torch.tensor([8192, 8192], dtype=torch.int32)
    table = torch.arange(1040, dtype=torch.int32).view(2, 520)
    ski = steps_until_built(measured(), cid=1, context=8192)
    settings = StepSettings.from_config(cfg)
    reasons = [planner.plan(FakeCam(seq, table), 2, settings, ListedBounds([3, None])).exact_reason for _ in range(ski)]
    # row 0 (3 decodes left: its build could never pay back) is never built, and says so; row 1 (no
    # bound) builds at the ski-rental step
    assert [r.get(0) for r in reasons] == ["index_cannot_pay"] * ski, reasons
    assert [r.get(1) for r in reasons] == ["index_deferred"] * (ski - 1) + [None], reasons
    # row 0's prompt kept its account: a later request over it with room builds at once
    assert planner.plan(FakeCam(seq[:1], table[:1]), 1, settings, ListedBounds([10 ** 6])).sparse == [0]


def test_a_prompt_asked_again_is_judged_by_ski_rental_alone():
    """A second request over the same prompt (a prefix-cache hit: its prefill recomputes the last
    token) means the prompt may be asked more: no single answer's bound keeps its build off then."""
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    planner = StepPlanner(cfg, 16, IndexStore(Stats(), cfg.segment_tokens), cost=measured())
    settings = StepSettings.from_config(cfg)
    table = torch.arange(520, dtype=torch.int32).view(1, 520)
    ski = steps_until_built(measured(), cid=1, context=8192)

    def prefill_then_decode(bound):  # the request's last prefill token, then its first decode
        last = torch.tensor([8191], dtype=torch.int64)  # block 511, slot 15: the prompt's last token
        planner.observe_step(FakeCam(torch.tensor([8191], dtype=torch.int32), table, slot_mapping=last,
                                     num_reqs=1), 0)
        return planner.plan(FakeCam(torch.tensor([8192], dtype=torch.int32), table), 1, settings, ListedBounds([bound]))

    assert prefill_then_decode(3).exact_reason == {0: "index_cannot_pay"}  # the first request: its bound decides
    for _ in range(ski):  # it decodes on, its account growing
        assert planner.plan(FakeCam(torch.tensor([8192], dtype=torch.int32), table), 1, settings,
                            ListedBounds([3])).exact_reason == {0: "index_cannot_pay"}
    # the second request over the prompt, with as short an answer: built, its account having paid
    assert prefill_then_decode(3).sparse == [0]


def test_built_at_once_where_sampling_was_never_timed_at_such_a_context():
    """Sampling timed at 4K only: an 8K prompt is built at once (its sampled cost is extrapolated
    and a deferred prompt is never sampled, so only a build measures it); a 6K one may wait."""
    m = DecodeCostModel(min_steps=16)
    for keys in (50, 500, 4100, 8200, 16000):
        for _ in range(8):
            m.observe_exact(1, keys, cost(EXACT, 1, keys))
    for _ in range(32):
        m.observe_sparse(2, 8200, cost(SPARSE, 2, 8200))  # 4100 keys a request
    m.observe_build(4096, 4096 * BUILD_PER_TOKEN)
    assert m.index_pays(1, 8192) and m.index_pays(2, 16384)
    assert not m.index_pays(3, 6000) and not m.index_pays(4, 4096)
    m.observe_sparse(1, 9000, cost(SPARSE, 1, 9000))  # now timed in 8K-16K
    assert not m.index_pays(1, 8192)


def test_one_build_explores_an_untimed_range_not_every_prompt_in_it():
    """Sampling timed at 4K only. The first 16K prompt is built at once to explore 16K-32K; while
    its sampled decodes go untimed, later 16K prompts wait on the extrapolated fit (ski-rental),
    until ``reexplore_steps`` steps have passed (an AMX run built every new 16K prompt on arrival)."""
    m = DecodeCostModel(min_steps=16, reexplore_steps=100)
    for keys in (50, 500, 4100, 8200, 16000, 33000):
        for _ in range(8):
            m.observe_exact(1, keys, cost(EXACT, 1, keys))
    for _ in range(32):
        m.observe_sparse(2, 8200, cost(SPARSE, 2, 8200))  # 4100 keys a request
    m.observe_build(4096, 4096 * BUILD_PER_TOKEN)
    assert m.index_pays(1, 16384)  # explores
    assert m.snapshot()["explored_untimed"] == [16384]
    assert m.index_pays(9, 40000)  # another range explores on its own
    waits = steps_until_built(m, cid=2, context=20000)
    assert waits > 1  # the second prompt in the range waited for its savings
    exact, sparse = m.predicted(20000)
    assert waits == math.ceil(BUILD_PER_TOKEN * 20000 / (exact - sparse))
    for _ in range(99):
        m.begin_step()
    assert not m.index_pays(3, 16384)
    m.begin_step()
    assert m.index_pays(4, 16384)  # reexplored, sampling still untimed there
    m.observe_sparse(1, 17000, cost(SPARSE, 1, 17000))  # timed in 16K-32K at last
    assert m.snapshot()["explored_untimed"] == [32768]
    assert not m.index_pays(5, 16384)


@pytest.mark.parametrize("seed", range(5))
def test_noise_at_one_context_never_predicts_cheaper_attention_at_a_longer_one(seed):
    """Steps clustered at ~4K keys with 20% noise: the unconstrained slope is noise, and was once
    negative enough to predict exact attention over 16K keys as negative seconds. The fit keeps
    both coefficients non-negative, so predictions never fall with context."""
    rng = random.Random(seed)
    fit = LinearCost(decay=0.99)
    for _ in range(400):
        keys = rng.randint(4096, 4140)
        fit.add(1, keys, cost(EXACT, 1, keys) * (1 + 0.2 * rng.uniform(-1, 1)))
    a, b = fit.coefficients()
    assert a >= 0 and b >= 0
    at_4k, at_16k, at_64k = (fit.per_request(n) for n in (4096, 16384, 65536))
    assert 0 < at_4k <= at_16k <= at_64k
    # and near the data the fit is still right
    assert at_4k == pytest.approx(cost(EXACT, 1, 4096), rel=0.1)


def test_where_a_term_would_be_negative_the_fit_is_its_sides_one_term_model():
    falling = [(4000, 1.0e-3), (4200, 0.9e-3)]  # seconds fall with keys (noise)
    steep = [(4000, 0.2e-3), (4200, 1.0e-3)]  # a line through zero keys below zero seconds
    for data in (falling, steep):
        per_key, per_request = LinearCost(decay=1.0, shape="keys"), LinearCost(decay=1.0, shape="requests")
        for keys, seconds in data:
            per_key.add(1, keys, seconds)
            per_request.add(1, keys, seconds)
        a, b = per_key.coefficients()
        assert a == 0 and b > 0  # exact attention's shape: in proportion to the keys
        assert per_key.per_request(4100) == pytest.approx(sum(s for _, s in data) / 2, rel=0.05)
        assert per_key.per_request(16400) == pytest.approx(4 * per_key.per_request(4100))
        a, b = per_request.coefficients()
        assert b == 0 and a == pytest.approx(sum(s for _, s in data) / 2, rel=1e-3)  # sampling's: per request
    with pytest.raises(ValueError, match="shape"):
        LinearCost(decay=1.0, shape="tokens")


def test_one_context_of_exact_timings_extrapolates_in_proportion_to_the_keys():
    """The decision the shapes are for: exact attention timed at ~4K only, with noise that makes
    the per-key term negative, must not predict exact attention over 16K keys as cheap as over 4K
    (sampling would then look slower there, and 16K decodes be served exactly until measured)."""
    m = DecodeCostModel(min_steps=16)
    for i in range(40):
        keys = 4096 + i
        m.observe_exact(1, keys, cost(EXACT, 1, 4096) * (1.2 - 0.01 * i))  # falling: noise
        m.observe_sparse(1, keys, cost(SPARSE, 1, keys))
    exact_4k, _ = m.predicted(4096)
    exact_16k, _ = m.predicted(16384)
    assert exact_16k == pytest.approx(4 * exact_4k, rel=1e-3)


# --------------------------------------------------------------------------- start-up calibration


def calibrated(sparse=SPARSE, contexts=(1092, 2991, 8192)) -> DecodeCostModel:
    """A model given only start-up timings (cost_calibration.py) of the synthetic costs."""
    m = DecodeCostModel(min_steps=16)
    m.calibrate([(1, n, cost(EXACT, 1, n)) for n in contexts], [(1, n, cost(sparse, 1, n)) for n in contexts],
                (8192, 8192 * BUILD_PER_TOKEN), {"contexts": list(contexts)})
    return m


def test_a_calibrated_model_decides_the_first_prompt_by_its_costs():
    """Calibrated at start-up: the first prompt in the calibrated ranges waits, ski-rental, instead of
    being built at once to measure the costs (0.90-0.95x for a fresh engine's first cold requests)."""
    m = calibrated()
    assert DecodeCostModel().index_pays(1, 4096)  # uncalibrated: built at once
    exact, sparse = m.predicted(4096)
    assert exact == pytest.approx(cost(EXACT, 1, 4096), rel=1e-3)
    assert sparse == pytest.approx(cost(SPARSE, 1, 4096), rel=1e-3)
    expected = BUILD_PER_TOKEN * 4096 / (exact - sparse)
    assert steps_until_built(m, cid=1, context=4096) == math.ceil(expected) > 1
    assert m.snapshot()["sampled_octaves"] == [1024, 2048, 4096, 8192]  # between the points: timed
    assert m.snapshot()["calibration"] == {"contexts": [1092, 2991, 8192]}
    assert m.snapshot()["build_ms_per_1k_tokens"] == pytest.approx(BUILD_PER_TOKEN * 1e6)


def test_past_the_calibrated_contexts_a_build_still_explores():
    m = calibrated()
    assert m.index_pays(1, 20000)  # 16K-32K: extrapolated, so the first prompt there is built to time it
    assert not m.index_pays(2, 20000)  # one build explores a range, the next prompt waits


def test_live_timings_outweigh_the_calibration():
    """Start-up timings are a prior: calibrated 5x too dear, sampling follows the engine's own
    timings at the contexts it serves within a few tens of steps (28 layers' observations a step)."""
    m = calibrated(sparse=(5 * SPARSE[0], 5 * SPARSE[1]))
    assert m.predicted(4096)[1] == pytest.approx(5 * cost(SPARSE, 1, 4096), rel=1e-3)
    for steps in (30, 70):
        for _ in range(steps):
            m.begin_step()
            m.observe_sparse(1, 4096, cost(SPARSE, 1, 4096), layers=28)
        assert m.predicted(4096)[1] == pytest.approx(cost(SPARSE, 1, 4096), rel=0.1 if steps == 30 else 0.02)


def test_a_side_still_on_its_calibration_moves_with_the_others_live_timings():
    """The calibration times both sides warm; live, each costs more by about the same factor. Until
    sampling is timed live, its prior is scaled by exact attention's live-to-calibrated ratio at the
    same context (and the other way round), so the two are compared at the same level. The AMX
    machine's case: exact 90 us and sampling 140 us calibrated at 3000 keys, exact 2.5x that live;
    unscaled, sampling (140) looked cheaper than exact (228), the prompt was built, and sampling then
    measured 315 us."""
    exact_cal, sparse_cal = (0.0, 3e-8), (140e-6, 0.0)  # 90 us exact at 3000 keys, sampling flat 140 us
    m = DecodeCostModel(min_steps=16)
    m.calibrate([(1, n, cost(exact_cal, 1, n)) for n in (1092, 2991, 8192)],
                [(1, n, cost(sparse_cal, 1, n)) for n in (1092, 2991, 8192)],
                (8192, 8192 * BUILD_PER_TOKEN), {"contexts": [1092, 2991, 8192]})
    e, s = m.predicted(3000)
    assert e == pytest.approx(90e-6, rel=1e-3) and s == pytest.approx(140e-6, rel=1e-3)
    assert m.snapshot()["prior_scale@4096"] == [1.0, 1.0]
    for _ in range(200):  # live exact steps at 2.5x the calibration (deferred prompts, dense layers)
        m.begin_step()
        m.observe_exact(1, 3000, 2.5 * cost(exact_cal, 1, 3000), layers=30)
    e, s = m.predicted(3000)
    ratio = e / cost(exact_cal, 1, 3000)
    assert ratio == pytest.approx(2.5, rel=0.02)
    assert s == pytest.approx(ratio * 140e-6, rel=1e-4)  # sampling's prior at exact's live level
    assert m.snapshot()["prior_scale@4096"][0] == 1.0 and m.snapshot()["prior_scale@4096"][1] > 1.5
    m.begin_step()
    assert not m.sampling_pays(3000)
    assert m.index_decision(1, 3000, remaining=400) == "sampling_slower"  # no build lost on a prior
    # sampling's own live timings end the scaling: at 100 us it pays, as measured
    for _ in range(2):
        m.begin_step()
        m.observe_sparse(1, 3000, 100e-6, layers=28)
    e, s = m.predicted(3000)
    assert s < 1.1 * 100e-6 and m.snapshot()["prior_scale@4096"] == [1.0, 1.0]
    assert m.sampling_pays(3000)


def test_exact_still_on_its_calibration_moves_with_samplings_live_timings():
    m = calibrated(sparse=(5 * SPARSE[0], 5 * SPARSE[1]))  # both calibrated; sampling live at 1/5 of it
    for _ in range(100):
        m.begin_step()
        m.observe_sparse(1, 4096, cost(SPARSE, 1, 4096), layers=28)
    e, s = m.predicted(4096)
    ratio = s / (5 * cost(SPARSE, 1, 4096))
    assert ratio == pytest.approx(0.2, rel=0.05)
    assert e == pytest.approx(ratio * cost(EXACT, 1, 4096), rel=1e-4)


def test_an_uncalibrated_model_is_not_scaled():
    m = trained()
    e, s = m.predicted(4096)
    assert e == pytest.approx(cost(EXACT, 1, 4096), rel=1e-3) and s == pytest.approx(cost(SPARSE, 1, 4096), rel=1e-3)
    assert m.snapshot()["prior_scale@4096"] == [1.0, 1.0]


def test_a_calibration_that_timed_nothing_leaves_the_model_as_it_was():
    m = DecodeCostModel(min_steps=16)
    m.calibrate([], [], (0, 0.0), {"contexts": [], "skipped": "no context up to max_model_len is sampled"})
    assert m.predicted(4096) is None and m.index_pays(1, 4096)  # built at once, as uncalibrated
    assert m.snapshot()["calibration"]["skipped"]


def test_sampling_pays_from_the_context_where_the_fits_cross():
    """``sampling_pays_from``: the shortest context from which sampling is predicted no slower, the
    line below which decodes are served exactly as ``sampling_slower``. The synthetic costs cross at
    (60 - 1) us / (0.04 - 0.002) us per key = 1552.6 keys; the fits, from the same costs, say so, and
    the non-exploring decisions agree with it on both sides of the line."""
    assert DecodeCostModel().sampling_pays_from() is None  # nothing measured: no line yet
    m = trained()
    start = m.sampling_pays_from()
    assert start == 1553, start
    e, s = m.predicted(start)
    assert s <= e
    e, s = m.predicted(start - 1)
    assert s > e
    m.begin_step()  # step 33 of explore_every 16: not exploring
    assert not m.sampling_pays(start - 1) and m.sampling_pays(start)
    assert m.snapshot()["sampling_pays_from_keys"] == start
    assert "sampled from 1553 keys" in m.summary()


def test_where_sampling_never_pays_there_is_no_line():
    """Sampling dearer per key than exact attention and dearer per request: slower at every context
    up to 1M keys."""
    m = calibrated(sparse=(60e-6, 5e-8))
    assert m.sampling_pays_from() is None
    assert m.snapshot()["sampling_pays_from_keys"] is None
    assert "sampled from no context" in m.summary()


def test_the_line_stays_where_the_calibration_put_it_while_sampling_is_on_its_prior():
    """While sampling has no live timings, its prior is scaled by exact attention's live level
    (``_prior_scale``), so exact attention's live cost moving does not move the line: the AMX
    machine's calibrated costs (exact 0.03 us a key, sampling a flat 140 us) cross at 4667 keys,
    before exact attention is timed live at 2.5x and after."""
    exact_cal, sparse_cal = (0.0, 3e-8), (140e-6, 0.0)
    m = DecodeCostModel(min_steps=16)
    m.calibrate([(1, n, cost(exact_cal, 1, n)) for n in (1092, 2991, 8192)],
                [(1, n, cost(sparse_cal, 1, n)) for n in (1092, 2991, 8192)],
                (8192, 8192 * BUILD_PER_TOKEN), {"contexts": [1092, 2991, 8192]})
    assert m.sampling_pays_from() in (4667, 4668)
    for i in range(200):  # live exact steps at 2.5x the calibration, over a growing context
        m.begin_step()
        m.observe_exact(1, 3000 + i, 2.5 * cost(exact_cal, 1, 3000 + i), layers=30)
    assert m.snapshot()["prior_scale@4096"][1] > 2.0
    assert m.sampling_pays_from() in (4667, 4668)


def test_the_stats_log_line_says_what_the_model_believes():
    """The periodic stats line carries the fitted costs at 4K and 16K, the build's cost and the
    prompts waiting for their build, so a server log shows why decodes were served exactly; nothing
    before the model has measured anything."""
    assert DecodeCostModel().summary() == ""
    m = measured()
    assert m.index_pays(cid=7, context=8192) is False  # one prompt's build waits
    exact4, sparse4 = m.predicted(4096)
    line = m.summary()
    assert line.startswith("cost_model[4K exact/sampled us ") and line.endswith("deferred prompts 1]"), line
    assert f"4K exact/sampled us {exact4 * 1e6:.0f}/{sparse4 * 1e6:.0f}" in line, line
    assert f"build ms/1K tokens {BUILD_PER_TOKEN * 1e6:.1f}" in line, line

    stats = Stats()
    stats.add_section("cost_model", lambda: {"cost_model": m.snapshot()}, summary=m.summary)
    assert stats.summary_line().endswith(" " + line)


def test_a_runtimes_stats_line_carries_its_cost_model():
    from vllm_magicpig.runtime import MagicPigRuntime

    rt = MagicPigRuntime(MagicPigConfig(), num_layers=2)
    assert "cost_model[" not in rt.stats.summary_line()  # nothing measured yet
    for _ in range(16):
        rt.cost.observe_exact(1, 4096, cost(EXACT, 1, 4096))
        rt.cost.observe_sparse(1, 4096, cost(SPARSE, 1, 4096))
    assert "cost_model[4K exact/sampled us " in rt.stats.summary_line()


def outlook_of(generated_answers, max_tokens=512, generated=1, running=()):
    """The outlook of a request ``generated`` tokens into an answer of at most ``max_tokens``, after
    answers of these lengths (each of ``max_tokens``) finished."""
    lengths = AnswerLengths(min_answers=1)
    for g in generated_answers:
        lengths.record(g, max_tokens)
    return lengths.outlook(generated, max_tokens, running)


def test_a_request_whose_answers_run_long_is_built_at_its_first_decode():
    """Where answers like this request's have run to their max_tokens, waiting for ski rental only
    serves exactly the decodes the build would have sampled: the prompt is built at once, and the
    model counts it. Where they ended early, it waits as before."""
    context = 8192
    exact, sparse = measured().predicted(context)
    decodes_to_pay = BUILD_PER_TOKEN * context / (exact - sparse)
    assert 50 < decodes_to_pay < 200
    m = measured()
    assert m.index_decision(1, context, 511, outlook_of([512] * 4)) is None
    assert m.snapshot()["built_on_outlook"] == 1 and m.snapshot()["deferred_prompts"] == 0
    m = measured()
    assert m.index_decision(1, context, 511, outlook_of([20] * 4, generated=1)) == "index_deferred"
    assert m.index_decision(1, context, 511) == "index_deferred"  # no outlook: ski rental, as before
    assert m.snapshot()["built_on_outlook"] == 0
    # answers that outlast ski rental's wait but end before a build now could pay back: not built on
    # them (neither policy's build pays; ski rental's account decides as before)
    m, half = measured(), int(decodes_to_pay / 2)
    for _ in range(half - 1):
        m.index_decision(1, context, 10 ** 6)
    ends = [half + int(0.75 * decodes_to_pay)] * 4  # tokens generated when each answer ended
    assert m.index_decision(1, context, 10 ** 6, outlook_of(ends, generated=half)) == "index_deferred"
    # a bound that cannot pay back wins over any outlook
    assert measured().index_decision(1, context, int(decodes_to_pay) - 1, outlook_of([512] * 4)) == "index_cannot_pay"


@pytest.mark.parametrize("seed", range(12))
def test_building_on_the_outlook_is_the_cheaper_policy_over_the_answers_seen(seed):
    """The rule against a float64 reference: over the finished answers (each equally likely), the
    expected cost of building now against ski rental's (exact decodes until the account has saved the
    build, then the build and sampled decodes) and against never building. It builds now exactly
    where that is the cheapest (near-ties skipped), also once the account has saved part of the build."""
    rng = random.Random(seed)
    context = rng.choice([3000, 8192, 20000])
    exact, sparse = measured().predicted(context)
    build = BUILD_PER_TOKEN * context
    short = rng.uniform(0.0, 0.95)  # the share of answers that end within 60 tokens
    answers = [rng.randint(2, 60) if rng.random() < short else rng.choice([512, rng.randint(2, 512)])
               for _ in range(rng.randint(4, 40))]
    checked = 0
    for waited in (0, 3, 17, 60):
        generated = 1 + waited
        left = [a - generated for a in answers if a > generated]
        if len(left) < 1:
            continue
        m = measured()
        for _ in range(waited):  # the account this request's exact decodes have filled so far
            m.index_decision(1, context, 10 ** 6)
        saved = (waited + 1) * (exact - sparse)  # with this decode's, as the model counts it when it decides
        if saved >= build:
            continue
        k = (build - saved) / (exact - sparse)  # decodes until ski rental builds
        now = sum(build + sparse * r for r in left) / len(left)
        ski = sum(exact * k + build + sparse * (r - k) if r > k else exact * r for r in left) / len(left)
        never = sum(exact * r for r in left) / len(left)
        best_other = min(ski, never)
        if abs(now - best_other) < 0.02 * best_other:
            continue
        decision = m.index_decision(1, context, 10 ** 6, outlook_of(answers, generated=generated))
        assert (decision is None) == (now < best_other), (seed, waited, now, ski, never)
        checked += 1
    assert checked  # every seed checks at least one case


class OutlookBounds(list):
    """A step's bounds as answer_bounds.RowBounds gives them, with each row's outlook."""

    def __init__(self, bounds, outlooks):
        super().__init__(bounds)
        self.outlooks, self.asked = outlooks, []

    def outlook(self, row):
        self.asked.append(row)
        return self.outlooks[row]


def test_planner_builds_a_prompt_at_once_on_its_requests_outlook():
    """The planner hands a decode's outlook to the cost model with its bound: a request whose answers
    run long is sampled from its first decode (its prompt built then), another waits; a row without a
    bound is not asked for one."""
    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    m = measured()
    planner = StepPlanner(cfg, 16, IndexStore(Stats(), cfg.segment_tokens), cost=m)
    seq = torch.tensor([8192, 8192, 8192], dtype=torch.int32)
    table = torch.arange(1560, dtype=torch.int32).view(3, 520)
    bounds = OutlookBounds([511, 511, None], [outlook_of([512] * 4), outlook_of([20] * 4), outlook_of([512] * 4)])
    plan = planner.plan(FakeCam(seq, table), 3, StepSettings.from_config(cfg), bounds)
    assert plan.sparse == [0] and plan.exact_reason == {1: "index_deferred", 2: "index_deferred"}, plan.exact_reason
    assert bounds.asked == [0, 1] and m.snapshot()["built_on_outlook"] == 1
