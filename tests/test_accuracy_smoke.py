"""The accuracy harness's smoke mode, end to end through vLLM (what CI runs)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_harness_smoke_run(tmp_path, model_path):
    from vllm_magicpig.eval import harness

    out = tmp_path / "acc"
    assert harness.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    rows = res["rows"]
    by = {(r["method"], r["task"]): r for r in rows}
    # Full attention must beat chance (0 for a 5-digit / word needle) on niah_single;
    # otherwise the harness or its prompt format is broken.
    assert by[("full", "niah_single")]["score"] > 0
    mp = by[("magicpig(10,150)", "niah_single")]
    assert mp["extra"]["decode_sparse"] > 0 and 0 < mp["cost"] < 0.2
    for base in ("topk", "quest"):
        r = by[(base, "niah_single")]
        assert r["extra"]["decode_by_method"].get(base, 0) > 0, r
        # matched budget: the baseline attends about as many keys as MAGICPIG sampled
        assert r["cost"] == pytest.approx(mp["cost"], rel=0.5, abs=0.01), (r["cost"], mp["cost"])
    # the evaluation-only 'global' centring ran the kernel path, calibrated first
    assert res["config"]["calibration"]["requests"] >= 1
    glob = by[("magicpig(10,150) global-centre", "niah_single")]
    assert glob["extra"]["decode_sparse"] > 0 and 0 < glob["cost"] < 0.5
    fid = {f["method"]: f for f in res["fidelity"]}
    assert 0 <= fid["magicpig(10,150)"]["agreement"] <= 1
    assert fid["magicpig(10,150)"]["mean_layer_rel_error"] is not None
    # teacher forcing: full attention forced onto its own continuation is the KL floor
    floor = fid["full (forced on itself)"]["kl_forced"]
    assert 0 <= floor < 1e-2, floor
    assert fid["magicpig(10,150)"]["kl_forced"] >= 0
    assert out.with_suffix(".md").exists()
