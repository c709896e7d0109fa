"""A seeded request whose prompt is prefilled in chunks crashes vLLM 0.32's CPU engine; this fixes it.

A step that prefills only part of a prompt still samples a token for that request, then discards
it, and rewinds the request's generator so that the discarded draw does not shift the request's
random stream: ``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``,
written for CUDA's Philox generators. vLLM's CPU model runner inherits it, and a CPU generator
(Mersenne Twister) has no offset: ``RuntimeError: CPU Generator does not use offset`` kills the
engine and every request in flight. It takes only a ``seed`` in one request (the OpenAI field that
evaluation harnesses set) and a prompt longer than one step's token budget, the long prompts
MAGICPIG is for, whatever the attention backend: ``benchmarks/serve_load.py --answer-tokens``
lost a server to it.

The patch gives the rewind its meaning on CPU: the states of the CPU generators whose draw will
be discarded are saved before ``_sample`` and restored after it, and those generators are kept
out of ``_bookkeeping_sync``'s rewind. A seeded request then samples the same tokens whether its
prompt was prefilled in one step or in several (tests/test_cpu_seeded_sampling.py).

It is applied to the CPU runner class in the worker process, once vLLM has imported it
(``platform_hooks``): importing the runner anywhere else would cost a front end ~5 s.
"""
from __future__ import annotations

import numpy as np

RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
_MARK = "_magicpig_seeded_sampling"


def discarded_cpu_generators(runner) -> dict:
    """{batch index: generator} of this step's requests whose sampled token is discarded (a
    partial prefill) and that sample with their own CPU generator (a seed)."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    found = {}
    for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]:
        gen = generators.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            found[int(i)] = gen
    return found


def patch(runner_cls) -> None:
    """Make ``runner_cls`` (vLLM's CPUModelRunner) restore, instead of rewind, the generators of
    discarded samples. Idempotent."""
    sample, bookkeeping = runner_cls._sample, runner_cls._bookkeeping_sync
    if getattr(sample, _MARK, False):
        return

    def _sample(self, *args, **kwargs):
        held = discarded_cpu_generators(self)
        states = {i: gen.get_state() for i, gen in held.items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in states.items():
                held[i].set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        held = discarded_cpu_generators(self)
        for i in held:  # already restored by _sample: vLLM's offset rewind must not see them
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    setattr(_sample, _MARK, True)
    runner_cls._sample = _sample
    runner_cls._bookkeeping_sync = _bookkeeping_sync
