"""benchmarks/lookup_floor.py: the bucket walk it times reads what the kernel's would (its counts),
and both modes walk the same buckets."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lookup_floor  # noqa: E402


def test_walk_counts_and_modes_agree(tmp_path):
    n, K = 2048, 6
    rows = lookup_floor.measure([n], K=K, L=12, kv_heads=2, heads_per_kv=3, layers=3, reps=2, seed=5)
    assert [r["mode"] for r in rows] == ["directory, then ids", "ids only (bounds known)"]
    # uniform codes over 2^K buckets: a bucket holds n / 2^K ids on average (12 tables x 6 heads x 3
    # layers = 216 buckets drawn, so the mean is within a few percent)
    expect = n / 2 ** K
    for r in rows:
        assert abs(r["ids_per_bucket"] - expect) < 0.15 * expect, r
        assert r["ns_per_bucket"] > 0 and r["us_per_layer"] > 0, r
        assert r["ns_per_id"] == pytest.approx(r["ns_per_bucket"] / r["ids_per_bucket"]), r
    # same seed: the same tables and query codes, so the same buckets, whichever way their bounds are read
    assert rows[0]["ids_per_bucket"] == rows[1]["ids_per_bucket"]


def test_cli_writes_its_table_and_rejects_long_segments(tmp_path, capsys):
    stem = tmp_path / "floor"
    lookup_floor.main(["--contexts", "1024", "--K", "5", "--L", "8", "--layers", "2", "--reps", "1",
                       "--out", str(stem)])
    text = (tmp_path / "floor.md").read_text()
    assert text.startswith("Command: `python benchmarks/lookup_floor.py --contexts 1024")
    assert text.count("| 1024 |") == 2, text
    with pytest.raises(SystemExit):
        lookup_floor.main(["--contexts", "40000"])
