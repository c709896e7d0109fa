"""vLLM's own CPU attention kernel in each cache layout this CPU can run: "vec" and, on CPUs with
AMX tiles, "amx". MAGICPIG's prefill, dense layers and exact decodes run this kernel in the layout
vLLM chose, so this is what keeping vLLM's choice is worth (before commit c647b36 MAGICPIG moved
AMX machines to "vec"), and what an exact decode costs MAGICPIG's cost model there.

    .venv/bin/python benchmarks/cpu_attn_isas.py [--quick] [--out benchmarks/results/cpu_attn_isas]

One paged cache per layout holds the same random K/V (written by vLLM's reshape_and_cache in that
layout); the same queries are timed in both layouts in turn, ABBA, on the calling thread only
(vLLM's default binding gives the worker one core). Rows: decode (one query token per request)
and a prefill chunk (query tokens at the end of the context, causal), at SmolLM2's shape (9 query /
3 KV heads, head_dim 64) and a head_dim-128 one (8 / 2).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

BLOCK = 128
SHAPES = {"smollm2": (9, 3, 64), "d128": (8, 2, 128)}  # query heads, KV heads, head_dim
CASES = ((4096, 1), (16384, 1), (4096, 512), (16384, 512))  # (context, query tokens)
QUICK_CASES = ((1024, 1), (1024, 64))


def isas() -> list[str]:
    """The layouts to time: vLLM runs "amx" only where the CPU has AMX tiles (kv_layout.amx_granted)."""
    from vllm_magicpig.kv_layout import amx_granted

    return ["vec", "amx"] if amx_granted() else ["vec"]


class Layer:
    """One attention call over one layout's cache: random K/V, random block ids."""

    def __init__(self, isa: str, n: int, qlen: int, shape: tuple[int, int, int], seed: int) -> None:
        from vllm import _custom_ops as ops

        self.ops, self.isa = ops, isa
        h, hkv, d = shape
        gen = torch.Generator().manual_seed(seed)
        nb = -(-n // BLOCK)
        self.cache = torch.zeros(nb, hkv, 2 * BLOCK, d, dtype=torch.bfloat16)
        self.kc, self.vc = self.cache.chunk(2, dim=2)
        self.bt = torch.randperm(nb, generator=gen).to(torch.int32).view(1, nb)
        slots = self.bt[0].long().repeat_interleave(BLOCK)[:n] * BLOCK + torch.arange(n) % BLOCK
        keys = torch.randn(n, hkv, d, generator=gen).bfloat16()
        values = torch.randn(n, hkv, d, generator=gen).bfloat16()
        ops.cpu_attn_reshape_and_cache(keys, values, self.kc, self.vc, slots, isa)
        self.q = torch.randn(qlen, h, d, generator=gen).bfloat16()
        self.qsl = torch.tensor([0, qlen], dtype=torch.int32)
        self.seq = torch.tensor([n], dtype=torch.int32)
        self.meta = ops.cpu_attn_get_scheduler_metadata(1, h, hkv, d, self.seq, torch.bfloat16, self.qsl, True, -1,
                                                        isa, False)
        self.out = torch.empty(qlen, h, d, dtype=torch.bfloat16)
        self.scale = d**-0.5

    def __call__(self) -> None:
        self.ops.cpu_attention_with_kv_cache(self.q, self.kc, self.vc, self.out, self.qsl, self.seq, self.scale, True,
                                             None, -1, self.bt, 0.0, self.meta, None)


def time_in_turn(calls: dict, reps: int) -> dict[str, float]:
    """Median seconds of each call, the calls taking turns in ABBA order (the machine drifts)."""
    names = list(calls)
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def run(cases, shapes, reps: int) -> list[dict]:
    torch.set_num_threads(1)
    layouts = isas()
    rows = []
    for shape_name in shapes:
        for n, qlen in cases:
            layers = {isa: Layer(isa, n, qlen, SHAPES[shape_name], seed=n + qlen) for isa in layouts}
            t = time_in_turn(layers, reps if qlen == 1 else max(3, reps // 4))
            ref = layers["vec"].out.float()
            row = dict(shape=shape_name, context=n, query_tokens=qlen, **{f"{k}_ms": v * 1e3 for k, v in t.items()})
            if "amx" in layers:
                row["vec_over_amx"] = t["vec"] / t["amx"]
                row["amx_rel_diff"] = float((layers["amx"].out.float() - ref).norm() / ref.norm())
            rows.append(row)
            print(row, flush=True)
    return rows


def table(rows: list[dict], argv: list[str]) -> str:
    has_amx = any("amx_ms" in r for r in rows)
    lines = [f"Command: `python benchmarks/cpu_attn_isas.py {' '.join(argv)}` ({time.strftime('%Y-%m-%d')}); one "
             "thread; medians, the layouts in turn (ABBA).", ""]
    if not has_amx:
        lines += ["This CPU has no AMX tiles: vLLM runs \"vec\" only.", ""]
    lines += ["| shape | context | query tokens | vec ms | amx ms | vec / amx | amx vs vec output (rel. diff) |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        amx = (f"{r['amx_ms']:.3f} | {r['vec_over_amx']:.2f}x | {r['amx_rel_diff']:.1e}" if "amx_ms" in r
               else "- | - | -")
        lines.append(f"| {r['shape']} | {r['context']} | {r['query_tokens']} | {r['vec_ms']:.3f} | {amx} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small contexts, SmolLM2's shape (a smoke run)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=None, help="write OUT.md (default: print only)")
    args = ap.parse_args(argv)
    argv = argv if argv is not None else sys.argv[1:]
    rows = run(QUICK_CASES if args.quick else CASES, ["smollm2"] if args.quick else list(SHAPES),
               4 if args.quick else args.reps)
    text = table(rows, argv)
    print(text)
    if args.out:
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
