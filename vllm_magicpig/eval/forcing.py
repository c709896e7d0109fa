"""Teacher forcing: make a run emit a given token sequence while reporting its own logprobs.

For "KL of next-token distributions against full attention on the same continuation" the
sparse run must see exactly the reference run's tokens as context, yet report the
distribution *it* would have sampled from. ``ForceTokens`` masks every logit but the
forced one; vLLM computes the returned logprobs before logits processors run (the
default ``logprobs_mode="raw_logprobs"``), so they are the model's unforced distribution.

Usage (the engine loads the processor by name, in its own spawned process)::

    llm = LLM(model, **FORCE_LLM_ARGS)
    out = llm.generate(prompt, forced_params(reference_token_ids))
    out.outputs[0].logprobs  # per position: top-k of the raw distribution + the forced token

Only the V1 model runner's processor interface is implemented (the one vLLM uses on CPU,
where Model Runner V2 needs Triton); V2 loads processors through a different interface.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

__all__ = ["ForceTokens", "FORCE_PROCESSOR", "FORCE_LLM_ARGS", "forced_params"]

FORCE_PROCESSOR = "vllm_magicpig.eval.forcing:ForceTokens"
"""``LLM(logits_processors=[FORCE_PROCESSOR])``: a name, because the engine core imports it."""

FORCE_LLM_ARGS = dict(logits_processors=[FORCE_PROCESSOR],
                      # explicit although it is the default: processed logprobs would
                      # report the forced token at 0.0 and everything else at -inf
                      logprobs_mode="raw_logprobs")


def _force(forced: tuple[int, ...], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    # output_ids is the request's live output list (vLLM passes a reference that grows,
    # with -1 placeholders under async scheduling), so its length is the position being
    # sampled now; beyond the forced sequence the request decodes freely.
    pos = len(output_ids)
    if pos < len(forced):
        logits.fill_(float("-inf"))
        logits[forced[pos]] = 0.0
    return logits


class ForceTokens(AdapterLogitsProcessor):
    """Forces ``SamplingParams.extra_args["force_tokens"]``; a no-op for other requests.

    The adapter base class tracks batch adds/removes/moves and hands each request's
    output token list to its per-request callable.
    """

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        forced = (params.extra_args or {}).get("force_tokens")
        if forced is not None and not all(isinstance(t, int) and t >= 0 for t in forced):
            raise ValueError("extra_args['force_tokens'] must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes the greedy choice: it must run for temperature-0 requests

    def new_req_logits_processor(self, params: SamplingParams):
        forced = (params.extra_args or {}).get("force_tokens")
        return None if forced is None else partial(_force, tuple(forced))


def forced_params(token_ids: Sequence[int], logprobs: int = 20) -> SamplingParams:
    """Greedy params that emit exactly ``token_ids`` and return top-``logprobs`` each step.

    ``ignore_eos`` so that a forced EOS-like token cannot end the request early;
    ``logprobs`` is capped by the engine's ``max_logprobs`` (20 by default).
    """
    ids = [int(t) for t in token_ids]
    return SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True,
                          logprobs=logprobs, extra_args={"force_tokens": ids})
