"""Budget mode end to end on SmolLM2 through real vLLM: one engine, one prompt of a few K tokens.

The first decodes calibrate (served exactly, counted as ``calibrating``); the rest run sparse
with each layer's own (K, L), and every sparse layer's measured fraction lands within +-25%
of the target. Read from the worker's counters, so a silent fallback to exact decode fails.
"""
from __future__ import annotations

import pytest

from tests.conftest import make_llm, stats
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


def test_budget_mode_calibrates_then_lands_every_layer_on_target(budget_llm):
    from vllm import SamplingParams

    tok = budget_llm.get_tokenizer()
    text = long_text(3000, tok, seed=7, source="britannica")
    budget_llm.collective_rpc("magicpig_reset_stats")
    out = budget_llm.generate([text], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    decode_steps = len(out.token_ids) - 1  # the first token comes from prefill
    st = stats(budget_llm)
    # calibration happened: the first CALIBRATION_DECODES decodes of every sparse layer were exact
    assert st["decode_exact"].get("calibrating") == SPARSE_LAYERS * CALIBRATION_DECODES, st["decode_exact"]
    b = st["budget"]
    assert b["calibrated_layers"] == SPARSE_LAYERS and b["calibrating_layers"] == 0, b
    # ... and the sparse path ran for the rest, with each layer's own (K, L)
    assert st["decode_sparse"] == SPARSE_LAYERS * (decode_steps - CALIBRATION_DECODES), st
    assert st["decode_by_method"] == {"magicpig": st["decode_sparse"]}
    assert st["index"]["segments_built"] > 0
    per_layer = {}
    for name, entry in b["layers"].items():
        c = entry[f"{TARGET:g}"]
        assert 1 <= c["K"] <= 16 and 2 <= c["L"] <= 150, (name, c)
        # the model's expectation at the choice, times the bias feedback learned, is the target
        assert abs(c["model_fraction"] * c["model_bias"] / TARGET - 1) < 0.05, (name, c)
        per_layer[name] = c["sampled_fraction"]
        assert c["sampled_fraction"] == pytest.approx(st["sampled_fraction_per_layer"][name])
    assert len(per_layer) == SPARSE_LAYERS
    off = {n: round(v, 4) for n, v in per_layer.items() if abs(v / TARGET - 1) > 0.25}
    assert not off, f"layers off target (+-25% of {TARGET}): {off}; all: {per_layer}"
    assert len({(e[f'{TARGET:g}']['K'], e[f'{TARGET:g}']['L']) for e in b['layers'].values()}) > 1  # per layer
