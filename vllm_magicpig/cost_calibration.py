"""Start-up calibration of the cost model: what sampling, exact attention and an index build cost
on this worker, timed on synthetic inputs of the model's shape before the first request.

Without it the cost model (``cost_model.py``) knows nothing when the engine starts, so the first
prompt of every power-of-2 range of contexts is indexed at once to measure that range, and its
build shares the worker's core with the decodes beside it: in a fresh engine on the 2-core
AVX-512 machine the first one or two cold 4K / 8K requests ran at 0.90-0.95x CPU_ATTN
(``benchmarks/results/e2e_decode_avx512_1206_cold.md``). Timed here, at a few contexts from
``min_sparse_context`` up to the model's length (at most ``MAX_CONTEXT``), a fresh engine's first
request is decided as every later one is: by the measured costs, ski-rental.

What is timed is what the engine runs, on the worker's own threads:

* a build: the prompt's centre and segments as its first decode plans them (``planner.segment_layout``),
  built by the layers' own code (``magicpig_decode.request_centre``, ``build_segment_from_cache``)
  from a paged cache in the platform's layout;
* sampling: the ops' one call per layer (``attend_queries``) over those segments, with the sinks
  and the exact tail read from the paged cache;
* exact attention: the platform's own decode kernel over the same cache (``time_exact``).

The keys are Gaussian around a shared offset (which centring removes, as in real models), with a
few per KV head near the direction its query heads share, so that at the default K=10, L=150
about 3% of keys are sampled, as on SmolLM2's real keys (``README``, "Accuracy"). The inputs are
synthetic and the caches warm, so the figures are a prior: every pure-decode step's own timings
follow and, with the fit's forgetting, outweigh them within tens of steps. Warm caches make
sampling look cheaper, not dearer, than in an engine whose 30 layers evict each other: an error
that way builds a prompt a little early and is then corrected by its timed decodes, while the
other way would defer prompts whose decodes are never sampled, so never timed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.index import CentreSpec, SegmentKey, SegmentRef
from vllm_magicpig.kv_layout import KVViews
from vllm_magicpig.magicpig_decode import build_segment_from_cache, request_centre
from vllm_magicpig.planner import covered_end_for, largest_segment, segment_layout

MAX_CONTEXT = 32768  # longer contexts are extrapolated, then explored by a build (cost_model.py)
MAX_POINTS = 3  # contexts timed, from min_sparse_context to the longest
REPEATS = 7  # timed calls per context and side (the median is kept), after WARMUP
WARMUP = 2
NEAR_FRACTION = 0.025  # keys near their KV head's query direction (~3% sampled at K=10, L=150)
NEAR_COSINE = 0.5  # their cosine with it, once centred (~60 degrees)
SEED = 0


@dataclass(frozen=True)
class LayerShape:
    """One sparse layer's attention on this worker (its tensor-parallel share of the heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def calibration_contexts(cfg: MagicPigConfig, max_model_len: int) -> list[int]:
    """Contexts to time: up to ``MAX_POINTS`` from the shortest that is sampled to the longest the
    model takes (at most ``MAX_CONTEXT``), evenly spaced in log2 (two points tell the fit's cost per
    request from its cost per key); [] when no context is sampled."""
    shortest = max(cfg.min_sparse_context, cfg.sink_tokens + cfg.local_window + 2 * cfg.segment_tokens)
    longest = min(max_model_len, MAX_CONTEXT)
    if longest < shortest:
        return []
    if longest == shortest:
        return [longest]
    # points at least 2x apart (a range of contexts is an octave), so two within 4x
    steps = MAX_POINTS - 1 if longest >= 4 * shortest else 1
    ratio = (longest / shortest) ** (1 / steps)
    return sorted({int(round(shortest * ratio ** i)) for i in range(steps)} | {longest})


def synthetic_context(shape: LayerShape, n: int, gen: torch.Generator):
    """Keys and values ``[n, Hkv, D]`` and a query ``[1, H, D]`` (module docs)."""
    hkv, d, group = shape.num_kv_heads, shape.head_dim, shape.num_heads // shape.num_kv_heads
    offset = 2.0 * torch.randn(hkv, d, generator=gen)
    direction = torch.nn.functional.normalize(torch.randn(hkv, d, generator=gen), dim=-1)
    noise = torch.randn(n, hkv, d, generator=gen)
    # a near key's centred part: NEAR_COSINE of its length along the direction (noise ~ sqrt(d) long)
    along = math.sqrt(d) * NEAR_COSINE / math.sqrt(1 - NEAR_COSINE ** 2)
    near = torch.rand(n, hkv, 1, generator=gen) < NEAR_FRACTION
    keys = offset + noise + near * along * direction
    values = torch.randn(n, hkv, d, generator=gen)
    query = direction.repeat_interleave(group, 0) * math.sqrt(d) + 0.3 * torch.randn(hkv * group, d, generator=gen)
    return keys.to(shape.dtype), values.to(shape.dtype), query.to(shape.dtype).unsqueeze(0)


def paged_cache(shape: LayerShape, keys: torch.Tensor, values: torch.Tensor, views: Callable[[torch.Tensor], KVViews],
                gen: torch.Generator):
    """The context in a paged cache ``[blocks, Hkv, block_size, 2 D]`` read through ``views`` (the
    platform's layout), its blocks in random order as an engine's are -> (cache, views, block table)."""
    n, hkv, d = keys.shape
    bs = shape.block_size
    nb = -(-n // bs)
    cache = torch.zeros(nb, hkv, bs, 2 * d, dtype=shape.dtype)
    kv = views(cache)
    table = torch.randperm(nb, generator=gen)
    for view, rows in ((kv.key, keys), (kv.value, values)):
        logical = torch.zeros(nb * bs, hkv, d, dtype=shape.dtype)
        logical[:n] = rows
        physical = torch.empty_like(logical).view(nb, bs, hkv, d)
        physical[table] = logical.view(nb, bs, hkv, d)
        view.copy_(physical.view(view.shape))  # a layout's split axes keep the token, then element, order
    return cache, kv, table.to(torch.int32).view(1, nb)


def _median_seconds(fn: Callable[[], Any]) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def time_context(cfg: MagicPigConfig, shape: LayerShape, ops: Any, projection: torch.Tensor,
                 views: Callable[[torch.Tensor], KVViews], time_exact: Callable, n: int,
                 gen: torch.Generator) -> dict:
    """One request of ``n`` keys at its first decode: its build, a sampled and an exact layer call.
    ``time_exact(query, cache, block_table, seq_len)`` runs the platform's decode kernel once."""
    keys, values, query = synthetic_context(shape, n, gen)
    cache, kv, table = paged_cache(shape, keys, values, views, gen)
    bs, unit = shape.block_size, cfg.segment_tokens
    limit = n - cfg.local_window
    prompt_end = (limit // bs) * bs
    covered = covered_end_for(limit, unit, prompt_end)
    row = tuple(table[0].tolist())
    # the production build: the planner's centre and segment refs, built from the cache as a layer builds them
    spec = CentreSpec(0, row[: prompt_end // bs], cfg.sink_tokens, prompt_end)

    def build() -> tuple[Any, list]:
        centre = request_centre(None, spec, kv)  # (the centring reads no layer context)
        segments = []
        for start, size in segment_layout(covered, unit, largest_segment(cfg), prompt_end):
            ref = SegmentRef(SegmentKey(spec.cid, start, size, row[start // bs : (start + size) // bs]),
                             max(start, cfg.sink_tokens))
            segments.append(build_segment_from_cache(ops, kv, ref, centre, projection, cfg.K, cfg.L))
        return centre, segments

    # Built twice, the second timed: the first touches memory the process never had, which a
    # hypervisor may back page by page (32-52 ms a MB on a freshly booted AMD VM, against 0.1-0.4
    # once backed), and which then waits, freed, in the segments' pool for the next build. An
    # engine's builds take their memory from that pool, so the second is the build they repeat.
    build()
    t0 = time.perf_counter()
    centre, segments = build()
    build_s = time.perf_counter() - t0
    dense = torch.tensor([[[0, cfg.sink_tokens], [covered, n]]], dtype=torch.int32)
    out = torch.empty_like(query)
    scale = shape.head_dim ** -0.5
    sampled = []

    def attend():
        sampled.append(ops.attend_queries(query, projection, [centre], [segments], kv, table, dense, scale,
                                          cfg.K, cfg.L, out))

    sampled_s = _median_seconds(attend)
    exact_s = _median_seconds(lambda: time_exact(query, cache, table, n))
    ops.end_calls()  # the ops' step would keep this synthetic cache alive until the first request
    return dict(context=n, indexed_tokens=covered - cfg.sink_tokens, build_s=build_s, sampled_s=sampled_s,
                exact_s=exact_s, sampled_fraction=sampled[-1] / (shape.num_heads * (covered - cfg.sink_tokens)))


def calibrate(cost: Any, cfg: MagicPigConfig, shape: LayerShape, ops: Any, projection: torch.Tensor,
              views: Callable[[torch.Tensor], KVViews], time_exact: Callable, max_model_len: int) -> dict:
    """Time this worker at ``calibration_contexts`` and hand the timings to ``cost``
    (``DecodeCostModel.calibrate``) -> what was measured (the stats' ``cost_model.calibration``)."""
    contexts = calibration_contexts(cfg, max_model_len)
    if not contexts:
        record = {"contexts": [], "skipped": "no context up to max_model_len is sampled"}
        cost.calibrate([], [], (0, 0.0), record)
        return record
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.perf_counter()
    points = [time_context(cfg, shape, ops, projection, views, time_exact, n, gen) for n in contexts]
    tokens = sum(p["indexed_tokens"] for p in points)
    build_s = sum(p["build_s"] for p in points)
    record = {
        "contexts": contexts, "seconds": round(time.perf_counter() - t0, 2),
        "heads": [shape.num_heads, shape.num_kv_heads, shape.head_dim],  # this worker's share: query, KV, dim
        "exact_us": [round(p["exact_s"] * 1e6, 1) for p in points],
        "sparse_us": [round(p["sampled_s"] * 1e6, 1) for p in points],
        "sampled_fraction": [round(p["sampled_fraction"], 4) for p in points],
        "build_ms_per_1k_tokens": round(build_s / tokens * 1e6, 2),
    }
    cost.calibrate([(1, p["context"], p["exact_s"]) for p in points],
                   [(1, p["context"], p["sampled_s"]) for p in points],
                   (tokens, build_s), record)
    return record
