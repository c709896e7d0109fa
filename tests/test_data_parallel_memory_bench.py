"""benchmarks/data_parallel_memory.py: its summaries of a run, on made-up samples and /metrics text
(the run itself starts two engines and fills the machine: benchmarks only)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

GIB, MIB = 2**30, 2**20


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "data_parallel_memory.py"
    spec = importlib.util.spec_from_file_location("data_parallel_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_lowest_free_memory_and_how_far_below_the_reserve():
    bench = _bench()
    samples = [(100.0, 3 * GIB), (100.5, 300 * MIB), (101.0, 900 * MIB)]
    s = bench.summarize(samples, 512 * MIB)
    assert s["min_free_gib"] == round(300 / 1024, 3) and s["at_s"] == 0.5 and s["below_reserve_mib"] == 212.0
    assert s["last_free_gib"] == round(900 / 1024, 3) and s["samples"] == 3
    assert bench.summarize([(0.0, GIB)], 512 * MIB)["below_reserve_mib"] == 0
    assert bench.summarize([], 512 * MIB) == {"samples": 0}


def test_each_engines_bytes_and_decodes_by_reason_from_metrics():
    text = "\n".join([
        '# HELP vllm:magicpig_index_bytes ...',
        'vllm:magicpig_index_bytes{engine="0",model_name="m",rank="0"} 5.9e+09',
        'vllm:magicpig_mirror_bytes{engine="0",model_name="m",rank="0"} 7.5e+08',
        'vllm:magicpig_decodes_total{engine="0",model_name="m",rank="0",reason="node_memory_low",served="exact"} 81.0',
        'vllm:magicpig_decodes_total{engine="0",model_name="m",rank="0",reason="evicted",served="exact"} 0.0',
        'vllm:magicpig_decodes_total{engine="1",model_name="m",rank="0",reason="magicpig",served="sparse"} 28.0',
    ])
    e = _bench().engine_metrics(text)
    assert e["0"] == {"index_bytes": 5_900_000_000, "mirror_bytes": 750_000_000, "decodes": {"node_memory_low": 81}}
    assert e["1"] == {"decodes": {"magicpig": 28}}
