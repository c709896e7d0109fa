"""What the kernel's bucket walk costs on its own, and what a bucket layout without a directory
read would save (``benchmarks/native/lookup_floor.cpp``, compiled by torch on the first run).

    python benchmarks/lookup_floor.py [--contexts 16384] [--layers 28] [--out FILE_STEM]

The kernel's lookup reads each (query head, table) bucket in two dependent random reads, its
directory entry, then its ids. This walks random tables of SmolLM2's shape (3 KV heads x 3 query
heads, K=10, L=150) over ``--layers`` copies in turn, as an engine's layers are, once with the
directory read and once with the buckets' bounds known beforehand (only the ids read at random). The
first is the floor of the kernel's lookup phase at uniform codes; their difference is what a layout
whose codes address the ids directly could save. Run it on one core (``taskset -c 1``), as the kernel
runs under vLLM's default binding.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _native():
    from torch.utils.cpp_extension import load

    return load("mp_lookup_floor", [str(Path(__file__).parent / "native" / "lookup_floor.cpp")],
                extra_cflags=["-O2"])


def measure(contexts, K=10, L=150, kv_heads=3, heads_per_kv=3, layers=28, reps=3, seed=0):
    """Rows of {context, mode, ns_per_bucket, ns_per_id, ids_per_bucket, us_per_layer}."""
    native = _native()
    rows = []
    for n in contexts:
        for mode, known in (("directory, then ids", False), ("ids only (bounds known)", True)):
            ns_b, ns_id, per_b, us = native.walk(n, K, L, kv_heads, heads_per_kv, layers, known, reps, seed)
            rows.append(dict(context=n, mode=mode, ns_per_bucket=ns_b, ns_per_id=ns_id, ids_per_bucket=per_b,
                             us_per_layer=us))
    return rows


def table(rows, heads: int) -> str:
    lines = [f"| context | bucket reads | ns a bucket | ns an id | ids a bucket | us a layer ({heads} heads) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['mode']} | {r['ns_per_bucket']:.1f} | {r['ns_per_id']:.2f} | "
                     f"{r['ids_per_bucket']:.1f} | {r['us_per_layer']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="16384", help="tokens per segment, comma-separated (<= 32768)")
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--heads-per-kv", type=int, default=3)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write FILE_STEM.md")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    if any(not 0 < n <= 32768 for n in contexts):
        ap.error("--contexts: each in 1..32768 (one segment's tokens)")
    rows = measure(contexts, a.K, a.L, a.kv_heads, a.heads_per_kv, a.layers, a.reps)
    text = table(rows, a.kv_heads * a.heads_per_kv)
    head = (f"K={a.K}, L={a.L}, {a.kv_heads} KV heads x {a.heads_per_kv} query heads, {a.layers} layers walked "
            f"in turn, best of {a.reps} passes; uniform random codes.")
    print(head)
    print(text)
    if a.out:
        cmd = "python benchmarks/lookup_floor.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(a.out + ".md").write_text(f"Command: `{cmd}`\n\n{head}\n\n{text}\n")


if __name__ == "__main__":
    main()
