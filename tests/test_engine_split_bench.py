"""benchmarks/engine_split.py: the arithmetic of its window and split on made-up timer readings, and
(e2e) a short run in a real engine, where every timed piece must be found and the parts must add up."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine_split as es  # noqa: E402


def test_the_window_is_the_long_run_less_the_short_and_the_split_adds_up():
    short = {"worker step": (0.5, 9), "layer": (0.09, 252), "ops call": (0.08, 252), "native run": (0.07, 252),
             "phases": (0.06, 252), "metadata build": (0.002, 9)}
    long = {"worker step": (2.1, 41), "layer": (0.09 + 32 * 28 * 400e-6, 252 + 32 * 28),
            "ops call": (0.08 + 32 * 28 * 350e-6, 252 + 32 * 28),
            "native run": (0.07 + 32 * 28 * 330e-6, 252 + 32 * 28),
            "phases": (0.06 + 32 * 28 * 300e-6, 252 + 32 * 28), "metadata build": (0.002 + 32 * 250e-6, 41),
            "index lookups": (32 * 28 * 15e-6, 32 * 28)}
    # the kernel's phases one by one (read() adds them beside their sum, "phases")
    short["phase lookup"], long["phase lookup"] = (0.02, 252), (0.02 + 32 * 28 * 120e-6, 252 + 32 * 28)
    row = es.split_row(es.window(long, short), steps=32)
    assert row["step ms"] == pytest.approx(1000 * 1.6 / 32)
    assert row["sparse layers"] == pytest.approx(28)
    assert row["layer"] == pytest.approx(400) and row["phases"] == pytest.approx(300)
    assert row["native set-up"] == pytest.approx(30) and row["wrapper"] == pytest.approx(20)
    assert row["above ops"] == pytest.approx(50) and row["index lookups"] == pytest.approx(15)
    assert row["metadata build"] == pytest.approx(250) and row["plan"] == 0
    # the parts of a layer add up to it
    assert row["phases"] + row["native set-up"] + row["wrapper"] + row["above ops"] == pytest.approx(row["layer"])
    assert row["phase lookup"] == pytest.approx(120)
    lines = es.table([row, row])
    assert len(lines) == 4 and lines[2].startswith("| 0 | 50.00 | 28.0 | 400.0 | 300.0 | 30.0 | 20.0 | 50.0")
    assert lines[0].rstrip(" |").endswith("phase lookup") and lines[2].rstrip(" |").endswith("120.0")


@pytest.mark.e2e
def test_a_short_run_in_an_engine_finds_every_timed_piece(tmp_path):
    out = tmp_path / "split"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_split.py"), "--context", "4096",
                        "--batch", "1", "--reps", "1", "--short", "0", "--long", "6", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.with_suffix(".md").read_text().splitlines()
    row = [ln for ln in text if ln.startswith("| 0 |")]
    assert len(row) == 1, r.stdout[-2000:]
    head = [ln for ln in text if ln.startswith("| rep |")][0]
    cells = [float(c) for c in row[0].strip("|").split("|")[1:]]
    named = dict(zip([c.strip() for c in head.strip("|").split("|")[1:]], cells))
    # each of the kernel's phases has its column, and they add up to the phases' sum
    phases = {k: v for k, v in named.items() if k.startswith(es.PHASE_PREFIX)}
    assert {"phase lookup", "phase gather_logits", "phase softmax_v"} <= set(phases), named
    assert sum(phases.values()) == pytest.approx(named["phases"], abs=0.1 * len(phases)), named
    # every step ran SmolLM2's 28 sparse layers (30 layers, 2 dense) through the timed forward
    assert named["sparse layers a step"] == pytest.approx(28, abs=0.1), named
    # one run (--short 0): the timers nest, so every part is a time of its own, and a layer is its parts
    for part in ("layer", "phases", "decode method", "index lookups", "accounting", "DecodeStep.serves",
                 "metadata build", "plan"):
        assert named[part] > 0, (part, named)
    for part in ("native set-up", "wrapper", "above ops"):
        assert named[part] > -1.0, (part, named)  # a layer's kernel runs on the worker's one thread
    assert named["phases"] < named["layer"] < 1000 * named["step ms"] / 28, named
