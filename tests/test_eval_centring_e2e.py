"""Evaluation-only centrings in the real decode path: calibration through vLLM, the
model's RoPE convention, and 'global' / 'segment' / 'pre_rope' really sampling."""
from __future__ import annotations

import pytest

from tests.conftest import make_llm, stats
from vllm_magicpig import passkey

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def llm(model_path):
    # every layer sparse (layer 0 too), and sparse from 512 tokens on
    llm = make_llm(model_path, magicpig={"log_stats_interval": 0, "dense_layers": [], "min_sparse_context": 512})
    yield llm
    del llm


def _generate(llm, prompts, n):
    from vllm import SamplingParams

    return [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n),
                                                     use_tqdm=False)]


def test_calibration_sees_layer0_keys_as_one_direction_before_rope(llm):
    """Layer 0's key of a token depends on the token alone, so a prompt of one repeated
    token has one pre-RoPE key: un-rotating with the model's RoPE must line them up."""
    llm.collective_rpc("magicpig_clear_calibration")
    llm.collective_rpc("magicpig_set_eval", kwargs={"method": "exact", "calibrate": True})
    try:
        _generate(llm, [" the" * 1000], 2)
    finally:
        llm.collective_rpc("magicpig_set_eval")
    (summary,) = llm.collective_rpc("magicpig_calibration")
    assert summary["layers"] == 30 and summary["requests"] == 1
    assert summary["positions"] >= 1000
    coherence = summary["pre_rope_coherence"]
    assert coherence["model.layers.0.self_attn.attn"] > 0.98, coherence


@pytest.mark.parametrize("centering", ["global", "segment", "pre_rope"])
def test_eval_centrings_sample_in_the_decode_path(llm, centering):
    from vllm_magicpig.eval import tasks as T

    tok = llm.get_tokenizer()
    llm.collective_rpc("magicpig_clear_calibration")
    llm.collective_rpc("magicpig_set_eval", kwargs={"method": "exact", "calibrate": True})
    _generate(llm, [T.long_text(2200, tok, seed=901)], 2)
    llm.collective_rpc("magicpig_set_eval", kwargs={"method": "magicpig", "centering": centering})
    llm.collective_rpc("magicpig_reset_stats")
    try:
        prompt = passkey.build(tok, 1500, seed=5)
        _generate(llm, [prompt.text], 8)
        st = stats(llm)
    finally:
        llm.collective_rpc("magicpig_set_eval")
    assert st["decode_sparse"] > 0
    assert 0 < st["sampled_fraction"] < 0.5
    if centering == "global":
        assert st["index"]["centres_computed"] >= 1  # a centre per request, from calibration
        assert st["index"]["segments_built"] > 0  # and the C++ kernel's segments
    else:
        assert st["decode_by_method"][f"magicpig[{centering}]"] > 0  # the per-key torch path
        assert st["index"].get("segments_built", 0) == 0
