"""Where one layer's decode time goes: MAGICPIG's whole per-layer path against vLLM's
CPU decode kernel on the same paged cache, for SmolLM2's shape (3 KV heads x 3).

    python benchmarks/decode_profile.py [--contexts 4096,16384] [--batches 1,4] [--tree DIR]
    python benchmarks/decode_profile.py --cold [--layers 28]

MAGICPIG is timed as the backend runs it (``SparseLayer.begin`` + ``forward``: index
lookups, then one native call that hashes the queries, computes q.c and attends) and split
into that call and the Python around it, so a gap to the end-to-end target can be traced to
Python overhead or kernel time. "hash ms" times ``kernel.hash_codes`` of the same queries
alone, for scale: the call does that hashing inside. "Its exact part alone" is the same call
with the sinks and the tail only (no segments), beside vLLM's kernel over as many tokens. Keys are
synthetic (a common offset, as real models have, plus noise); the sampled fraction
is printed next to every time. "Bucket ids walked" counts what the lookup reads (one collision
update each), so its phase time over that count is its cost per id; the call's phases are the
kernel's timers (``kernel.profiling``).

``--cold`` times the layer as an engine meets it: copies of it, each with its own cache and
index, called in turn (by default enough copies to hold 3x the L3, as kernel_bench's cold;
``--layers 28`` as many as SmolLM2's sparse layers, whose index and mirror together span
gigabytes), against vLLM's kernel over copies of the cache in turn, with the kernel's phase
timers. Called back to back, one layer's index and sampled rows stay in the L3 and its pages
in the TLB, which no engine step sees. "Outside the phases" is a turn's time less the kernel's
phase timers, per layer: the Python around the call and the call's set-up, cold (one thread).
A second table counts the 64-byte lines the profiled call reads (``lines_read``: directory entries,
bucket ids, the sampled rows' K and V) and sets the lookup's and the row passes' times against them
at this machine's random-line roof on one thread (``line_roof_ns``, kernel_bench's native gather):
a phase at ~1x that roof waits on DRAM for every line it needs and gains only from reading fewer.

``--tree DIR`` times the vllm_magicpig of another checkout with its extension built (a git
worktree of an earlier commit, say) with this script's timings; run it and the default in turn
to compare two commits through the machine's drift.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timed_tree import use_tree_from_argv  # noqa: E402

TREE = use_tree_from_argv()
from vllm_magicpig import kernel, kv_layout  # noqa: E402
from vllm_magicpig.config import MagicPigConfig  # noqa: E402
from vllm_magicpig.decode_methods import LayerContext  # noqa: E402
from vllm_magicpig.index import segment_owner  # noqa: E402
from vllm_magicpig.layer import SparseLayer  # noqa: E402
from vllm_magicpig.planner import StepPlanner  # noqa: E402
from vllm_magicpig.runtime import MagicPigRuntime  # noqa: E402

# The cache layout vLLM picks here: "amx" on CPUs with AMX tiles (kv_layout.amx_granted), else
# "vec"; a --tree checkout from before the AMX layout reads "vec".
_CPU_LAYOUTS = getattr(kv_layout, "CPU_LAYOUTS", {"vec": kv_layout.CpuVecLayout})
ISA = "amx" if "amx" in _CPU_LAYOUTS and kv_layout.amx_granted() else "vec"
LAYOUT = _CPU_LAYOUTS[ISA]()

from kernel_bench import timeit  # noqa: E402

D, HKV, G, BS = 64, 3, 3, 128


def split_kv(cache):
    """(K, V) views of a [blocks, KV heads, BS, 2 * D] cache, the layout vLLM's CPU kernel reads."""
    return cache.view(cache.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)


def med(fn, reps=30, before=None):
    """Median milliseconds of ``fn`` (the kernel benchmark's timer; ``before`` runs untimed ahead of each call)."""
    return timeit(fn, reps, warmup=3, before=before) * 1e3


class _Cam:  # the fields of vLLM's CommonAttentionMetadata that StepPlanner.plan reads
    def __init__(self, seq_lens, bt):
        self.seq_lens = seq_lens
        self.block_table_tensor = bt


def run(ctx: int, batch: int, K: int, L: int, cold: bool = False, layers: int = 0, fresh: bool = False):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(ctx + batch)
    H = HKV * G
    nbr = math.ceil(ctx / BS)
    nb = nbr * batch + 1
    cache = torch.zeros(nb, HKV, BS, 2 * D, dtype=torch.bfloat16)
    kc, vc = split_kv(cache)
    off = torch.randn(HKV, D, generator=gen) * 2
    bt = torch.zeros(batch, nbr, dtype=torch.int32)
    for r in range(batch):
        blocks = torch.arange(1 + r * nbr, 1 + (r + 1) * nbr, dtype=torch.int32)
        bt[r] = blocks
        keys = (torch.randn(ctx, HKV, D, generator=gen) + off).bfloat16()
        vals = torch.randn(ctx, HKV, D, generator=gen).bfloat16()
        slots = blocks.long().repeat_interleave(BS)[:ctx] * BS + torch.arange(ctx) % BS
        ops.cpu_attn_reshape_and_cache(keys, vals, kc, vc, slots, ISA)
    seq = torch.full((batch,), ctx, dtype=torch.int32)
    q = (torch.randn(batch, H, D, generator=gen) - 0.5 * off.repeat_interleave(G, 0)).bfloat16()
    out = torch.empty(batch, H, D, dtype=torch.bfloat16)

    # exact: vLLM's own CPU decode kernel
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(num_reqs=batch, num_heads=H, num_kv_heads=HKV, head_dim=D,
                                                seq_lens=seq, dtype=torch.bfloat16, query_start_loc=qsl,
                                                causal=True, sliding_window_size=-1, isa=ISA,
                                                enable_kv_split=True)

    def exact_on(k, v):  # vLLM's kernel over K/V views like kc, vc (run_cold passes its copies)
        ops.cpu_attention_with_kv_cache(query=q, key_cache=k, value_cache=v, output=out, query_start_loc=qsl,
                                        seq_lens=seq, scale=D ** -0.5, causal=True, alibi_slopes=None,
                                        sliding_window=-1, block_table=bt, softcap=0, scheduler_metadata=sched,
                                        s_aux=None)

    def exact():
        exact_on(kc, vc)

    # Each run writes its cache directly, not through vLLM, so nothing invalidates the
    # previous run's index entries on the same block ids: a fresh runtime per run.
    cfg = MagicPigConfig(K=K, L=L)
    rt = MagicPigRuntime(cfg, num_layers=30, layout=LAYOUT)
    layer = SparseLayer(LayerContext("model.layers.3.self_attn.attn", 3, H, HKV, D, D ** -0.5, rt))
    planner = StepPlanner(cfg, BS, rt.index)
    settings = rt.step_settings()
    plan = planner.plan(_Cam(seq, bt), batch, settings)

    def step_of(layer_, cache_):  # one decode of a layer over its cache, as the backend runs it
        return lambda: layer_.forward(q, layer_.begin(cache_, plan), plan, out)

    layer_step = step_of(layer, cache)

    t0 = time.perf_counter()
    layer_step()  # builds the index
    build_ms = (time.perf_counter() - t0) * 1e3

    if cold:
        # fresh: each turn's query a new draw (in place: the layer closures read this tensor)
        new_query = (lambda: q.copy_((torch.randn(batch, H, D, generator=gen) - 0.5 * off.repeat_interleave(G, 0))
                                     .bfloat16())) if fresh else None
        res = run_cold(ctx, batch, cache, rt, H, layer_step, step_of, exact_on, build_ms, layers, new_query)
        # what the profiled turn's query (the last one drawn) reads; every copy holds the same keys
        res["lines"] = lines_read(q, layer.ctx.projection, layer_segments(rt, layer, plan, batch, K, L), K, L)
        return res
    t_exact = med(exact)
    t_plan = med(lambda: planner.plan(_Cam(seq, bt), batch, settings))
    t_layer = med(layer_step)
    # parts of the layer path: the one native call (query hashing, q . c, retrieval, attention) and the rest
    proj = layer.ctx.projection
    t_hash = med(lambda: kernel.hash_codes(q.reshape(-1, D), proj, K, L))  # inside the call too; for scale
    kv = rt.layout.views(cache)
    segs = layer_segments(rt, layer, plan, batch, K, L)
    centres = [rt.index.centre(layer.ctx.name, plan.centres[r], None) for r in range(batch)]
    cnt = torch.zeros(batch, H, dtype=torch.int64)
    def one_call():  # as ops calls it
        kernel.magicpig_decode_attention(q, proj, centres, segs, kv.key, kv.value, block_table=bt,
                                         dense_ranges=plan.dense_ranges, scale=layer.ctx.scale, K=K, L=L, out=out,
                                         sampled_counts=cnt, check_values=False)

    t_kernel_wrapped = med(one_call)
    frac = cnt.double().sum().item() / (sum(plan.covered.values()) * H)
    with kernel.profiling() as phase_s:  # the call's phase timers (thread-seconds), over 10 calls
        for _ in range(10):
            one_call()
    phases = phase_text(phase_s, 10)
    ids = bucket_ids_walked(q, proj, segs, K, L) / batch
    # The exact part of the same decode alone (sinks and tail, no segments), beside vLLM's kernel
    # over as many tokens per request: what an exact token costs in each.
    tail = int((plan.dense_ranges[:, :, 1] - plan.dense_ranges[:, :, 0]).sum(-1).max())
    t_tail = med(lambda: kernel.magicpig_decode_attention(
        q, proj, [None] * batch, [[] for _ in range(batch)], kv.key, kv.value, block_table=bt,
        dense_ranges=plan.dense_ranges, scale=layer.ctx.scale, K=K, L=L, out=out, check_values=False))
    seq_tail = torch.full((batch,), tail, dtype=torch.int32)
    sched_tail = ops.cpu_attn_get_scheduler_metadata(num_reqs=batch, num_heads=H, num_kv_heads=HKV, head_dim=D,
                                                     seq_lens=seq_tail, dtype=torch.bfloat16, query_start_loc=qsl,
                                                     causal=True, sliding_window_size=-1, isa=ISA,
                                                     enable_kv_split=True)
    t_tail_vllm = med(lambda: ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq_tail, scale=D ** -0.5,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0, scheduler_metadata=sched_tail,
        s_aux=None))
    return dict(context=ctx, batch=batch, exact_ms=t_exact, magicpig_layer_ms=t_layer, plan_ms=t_plan,
                hash_ms=t_hash, kernel_call_ms=t_kernel_wrapped, python_ms=t_layer - t_kernel_wrapped,
                sampled=frac, build_ms=build_ms, tail_tokens=tail, tail_ms=t_tail, tail_vllm_ms=t_tail_vllm,
                phases=phases, ids_walked=ids)


def layer_segments(rt, layer, plan, batch, K, L) -> list[list]:
    """Each request's segments of ``layer`` as the step's plan names them, from the runtime's index."""
    owner = segment_owner(layer.ctx.name, K, L)  # the index keys a layer's segments by its (K, L) too
    return [[rt.index.get_segment(owner, ref.key) for ref in plan.segments[r]] for r in range(batch)]


def phase_text(phase_s: dict[str, float], calls: int) -> str:
    """The kernel's phase timers (``kernel.profiling``'s seconds) as thread-ms a call."""
    return " ".join(f"{k} {v / calls * 1e3:.3f}" for k, v in phase_s.items())


def bucket_ids_walked(q, proj, segs, K, L) -> int:
    """Token ids the lookup reads: over every request, query head, segment and table, the size of
    the bucket the head's code names (each id one update of a collision count). Recomputed from the
    codes, for scale: the lookup's time over this is its cost per id."""
    R, H, D = q.shape
    qc = kernel.hash_codes(q.reshape(-1, D), proj, K, L).view(R, H, L)
    total = 0
    for r in range(R):
        for seg in segs[r]:
            codes = seg.codes()  # [Hkv, L, n]
            g = H // codes.shape[0]
            for h in range(H):
                total += int((codes[h // g] == qc[r, h].view(L, 1)).sum())
    return total


def lines_read(q, proj, segs, K, L) -> dict[str, int]:
    """The 64-byte lines of a segment's memory one decode call reads, from the codes (the segments'
    layout, common.h's Segment): per (head, table) its directory entry and its bucket's id lines;
    per (KV head, segment) the union of its heads' sampled rows, each a K row and a V row (d bf16
    values, 128 B each at d = 64: ``row_lines``), and the lines of their |k - c| (``norm_lines``).
    In an engine a layer's mirror and bucket ids are cold (14.7 + 12 MB a layer at 16K tokens);
    its norms (192 KB a layer) stay in the L3: computing |k - c| from the row instead of reading it
    saved nothing (2026-12-06). The kernel's phases over these counts, against the machine's
    random-line roof, say how close to that roof the lookup and the row passes run."""
    R, H, D = q.shape
    qc = kernel.hash_codes(q.reshape(-1, D), proj, K, L).view(R, H, L).long()
    out = dict(directory=0, bucket_ids=0, union_rows=0, norm_lines=0)
    row_lines = max(1, D * 2 // 64)
    for r in range(R):
        for seg in segs[r]:
            codes = seg.codes().long()  # [Hkv, L, n]
            hkv, _, n = codes.shape
            g = H // hkv
            counts = torch.zeros(hkv, L, 1 << K, dtype=torch.long).scatter_add_(2, codes, torch.ones_like(codes))
            ends = counts.cumsum(2)
            tables = torch.arange(L)
            for kvh in range(hkv):
                base = (kvh * L + tables) * n * 2  # byte offset of each of the KV head's tables' ids
                union = torch.zeros(n, dtype=torch.bool)
                for h in range(kvh * g, (kvh + 1) * g):
                    code = qc[r, h]  # [L]
                    end = ends[kvh, tables, code]
                    begin = end - counts[kvh, tables, code]
                    first, last = (base + 2 * begin) // 64, (base + 2 * end - 1) // 64
                    out["directory"] += L
                    out["bucket_ids"] += int(torch.where(end > begin, last - first + 1, 0).sum())
                    union |= (codes[kvh] == code.view(L, 1)).sum(0) >= 2
                ids = union.nonzero().flatten()
                out["union_rows"] += int(ids.numel())
                out["norm_lines"] += int(torch.unique((kvh * n + ids) * 4 // 64).numel())
    out["row_lines"] = out["union_rows"] * 2 * row_lines
    return out


def line_roof_ns() -> float:
    """Nanoseconds a random 64-byte line costs one thread here: kernel_bench's native gather of random
    64 B rows (2 MiB pages, prefetched ahead), the best of three prefetch distances."""
    from kernel_bench import _gather_native

    native = _gather_native()
    return 64 / max(native.gather_gbps(64, 1 << 20, 1024, ahead, 1, 3) for ahead in (8, 16, 32))


def run_cold(ctx, batch, cache, rt, H, layer_step, step_of, exact_on, build_ms, layers, new_query=None):
    """The layer as an engine meets it: copies of it (own cache, own index) called in turn, so
    between two calls of one the others have read 3x the L3 (kernel_bench's cold), against
    vLLM's kernel over copies of the cache in turn. Per-layer milliseconds of a whole turn."""
    from kernel_bench import cold_layers

    n = layers or cold_layers(cache.numel() * cache.element_size() + rt.index.index_bytes + rt.index.mirror_bytes)
    caches, steps = [cache], [layer_step]
    for j in range(1, n):
        caches.append(cache.clone())
        lay = SparseLayer(LayerContext(f"model.layers.{3 + j}.self_attn.attn", 3 + j, H, HKV, D, D ** -0.5, rt))
        steps.append(step_of(lay, caches[-1]))
        steps[-1]()  # builds its index

    kvs = [split_kv(c) for c in caches]

    def exact_turn():
        for k, v in kvs:
            exact_on(k, v)

    def layer_turn():
        for step in steps:
            step()

    reps = max(5, 60 // n)
    # with new_query, a new query a turn, drawn outside the timed turn
    t_exact, t_layer = med(exact_turn, reps, new_query) / n, med(layer_turn, reps, new_query) / n
    if new_query is not None:
        new_query()
    with kernel.profiling() as phase_s:  # the kernel's phase timers (thread-seconds), one turn more
        t0 = time.perf_counter()
        layer_turn()
        t_prof = time.perf_counter() - t0
    phases = phase_text(phase_s, n)
    # That turn's time outside the phases: the Python around the call and the call's set-up (one
    # thread: thread-seconds are seconds).
    outside_ms = (t_prof - sum(phase_s.values())) / n * 1e3
    return dict(context=ctx, batch=batch, layers=n, exact_ms=t_exact, magicpig_layer_ms=t_layer, build_ms=build_ms,
                phases=phases, phase_us={k: v / n * 1e6 for k, v in phase_s.items()}, outside_ms=outside_ms)


def print_line_roof(rows, ns: float) -> None:
    """The profiled turn's phases against the lines they read (lines_read) at the random-line roof."""
    print(f"\nLines a layer call reads (its profiled turn; lines_read) and the phases against them at this machine's "
          f"random-line roof, {ns:.1f} ns a 64 B line on one thread (line_roof_ns). The row passes' lines are the "
          f"union rows' K and V rows (their norms' lines beside, L3-resident across layers); the q.k pass prefetches "
          f"a row's V lines with its K lines, so the two passes are taken together.")
    print("| context | batch | directory lines | bucket id lines | union rows | K and V row lines (norm lines) | "
          "lookup us (at the roof) | gather_logits + softmax_v us (at the roof) | ns a line: lookup, row passes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        li, ph = r["lines"], r["phase_us"]
        look_lines = li["directory"] + li["bucket_ids"]
        look, passes = ph.get("lookup", 0.0), ph.get("gather_logits", 0.0) + ph.get("softmax_v", 0.0)
        print(f"| {r['context']} | {r['batch']} | {li['directory']} | {li['bucket_ids']} | {li['union_rows']} | "
              f"{li['row_lines']} ({li['norm_lines']}) | {look:.0f} ({look_lines * ns / 1e3:.0f}) | {passes:.0f} "
              f"({li['row_lines'] * ns / 1e3:.0f}) | {look * 1e3 / max(look_lines, 1):.1f}, "
              f"{passes * 1e3 / max(li['row_lines'], 1):.1f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--cold", action="store_true",
                    help="time copies of the layer in turn (run_cold), as an engine calls it")
    ap.add_argument("--layers", type=int, default=0,
                    help="with --cold: this many copies (an engine's sparse layers, 28 for SmolLM2) instead of "
                         "enough to hold 3x the L3")
    ap.add_argument("--fresh-queries", action="store_true",
                    help="with --cold: a new query every turn, so each turn samples other rows, as an engine's "
                         "steps do (the same query every turn leaves a layer's sampled rows in the L3)")
    ap.add_argument("--tree", type=Path, default=None, help="another built checkout to time (module docs)")
    a = ap.parse_args(argv)
    print(f"threads={torch.get_num_threads()} isa={kernel.active_isa()} vLLM cache layout={ISA} K={a.K} L={a.L} "
          f"tree={TREE}")
    if a.cold:
        print("Cold: copies of the layer called in turn; ms per layer call"
              + ("; a new query every turn" if a.fresh_queries else "; the same query every turn"))
        print("| context | batch | layer copies | vLLM exact ms cold | MAGICPIG layer ms cold | ratio | "
              "index build ms | kernel phases, thread-ms per layer | outside the phases ms (1 thread) |")
        print("|---|---|---|---|---|---|---|---|---|")
        rows = []
        for ctx in [int(x) for x in a.contexts.split(",")]:
            for b in [int(x) for x in a.batches.split(",")]:
                r = run(ctx, b, a.K, a.L, cold=True, layers=a.layers, fresh=a.fresh_queries)
                rows.append(r)
                print(f"| {ctx} | {b} | {r['layers']} | {r['exact_ms']:.3f} | {r['magicpig_layer_ms']:.3f} | "
                      f"{r['exact_ms'] / r['magicpig_layer_ms']:.2f}x | {r['build_ms']:.0f} | {r['phases']} | "
                      f"{r['outside_ms']:.3f} |", flush=True)
        print_line_roof(rows, line_roof_ns())
        return
    print("| context | batch | vLLM exact ms | MAGICPIG layer ms | ratio | plan ms (per step) | hash ms | "
          "one-call kernel ms (hashing included) | other python ms | sampled | index build ms | "
          "exact tokens a request | its exact part alone ms (vLLM's kernel, as many tokens) | "
          "bucket ids walked a request | the call's phases, thread-ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for ctx in [int(x) for x in a.contexts.split(",")]:
        for b in [int(x) for x in a.batches.split(",")]:
            r = run(ctx, b, a.K, a.L)
            print(f"| {ctx} | {b} | {r['exact_ms']:.3f} | {r['magicpig_layer_ms']:.3f} | "
                  f"{r['exact_ms'] / r['magicpig_layer_ms']:.2f}x | {r['plan_ms']:.3f} | {r['hash_ms']:.3f} | "
                  f"{r['kernel_call_ms']:.3f} | {r['python_ms']:.3f} | {r['sampled']:.2%} | {r['build_ms']:.0f} | "
                  f"{r['tail_tokens']} | {r['tail_ms']:.3f} ({r['tail_vllm_ms']:.3f}) | {r['ids_walked']:.0f} | "
                  f"{r['phases']} |", flush=True)


if __name__ == "__main__":
    main()
