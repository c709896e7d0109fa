"""Sparse decode: a per-step plan (shared by all layers) and its per-layer execution.

Per step, :class:`StepPlanner` (called from the metadata builder) notes KV writes
(index invalidation), finds or creates each decode request's centre, and splits its
context into: sinks [0, sink) and the tail [covered_end, seq_len) attended exactly,
and aligned segments over [sink, covered_end) that are LSH-sampled.

Per sparse layer, :class:`LayerState` makes sure the planned centre and segments
exist for that layer (building or merging them from the KV cache on first need),
hashes the queries and runs one kernel call for all decode requests of the batch.
Requests that are not served sparse (short context, evicted, exact method) go
through the same call with their whole context as the dense part, which is exact.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from vllm_magicpig import centring, kernel
from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.control import StepSettings
from vllm_magicpig.index import STORE, CentreSpec
from vllm_magicpig.stats import EXACT_EVICTED, EXACT_METHOD, EXACT_SHORT_CONTEXT, STATS

_PROJECTIONS: dict[tuple[int, int, int, int], torch.Tensor] = {}


def projection(head_dim: int, K: int, L: int, seed: int) -> torch.Tensor:
    """The shared, seeded Gaussian SimHash projection [D, K*L] (one per process)."""
    key = (head_dim, K, L, seed)
    if key not in _PROJECTIONS:
        g = torch.Generator().manual_seed(seed)
        _PROJECTIONS[key] = torch.randn(head_dim, K * L, generator=g, dtype=torch.float32)
    return _PROJECTIONS[key]


def segment_layout(covered_end: int, unit: int, largest: int) -> list[tuple[int, int]]:
    """Split [0, covered_end) into full segments of ``largest`` tokens and one growing last
    segment (a multiple of ``unit``).

    Every segment costs L bucket lookups per query head per step, about as much as
    attending ~``unit`` tokens exactly, so a context is held in as few segments as
    possible: the last one grows by merging (no re-hashing) as decoding fills blocks.
    """
    full = (covered_end // largest) * largest
    out = [(pos, largest) for pos in range(0, full, largest)]
    if covered_end > full:
        out.append((full, covered_end - full))
    return out


@dataclass
class SegmentRef:
    key: tuple  # (cid, start, size, blocks)
    first_token: int  # tokens [first_token, start + size) are indexed (the first segment skips the sinks)


@dataclass
class DecodePlan:
    settings: StepSettings
    num_decodes: int
    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: list[int]
    dense_ranges: torch.Tensor  # int32 [R, 2, 2]
    sparse: list[int]  # indices of requests planned sparse
    centres: dict[int, CentreSpec] = field(default_factory=dict)  # request -> centre
    segments: dict[int, list[SegmentRef]] = field(default_factory=dict)
    covered: dict[int, int] = field(default_factory=dict)  # request -> indexed token count
    exact_reason: dict[int, str] = field(default_factory=dict)

    def count_exact(self) -> None:
        """Count the requests planned exact, by reason (once per layer that serves them)."""
        for reason in self.exact_reason.values():
            STATS.decode_exact[reason] += 1


class StepPlanner:
    """Layer-independent decisions, made once per engine step in the metadata builder."""

    def __init__(self, cfg: MagicPigConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.unit = cfg.segment_tokens
        self.largest = max(self.unit, (min(cfg.max_segment_tokens, kernel.MAX_SEGMENT_TOKENS) // self.unit) * self.unit)
        # last block written by a prefill chunk -> sequence length after it; a decode
        # right after it is that request's first decode (vLLM gives no request ids).
        self._prefill_ends: OrderedDict[int, int] = OrderedDict()

    def observe_step(self, cam, num_decodes: int) -> None:
        """Every step: KV writes invalidate the index; remember where prefills ended."""
        STORE.step += 1
        slots = cam.slot_mapping[: cam.num_actual_tokens]
        slots = slots[slots >= 0]
        if slots.numel():
            written = torch.unique(slots // self.block_size).tolist()
            STORE.on_blocks_written(written)
        if cam.num_reqs > num_decodes:
            seq_lens = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens
            bt = cam.block_table_tensor
            for r in range(num_decodes, cam.num_reqs):
                s = int(seq_lens[r])
                if s > 0:
                    self._prefill_ends[int(bt[r, (s - 1) // self.block_size])] = s
            while len(self._prefill_ends) > 4096:
                self._prefill_ends.popitem(last=False)

    def plan(self, cam, num_decodes: int, settings: StepSettings) -> DecodePlan:
        cfg, bs = self.cfg, self.block_size
        seq_lens = [int(x) for x in cam.seq_lens[:num_decodes].tolist()]
        block_table = cam.block_table_tensor[:num_decodes]
        dense = torch.empty(num_decodes, 2, 2, dtype=torch.int32)
        plan = DecodePlan(settings, num_decodes, block_table, seq_lens, dense, [])
        for r, s in enumerate(seq_lens):
            dense[r, 0, 0], dense[r, 0, 1], dense[r, 1, 0], dense[r, 1, 1] = 0, s, s, s
            if settings.method == "exact":
                plan.exact_reason[r] = EXACT_METHOD
                continue
            covered_end = ((s - cfg.local_window) // self.unit) * self.unit
            if s < cfg.min_sparse_context or covered_end <= cfg.sink_tokens:
                plan.exact_reason[r] = EXACT_SHORT_CONTEXT
                continue
            row = block_table[r, : (s + bs - 1) // bs].tolist()
            spec = self._centre_for(row, s)
            if spec is None:
                plan.exact_reason[r] = EXACT_SHORT_CONTEXT
                continue
            refs = []
            for start, size in segment_layout(covered_end, self.unit, self.largest):
                blocks = tuple(row[start // bs : (start + size) // bs])
                refs.append(SegmentRef((spec.cid, start, size, blocks), max(start, cfg.sink_tokens)))
            plan.sparse.append(r)
            plan.centres[r] = spec
            plan.segments[r] = refs
            plan.covered[r] = covered_end - cfg.sink_tokens
            dense[r, 0, 1] = cfg.sink_tokens
            dense[r, 1, 0] = covered_end
        return plan

    def _centre_for(self, row: list[int], s: int) -> CentreSpec | None:
        cfg, bs = self.cfg, self.block_size
        first_decode = s >= 2 and self._prefill_ends.get(row[(s - 2) // bs]) == s - 1
        if first_decode:
            self._prefill_ends.pop(row[(s - 2) // bs], None)
        found = STORE.find_centre(row)
        if found is not None and not first_decode:
            return found
        # The centre is the mean of the prompt's keys between the sinks and the local
        # window, over full blocks only (so it is keyed by immutable blocks).
        end = ((s - cfg.local_window) // bs) * bs
        if end <= cfg.sink_tokens:
            return found
        blocks = tuple(row[: end // bs])
        if found is not None:
            if found.blocks == blocks[: len(found.blocks)] and len(found.blocks) == len(blocks):
                return found  # same prompt blocks (a prefix-cache hit or a recompute)
            if cfg.inherit_centre and found.end * 2 >= end:
                STORE.inherit_centre(blocks, found)
                return found
        return STORE.new_centre(blocks, cfg.sink_tokens, end)


class LayerState:
    """One sparse layer's execution of the step plan."""

    def __init__(self, cfg: MagicPigConfig, layer_name: str, layer_index: int, num_heads: int,
                 num_kv_heads: int, head_size: int, scale: float) -> None:
        self.cfg = cfg
        self.name = layer_name
        self.index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.cap_bytes = cfg.index_memory_mb * 2**20
        self.settings: StepSettings | None = None  # the current step's settings
        self.proj = None
        self.rope: centring.Rope | None = None  # the model's RoPE (evaluation-only centrings)

    # -------------------------------------------------------------- cache views
    def _views(self, kv_cache: torch.Tensor):
        """[num_blocks, block_size, Hkv, D] views of K and V in vLLM's 'vec' CPU layout.

        Each (block, head) region holds N rows of K then N rows of V; inside it K is
        stored column-major ([D, N]) and V row-major ([N, D]).
        """
        nb, hkv, n, two_d = kv_cache.shape
        d = two_d // 2
        base = kv_cache.view(nb, hkv, 2 * n, d)
        s_blk, s_head = base.stride(0), base.stride(1)
        k = base.as_strided((nb, n, hkv, d), (s_blk, 1, s_head, n))
        v = base.as_strided((nb, n, hkv, d), (s_blk, d, s_head, 1), storage_offset=base.storage_offset() + n * d)
        return k, v

    @staticmethod
    def _gather(view: torch.Tensor, blocks: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """Tokens [lo, hi) of a block run as a contiguous [n, Hkv, D] tensor."""
        n = view.shape[1]
        first, last = lo // n, (hi + n - 1) // n
        rows = view[torch.tensor(blocks[first:last], dtype=torch.long)]  # [nb, N, Hkv, D]
        rows = rows.reshape(-1, view.shape[2], view.shape[3])
        return rows[lo - first * n : hi - first * n].contiguous()

    # -------------------------------------------------------------- index pieces
    def _centre(self, spec: CentreSpec, kview) -> torch.Tensor:
        c = STORE.centre_tensor(self.name, spec.cid)
        if c is None:
            if self.settings.centering == "none":
                c = torch.zeros(self.num_kv_heads, self.head_size, dtype=torch.float32)
            elif self.settings.centering == "global":
                c = centring.request_centre("global", self.name, spec.start, spec.end)
            else:
                keys = self._gather(kview, spec.blocks, spec.start, spec.end)
                c = keys.to(torch.float32).mean(dim=0).contiguous()
            STORE.put_centre_tensor(self.name, spec.cid, c)
        return c

    def _segment(self, ref: SegmentRef, centre, kview, vview) -> kernel.Segment:
        seg = STORE.get_segment(self.name, ref.key)
        if seg is not None:
            return seg
        cid, start, size, blocks = ref.key
        unit, bs = self.cfg.segment_tokens, kview.shape[1]
        # Grow the longest existing segment with the same start (the previous step's, or a
        # shared prefix's): index only the new tokens and merge, without re-hashing.
        for shorter in range(size - unit, 0, -unit):
            base_key = (cid, start, shorter, blocks[: shorter // bs])
            base = STORE.peek_segment(self.name, base_key)
            if base is None:
                continue
            rest = self._build(SegmentRef((cid, start + shorter, size - shorter, blocks[shorter // bs :]),
                                          start + shorter), centre, kview, vview)
            t0 = time.perf_counter()
            seg = kernel.merge_segments([base, rest])
            STATS.build_seconds += time.perf_counter() - t0
            STATS.index["segments_merged"] += 1
            if not STORE.used_this_step(self.name, base_key):  # nobody else reads it now
                STORE.drop_segment(self.name, base_key)
            STORE.put_segment(self.name, ref.key, seg)
            return seg
        seg = self._build(ref, centre, kview, vview)
        STORE.put_segment(self.name, ref.key, seg)
        return seg

    def _build(self, ref: SegmentRef, centre, kview, vview) -> kernel.Segment:
        """Index tokens [ref.first_token, start + size) from the KV cache."""
        t0 = time.perf_counter()
        _, start, size, blocks = ref.key
        lo, hi = ref.first_token - start, size  # offsets inside the block run
        keys = self._gather(kview, blocks, lo, hi)
        values = self._gather(vview, blocks, lo, hi)
        seg = kernel.build_segment(keys, values, centre, self.proj, self.settings.K, self.settings.L)
        STATS.build_seconds += time.perf_counter() - t0
        STATS.index["segments_built"] += 1
        STATS.index["tokens_indexed"] += hi - lo
        return seg

    # -------------------------------------------------------------- the step
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: DecodePlan, output: torch.Tensor) -> None:
        R, H, D = plan.num_decodes, self.num_heads, self.head_size
        st = self.settings = plan.settings
        self.proj = projection(D, st.K, st.L, self.cfg.seed)
        q = query.view(R, H, D)
        kview, vview = self._views(kv_cache)
        if st.method in ("topk", "quest"):
            from vllm_magicpig import baselines

            baselines.forward(self, q, kview, vview, plan, output.view(R, H, D))
            return
        if st.centering in ("segment", "pre_rope"):
            from vllm_magicpig import per_token_centres

            per_token_centres.forward(self, q, kview, vview, plan, output.view(R, H, D))
            return
        dense = plan.dense_ranges
        segments: list[list[kernel.Segment]] = [[] for _ in range(R)]
        centres = torch.zeros(R, self.num_kv_heads, 1, D, dtype=torch.float32)
        served: list[int] = []
        for r in plan.sparse:
            centre = self._centre(plan.centres[r], kview)
            segs = [self._segment(ref, centre, kview, vview) for ref in plan.segments[r]]
            if not STORE.enforce_cap(self.cap_bytes):
                # Over the memory cap with everything in use: this request is attended
                # exactly in this layer (its segments are rebuilt when there is room).
                for ref in plan.segments[r]:
                    STORE.drop_segment(self.name, ref.key)
                if dense is plan.dense_ranges:
                    dense = dense.clone()
                dense[r, 0, 1] = plan.seq_lens[r]
                dense[r, 1, 0] = plan.seq_lens[r]
                STATS.decode_exact[EXACT_EVICTED] += 1
                continue
            segments[r] = segs
            served.append(r)
            centres[r, :, 0] = centre
        # q . c for every (request, query head) at once; zero for exact requests
        qdc = (q.to(torch.float32).view(R, self.num_kv_heads, self.group, D) * centres).sum(-1).view(R, H)
        plan.count_exact()
        t0 = time.perf_counter()
        codes = kernel.hash_codes(q.reshape(R * H, D), self.proj, st.K, st.L).view(R, H, st.L)
        counts = torch.zeros(R, H, dtype=torch.int64)
        out = output.view(R, H, D)
        kernel.sparse_decode_attention(q, codes, qdc, segments, kview, vview, plan.block_table, dense,
                                       self.scale, st.K, st.L, out=out, sampled_counts=counts,
                                       check_values=False)
        STATS.sparse_seconds += time.perf_counter() - t0
        if st.measure_error and served:
            self.record_error(q, kview, vview, plan, out, served)
        if served:
            STATS.decode_sparse += len(served)
            sampled = int(counts[served].sum())
            STATS.add_sampled(self.name, sampled, sum(plan.covered[r] for r in served) * H)

    # -------------------------------------------------------------- evaluation only
    def calibrate(self, kv_cache: torch.Tensor, plan: DecodePlan) -> None:
        """Add every decode request's cached keys (positions [0, seq_len - 1)) to the centring
        calibration (see :mod:`vllm_magicpig.centring`)."""
        kview, _ = self._views(kv_cache)
        bs = kview.shape[1]
        for r, s in enumerate(plan.seq_lens):
            if s >= 2:
                blocks = tuple(plan.block_table[r, : (s + bs - 1) // bs].tolist())
                centring.calibrate(self.name, self._gather(kview, blocks, 0, s - 1).float(), self.rope)

    def exact_output(self, q, kview, vview, plan: DecodePlan) -> torch.Tensor:
        """Exact attention for every decode request (the kernel with the whole context dense)."""
        R, H, D = q.shape
        full = torch.zeros(R, 2, 2, dtype=torch.int32)
        full[:, 0, 1] = torch.tensor(plan.seq_lens, dtype=torch.int32)
        full[:, 1, 0] = full[:, 0, 1]
        full[:, 1, 1] = full[:, 0, 1]
        out = torch.empty(R, H, D, dtype=q.dtype)
        codes = torch.zeros(R, H, self.settings.L, dtype=torch.int32)
        kernel.sparse_decode_attention(q, codes, torch.zeros(R, H), [[] for _ in range(R)], kview, vview,
                                       plan.block_table, full, self.scale, self.settings.K, self.settings.L,
                                       out=out)
        return out

    def record_error(self, q, kview, vview, plan: DecodePlan, out, served: list[int]) -> None:
        exact = self.exact_output(q, kview, vview, plan)
        for r in served:
            e = exact[r].float()
            err = float((out[r].float() - e).norm() / e.norm().clamp_min(1e-12))
            STATS.add_error(self.name, err)
