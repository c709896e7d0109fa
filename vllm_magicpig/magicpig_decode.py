"""The MAGICPIG decode method, and the production centrings.

For every request planned sparse: its centre and segments come from the index (built from
the KV cache on first need); then one ops call hashes the queries and attends every decode
request of the plan. The backend hands this method the sampled requests only
(``backend_common.DecodeSplit``: the platform kernel attends the exact ones); a request here
without segments (one whose segments a layer could not keep under ``index_memory_mb``, reason
``evicted``, or could not build beside its memory node's reserve, ``node_memory_low``, or any
exact request where the platform does not split) goes through the same call with its whole
context as the exact part, so it is served exactly.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from vllm_magicpig import decode_methods
from vllm_magicpig.decode_methods import DecodeResult, LayerContext
from vllm_magicpig.index import REFUSED_NODE_MEMORY, CentreSpec, SegmentRef, segment_owner
from vllm_magicpig.kv_layout import KVViews, gather
from vllm_magicpig.planner import DecodePlan
from vllm_magicpig.stats import EXACT_EVICTED, EXACT_NODE_MEMORY


def request_centre(ctx: LayerContext, spec: CentreSpec, kv: KVViews) -> torch.Tensor:
    """The paper's centre: the mean key of the request's prompt between the sinks and the window."""
    return gather(kv.key, spec.blocks, spec.start, spec.end).to(torch.float32).mean(dim=0).contiguous()


def build_segment_from_cache(ops, kv: KVViews, ref: SegmentRef, centre: torch.Tensor, projection: torch.Tensor,
                             K: int, L: int):
    """The segment ``ref`` plans, built from the layer's paged KV cache (``kv``)."""
    _, start, size, blocks = ref.key
    lo, hi = ref.first_token - start, size  # offsets inside the block run
    return ops.build_segment(gather(kv.key, blocks, lo, hi), gather(kv.value, blocks, lo, hi), centre, projection, K, L)


def no_centre(ctx: LayerContext, spec: CentreSpec, kv: KVViews) -> torch.Tensor:
    return torch.zeros(ctx.num_kv_heads, ctx.head_size, dtype=torch.float32)


def index_sparse_requests(ctx: LayerContext, plan: DecodePlan, compute_centre: Callable[[CentreSpec], Any],
                          make_build: Callable[[Any], Callable[[SegmentRef], Any]]):
    """For every request planned sparse: its centre and segments from the index, built on first
    need (``compute_centre(spec)``; ``make_build(centre)(ref)``). A request whose segments do not
    fit under ``index_memory_mb`` (or in its memory node's free memory less ``node_reserve_mb``) gets
    its whole context as the exact range instead.

    Returns (segments per request, centre per served request, exact ranges, DecodeResult with
    ``served`` and ``exact`` filled in).
    """
    rt = ctx.runtime
    index = rt.index
    dense = plan.dense_ranges
    segments: list[list] = [[] for _ in range(plan.num_decodes)]
    centres: dict[int, Any] = {}
    result = DecodeResult(served=[])
    owner = segment_owner(ctx.name, ctx.settings.K, ctx.settings.L)  # segments hashed with this (K, L) only
    for r in plan.sparse:
        centre = index.centre(ctx.name, plan.centres[r], compute_centre)
        refs = plan.segments[r]
        build = make_build(centre)
        segs, why = [], EXACT_EVICTED
        for ref in refs:  # up to the first that does not fit: building the rest would be for nothing
            seg = index.get_or_build(owner, ref, build, rt.ops.merge_segments, rt.cap_bytes)
            if seg is None:
                why = EXACT_NODE_MEMORY if index.last_refusal == REFUSED_NODE_MEMORY else EXACT_EVICTED
                break
            segs.append(seg)
        fits = len(segs) == len(refs)
        if not fits:
            index.drop_refs(owner, refs)
        if not fits or not index.reserve(owner, refs, rt.cap_bytes):
            # Over the memory cap with everything in use: attend the whole context exactly.
            if dense is plan.dense_ranges:
                dense = dense.clone()
            dense[r, 0, 1] = dense[r, 1, 0] = plan.seq_lens[r]
            result.exact[r] = why
            continue
        segments[r] = segs
        centres[r] = centre
        result.served.append(r)
    return segments, centres, dense, result


class MagicPigDecode:
    name = decode_methods.MAGICPIG

    def forward(self, ctx: LayerContext, query: torch.Tensor, kv: KVViews, plan: DecodePlan,
                out: torch.Tensor) -> DecodeResult:
        rt, st = ctx.runtime, ctx.settings
        R = query.shape[0]
        ops = rt.ops
        centring = decode_methods.get_centring(st.centering)

        def make_build(centre):
            return lambda ref: build_segment_from_cache(ops, kv, ref, centre, ctx.projection, st.K, st.L)

        segments, served_centres, dense, result = index_sparse_requests(
            ctx, plan, lambda spec: centring(ctx, spec, kv), make_build)
        centres: list[torch.Tensor | None] = [None] * R
        for r, centre in served_centres.items():
            # the production centrings' are float32 and contiguous already: no torch call (~5 us a request)
            fits = centre.dtype is torch.float32 and centre.is_contiguous()
            centres[r] = centre if fits else centre.to(torch.float32).contiguous()
        # One native call: query hashing, q . c, retrieval and attention (requests without segments
        # attend their whole context exactly in it, and sample nothing, so the total is the served ones').
        # Budget mode steers each request by its own sampled keys; otherwise the total is enough.
        counts = torch.zeros(R, query.shape[1], dtype=torch.int64) if st.target_cost is not None else None
        t0 = time.perf_counter()
        result.sampled = ops.attend_queries(query, ctx.projection, centres, segments, kv, plan.block_table, dense,
                                            ctx.scale, st.K, st.L, out, sampled_counts=counts, L_read=st.L_read)
        rt.stats.sparse_seconds += time.perf_counter() - t0
        if counts is not None:
            result.count_by_request(counts)
        return result


decode_methods.register_method(MagicPigDecode())
decode_methods.register_centring("request", request_centre)
decode_methods.register_centring("none", no_centre)
