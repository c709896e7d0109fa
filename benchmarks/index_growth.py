"""What growing the index costs as decoding crosses a ``segment_tokens`` boundary.

    python benchmarks/index_growth.py [--contexts 4096,16384,32768] [--threads 1]

Every ``segment_tokens`` (512) decoded tokens, each sparse layer hashes the new tokens into a
segment of their own and merges it into the request's last segment (``IndexStore.get_or_build``):
the merge copies the whole last segment. This times both parts, per layer, at SmolLM2's shape
(3 KV heads, head_dim 64) and a head_dim-128 shape (8 KV heads), on synthetic keys, and gives
the cost amortised per decoded token for a 28-layer model. The end-to-end benchmark's 32-token
decode windows do not cross a boundary, so its ratios leave this cost out.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_magicpig import kernel  # noqa: E402

K, L, UNIT, LAYERS = 10, 150, 512, 28
SHAPES = {"smollm2 (3 KV heads, d64)": (3, 64), "d128 (8 KV heads)": (8, 128)}


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(n: int, hkv: int, d: int, threads: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(n + hkv)
    off = torch.randn(hkv, d, generator=gen) * 2
    keys = (torch.randn(n + UNIT, hkv, d, generator=gen) + off).bfloat16()
    vals = torch.randn(n + UNIT, hkv, d, generator=gen).bfloat16()
    proj = torch.randn(d, K * L, generator=gen)
    centre = keys[:n].float().mean(0)
    base = kernel.build_segment(keys[:n], vals[:n], centre, proj, K, L, num_threads=threads)
    new = kernel.build_segment(keys[n:], vals[n:], centre, proj, K, L, num_threads=threads)
    build = median_ms(lambda: kernel.build_segment(keys[n:], vals[n:], centre, proj, K, L, num_threads=threads), reps)
    merge = median_ms(lambda: kernel.merge_segments([base, new], num_threads=threads), reps)
    return dict(context=n, hkv=hkv, d=d, build_ms=build, merge_ms=merge,
                per_token_ms=(build + merge) * LAYERS / UNIT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384,32256")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (vLLM's CPU worker: 1 by default)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    print(f"isa={kernel.active_isa()} threads={a.threads} K={K} L={L} segment_tokens={UNIT}")
    print("| shape | last segment tokens | hash + index 512 new ms | merge ms | per decoded token, 28 layers |")
    print("|---|---|---|---|---|")
    for name, (hkv, d) in SHAPES.items():
        for n in [int(x) for x in a.contexts.split(",")]:
            r = run(n, hkv, d, a.threads, a.reps)
            print(f"| {name} | {n} | {r['build_ms']:.1f} | {r['merge_ms']:.1f} | {r['per_token_ms']:.2f} ms |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
