"""answer_bounds: what each batch row's request may still decode, read from a runner as vLLM's
holds it, published on the worker's runtime before the step's metadata is built and taken by the
MAGICPIG builder once. (The engine test in test_cost_calibration.py shows it in a real worker.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_magicpig import answer_bounds, runtime
from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.runtime import MagicPigRuntime


def fake_runner(reqs):
    """reqs: (req_id, max_tokens or None, decoded tokens, has sampling params) in batch order."""
    requests = {}
    for req_id, max_tokens, decoded, has_params in reqs:
        params = SimpleNamespace(max_tokens=max_tokens) if has_params else None
        requests[req_id] = SimpleNamespace(sampling_params=params, output_token_ids=[0] * decoded)
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=[r[0] for r in reqs]), requests=requests)


def test_a_rows_bound_is_its_max_tokens_less_what_it_decoded():
    runner = fake_runner([("a", 512, 100, True), ("b", None, 3, True), ("c", 64, 80, True), ("d", 10, 0, False)])
    assert list(answer_bounds.bounds_of(runner, 4)) == [412, None, 0, None]
    assert list(answer_bounds.bounds_of(runner, 2)) == [412, None]  # the step's first rows only
    assert answer_bounds.bounds_of(runner, 5) is None  # more rows than requests: a dummy run, no bounds


class Runner:
    def __init__(self, reqs):
        fake = fake_runner(reqs)
        self.input_batch, self.requests = fake.input_batch, fake.requests
        self.seen = []

    def _build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        rt = runtime.current()
        bounds = None if rt is None or rt.answer_bounds is None else list(rt.answer_bounds)
        self.seen.append((num_tokens, num_reqs, args, kwargs, bounds))
        return "metadata"

    def _on_request_state_removed(self, req_id, req_state):  # vLLM's hook: a no-op there
        self.seen.append(("removed", req_id))

    def finish(self, req_id):  # as vLLM's _update_states does for a finished request
        self._on_request_state_removed(req_id, self.requests.pop(req_id, None))


def test_the_patched_runner_publishes_before_it_builds_and_only_once():
    answer_bounds.patch(Runner)
    first = Runner._build_attention_metadata
    answer_bounds.patch(Runner)  # idempotent
    assert Runner._build_attention_metadata is first
    rt = MagicPigRuntime(MagicPigConfig(), num_layers=4)
    runtime.install(rt)
    try:
        runner = Runner([("a", 40, 8, True), ("b", 9, 9, True)])
        assert runner._build_attention_metadata(7, 2, "x", pad=1) == "metadata"
        assert runner.seen == [(7, 2, ("x",), {"pad": 1}, [32, 0])]  # published before the build ran
        runtime.install(None)  # no MAGICPIG runtime in this worker: nothing published, nothing fails
        assert runner._build_attention_metadata(7, 2) == "metadata" and runner.seen[-1][-1] is None
    finally:
        runtime.install(None)


def test_the_patched_runner_records_each_finished_answer_and_rows_get_an_outlook():
    """Finished requests' answers (tokens generated of max_tokens) go to the runtime's answer_lengths
    through vLLM's hook, whose own body still runs; a row's outlook adds the requests running now,
    censored at what they have generated."""
    answer_bounds.patch(Runner)
    rt = MagicPigRuntime(MagicPigConfig(), num_layers=4)
    rt.answer_lengths.min_answers = 3
    runtime.install(rt)
    try:
        runner = Runner([("a", 512, 512, True), ("f", 512, 10, True), ("b", 512, 500, True), ("c", 512, 40, True),
                         ("d", 512, 1, True), ("e", 64, 3, False)])
        for req_id in ("a", "f", "e", "zz"):  # "e" has no sampling params; "zz" vLLM no longer holds (None)
            runner.finish(req_id)
        assert runner.seen == [("removed", r) for r in ("a", "f", "e", "zz")]  # vLLM's own hook still ran
        assert rt.answer_lengths.snapshot() == {"answers_recorded": 2, "answer_groups": {512: 2}}
        runner.input_batch.req_ids = ["b", "c", "d"]
        rows = answer_bounds.bounds_of(runner, 3, rt.answer_lengths)
        assert list(rows) == [12, 472, 511]
        # row 2 ("d", 1 of 512): "f" ended at 10 with 4 at risk (S = 3/4), "c" (40) and "b" (500) run on,
        # censored, and "a" ended at 512, the last: the curve's end
        outlook = rows.outlook(2)
        assert outlook.survives(5) == 1.0 and outlook.survives(30) == 0.75 and outlook.survives(511) == 0.0
        assert outlook.expected() == pytest.approx(9 + 502 * 0.75)
        assert rows.outlook(0) is None  # past 500 of 512 only "a" is known: too few
        assert answer_bounds.bounds_of(runner, 3).outlook(2) is None  # no answer lengths given: none
    finally:
        runtime.install(None)
