"""Bootstrap intervals of the accuracy harness (``eval/metrics.py``, ``harness.confidence_table``):
scores over prompts with a 95% interval, and paired differences against full attention.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_magicpig.eval import harness
from vllm_magicpig.eval import metrics as M


def test_constant_scores_have_a_point_interval():
    iv = M.bootstrap_mean([50.0] * 12)
    assert (iv.estimate, iv.low, iv.high, iv.n) == (50.0, 50.0, 50.0, 12)


def test_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    covered = 0
    trials = 300
    for t in range(trials):
        scores = 100.0 * (rng.random(60) < 0.4)
        iv = M.bootstrap_mean(scores, n_boot=1000, seed=t)
        covered += iv.low <= 40.0 <= iv.high
    assert 0.89 <= covered / trials <= 0.99, covered / trials


def test_tasks_are_averaged_and_resampled_separately():
    by_task = {"a": [100.0] * 30, "b": [0.0, 100.0] * 2}  # pooled mean would be 91.2; task mean 75
    iv = M.bootstrap_mean(by_task, seed=3)
    assert iv.estimate == pytest.approx(75.0) and iv.n == 34
    assert 50.0 <= iv.low < 75.0 < iv.high <= 100.0  # only task b varies: at most 50 points either way / 2


def test_paired_difference_is_much_tighter_than_unpaired_intervals():
    rng = np.random.default_rng(2)
    ref = 100.0 * (rng.random(40) < 0.5)
    ours = ref.copy()
    ours[:3] = 100.0 - ours[:3]  # differs on 3 prompts of 40
    d = M.bootstrap_paired_difference(ours, ref)
    assert d.estimate == pytest.approx((ours - ref).mean())
    a, b = M.bootstrap_mean(ours), M.bootstrap_mean(ref)
    unpaired = float(np.hypot(a.high - a.low, b.high - b.low))  # width of an independent difference
    assert d.high - d.low < 0.5 * unpaired, (d, a, b)
    same = M.bootstrap_paired_difference(ref, ref)
    assert (same.estimate, same.low, same.high) == (0.0, 0.0, 0.0)


def test_within_margin_reads_the_upper_end():
    assert M.Interval(-5.0, -9.0, -1.5, 0.95, 10).within(-2)  # -2 cannot be rejected
    assert not M.Interval(-5.0, -9.0, -2.5, 0.95, 10).within(-2)


def test_paired_needs_the_same_prompts():
    with pytest.raises(ValueError, match="same prompts"):
        M.bootstrap_paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same tasks"):
        M.bootstrap_paired_difference({"a": [1.0]}, {"b": [1.0]})
    with pytest.raises(ValueError, match="at least one"):
        M.bootstrap_mean([])


def _rows(method, ctx, scores_by_task, with_scores=True):
    out = []
    for task, sc in scores_by_task.items():
        extra = {"scores": sc} if with_scores else {}
        out.append(harness.Row(method, "magicpig" if method != "full" else "full", ctx, task,
                               sum(sc) / len(sc), 1.0, len(sc), extra))
    return out


def test_confidence_table_reports_intervals_and_the_2_point_verdict():
    full = {"niah": [100.0] * 8 + [0.0] * 2, "vt": [100.0, 0.0] * 5}
    close = {"niah": [100.0] * 8 + [0.0] * 2, "vt": [100.0, 0.0] * 4 + [0.0, 0.0]}  # one prompt worse
    far = {"niah": [0.0] * 10, "vt": [0.0] * 10}
    rows = _rows("full", 4096, full) + _rows("close", 4096, close) + _rows("far", 4096, far)
    lines, fields = harness.confidence_table(rows)
    text = "\n".join(lines)
    assert "| close | 4096 | 20 |" in text and "| far | 4096 | 20 |" in text
    assert fields[("close", 4096)]["within"] is True
    assert fields[("far", 4096)]["within"] is False
    assert fields[("far", 4096)]["diff"] == pytest.approx(-65.0)
    assert "diff" not in fields[("full", 4096)]
    lo, hi = fields[("close", 4096)]["avg_ci"]
    assert lo <= 60.0 <= hi


def test_confidence_table_skips_rows_without_per_prompt_scores():
    rows = _rows("full", 4096, {"niah": [100.0, 0.0]}, with_scores=False)
    assert harness.confidence_table(rows) == ([], {})


def test_outputs_pair_magicpig_against_topk_and_average_the_tasks_costs(tmp_path):
    """The report adds MAGICPIG's paired difference against TopK (no 2-point verdict there), and a
    method's cost is the mean of its tasks' measured fractions (methods run task by task)."""
    full = {"niah": [100.0] * 10, "vt": [100.0, 0.0] * 5}
    mp = {"niah": [100.0] * 9 + [0.0], "vt": [100.0, 0.0] * 5}
    topk = {"niah": [0.0] * 10, "vt": [0.0] * 10}
    rows = _rows("full", 4096, full) + _rows("magicpig(10,150)", 4096, mp)
    rows[2].cost, rows[3].cost = 0.02, 0.04
    rows += [harness.Row("topk", "topk", 4096, t, 0.0, 0.03, 10, {"scores": s}) for t, s in topk.items()]
    text = harness.write_outputs(rows, [], tmp_path / "acc", {"command": "test"})
    assert "paired difference against topk" in text
    vs_topk = text[text.index("difference vs topk"):]
    assert "| magicpig(10,150) | 4096 | 20 | " in vs_topk and "within 2 points" not in vs_topk.splitlines()[0]
    summary = {s["method"]: s for s in json.loads((tmp_path / "acc.json").read_text())["summary"]}
    assert summary["magicpig(10,150)"]["cost"] == pytest.approx(0.03)
    assert summary["magicpig(10,150)"]["diff_vs_topk"] == pytest.approx(70.0)  # task means 90 and 50 vs 0
    assert "diff_vs_topk" not in summary["full"]  # full attention is not in the TopK comparison


def test_merge_replaces_rows_of_a_rerun(tmp_path):
    """Merging a rerun of some methods: its rows replace the earlier run's rows of the same method,
    context and task; the other rows stay."""
    first = _rows("full", 4096, {"niah": [100.0] * 10}) + _rows("budget(2%)", 4096, {"niah": [0.0] * 10})
    rerun = _rows("budget(2%)", 4096, {"niah": [100.0] * 9 + [0.0]})
    harness.write_outputs(first, [], tmp_path / "first", {"command": "first", "contexts": [4096]})
    harness.write_outputs(rerun, [], tmp_path / "rerun", {"command": "rerun", "contexts": [4096]})
    harness.merge_results([tmp_path / "first.json", tmp_path / "rerun.json"], tmp_path / "merged")
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted((r["method"], r["score"]) for r in merged["rows"]) == [("budget(2%)", 90.0), ("full", 100.0)]


def test_budget_rows_name_their_largest_L():
    """Budget rows without a suffix take the config's default max_L; the 'L<=N' rows pin it, so a
    row keeps its meaning when the default moves (it was 150 before 2026-12-01)."""
    from vllm_magicpig.config import MagicPigConfig

    rows = {m.name: m.settings for m in harness.methods(full_mode=True) if m.name.startswith("budget(")}
    assert rows["budget(2%)"] == {"method": "magicpig", "target_cost": 0.02}
    assert MagicPigConfig().max_L == 300
    for target in ("2%", "4%"):
        for max_L in (150, 300):
            assert rows[f"budget({target}) L<={max_L}"]["max_L"] == max_L


def test_merge_renames_rows_run_under_an_old_default(tmp_path):
    """--rename relabels a method in every input before rows replace each other: the first run's
    budget(2%) row and its rerun both become 'L<=150', and a later 'budget(2%)' run (the new
    default) stays apart from them."""
    first = _rows("full", 4096, {"niah": [100.0] * 10}) + _rows("budget(2%)", 4096, {"niah": [0.0] * 10})
    rerun = _rows("budget(2%)", 4096, {"niah": [100.0] * 9 + [0.0]})
    wide = _rows("budget(2%) L<=300", 4096, {"niah": [100.0] * 10})
    for name, rows in (("first", first), ("rerun", rerun), ("wide", wide)):
        harness.write_outputs(rows, [], tmp_path / name, {"command": name, "contexts": [4096]})
    paths = [tmp_path / f"{n}.json" for n in ("first", "rerun", "wide")]
    text = harness.merge_results(paths, tmp_path / "merged", {"budget(2%)": "budget(2%) L<=150"})
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert sorted((r["method"], r["score"]) for r in merged["rows"]) == [
        ("budget(2%) L<=150", 90.0), ("budget(2%) L<=300", 100.0), ("full", 100.0)]
    assert "budget(2%) -> budget(2%) L<=150" in merged["config"]["command"] and "L<=150" in text
    with pytest.raises(SystemExit):
        harness.main(["--merge", ",".join(map(str, paths)), "--rename", "budget(2%)"])
