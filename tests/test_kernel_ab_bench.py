"""The build comparison (benchmarks/kernel_ab.py) on a small layer: each tree runs in its own process,
the rounds alternate, and the same tree against itself computes the same output."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_ab.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_tree_against_itself_gives_one_table_and_equal_outputs():
    r = run_ab(str(ROOT), str(ROOT), "--sizes", "2048", "--rounds", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert "head_dim 64, 2K" in lines, r.stdout
    rows = [ln for ln in lines if ln.startswith("| cold (ms)") or ln.startswith("| lookup (thread-ms)")]
    assert len(rows) == 2, r.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and float(cells[3]) > 0, row  # label, two trees, their ratio
    sums = next(ln for ln in lines if ln.startswith("output sums:")).split(":")[1].split(",")
    assert len(sums) == 2 and sums[0] == sums[1], r.stdout


def test_a_tree_without_this_build_is_refused(tmp_path):
    (tmp_path / "vllm_magicpig").mkdir()  # no extension here: the import finds another build
    r = run_ab(str(ROOT), str(tmp_path), "--sizes", "2048", "--rounds", "1")
    assert r.returncode != 0
    assert "failed to start" in r.stderr + r.stdout or "not this tree's build" in r.stderr, r.stderr[-2000:]


def test_one_tree_is_an_error():
    r = run_ab(str(ROOT))
    assert r.returncode != 0 and "at least two" in r.stderr
