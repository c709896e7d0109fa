"""Budget mode end to end on SmolLM2 through real vLLM: one engine, one prompt of a few K tokens.

Every decode runs sparse (no calibration phase: the request chooses its (K, L) per layer at its
first decode), every layer's (K, L) is its own, and every sparse layer's measured fraction lands
within +-25% of the target. Read from the worker's counters, so a silent fallback to exact
decode fails the test.
"""
from __future__ import annotations

import pytest

from tests.conftest import make_llm, stats
from vllm_magicpig.eval.tasks import long_text

pytestmark = pytest.mark.e2e

NUM_LAYERS = 30
SPARSE_LAYERS = NUM_LAYERS - 2  # layers 0 and 15 are dense by default
TARGET = 0.02
DECODE_TOKENS = 32


@pytest.fixture(scope="module")
def budget_llm(model_path):
    # cost_model off: every decode is sampled, so every layer's fraction is measured on every step
    llm = make_llm(model_path, magicpig={"target_cost": TARGET, "log_stats_interval": 0, "cost_model": False})
    yield llm
    del llm


def test_budget_mode_lands_every_layer_on_target(budget_llm):
    from vllm import SamplingParams

    tok = budget_llm.get_tokenizer()
    text = long_text(3000, tok, seed=7, source="britannica")
    budget_llm.collective_rpc("magicpig_reset_stats")
    out = budget_llm.generate([text], SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    decode_steps = len(out.token_ids) - 1  # the first token comes from prefill
    st = stats(budget_llm)
    # the sparse path ran for every decode of every sparse layer, through the production method
    assert st["decode_sparse"] == SPARSE_LAYERS * decode_steps, st
    assert st["decode_exact"] == {"dense_layer": 2 * decode_steps}, st["decode_exact"]
    assert st["decode_by_method"] == {"magicpig": st["decode_sparse"]}
    assert st["index"]["segments_built"] > 0
    layers = st["budget"]["layers"]
    assert len(layers) == SPARSE_LAYERS
    per_layer = {}
    for name, entry in layers.items():
        c = entry[f"{TARGET:g}"]
        assert c["requests"] == 1 and 1 <= c["K"] <= 16 and 2 <= c["L"] <= 150, (name, c)
        assert abs(c["model_fraction"] / TARGET - 1) < 0.05, (name, c)  # one request: the bias is still 1
        per_layer[name] = c["sampled_fraction"]
        assert c["sampled_fraction"] == pytest.approx(st["sampled_fraction_per_layer"][name])
    off = {n: round(v, 4) for n, v in per_layer.items() if abs(v / TARGET - 1) > 0.25}
    assert not off, f"layers off target (+-25% of {TARGET}): {off}; all: {per_layer}"
    assert len({(e[f"{TARGET:g}"]["K"], e[f"{TARGET:g}"]["L"]) for e in layers.values()}) > 1  # per layer
