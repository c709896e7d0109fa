"""Decode-attention benchmark for one layer: MagicPIG kernel vs exact attention, same K/V, one run.

    .venv/bin/python benchmarks/kernel_bench.py            # 8K / 32K / 128K, D=64 (3x3) and D=128 (8x4)
    .venv/bin/python benchmarks/kernel_bench.py --quick    # small smoke run

MagicPIG is called as the backend calls it (check_values=False).  Besides the ratio to vLLM's exact
kernel, each time is set against the bandwidth roof: exact attention streaming its K/V once at the
measured copy bandwidth.  The bytes MagicPIG touches are whole K/V rows at random tokens, which no
CPU reads at copy bandwidth, so its GB/s is also given against the random-row gather roof: a
prefetched gather of random rows of the same size, on the same threads and 2 MiB pages
(benchmarks/native/gather_roof.cpp, compiled by torch on the first run and cached).

Warm and cold: calling one layer back to back leaves its index, its sampled rows and their page
translations in the caches, which an engine step never does: every other layer's attention data
passes through them between two calls of a layer.  So both kernels are also timed cold, as
layers in turn: copies of the same context at other addresses (enough that the others hold 3x
the last-level cache), called one after another, each call timed.  The code and the Python around
the call stay warm, as they do in an engine, where every layer runs them.  Cold is what a decode
step in vLLM meets; warm is the kernel's best case.

The int8 mirror (``mirror_dtype: int8``) is timed on the same layer in the same run: its segments
built with ``mirror="int8"`` (same codes, so the same sampled keys), the two mirrors taking turns.
And the gather is also measured against vLLM's own cache layout (a K row there is one cache line
per element): what reading sampled rows from the paged cache, instead of a mirror, would reach.

Exact attention runs through vLLM's own CPU decode kernel (ops.cpu_attention_with_kv_cache, in the
cache layout vLLM picks on this CPU: "amx" where it has AMX tiles, else "vec"; ``--layout`` overrides;
the same paged cache the MagicPIG kernel reads its dense tokens from) when vLLM imports, plus torch
SDPA on bf16.  The float64 torch reference runs at the smallest size only.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_magicpig import kernel as kx  # noqa: E402
from vllm_magicpig.eval import reference as ref  # noqa: E402
from vllm_magicpig.kv_layout import CPU_LAYOUTS, amx_granted  # noqa: E402

SINKS, WINDOW, TAIL, SEG_MAX, BLOCK = 4, 64, 100, 32768, 128
CONFIGS = ((64, 3, 3), (128, 8, 4))  # (head_dim, KV heads, query heads per KV head)
COLD_BYTES = 96 * 2**20  # 3x this machine's 32 MiB L3: what the other layers of a cold run hold


def timeit(fn, reps, warmup=2, before=None):
    """Median seconds of a call of ``fn``; ``before()``, if given, runs ahead of every call, untimed."""
    def once():
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for _ in range(warmup):
        once()
    return statistics.median([once() for _ in range(reps)])


def cold_layers(layer_bytes: int) -> int:
    """Layers to take turns so that, between two calls of one, the others have read COLD_BYTES."""
    return 1 + -(-COLD_BYTES // max(layer_bytes, 1))


def timeit_in_turn(fns, reps):
    """Median seconds of one call, the calls cycling through ``fns`` (one per layer copy)."""
    for fn in fns:
        fn()
    ts = []
    for i in range(max(reps, len(fns))):
        t = time.perf_counter()
        fns[i % len(fns)]()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def timeit_alternating(fns_by_name, turns, burst=1):
    """Median seconds of one call per name, the names taking turns, each cycling through its own
    ``fns`` (one per layer copy). A turn of ``burst`` > 1 calls times all but its first call, which
    refills the caches the other names' turn took: back-to-back (warm) times."""
    for fns in fns_by_name.values():
        for fn in fns:
            fn()
    ts = {name: [] for name in fns_by_name}
    for i in range(turns):
        for name, fns in fns_by_name.items():
            for b in range(burst):
                t = time.perf_counter()
                fns[i % len(fns)]()
                if burst == 1 or b > 0:
                    ts[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in ts.items()}


def copy_bandwidth():
    """GB/s of a large tensor copy (bytes read + written), the memory roof for this machine."""
    a = torch.empty(256 * 2**20, dtype=torch.uint8).random_()
    b = torch.empty_like(a)
    t = timeit(lambda: b.copy_(a), 5)
    return 2 * a.numel() / t / 1e9


def _gather_native():
    from torch.utils.cpp_extension import load

    return load("mp_gather_roof", [str(Path(__file__).parent / "native" / "gather_roof.cpp")],
                extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"])


def gather_roofs(row_sizes, threads):
    """GB/s of a prefetched gather of random rows of each size (benchmarks/native/gather_roof.cpp),
    the best of a few prefetch distances: the roof for reads of whole sampled rows at random."""
    native = _gather_native()
    return {b: max(native.gather_gbps(b, 1 << 20, 1024, ahead, threads, 3) for ahead in (4, 8, 16))
            for b in row_sizes}


def paged_gather_roofs(head_dims, threads):
    """GB/s of the same gather of random tokens' K and V rows read from vLLM's CPU cache layout
    (K column-major per block: one cache line per element of a K row) instead of from the mirror:
    why the mirror keeps its own row-major copy."""
    native = _gather_native()
    return {d: max(native.paged_gather_gbps(d, BLOCK, 1 << 17, 1024, ahead, threads, 3) for ahead in (4, 8, 16))
            for d in head_dims}


def vllm_isa(ops, choice: str) -> str:
    """The layout to run: vLLM's choice on this CPU ("amx" with AMX tiles, granted here as an engine's
    oneDNN matmuls would have them granted before attention), or ``choice`` when not "auto"."""
    amx = ops is not None and amx_granted()
    if choice == "amx" and not amx:
        raise SystemExit("--layout amx: this CPU has no AMX tiles (or vLLM did not import)")
    return choice if choice != "auto" else ("amx" if amx else "vec")


def load_vllm():
    try:
        import vllm._custom_ops as ops  # noqa: F401
        return ops
    except Exception as e:  # noqa: BLE001
        print(f"# vLLM CPU kernel unavailable ({e}); exact baseline = torch SDPA only")
        return None


def make_context(n, hkv, D, gen):
    """Keys: a strong common offset (opposite to the queries, as in real models) plus noise, and
    a few heavy keys aligned with the query; values random."""
    off = torch.randn(hkv, D, generator=gen)
    off = off / off.norm(dim=-1, keepdim=True) * 2.0 * math.sqrt(D) ** 0.5 * 3
    keys = torch.randn(n, hkv, D, generator=gen) + off
    vals = torch.randn(n, hkv, D, generator=gen)
    return keys, vals, off


def make_layer(D, hkv, G, n, K, L, ops, gen, isa="vec"):
    """One layer's decode inputs: the context (make_context, plus two heavy keys per query head), the
    query, the centre and projection, vLLM's paged cache of the context in the layout of ``isa``, the
    query's codes and the dense ranges; ``build(mirror)`` builds one copy of its segments.  Also the
    layer of benchmarks/kernel_ab.py."""
    H = hkv * G
    scale = D ** -0.5
    keys, vals, off = make_context(n, hkv, D, gen)
    q = torch.randn(1, H, D, generator=gen) - 0.3 * off.repeat_interleave(G, 0).unsqueeze(0) / math.sqrt(D) ** 0.5
    kvh = torch.arange(H) // G
    # Two heavy keys per query head, in its own KV head, a few logits above the crowd.
    heavy = torch.randint(SINKS, n - WINDOW - TAIL, (H, 2), generator=gen)
    for h in range(H):
        qh = q[0, h] / q[0, h].norm()
        for i in heavy[h].tolist():
            keys[i, kvh[h]] = off[kvh[h]] + qh * 6.0 * math.sqrt(D) / q[0, h].norm() * math.sqrt(D)
    keys, vals, q = keys.bfloat16(), vals.bfloat16(), q.bfloat16()

    cov_lo, cov_hi = SINKS, n - WINDOW - TAIL
    centre = keys[cov_lo:cov_hi].float().mean(0)
    W = torch.randn(D, K * L, generator=gen)

    def build(mirror="cache"):
        out, p = [], cov_lo
        while p < cov_hi:
            e = min(cov_hi, p + SEG_MAX)
            out.append(kx.build_segment(keys[p:e], vals[p:e], centre, W, K, L, mirror=mirror))
            p = e
        return out

    # vLLM CPU paged cache, [blocks, Hkv, 2*BLOCK, D] in the layout of `isa` ("vec": K column-major,
    # V row-major; "amx": both in bf16-pair tiles), read through the backend's own views.
    nb = -(-n // BLOCK)
    kv_cache = torch.zeros(nb, hkv, 2 * BLOCK, D, dtype=torch.bfloat16)
    bt = torch.randperm(nb, generator=gen).to(torch.int32).view(1, nb)
    slots = (bt[0].long().repeat_interleave(BLOCK)[:n] * BLOCK + torch.arange(n) % BLOCK)
    kcache, vcache = kv_cache.chunk(2, dim=2)
    if ops is not None:
        ops.cpu_attn_reshape_and_cache(keys, vals, kcache, vcache, slots, isa)
    views = CPU_LAYOUTS[isa]().views(kv_cache.view(nb, hkv, BLOCK, 2 * D))
    kview, vview = views.key, views.value
    if ops is None:  # the "vec" layout by hand
        kview[slots // BLOCK, slots % BLOCK] = keys
        vview[slots // BLOCK, slots % BLOCK] = vals

    qcodes = kx.hash_codes(q[0], W, K, L).view(1, H, L)
    qdc = (q[0].float() * centre[kvh]).sum(-1).view(1, H)
    ranges = torch.tensor([[[0, SINKS], [cov_hi, n]]], dtype=torch.int32)
    return SimpleNamespace(H=H, scale=scale, keys=keys, vals=vals, q=q, centre=centre, W=W, cov_lo=cov_lo,
                           cov_hi=cov_hi, build=build, kv_cache=kv_cache, kcache=kcache, vcache=vcache, bt=bt,
                           kview=kview, vview=vview, qcodes=qcodes, qdc=qdc, ranges=ranges)


def run_config(D, hkv, G, n, K, L, ops, bw, reps, with_ref, gen, isa="vec"):
    lay = make_layer(D, hkv, G, n, K, L, ops, gen, isa)
    H, scale, keys, vals, q, centre, W = lay.H, lay.scale, lay.keys, lay.vals, lay.q, lay.centre, lay.W
    cov_lo, cov_hi, build, bt = lay.cov_lo, lay.cov_hi, lay.build, lay.bt
    kv_cache, kcache, vcache, kview, vview = lay.kv_cache, lay.kcache, lay.vcache, lay.kview, lay.vview
    qcodes, qdc, ranges = lay.qcodes, lay.qdc, lay.ranges

    t0 = time.perf_counter()
    segs = build()
    build_s = time.perf_counter() - t0
    index_b = sum(s.index_bytes for s in segs)

    out = torch.empty(1, H, D, dtype=torch.bfloat16)
    lse = torch.empty(1, H)
    cnt = torch.zeros(1, H, dtype=torch.int64)

    def mp(layer_segs, force_scalar=False):
        # check_values=False as the backend calls it (ops.CpuKernelOps.attend): the O(n) value scans
        # of the validation are for direct callers, not the decode hot path.
        kx.sparse_decode_attention(q, qcodes, qdc, [layer_segs], kview, vview, block_table=bt, dense_ranges=ranges,
                                   scale=scale, K=K, L=L, out=out, lse=lse, sampled_counts=cnt,
                                   force_scalar=force_scalar, check_values=False)

    def profile(fns):
        calls = max(5, len(fns))
        with kx.profiling() as phase_s:  # phase timers (thread-seconds) for the breakdown
            for i in range(calls):
                fns[i % len(fns)]()
        return {k: f"{v / calls * 1e3:.2f}ms" for k, v in phase_s.items()}

    # The same layer with an int8 mirror (same codes, same samples). The two mirrors take turns, a
    # burst of back-to-back calls each (warm) or call by call (cold), so this machine's drift falls on
    # both alike.
    # Cold: copies of each layer's segments in turn (same keys, same codes: the same work at other
    # addresses; the few dense tokens stay in one cache).
    segs8 = build("int8")
    firsts = {"cache": segs, "int8": segs8}
    layers, mirror_b, prof, outs = {}, {}, {}, {}
    for m, first in firsts.items():
        mirror_b[m] = sum(s.mirror_bytes for s in first)
        layers[m] = [first] + [build(m) for _ in range(cold_layers(index_b + mirror_b[m]) - 1)]
        mp(first)
        outs[m] = out.clone()
    warm = timeit_alternating({m: [lambda f=f: mp(f)] for m, f in firsts.items()}, max(2, reps // 3), burst=4)
    cold = timeit_alternating({m: [lambda lay=lay: mp(lay) for lay in lays] for m, lays in layers.items()},
                              max(reps, 2 * max(len(v) for v in layers.values())))
    for m, first in firsts.items():
        prof[m] = {"warm": profile([lambda f=first: mp(f)]),
                   "cold": profile([lambda lay=lay: mp(lay) for lay in layers[m]])}
    n_cold = len(layers["cache"])
    t_mp, t_mp_cold, t_mp8, t_mp8_cold = warm["cache"], cold["cache"], warm["int8"], cold["int8"]
    out_cache, out_int8 = outs["cache"], outs["int8"]
    del layers, segs8, firsts
    t_mp_scalar = timeit(lambda: mp(segs, True), max(3, reps // 4), warmup=1)
    mp(segs)
    sampled_frac = cnt.double().mean().item() / (cov_hi - cov_lo)

    # Bytes the kernel touches per step: bucket ids walked, the union of sampled rows per KV head
    # (K + V + norm: 4D + 4 bytes with the cache's bf16 rows, 2D + 12 with int8 rows), and the dense rows.
    walked, union_rows = 0, 0
    qc = qcodes[0]
    for s in segs:
        codes = s.codes()  # [Hkv, L, n_s]
        for h in range(hkv):
            m = codes[h].unsqueeze(0) == qc[h * G:(h + 1) * G].unsqueeze(-1)  # [G, L, n_s]
            walked += int(m.sum())
            union_rows += int((m.sum(1) >= 2).any(0).sum())
    print(f"#   walked={walked} union_rows={union_rows} per-head sampled={cnt.sum().item()}")
    dense_rows = (SINKS + n - cov_hi) * hkv
    mp_bytes = walked * 2 + union_rows * (4 * D + 4) + dense_rows * 4 * D
    mp_bytes8 = walked * 2 + union_rows * (2 * D + 12) + dense_rows * 4 * D
    exact_bytes = n * hkv * D * 2 * 2

    res = dict(D=D, hkv=hkv, G=G, n=n, n_cold=n_cold, t_mp=t_mp, t_mp_cold=t_mp_cold, t_mp_scalar=t_mp_scalar,
               sampled=sampled_frac, mp_bytes=mp_bytes, index_bpt=index_b / ((cov_hi - cov_lo) * hkv), build=build_s,
               mirror_bpt=mirror_b["cache"] / ((cov_hi - cov_lo) * hkv), exact_bytes=exact_bytes, bw=bw,
               profile=prof["cache"], t_mp8=t_mp8, t_mp8_cold=t_mp8_cold, mp_bytes8=mp_bytes8, profile8=prof["int8"],
               mirror_bpt8=mirror_b["int8"] / ((cov_hi - cov_lo) * hkv))

    # Exact attention over the same K/V.
    if ops is not None:
        qsl = torch.tensor([0, 1], dtype=torch.int32)
        seq = torch.tensor([n], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(1, H, hkv, D, seq, torch.bfloat16, qsl, True, -1, isa, False)
        vout = torch.empty(1, H, D, dtype=torch.bfloat16)

        def vl_on(kc, vc):
            ops.cpu_attention_with_kv_cache(q, kc, vc, vout, qsl, seq, scale, True, None, -1, bt, 0.0, meta, None)

        def vl():
            vl_on(kcache, vcache)
        res["t_vllm"] = timeit(vl, max(3, reps // 2))
        caches = [(kcache, vcache)] + [kv_cache.clone().chunk(2, dim=2)
                                       for _ in range(cold_layers(kv_cache.numel() * 2) - 1)]
        res["t_vllm_cold"] = timeit_in_turn([lambda c=c: vl_on(*c) for c in caches], max(3, reps // 2, 2 * len(caches)))
        del caches
        vl()
        ex, ex_lse = ref.exact_attention(q[0], keys, vals, scale) if n <= 32768 else (None, None)
        if ex is not None:
            res["vllm_err"] = ((vout[0].double() - ex).norm(dim=-1) / ex.norm(dim=-1)).mean().item()
    kq = keys.transpose(0, 1).unsqueeze(0).contiguous()
    vq = vals.transpose(0, 1).unsqueeze(0).contiguous()
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, 1, D]
    res["t_sdpa"] = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(
        qq, kq, vq, scale=scale, enable_gqa=True), max(3, reps // 2))
    if n <= 32768:
        ex, _ = ref.exact_attention(q[0], keys, vals, scale)
        res["mp_err"] = ((out_cache[0].double() - ex).norm(dim=-1) / ex.norm(dim=-1)).mean().item()
        res["mp8_err"] = ((out_int8[0].double() - ex).norm(dim=-1) / ex.norm(dim=-1)).mean().item()
    # What the int8 rows move the output by, against what sampling moves it by (both as norms).
    res["int8_gap"] = ((out_int8[0].double() - out_cache[0].double()).norm(dim=-1)
                       / out_cache[0].double().norm(dim=-1)).mean().item()
    if with_ref:
        cov = torch.zeros(n, dtype=torch.bool)
        cov[cov_lo:cov_hi] = True
        kc = torch.cat([torch.zeros(hkv, L, cov_lo, dtype=torch.long)] + [s.codes().long() for s in segs]
                       + [torch.zeros(hkv, L, n - cov_hi, dtype=torch.long)], -1)
        t = time.perf_counter()
        ro, _, _ = ref.magicpig_attention(q[0], keys, vals, centre, W, K, L, cov, scale, query_codes=qc.long(),
                                          kcodes=kc, query_dot_centre=qdc[0])
        res["t_ref"] = time.perf_counter() - t
        res["ref_diff"] = (out_cache[0].double() - ro).abs().max().item()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke run)")
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated context lengths")
    ap.add_argument("--layout", choices=("auto", "vec", "amx"), default="auto",
                    help="vLLM's CPU cache layout (auto: what vLLM picks on this CPU)")
    args = ap.parse_args()
    default_sizes = [4096, 16384] if args.quick else [8192, 32768, 131072]
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes
    reps = 5 if args.quick else 20
    gen = torch.Generator().manual_seed(1234)
    ops = load_vllm()
    isa = vllm_isa(ops, args.layout)
    bw = copy_bandwidth()
    # A token's K and V rows, 4*D bytes, are what a sampled key costs the kernel (about 2*D with int8 rows).
    roof = gather_roofs(sorted({b * D for D, _, _ in CONFIGS for b in (2, 4)}), torch.get_num_threads())
    print("# random-row gather roof: " + ", ".join(f"{b} B rows {g:.1f} GB/s ({100 * g / bw:.0f}% of copy)"
                                                   for b, g in roof.items()))
    paged = paged_gather_roofs([D for D, _, _ in CONFIGS], torch.get_num_threads())
    print("# the same tokens' K and V rows read from vLLM's paged CPU cache (K column-major per block) instead of "
          "the mirror: " + ", ".join(f"head_dim {d} {g:.2f} GB/s ({100 * g / roof[4 * d]:.0f}% of the mirror's "
                                     f"{4 * d} B rows)" for d, g in paged.items()))
    print(f"# isa={kx.active_isa()} vLLM cache layout={isa} threads={torch.get_num_threads()} "
          f"copy bandwidth={bw:.1f} GB/s K={args.K} L={args.L}")
    rows = []
    for D, hkv, G in CONFIGS:
        for n in sizes:
            r = run_config(D, hkv, G, n, args.K, args.L, ops, bw, reps, with_ref=(n == sizes[0]), gen=gen, isa=isa)
            rows.append(r)
            print(f"# done D={D} n={n}: {r['t_mp'] * 1e3:.3f} ms", flush=True)

    print()
    print("| D | Hkv x G | ctx | MagicPIG ms | scalar ms | vLLM exact ms | SDPA ms | speedup vs vLLM | sampled % | "
          "MP bytes/step | MP GB/s (% copy) | exact GB/s | index B/tok/KVh | mirror B/tok/KVh | build s | "
          "rel.err MP / vLLM | ref ms (max diff) |")
    print("|" + "---|" * 17)
    for r in rows:
        base = r.get("t_vllm", r["t_sdpa"])
        gbs = r["mp_bytes"] / r["t_mp"] / 1e9
        ex_gbs = r["exact_bytes"] / base / 1e9
        err = f"{r['mp_err']:.3f} / {r.get('vllm_err', float('nan')):.4f}" if "mp_err" in r else "-"
        refc = f"{r['t_ref'] * 1e3:.0f} ({r['ref_diff']:.1e})" if "t_ref" in r else "-"
        vll = f"{r['t_vllm'] * 1e3:.2f}" if "t_vllm" in r else "n/a"
        print(f"| {r['D']} | {r['hkv']}x{r['G']} | {r['n'] // 1024}K | {r['t_mp'] * 1e3:.3f} | "
              f"{r['t_mp_scalar'] * 1e3:.2f} | "
              f"{vll} | {r['t_sdpa'] * 1e3:.2f} | {base / r['t_mp']:.1f}x | {100 * r['sampled']:.2f} | "
              f"{r['mp_bytes'] / 1e6:.2f} MB | {gbs:.1f} ({100 * gbs / r['bw']:.0f}%) | {ex_gbs:.1f} | "
              f"{r['index_bpt']:.0f} | {r['mirror_bpt']:.0f} | {r['build']:.2f} | {err} | {refc} |")
    print()
    print("Warm against cold (cold: copies of the layer at other addresses called in turn, the others holding 3x "
          "the L3; each kernel its own copies):")
    print()
    print("| D | Hkv x G | ctx | MagicPIG warm ms | MagicPIG cold ms | vLLM warm ms | vLLM cold ms | speedup warm | "
          "speedup cold | sampled % | MP GB/s cold (% copy) | % of gather roof |")
    print("|" + "---|" * 12)
    for r in rows:
        if "t_vllm" not in r:
            continue
        gbs = r["mp_bytes"] / r["t_mp_cold"] / 1e9
        print(f"| {r['D']} | {r['hkv']}x{r['G']} | {r['n'] // 1024}K | {r['t_mp'] * 1e3:.3f} | "
              f"{r['t_mp_cold'] * 1e3:.3f} | {r['t_vllm'] * 1e3:.2f} | {r['t_vllm_cold'] * 1e3:.2f} | "
              f"{r['t_vllm'] / r['t_mp']:.1f}x | {r['t_vllm_cold'] / r['t_mp_cold']:.1f}x | {100 * r['sampled']:.2f} | "
              f"{gbs:.1f} ({100 * gbs / r['bw']:.0f}%) | {100 * gbs / roof[4 * r['D']]:.0f}% |")
    print()
    print("The int8 mirror (the same layer built with mirror='int8': the same codes and samples, K/V rows as 8-bit "
          "values with a scale per row, 2D + 12 bytes; timed with the cache-dtype mirror, the two taking turns):")
    print()
    print("| D | Hkv x G | ctx | mirror B/tok/KVh bf16 / int8 | warm ms bf16 / int8 | cold ms bf16 / int8 | "
          "int8 over bf16 warm / cold | int8 vs vLLM warm / cold | sampled % | int8 GB/s cold (% of 2D-byte roof) | "
          "rel. err vs exact bf16 / int8 | int8 moves output by |")
    print("|" + "---|" * 12)
    for r in rows:
        vs = (f"{r['t_vllm'] / r['t_mp8']:.1f}x / {r['t_vllm_cold'] / r['t_mp8_cold']:.1f}x" if "t_vllm" in r
              else "n/a")
        gbs8 = r["mp_bytes8"] / r["t_mp8_cold"] / 1e9
        err = f"{r['mp_err']:.3f} / {r['mp8_err']:.3f}" if "mp8_err" in r else "-"
        print(f"| {r['D']} | {r['hkv']}x{r['G']} | {r['n'] // 1024}K | "
              f"{r['mirror_bpt']:.0f} / {r['mirror_bpt8']:.0f} | {r['t_mp'] * 1e3:.3f} / {r['t_mp8'] * 1e3:.3f} | "
              f"{r['t_mp_cold'] * 1e3:.3f} / {r['t_mp8_cold'] * 1e3:.3f} | "
              f"{r['t_mp'] / r['t_mp8']:.2f}x / {r['t_mp_cold'] / r['t_mp8_cold']:.2f}x | {vs} | "
              f"{100 * r['sampled']:.2f} | {gbs8:.1f} ({100 * gbs8 / roof[2 * r['D']]:.0f}%) | {err} | "
              f"{100 * r['int8_gap']:.2f}% |")
    print()
    print("Against the bandwidth roof (exact attention streaming its K/V once at the copy bandwidth; does not "
          "move with the exact kernels' noise):")
    print()
    print("| D | Hkv x G | ctx | exact at roof ms | MagicPIG warm ms | warm vs roof | MagicPIG cold ms | "
          "cold vs roof |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        roof = r["exact_bytes"] / (r["bw"] * 1e9)
        print(f"| {r['D']} | {r['hkv']}x{r['G']} | {r['n'] // 1024}K | {roof * 1e3:.2f} | {r['t_mp'] * 1e3:.3f} | "
              f"{roof / r['t_mp']:.1f}x | {r['t_mp_cold'] * 1e3:.3f} | {roof / r['t_mp_cold']:.1f}x |")
    print()
    print("Time breakdown (per step, thread-ms summed over the threads):")
    for r in rows:
        for mirror, key in (("bf16", "profile"), ("int8", "profile8")):
            for mode, phases in r[key].items():
                print(f"  D={r['D']} n={r['n']} {mirror} {mode}: {phases}")
    print()
    print(f"index target <= {1.5 * args.L * 2:.0f} B/tok/KV head; speed targets: 32K >= 8x, 128K >= 15x vs exact")
    for mode, mp_key, ex_key in (("warm", "t_mp", "t_vllm"), ("cold", "t_mp_cold", "t_vllm_cold")):
        missed = [f"D={r['D']} {r['n'] // 1024}K {r[ex_key] / r[mp_key]:.1f}x" for r in rows if ex_key in r
                  and r["n"] >= 32768 and r[ex_key] / r[mp_key] < (15 if r["n"] >= 131072 else 8)]
        print(f"below target {mode}: {', '.join(missed) or 'none'}")


if __name__ == "__main__":
    main()
