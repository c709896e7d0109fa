"""benchmarks/load_split.py: its grouping and per-request arithmetic on made-up records, and (e2e) a
short run in a real engine, where the sampled calls must be recorded and their parts add up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_split as ls  # noqa: E402


def record(requests, seconds, native, building=False, served=True, dense=0.0, exact_tokens=0, keys=4096):
    return {"requests": requests, "keys": keys * requests, "segments": requests, "exact_tokens": exact_tokens,
            "seconds": seconds, "native": native, "building": building, "all_served": served,
            "phases": {"lookup": native / 2, "dense": dense}}


def test_calls_are_grouped_by_build_and_batch_and_counted_per_request():
    records = [record(1, 300e-6, 200e-6), record(1, 500e-6, 400e-6),  # two batch-1 calls
               record(3, 900e-6, 600e-6, dense=90e-6, exact_tokens=900),  # batch <= 4
               record(20, 6e-3, 5e-3),  # batch <= 32
               record(2, 2e-3, 1e-3, building=True),  # beside a build: its own row
               record(2, 9e-3, 9e-3, served=False),  # a request attended exactly after all: not sampling's time
               record(0, 1e-4, 0.0)]  # nothing sampled
    rows = ls.summarise(records)
    assert [(r["building"], r["batch"], r["calls"], r["requests"]) for r in rows] == [
        (False, 1, 2, 2), (False, 4, 1, 3), (False, 32, 1, 20), (True, 4, 1, 2)]
    one, three = rows[0], rows[1]
    assert one["us"] == pytest.approx(400) and one["native_us"] == pytest.approx(300)
    assert one["python_us"] == pytest.approx(100) and one["phases_us"] == pytest.approx(150)
    assert three["us"] == pytest.approx(300) and three["python_us"] == pytest.approx(100)
    assert three["phase_us"]["dense"] == pytest.approx(30) and three["exact_tokens"] == pytest.approx(300)
    assert three["dense_ns_per_token"] == pytest.approx(100)
    assert rows[2]["dense_ns_per_token"] == 0.0 and rows[2]["keys"] == pytest.approx(4096)
    lines = ls.table(rows)
    assert len(lines) == 2 + len(rows)
    assert lines[2].startswith("| no | 1 | 2 | 400 | 300 | 150 | 100 |")
    assert lines[-1].startswith("| yes | 4 | 1 |")


def test_batch_groups():
    assert [ls.batch_group(n) for n in (1, 2, 4, 5, 12, 13, 32, 100, 200)] == [1, 4, 4, 12, 12, 32, 32, 128, 200]


@pytest.mark.e2e
def test_a_short_load_records_its_sampled_calls(tmp_path):
    out = tmp_path / "load"
    # the cost model off, built at the first decode: every decode past the short prompts' window is sampled
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_split.py"), "--prompts", "3",
                        "--doc-tokens", "1300,1700", "--answer-tokens", "24",
                        "--magicpig", '{"cost_model": false, "background_index": false}', "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows = data["rows"]
    assert rows and not any(row["building"] for row in rows), rows
    # 3 requests x (24 - 1) decodes x 28 sparse layers, sampled in the calls recorded (batches of 1-3)
    assert sum(row["requests"] for row in rows) == 3 * 23 * 28 == data["stats"]["decode_sparse"]
    for row in rows:
        assert 0 < row["phases_us"] < row["native_us"] < row["us"], row
        assert sum(row["phase_us"].values()) == pytest.approx(row["phases_us"])
        assert 1300 <= row["keys"] <= 1700 + 24 and row["segments"] >= 1 and row["exact_tokens"] >= 64, row
    assert "| no |" in out.with_suffix(".md").read_text()
