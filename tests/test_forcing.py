"""Teacher forcing through real vLLM on SmolLM2: forced ids come out verbatim, and the
reported logprobs are the model's raw (pre-forcing) next-token distribution."""
from __future__ import annotations

import math

import pytest

from tests.conftest import make_llm
from vllm_magicpig.eval.forcing import FORCE_LLM_ARGS, forced_params

pytestmark = pytest.mark.e2e

N = 10
K = 20  # logprobs per position
REPLACED = (4, 7)  # positions of the reference continuation replaced by other tokens


@pytest.fixture(scope="module")
def llm(model_path):
    llm = make_llm(model_path, max_model_len=2048, **FORCE_LLM_ARGS)
    yield llm
    del llm


def _top1(position_logprobs) -> int:
    (tok,) = [t for t, lp in position_logprobs.items() if lp.rank == 1]
    return tok


def _assert_same_logprobs(got, want, pos):
    # got may hold one more entry: the forced token, reported even outside the top K
    assert set(want) <= set(got) and len(got) <= len(want) + 1, pos
    for t in want:
        assert abs(got[t].logprob - want[t].logprob) < 1e-3, (pos, t)


def test_forced_tokens_are_emitted_and_logprobs_are_raw(llm):
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    prompt, other = "The capital of France is", "def fibonacci(n):"
    greedy = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=K)
    (ref,) = [o.outputs[0] for o in llm.generate([prompt], greedy, use_tqdm=False)]
    ref_ids = list(ref.token_ids)
    assert len(ref_ids) == N

    replacements = iter(tok.encode(" zebra purple", add_special_tokens=False))
    forced_a = list(ref_ids)
    for pos in REPLACED:
        forced_a[pos] = next(replacements)
        assert forced_a[pos] != ref_ids[pos]
    forced_b = tok.encode(" banana banana quietly elephant", add_special_tokens=False)

    # one batch: two forced requests and an unforced one, so that per-request state and
    # batch indices are exercised (the unforced request must be left alone)
    outs = llm.generate([prompt, other, prompt],
                        [forced_params(forced_a, K), forced_params(forced_b, K), greedy],
                        use_tqdm=False)
    a, b, free = (o.outputs[0] for o in outs)

    # (a) exactly the forced ids; other requests are untouched
    assert list(a.token_ids) == forced_a
    assert list(b.token_ids) == forced_b
    assert list(free.token_ids) == ref_ids

    # (b) raw logprobs: up to and including the first replacement the context equals the
    # unforced request's, so the whole top-K distribution must equal its. Compare within
    # one batch: in bf16 on CPU the batch's make-up alone moves logprobs by up to ~0.2.
    for pos in range(REPLACED[0] + 1):
        _assert_same_logprobs(a.logprobs[pos], free.logprobs[pos], pos)
    # and a run forced onto its own greedy continuation reports the unforced run's logprobs
    (solo,) = [o.outputs[0] for o in llm.generate([prompt], forced_params(ref_ids, K),
                                                  use_tqdm=False)]
    assert list(solo.token_ids) == ref_ids
    for pos in range(N):
        _assert_same_logprobs(solo.logprobs[pos], ref.logprobs[pos], pos)

    # where the forced token is not the argmax, the report still ranks the argmax first
    # and gives the forced token its real (finite, lower) logprob, not 0.0
    for pos in REPLACED:
        lp = a.logprobs[pos]
        forced_lp = lp[forced_a[pos]]
        assert _top1(lp) != forced_a[pos], pos
        assert forced_lp.rank > 1 and math.isfinite(forced_lp.logprob)
        assert forced_lp.logprob < lp[_top1(lp)].logprob - 1e-3
    assert _top1(a.logprobs[REPLACED[0]]) == ref_ids[REPLACED[0]]
    # every position of a forced run reports K finite logprobs, never the -inf mask
    for lp in (*a.logprobs, *b.logprobs):
        assert len(lp) >= K and all(math.isfinite(x.logprob) for x in lp.values())
