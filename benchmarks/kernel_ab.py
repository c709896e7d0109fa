"""Two or more builds of the kernel, one layer's decode attention timed cold in alternating rounds.

    .venv/bin/python benchmarks/kernel_ab.py /tmp/old . --sizes 32768,131072 --rounds 14

Each TREE is a checkout with its extension built (``python setup.py build_ext --inplace``).  Builds are
compared in separate processes, one per tree: CPython caches an extension module by its name, so a
second build of ``vllm_magicpig._C`` loaded into the same process would silently be the first one.
Each process builds kernel_bench's layer (``kernel_bench.make_layer``; same seed, so the same keys,
codes and samples in every tree) and its cold copies once, then runs one round per request of the
driver; the trees take turns round by round (the order reversed every other round), so a drift of the
machine's speed, which on these shared machines moves timings by 2x within the hour, falls on all of
them alike.

Printed per size: the median over rounds of each tree's cold call (ms, the median of 60 calls of the
layer copies in turn, as kernel_bench's cold time) and of its phases (thread-ms per call, from the
kernel's profiling counters: lookup, gather_logits = q.k and logits, softmax_v; since dcf228b these
count segment units only, a dense unit having its own "dense" timer, so compare phases only between
trees on the same side of that commit), their range, and
the median of the per-round ratios to the first tree, which cancels the drift that a ratio of
medians would keep.  The output sum of the last call shows the trees computed the same thing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("lookup", "gather_logits", "softmax_v")
CALLS = 60  # calls per size per round


def serve(tree: str, configs: list[tuple[int, int, int, int]], K: int, L: int) -> None:
    """One tree's process: build the layers, then one round per stdin line, one JSON line out."""
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, tree)
    import torch

    from vllm_magicpig import kernel as kx

    if not kx.__file__.startswith(str(Path(tree).resolve())):
        raise SystemExit(f"{tree}: imported {kx.__file__}, not this tree's build")
    import kernel_bench as kb

    ops = kb.load_vllm()
    if ops is None:
        raise SystemExit("kernel_ab needs vLLM (the dense tokens are read from its paged cache)")
    setups = []
    for D, hkv, G, n in configs:
        lay = kb.make_layer(D, hkv, G, n, K, L, ops, torch.Generator().manual_seed(1234 + n + D))
        first = lay.build()
        copies = 2 * kb.cold_layers(sum(s.index_bytes + s.mirror_bytes for s in first))
        layers = [first] + [lay.build() for _ in range(copies - 1)]
        out = torch.empty(1, lay.H, D, dtype=torch.bfloat16)
        args = dict(block_table=lay.bt, dense_ranges=lay.ranges, scale=lay.scale, K=K, L=L, out=out,
                    check_values=False)

        def call(segs, lay=lay, args=args):
            kx.sparse_decode_attention(lay.q, lay.qcodes, lay.qdc, [segs], lay.kview, lay.vview, **args)

        for layer in layers:
            call(layer)
        setups.append((f"head_dim {D}, {n // 1024}K", layers, call, out))
    print("ready", flush=True)
    for _ in sys.stdin:
        res = {}
        for name, layers, call, out in setups:
            ts = []
            with kx.profiling() as ph:
                for i in range(CALLS):
                    t = time.perf_counter()
                    call(layers[i % len(layers)])
                    ts.append(time.perf_counter() - t)
            res[name] = dict(cold=statistics.median(ts) * 1e3, **{k: ph[k] / CALLS * 1e3 for k in PHASES},
                             sum=float(out.float().sum()))
        print(json.dumps(res), flush=True)


def drive(trees: list[str], configs: str, rounds: int, K: int, L: int) -> str:
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", t, "--configs", configs, "--K", str(K),
                               "--L", str(L)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for t in trees]
    for t, p in zip(trees, procs):
        if p.stdout.readline().strip() != "ready":
            raise SystemExit(f"{t}: the benchmark process failed to start")
    data: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(rounds):
        for i in (range(len(trees)) if r % 2 == 0 else reversed(range(len(trees)))):
            procs[i].stdin.write("go\n")
            procs[i].stdin.flush()
            data[trees[i]].append(json.loads(procs[i].stdout.readline()))
    for p in procs:
        p.stdin.close()
        p.wait()
    base = trees[0]
    lines = [f"K={K}, L={L}, {rounds} rounds; median [range] over rounds; ratio: median of per-round ratios to {base}",
             ""]
    for name in data[base][0]:
        lines += [f"{name}", "", "| | " + " | ".join(trees) + " | " +
                  " | ".join(f"{t} / {base}" for t in trees[1:]) + " |",
                  "|---" * (2 * len(trees)) + "|"]
        for k in ("cold",) + PHASES:
            cells = []
            for t in trees:
                v = [d[name][k] for d in data[t]]
                cells.append(f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]")
            for t in trees[1:]:
                cells.append(f"{statistics.median(b[name][k] / a[name][k] for a, b in zip(data[base], data[t])):.3f}")
            unit = "ms" if k == "cold" else "thread-ms"
            lines.append(f"| {k} ({unit}) | " + " | ".join(cells) + " |")
        lines += ["", "output sums: " + ", ".join(f"{data[t][0][name]['sum']:.6g}" for t in trees), ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="*", help="built checkouts; the first is the baseline of the ratios")
    ap.add_argument("--sizes", default="32768,131072", help="context lengths at head_dim 64 (3 KV x 3 query heads)")
    ap.add_argument("--head-dim-128", action="store_true", help="also head_dim 128 (8 KV x 4 query heads) at 32K")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, [tuple(map(int, c.split("x"))) for c in args.configs.split(",")], args.K, args.L)
        return
    if len(args.trees) < 2:
        ap.error("give at least two built trees")
    configs = [f"64x3x3x{int(n)}" for n in args.sizes.split(",")]
    if args.head_dim_128:
        configs.append("128x8x4x32768")
    trees = [str(Path(t).resolve()) for t in args.trees]
    print(f"Command: `python benchmarks/kernel_ab.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')})\n")
    print(drive(trees, ",".join(configs), args.rounds, args.K, args.L))


if __name__ == "__main__":
    main()
