"""The exact-service benchmark (benchmarks/exact_service.py) runs both backends at the vLLM seam
and checks through MAGICPIG's counters that it served every decode exactly; here on a tiny row."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from helpers import torch_threads_kept

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import exact_service  # noqa: E402


def test_one_row_times_both_backends_and_restores_vllms_op(model_path, capsys):
    import vllm._custom_ops  # noqa: F401

    op = torch.ops._C.cpu_attention_with_kv_cache
    with torch_threads_kept():
        assert exact_service.main(["--contexts", "1024", "--batches", "2", "--steps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1024 | 2 |")]
    assert len(rows) == 1, rows
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4].endswith("x")
    assert torch.ops._C.cpu_attention_with_kv_cache is op  # the timing wrapper is gone


def test_deferred_path_serves_every_decode_exactly_as_index_deferred(model_path, capsys):
    """--reason index_deferred: the planner finds each prompt's centre and the primed cost model
    defers its build every step; run() asserts through MAGICPIG's counters that every sparse-layer
    decode was exact for that reason (a build, a sampled decode or another reason fails it)."""
    import vllm._custom_ops  # noqa: F401

    with torch_threads_kept():
        assert exact_service.main(["--contexts", "2048", "--batches", "2", "--steps", "3",
                                   "--reason", "index_deferred"]) == 0
    out = capsys.readouterr().out
    assert "exact as index_deferred" in out
    assert len([line for line in out.splitlines() if line.startswith("| 2048 | 2 |")]) == 1
