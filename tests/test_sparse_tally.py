"""The sparse layers' records (sparse_tally.py): what every layer served and sampled, and its time,
reach the counters and the cost model when the stats are read, exactly as if each layer had
counted itself."""
from __future__ import annotations

import random

import pytest

from vllm_magicpig.cost_model import DecodeCostModel
from vllm_magicpig.sparse_tally import SparseTally
from vllm_magicpig.stats import Stats


def test_records_are_folded_when_the_stats_are_read_and_only_once():
    rng = random.Random(11)
    stats, cost, ref_cost = Stats(), DecodeCostModel(), DecodeCostModel()
    tally = SparseTally()
    stats.add_flush(lambda: tally.fold(stats, cost))
    want_sparse, want_by_method, want_sampled = 0, {}, {}
    for _ in range(5):
        cost.begin_step(), ref_cost.begin_step()
        requests = rng.randint(1, 4)
        keys = sum(rng.randint(2000, 20000) for _ in range(requests))
        for layer in range(2, 2 + rng.randint(1, 6)):
            name, label = f"model.layers.{layer}.self_attn.attn", rng.choice(["magicpig", "other"])
            served, sampled, candidates = rng.randint(1, requests), rng.randint(0, 999), rng.randint(1000, 9999)
            seconds = rng.uniform(1e-4, 1e-3)
            tally.served(name, label, served, sampled, candidates)
            tally.timed(requests, keys, seconds)
            ref_cost.observe_sparse(requests, keys, seconds)
            want_sparse += served
            want_by_method[label] = want_by_method.get(label, 0) + served
            s = want_sampled.setdefault(name, [0, 0])
            s[0], s[1] = s[0] + sampled, s[1] + candidates
        assert cost.sparse.steps < ref_cost.sparse.steps and stats.decode_sparse < want_sparse  # not folded yet
        snap = stats.snapshot()  # a read folds
        assert snap["decode_sparse"] == want_sparse
        assert dict(stats.decode_by_method) == want_by_method
        assert {k: list(v) for k, v in stats.sampled.items()} == want_sampled
        assert cost.sparse.steps == ref_cost.sparse.steps
        assert cost.sparse.coefficients() == pytest.approx(ref_cost.sparse.coefficients(), rel=1e-12)
    stats.snapshot()  # a second read adds nothing
    assert stats.decode_sparse == want_sparse and cost.sparse.steps == ref_cost.sparse.steps


def test_a_reset_drops_what_was_recorded_before_it():
    stats, tally = Stats(), SparseTally()
    stats.add_flush(lambda: tally.fold(stats, None))
    tally.served("model.layers.3.self_attn.attn", "magicpig", 2, 10, 100)
    stats.reset()  # what happened before the reset goes with it
    assert stats.snapshot()["decode_sparse"] == 0
    tally.served("model.layers.3.self_attn.attn", "magicpig", 1, 5, 50)
    assert stats.snapshot()["decode_sparse"] == 1 and stats.sampled_fraction() == pytest.approx(0.1)
