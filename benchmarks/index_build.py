"""What building a prompt's index costs per key, and where it goes.

    python benchmarks/index_build.py [--tokens 16384] [--threads 1] [--rounds 3] [--against DIR]

A new prompt's index is built once per sparse layer, off the decode path (background_index.py),
but on the worker's cores: on vLLM's default CPU binding, the one core that also decodes. So what
it costs comes back as slower decode steps while it runs (the end-to-end benchmark's cold rows).
This times, per key (token and KV head), on synthetic bf16 keys at SmolLM2's shape (3 KV heads,
head_dim 64) and a head_dim-128 shape (8 KV heads), with the worker's one thread:

* build: the whole build, with the cache-dtype (bf16) mirror and with the int8 mirror;
* from codes: the rest of a build (the K/V mirror, |k - c|, the bucket sort of L tables);
* hash: the build less that, the SimHash codes of the keys (K * L = 1500 projections a key), and
  its GFLOP/s;
* a 16K-token SmolLM2 prompt: the build time of its 28 sparse layers.

Each twice, side by side in one process: with the plugin's projection (bf16 values: bf16 keys take
the bf16-pairs key hash on an AVX-512 BF16 CPU, ``kernel.key_hash``) and with a float32 one (the
float32 k - c hash, which every build took before).

``--against DIR``: DIR is another checkout of this repository with its extension built (a git
worktree of an earlier commit, say). Each round runs this tree and DIR in turn, in fresh
processes, so the two are timed side by side through the machine's drift; the table gives both
and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
K, L, LAYERS, SMOL_TOKENS = 10, 150, 28, 16384
SHAPES = {"smollm2 (3 KV heads, d64)": (3, 64), "d128 (8 KV heads)": (8, 128)}


def best_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def time_shape(kernel, hkv: int, d: int, tokens: int, threads: int, reps: int) -> dict:
    """Microseconds per key of each part of a build of ``tokens`` tokens at one shape, per projection:
    ``runtime`` (as the plugin makes it: bf16 values, so bf16 keys take the bf16-pairs key hash on an
    AVX-512 BF16 CPU) and ``float32`` (a projection off the bf16 grid: float32 k - c, the hash every
    build took before)."""
    gen = torch.Generator().manual_seed(hkv * d)
    keys = (torch.randn(tokens, hkv, d, generator=gen) + torch.randn(hkv, d, generator=gen) * 2).bfloat16()
    vals = torch.randn(tokens, hkv, d, generator=gen).bfloat16()
    projections = {"float32": torch.randn(d, K * L, generator=gen)}
    projections["runtime"] = projections["float32"].bfloat16().float()  # runtime.simhash_projection's rounding
    centre = keys.float().mean(0)
    n = tokens * hkv
    codes = kernel.build_segment(keys, vals, centre, projections["float32"], K, L, num_threads=threads).codes()
    from_codes_us = best_s(lambda: kernel.build_segment_from_codes(keys, vals, centre, codes, K, L,
                                                                    num_threads=threads), reps) / n * 1e6
    key_hash = getattr(kernel, "key_hash", None)  # absent in trees before the bf16-pairs hash
    out = {}
    for name, proj in projections.items():
        def build(mirror, proj=proj):
            return lambda: kernel.build_segment(keys, vals, centre, proj, K, L, num_threads=threads, mirror=mirror)

        build_us = best_s(build("cache"), reps) / n * 1e6
        hash_us = max(build_us - from_codes_us, 1e-9)  # the build less its mirror and bucket sort
        out[name] = {
            "key_hash": key_hash(keys.dtype, proj, K, L) if key_hash else "centred_fp32",
            "hash_us": hash_us,
            "hash_gflops": K * L * d * 2 / hash_us / 1e3,
            "from_codes_us": from_codes_us,
            "build_us": build_us,
            "build_int8_us": best_s(build("int8"), reps) / n * 1e6,
        }
    return out


def measure(tokens: int, threads: int, reps: int) -> dict:
    """One process's timings of the tree on sys.path (microseconds per key)."""
    from vllm_magicpig import kernel

    out = {"isa": kernel.active_isa()}
    for name, (hkv, d) in SHAPES.items():
        out[name] = time_shape(kernel, hkv, d, tokens, threads, reps)
    return out


def run_tree(tree: Path, args: argparse.Namespace) -> dict:
    """measure() in a fresh process importing vllm_magicpig from ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tokens", str(args.tokens),
           "--threads", str(args.threads), "--reps", str(args.reps)]
    res = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"timing {tree} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def median_of(rounds: list[dict], shape: str, proj: str, key: str) -> float:
    return statistics.median(r[shape][proj][key] for r in rounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per segment built")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads (vLLM's CPU worker: 1 by default)")
    ap.add_argument("--reps", type=int, default=5, help="timings per figure in a process (the fastest is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per tree (the median is reported)")
    ap.add_argument("--against", type=Path, default=None, help="another checkout, built, to time side by side")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(measure(a.tokens, a.threads, a.reps)))
        return 0
    trees = {"this tree": ROOT}
    if a.against is not None:
        trees["against"] = a.against.resolve()
    rounds: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(a.rounds):
        for label, tree in trees.items():  # in turn, so both see the same drift
            rounds[label].append(run_tree(tree, a))
    isa = rounds["this tree"][0]["isa"]
    print(f"isa={isa} threads={a.threads} K={K} L={L} tokens per segment={a.tokens}; "
          f"median of {a.rounds} processes per tree, each the fastest of {a.reps}")
    if a.against is not None:
        print(f"against: {trees['against']}")
    print("projection `runtime`: bf16 values, as the plugin makes it; `float32`: off the bf16 grid. hash = build less "
          "mirror + sort (a build from given codes)")
    cols = [("hash_us", "hash us/key"), ("hash_gflops", "hash GFLOP/s"), ("from_codes_us", "mirror + sort us/key"),
            ("build_us", "build us/key (bf16 mirror)"), ("build_int8_us", "build us/key (int8 mirror)")]
    print("| tree | shape | projection | key hash | " + " | ".join(c[1] for c in cols)
          + " | 16K-token SmolLM2 prompt, 28 layers, s |")
    print("|---" * (len(cols) + 5) + "|")
    for label in trees:
        for shape, (hkv, _) in SHAPES.items():
            for proj in ("runtime", "float32"):
                vals = [median_of(rounds[label], shape, proj, k) for k, _ in cols]
                prompt = (f"{vals[3] * SMOL_TOKENS * hkv * LAYERS / 1e6:.1f}" if shape.startswith("smollm2") else "-")
                method = rounds[label][0][shape][proj]["key_hash"]
                print(f"| {label} | {shape} | {proj} | {method} | "
                      + " | ".join(f"{v:.2f}" if k != "hash_gflops" else f"{v:.1f}" for (k, _), v in zip(cols, vals))
                      + f" | {prompt} |")
    def ratio(shape: str, num: tuple, den: tuple, k: str) -> float:  # num, den: (tree, projection)
        return median_of(rounds[num[0]], shape, num[1], k) / median_of(rounds[den[0]], shape, den[1], k)

    print("\nruntime's projection over float32's, same tree (time ratio, > 1: runtime's is faster):")
    for label in trees:
        for shape in SHAPES:
            parts = [f"{name} {ratio(shape, (label, 'float32'), (label, 'runtime'), k):.2f}x"
                     for k, name in (("hash_us", "hash"), ("build_us", "build bf16"), ("build_int8_us", "build int8"))]
            print(f"  {label}, {shape}: " + ", ".join(parts))
    if a.against is not None:
        print("\nthis tree over against, runtime's projection (time ratio, > 1: this tree is faster):")
        for shape in SHAPES:
            parts = [f"{name} {ratio(shape, ('against', 'runtime'), ('this tree', 'runtime'), k):.2f}x"
                     for k, name in (("hash_us", "hash"), ("from_codes_us", "mirror + sort"),
                                     ("build_us", "build bf16"), ("build_int8_us", "build int8"))]
            print(f"  {shape}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
