"""Budget mode end to end on SmolLM2 through real vLLM: one engine, one prompt of a few K tokens.

Every decode is sampled from the first: each sparse layer chooses the request's (K, L) from its
own angles, refines it over its first decodes and steers it by what it sampled, and its measured
fraction lands within +-25% of the target. Read from the worker's counters, so a silent fallback to exact decode fails.
"""
from __future__ import annotations

import pytest

from tests.conftest import make_llm, stats
from vllm_magicpig.budget import built_tables
from vllm_magicpig.eval.tasks import long_text

pytestmark = pytest.mark.e2e

NUM_LAYERS = 30
SPARSE_LAYERS = NUM_LAYERS - 2  # layers 0 and 15 are dense by default
TARGET = 0.02
CALIBRATION_DECODES = 8
DECODE_TOKENS = 40


@pytest.fixture(scope="module")
def budget_llm(model_path):
    # cost_model off: every decode is sampled, so every layer's fraction is measured on every step
    llm = make_llm(model_path, magicpig={"target_cost": TARGET, "calibration_decodes": CALIBRATION_DECODES,
                                         "log_stats_interval": 0, "cost_model": False})
    yield llm
    del llm


def test_budget_mode_samples_from_the_first_decode_and_lands_every_layer_on_target(budget_llm):
    from vllm import SamplingParams

    tok = budget_llm.get_tokenizer()
    text = long_text(3000, tok, seed=7, source="britannica")
    budget_llm.collective_rpc("magicpig_reset_stats")
    out = budget_llm.generate([text], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    decode_steps = len(out.token_ids) - 1  # the first token comes from prefill
    st = stats(budget_llm)
    # nothing was served exactly: the sparse path ran every decode of every sparse layer
    assert st["decode_exact"].get("dense_layer", 0) == 2 * decode_steps
    assert sum(st["decode_exact"].values()) == 2 * decode_steps, st["decode_exact"]
    assert st["decode_sparse"] == SPARSE_LAYERS * decode_steps, st
    assert st["decode_by_method"] == {"magicpig": st["decode_sparse"]}
    assert st["index"]["segments_built"] > 0
    b = st["budget"]
    assert b["requests_refining"] == 0 and b["calibration_decodes"] == CALIBRATION_DECODES, b
    per_layer = {}
    for name, entry in b["layers"].items():
        c = entry[f"{TARGET:g}"]
        # L read <= the tables built <= 1.25 x max_L (steering reads within what was built)
        assert 1 <= c["K"] <= 16 and 2 <= c["L"] <= c["L_built"] <= built_tables(b["max_L"]), (name, c)
        assert c["choices"] == 1 + c["refined"], (name, c)  # one request: its first choice and refinements
        if not c["steered"]:  # a steered L meets the target with the model scaled by the measured drift
            assert abs(c["model_fraction"] / TARGET - 1) < 0.1, (name, c)  # L is integer: near, not exact
        per_layer[name] = c["sampled_fraction"]
        assert c["sampled_fraction"] == pytest.approx(st["sampled_fraction_per_layer"][name])
    assert len(per_layer) == SPARSE_LAYERS
    off = {n: round(v, 4) for n, v in per_layer.items() if abs(v / TARGET - 1) > 0.25}
    assert not off, f"layers off target (+-25% of {TARGET}): {off}; all: {per_layer}"
    assert len({(e[f'{TARGET:g}']['K'], e[f'{TARGET:g}']['L']) for e in b['layers'].values()}) > 1  # per layer
