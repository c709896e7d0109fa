"""The layouts benchmark (benchmarks/cpu_attn_isas.py) on its quick rows: vLLM's kernel in each
layout this CPU runs, over the same K/V; where AMX runs, its output agrees with "vec"'s."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_attn_isas  # noqa: E402


def test_quick_rows_time_every_layout_over_the_same_values(capsys):
    threads = torch.get_num_threads()
    try:
        rows = cpu_attn_isas.run(cpu_attn_isas.QUICK_CASES, ["smollm2"], reps=2)
    finally:
        torch.set_num_threads(threads)
    assert [(r["context"], r["query_tokens"]) for r in rows] == list(cpu_attn_isas.QUICK_CASES)
    amx = torch.cpu._is_amx_tile_supported()
    for r in rows:
        assert r["vec_ms"] > 0
        assert ("amx_ms" in r) == amx, r
        if amx:  # the same attention in another layout: bf16 rounding apart, nothing more
            assert r["amx_ms"] > 0 and r["amx_rel_diff"] < 1e-2, r
    text = cpu_attn_isas.table(rows, ["--quick"])
    assert text.count("| smollm2 | 1024 |") == 2
