"""A seeded request whose prompt is prefilled in chunks (vLLM 0.32's CPU runner rewinds a CPU
generator by an offset it does not have, and the engine dies): vllm_magicpig/cpu_seeded_sampling.py.

The unit tests run the patch on a stand-in runner with vLLM's rewind; the end-to-end test sends a
seeded request whose prompt takes three prefill steps, then the same request from the prefix cache
(one step), and needs the same sampled text from both.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import make_llm

from vllm_magicpig import cpu_seeded_sampling


class StandInRunner:
    """The two methods the patch wraps, as vLLM's GPUModelRunner has them: ``_sample`` draws from
    each request's generator, ``_bookkeeping_sync`` rewinds the discarded ones by offset."""

    def __init__(self, discard: list[bool], seeded: list[int]):
        self.discard_request_mask = types.SimpleNamespace(np=np.array(discard + [False] * 3))  # padded past num_reqs
        gens = {i: torch.Generator().manual_seed(100 + i) for i in seeded}
        self.input_batch = types.SimpleNamespace(generators=gens, num_reqs=len(discard))

    def _sample(self, logits=None, spec_decode_metadata=None):
        return {i: torch.rand(4, generator=g) for i, g in self.input_batch.generators.items()}

    def _bookkeeping_sync(self, *args):
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        return "bookkept"


def test_the_stand_in_fails_as_vllm_does():
    runner = StandInRunner(discard=[True, False], seeded=[0, 1])
    runner._sample()
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        runner._bookkeeping_sync()


def test_discarded_draws_are_undone_and_kept_draws_are_not():
    cls = type("Patched", (StandInRunner,), {})
    cpu_seeded_sampling.patch(cls)
    wrapped = cls._sample, cls._bookkeeping_sync
    cpu_seeded_sampling.patch(cls)  # idempotent: one wrapper, not two
    assert (cls._sample, cls._bookkeeping_sync) == wrapped and cls._sample is not StandInRunner._sample
    runner = cls(discard=[True, False, True, False], seeded=[0, 1, 3])  # request 2 has no seed
    before = {i: g.get_state() for i, g in runner.input_batch.generators.items()}
    first = runner._sample()
    assert runner._bookkeeping_sync() == "bookkept"
    gens = runner.input_batch.generators
    assert sorted(gens) == [0, 1, 3]  # every generator is back in the batch
    assert torch.equal(gens[0].get_state(), before[0])  # discarded: as if it never drew
    assert not torch.equal(gens[1].get_state(), before[1]) and not torch.equal(gens[3].get_state(), before[3])
    # the discarded request draws its first sample again, the kept one its next
    again = runner._sample()
    assert torch.equal(again[0], first[0]) and not torch.equal(again[1], first[1])


def test_only_the_discarded_cpu_generators_are_found():
    runner = StandInRunner(discard=[True, True, False], seeded=[1, 2])
    assert list(cpu_seeded_sampling.discarded_cpu_generators(runner)) == [1]
    runner.input_batch.generators = {}
    assert cpu_seeded_sampling.discarded_cpu_generators(runner) == {}


@pytest.mark.e2e
def test_a_seeded_request_prefilled_in_chunks_samples_as_one_prefilled_at_once(model_path):
    from vllm import SamplingParams

    budget = 256  # prompt tokens a step: the prompt below takes three steps, two of them discarded samples
    llm = make_llm(model_path, magicpig={}, max_model_len=2048, max_num_batched_tokens=budget, max_num_seqs=4)
    prompt = "Once upon a time, in a town by the river, people told many stories. " * 40
    params = SamplingParams(temperature=1.5, max_tokens=24, seed=1234)
    chunked = llm.generate([prompt], params)[0]  # the engine died here before the patch
    cached = llm.generate([prompt], params)[0]
    assert len(chunked.prompt_token_ids) > 2 * budget
    assert (chunked.num_cached_tokens or 0) == 0 and cached.num_cached_tokens >= budget  # one step from the cache
    assert chunked.outputs[0].text == cached.outputs[0].text  # the discarded draws left the stream as it was
    assert len(chunked.outputs[0].token_ids) == 24
