"""answer_bounds: what each batch row's request may still decode, read from a runner as vLLM's
holds it, published on the worker's runtime before the step's metadata is built and taken by the
MAGICPIG builder once. (The engine test in test_cost_calibration.py shows it in a real worker.)"""
from __future__ import annotations

from types import SimpleNamespace

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
