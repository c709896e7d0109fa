"""The step's tally of layers the platform kernel served (exact_tally.py), the cost model's fit
under lazy forgetting and counted observations, and the builder's decode/prefill split: the
pieces that keep an exactly-served step as cheap as the platform's own backend."""
from __future__ import annotations

import random

import pytest
import torch

from vllm_magicpig.cost_model import DecodeCostModel, LinearCost
from vllm_magicpig.exact_tally import ExactTally
from vllm_magicpig.stats import Stats


def weighted_fit(obs: list[tuple[int, float, float, float]]) -> tuple[float, float]:
    """Float64 least squares of seconds = a * requests + b * keys (keys in 10K units, as the fit's),
    each observation weighted as given: the reference for LinearCost."""
    x = torch.tensor([[r, k * 1e-4] for r, k, _, _ in obs], dtype=torch.float64)
    t = torch.tensor([s for _, _, s, _ in obs], dtype=torch.float64)
    w = torch.tensor([w for _, _, _, w in obs], dtype=torch.float64)
    a = x.T @ (w[:, None] * x)
    a += 1e-6 * (a[0, 0] + a[1, 1]) * torch.eye(2, dtype=torch.float64)  # the fit's ridge
    return tuple((torch.linalg.solve(a, x.T @ (w * t))).tolist())


@pytest.mark.parametrize("decay,steps", [(0.99, 300), (0.5, 700)])  # 0.5^-700 passes the renormalisation
def test_lazy_forgetting_is_the_decayed_least_squares_fit(decay, steps):
    rng = random.Random(7)
    fit = LinearCost(decay)
    obs = []
    for step in range(steps):
        fit.forget()
        for _ in range(rng.randint(0, 3)):
            r = rng.randint(1, 4)
            keys = sum(rng.randint(100, 20000) for _ in range(r))
            seconds = 1e-5 * r + 3e-8 * keys * rng.uniform(0.8, 1.2)
            fit.add(r, keys, seconds)
            obs.append((r, keys, seconds, step))
    ref = weighted_fit([(r, k, s, decay ** (steps - 1 - st)) for r, k, s, st in obs])
    got = fit.coefficients()
    assert got[0] == pytest.approx(ref[0], rel=1e-6, abs=1e-12) and got[1] == pytest.approx(ref[1], rel=1e-6)
    assert fit.steps == len(obs)


def test_counted_observations_equal_the_same_observations_one_by_one():
    one, counted = LinearCost(0.9), LinearCost(0.9)
    rng = random.Random(3)
    for _ in range(20):
        one.forget(), counted.forget()
        r, keys, n = rng.randint(1, 4), rng.randint(1000, 40000), rng.randint(1, 30)
        times = [1e-5 * r + 2e-8 * keys * rng.uniform(0.5, 1.5) for _ in range(n)]
        for t in times:
            one.add(r, keys, t)
        counted.add(r, keys, sum(times) / n, n)
    assert counted.steps == one.steps
    assert counted.coefficients() == pytest.approx(one.coefficients(), rel=1e-9)


def test_a_tally_counts_decodes_by_reason_and_feeds_the_mean_layer_time():
    stats, cost = Stats(), DecodeCostModel(min_steps=1)
    tally = ExactTally(num_decodes=3, reasons=["short_context", "index_deferred", "short_context"],
                       context_keys=9000, timed=True)
    for dense, seconds in [(True, 1e-3), (False, 2e-3), (False, 4e-3), (True, 5e-3)]:
        tally.add(dense, seconds)
    tally.fold(stats, cost)
    assert dict(stats.decode_exact) == {"dense_layer": 2 * 3, "short_context": 2 * 2, "index_deferred": 2}
    assert cost.exact.steps == 4
    reference = LinearCost(cost.exact.decay)
    for s in (1e-3, 2e-3, 4e-3, 5e-3):
        reference.add(3, 9000, s)
    assert cost.exact.coefficients() == pytest.approx(reference.coefficients(), rel=1e-9)
    tally.fold(stats, cost)  # folding again adds nothing: the counts went with the first fold
    assert sum(stats.decode_exact.values()) == 12 and cost.exact.steps == 4
    untimed = ExactTally(2, ["indexing", "indexing"], 5000, timed=False)  # a build beside it, or a prefill
    untimed.add(False, 1.0)
    untimed.fold(stats, cost)
    assert stats.decode_exact["indexing"] == 2 and cost.exact.steps == 4


def test_stats_reads_and_resets_fold_the_pending_tally_first():
    stats = Stats()
    tally = ExactTally(2, ["short_context", "short_context"], 100, timed=False)
    stats.add_flush(lambda: tally.fold(stats, None))
    tally.add(False, 0.0)
    assert stats.snapshot()["decode_exact"] == {"short_context": 2}
    assert "short_context=2" in stats.summary_line()
    tally.add(True, 0.0)
    stats.reset()  # the dense layer counted before the reset goes with it
    assert stats.snapshot()["decode_exact"] == {}


@pytest.mark.parametrize("seed", range(6))
def test_the_builders_split_matches_vllms(seed):
    """decodes_and_prefills' shortcut for 1-token batches against vLLM's own split: a 1-token
    chunk that is still prefilling is a prefill, and so is everything after it."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    from vllm_magicpig.backend_common import decodes_and_prefills

    rng = random.Random(seed)
    for _ in range(50):
        n = rng.randint(1, 6)
        qlens = [1] * n if rng.random() < 0.6 else [rng.choice([1, 1, 5]) for _ in range(n)]
        qlens.sort(key=lambda q: q > 1)  # decodes first, as vLLM reorders them
        prefilling = [rng.random() < 0.2 for _ in range(n)]
        qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
        seq = torch.tensor([rng.randint(q, 4000) for q in qlens], dtype=torch.int32)
        cam = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=n,
            num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=int(seq.max()),
            block_table_tensor=torch.zeros(n, 32, dtype=torch.int32), slot_mapping=torch.zeros(int(qsl[-1])),
            is_prefilling=torch.tensor(prefilling))
        want = split_decodes_and_prefills(cam, decode_threshold=1, treat_short_extends_as_decodes=False)
        assert decodes_and_prefills(cam) == want[:3], (qlens, prefilling)
