"""The mixed-step benchmark (benchmarks/mixed_step.py) times a step that samples one request and
serves the rest exactly; run() checks through MAGICPIG's counters that the step really mixed them
(one sampled request per sparse layer, the others exact as short_context). A tiny row here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import torch_threads_kept

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import mixed_step  # noqa: E402


def test_a_tiny_mixed_row_runs_and_mixes(model_path, capsys):
    with torch_threads_kept():
        assert mixed_step.main(["--batches", "1,3", "--sampled-context", "1536", "--exact-context", "1024",
                                "--steps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 2, rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("x")


def test_exact_requests_must_be_shorter_than_the_sampled_one(model_path):
    import vllm_magicpig

    vllm_magicpig.register()
    with pytest.raises(SystemExit, match="--exact-context must be below"):
        mixed_step.run(model_path, 1024, 1024, 2, 1)
