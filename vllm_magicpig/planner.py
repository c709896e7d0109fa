"""The per-step decode plan, made once per engine step in the metadata builder.

:class:`StepPlanner` notes KV writes (index invalidation), finds or creates each decode
request's centre, and splits its context into: sinks [0, sink) and the tail
[covered_end, seq_len) attended exactly, and aligned segments over [sink, covered_end)
that are LSH-sampled. Every sparse layer then executes the same plan (``layer.py``).
The planner is device-agnostic: it reads block tables and sequence lengths only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

import torch

from vllm_magicpig.answer_bounds import AnswerBounds
from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.decode_methods import EXACT
from vllm_magicpig.index import CentreSpec, IndexStore, SegmentKey, SegmentRef
from vllm_magicpig.limits import MAX_SEGMENT_TOKENS
from vllm_magicpig.stats import (
    EXACT_EVICTED,
    EXACT_INDEXING,
    EXACT_METHOD,
    EXACT_NODE_MEMORY,
    EXACT_NOT_MIRRORED,
    EXACT_SAMPLING_SLOWER,
    EXACT_SHORT_CONTEXT,
)

SMALL_STEP = 64  # tokens in a step up to which its written blocks are found in Python


@dataclass(frozen=True)
class StepSettings:
    """What one engine step's decode uses: the config, unless an extension overrides it
    (a settings hook attached to the runtime: ``MagicPigRuntime.settings_hooks``)."""

    method: str
    K: int
    L: int
    centering: str
    options: Mapping[str, Any] = field(default_factory=dict)  # method-specific, from extensions
    target_cost: float | None = None
    """Budget mode (``budget.py``): each sparse layer replaces K and L by each request's own choice
    for this target (``SparseLayer.forward``); None = K and L as given, for every layer."""
    L_read: int | None = None
    """Tables the kernel reads, <= L (None: L): budget mode builds L tables and steers its sampled
    fraction by reading fewer, without rehashing (``kernel.sparse_decode_attention``)."""

    @classmethod
    def from_config(cls, cfg: MagicPigConfig) -> "StepSettings":
        return cls(cfg.decode_method, cfg.K, cfg.L, cfg.centering, cfg.options(), cfg.target_cost)


@dataclass
class StepHostView:
    """The fields of vLLM's ``CommonAttentionMetadata`` the planner reads, as host tensors, for
    platforms whose metadata lives on a device (the CPU platform passes its metadata as is)."""

    seq_lens: torch.Tensor  # int32 [R]
    block_table_tensor: torch.Tensor  # int32 [R, cols]
    slot_mapping: torch.Tensor  # int64 [tokens]: where this step's tokens are written
    num_reqs: int

    @property
    def num_actual_tokens(self) -> int:
        return self.slot_mapping.numel()

    @property
    def seq_lens_cpu_upper_bound(self) -> torch.Tensor:
        return self.seq_lens

    @classmethod
    def from_metadata(cls, cam, num_reqs: int, block_size: int) -> "StepHostView":
        """From host fields vLLM keeps (``seq_lens_cpu_upper_bound``, exact without speculative
        decoding, which MAGICPIG refuses; ``query_start_loc_cpu``) plus one device-to-host copy
        of the block table's used columns. The written slots follow from those."""
        seq = cam.seq_lens_cpu_upper_bound
        seq = (seq if seq is not None else cam.seq_lens.cpu())[:num_reqs].to(torch.int32)
        cols = max(1, -(-int(seq.max()) // block_size)) if num_reqs else 1
        table = cam.block_table_tensor[:num_reqs, :cols].cpu()
        qlens = (cam.query_start_loc_cpu[1 : num_reqs + 1] - cam.query_start_loc_cpu[:num_reqs]).tolist()
        slots = []
        for r, (s, q) in enumerate(zip(seq.tolist(), qlens)):
            pos = torch.arange(s - q, s)
            slots.append(table[r].long()[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
        return cls(seq, table, slot_mapping, num_reqs)


def covered_end_for(limit: int, unit: int, prompt_end: int) -> int:
    """Where the LSH-covered range of a request ends, for a cover that may not pass ``limit`` (its
    context less the local window, or the GPU mirror's copied blocks): the prompt's tokens up to
    ``prompt_end`` (the last full block before the local window at its first decode), then the
    decoded tokens in whole ``unit``s from there (the growing segment, ``segment_layout``).

    The prompt's cover ends at a block, not at a ``unit``: a prompt whose end fell just short of a
    unit boundary (the end-to-end benchmark's 16381-token prompts) left up to ``unit`` + the local
    window of its tokens (~509 + 4 at 16K, as many as the sampled keys) to be attended exactly by
    every sparse layer at every step, until decoding crossed the boundary; block by block the
    exact tail at a first decode is the local window plus less than a block. Short of the prompt's
    end (a cover the mirror still holds back, or a request over a longer prompt's centre) it is
    whole units, as the decoded tokens'."""
    if limit < prompt_end:
        return (limit // unit) * unit
    return prompt_end + ((limit - prompt_end) // unit) * unit


def largest_segment(cfg) -> int:
    """Tokens in the largest segment: ``max_segment_tokens`` in whole ``segment_tokens``, at least one."""
    unit = cfg.segment_tokens
    return max(unit, (min(cfg.max_segment_tokens, MAX_SEGMENT_TOKENS) // unit) * unit)


def segment_layout(covered_end: int, unit: int, largest: int, prompt_end: int = 0) -> list[tuple[int, int]]:
    """Split [0, covered_end) into segments: up to ``prompt_end`` (the tokens covered at the
    prompt's first decode, a multiple of the block size), full segments of ``largest`` tokens and one
    last segment; past it, the same again for the decoded tokens, whose last segment grows (a
    multiple of ``unit``).

    Every segment costs L bucket lookups per query head per step, about as much as attending
    ~``unit`` tokens exactly, so a context is held in as few segments as possible, and the
    growing one grows by merging (no re-hashing) as decoding fills blocks. The prompt's segments
    never grow: every request over the same prompt (prefix caching) shares them, while decoded
    tokens are a request's own, and a merge copies its base (a 16K-token prompt's last segment
    copied at every 512-token step, and dropped after it, left the next request over the prompt
    to rebuild it whole).
    """
    out = []
    for lo, hi in ((0, min(covered_end, prompt_end)), (prompt_end, covered_end)):
        pos = lo
        while pos < hi:
            size = min(largest, hi - pos)
            out.append((pos, size))
            pos += size
    return out


@dataclass
class DecodePlan:
    settings: StepSettings
    num_decodes: int
    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: list[int]
    dense_ranges: torch.Tensor  # int32 [R, 2, 2]: tokens attended exactly, [sink range, tail range]
    sparse: list[int]  # indices of requests planned sparse
    centres: dict[int, CentreSpec] = field(default_factory=dict)  # request -> centre
    segments: dict[int, list[SegmentRef]] = field(default_factory=dict)
    covered: dict[int, int] = field(default_factory=dict)  # request -> indexed token count
    exact_reason: dict[int, str] = field(default_factory=dict)  # requests planned exact, and why
    # whether this step's layer timings may teach the cost model: not while a background build
    # shares the worker's cores (decodes beside one ran up to ~50% slower)
    timed: bool = True

    @cached_property
    def context_keys(self) -> int:
        """Keys attended over all decode requests (the cost model's size of the step)."""
        return sum(self.seq_lens)

    def covered_range(self, r: int) -> tuple[int, int]:
        """[lo, hi): the LSH-sampled tokens of request r (empty when it is exact)."""
        if r not in self.sparse:
            return self.seq_lens[r], self.seq_lens[r]
        return int(self.dense_ranges[r, 0, 1]), int(self.dense_ranges[r, 1, 0])


class StepPlanner:
    """Layer-independent decisions, made once per engine step in the metadata builder."""

    def __init__(self, cfg: MagicPigConfig, block_size: int, index: IndexStore, mirror: Any = None,
                 cost: Any = None, indexer: Any = None, cap_bytes: int | None = None) -> None:
        """``mirror``: the host mirror of a device KV cache (``host_mirror.HostMirror``), on platforms
        whose cache is not in host memory; only mirrored blocks are covered by segments.
        ``cost``: the worker's ``cost_model.DecodeCostModel``; requests it predicts would sample
        slower than exact attention are served exactly, as are those over a prompt whose index
        has not paid for its build yet. ``indexer``: the runtime's
        ``background_index.BackgroundIndexer``; a new prompt is served exactly while it indexes it.
        ``cap_bytes``: the index's memory cap; a new prompt whose index would not fit beside the
        segments in use is served exactly (``evicted``), and not indexed (``_no_index_room``)."""
        self.cfg = cfg
        self.indexer = indexer
        self.block_size = block_size
        self.index = index
        self.mirror = mirror
        self.cost = cost
        self.cap_bytes = cap_bytes
        # this step's idle_room under the cap, less what new prompts admitted in it need; and what
        # the memory node must still give the index (jobs being built, new prompts admitted)
        self._room: float | None = None
        self._node_claimed = 0.0
        self.unit = cfg.segment_tokens
        self.largest = largest_segment(cfg)
        # last block written by a prefill chunk -> sequence length after it; a decode
        # right after it is that request's first decode (vLLM gives no request ids).
        self._prefill_ends: OrderedDict[int, int] = OrderedDict()
        # centre id -> requests whose first decode was over it (up to 2: a prompt asked again may
        # be asked more, so its build is judged by ski rental alone, not by one answer's bound)
        self._requests_over: OrderedDict[int, int] = OrderedDict()

    def observe_step(self, cam, num_decodes: int) -> None:
        """Every step: KV writes invalidate the index; remember where prefills ended."""
        self.index.begin_step()
        bs = self.block_size
        slots = cam.slot_mapping[: cam.num_actual_tokens]
        if cam.num_actual_tokens <= SMALL_STEP:  # a decode step: a few tokens, Python beats torch's per-op cost
            slot_list = [x for x in slots.tolist() if x >= 0]
            written = sorted({x // bs for x in slot_list})
            completed = sorted({x // bs for x in slot_list if x % bs == bs - 1})
        else:
            slots = slots[slots >= 0]
            written = torch.unique(slots // bs).tolist()
            completed = torch.unique(slots[slots % bs == bs - 1] // bs).tolist()
        if written:
            self.index.on_blocks_written(written)
        if self.indexer is not None:  # after the invalidations: a job over rewritten blocks is dropped
            self.indexer.install_finished()
        if self.mirror is not None:  # blocks whose last slot is written now are complete
            self.mirror.begin_step(written, completed)
        if cam.num_reqs > num_decodes:
            seq_lens = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens
            bt = cam.block_table_tensor
            for r in range(num_decodes, cam.num_reqs):
                s = int(seq_lens[r])
                if s > 0:
                    self._prefill_ends[int(bt[r, (s - 1) // self.block_size])] = s
            while len(self._prefill_ends) > 4096:
                self._prefill_ends.popitem(last=False)

    def plan(self, cam, num_decodes: int, settings: StepSettings,
             answer_bounds: AnswerBounds | None = None) -> DecodePlan:
        """The step's decode plan. ``answer_bounds``: the decodes each request (by row) may still take,
        from its ``max_tokens`` (answer_bounds.py); a new prompt whose build could not pay back within
        its request's bound is not built (``index_cannot_pay``), and one whose request's answer will
        likely run long (``answer_bounds.outlook(row)``) may be built at once."""
        cfg, bs = self.cfg, self.block_size
        seq_lens = [int(x) for x in cam.seq_lens[:num_decodes].tolist()]
        block_table = cam.block_table_tensor[:num_decodes]
        # [sink range, tail range] per request, as Python lists until the end: element stores
        # into a tensor cost microseconds each, and this runs every step
        dense = [[[0, s], [s, s]] for s in seq_lens]
        plan = DecodePlan(settings, num_decodes, block_table, seq_lens, torch.empty(0), [])
        background = self.indexer is not None and self.indexer.applies(settings)
        if self.cost is not None:
            self.cost.begin_step()
        self._room = None
        for r, s in enumerate(seq_lens):
            if settings.method == EXACT:
                plan.exact_reason[r] = EXACT_METHOD
                continue
            limit = s - cfg.local_window  # the local window is always attended exactly
            if s < cfg.min_sparse_context or (limit // self.unit) * self.unit <= cfg.sink_tokens:
                plan.exact_reason[r] = EXACT_SHORT_CONTEXT
                continue
            if self.cost is not None and not self.cost.sampling_pays(s):
                plan.exact_reason[r] = EXACT_SAMPLING_SLOWER
                continue
            row = block_table[r, : (s + bs - 1) // bs].tolist()
            first_decode = self._take_first_decode(row, s)
            spec = self._centre_for(row, s, first_decode)
            if spec is not None and first_decode:
                self._count_request(spec.cid)
            if spec is None:
                plan.exact_reason[r] = EXACT_SHORT_CONTEXT
                continue
            prompt_end = spec.end  # covered from the prompt's first decode on
            covered_end = covered_end_for(limit, self.unit, prompt_end)
            if self.mirror is not None:  # cover mirrored blocks only: the rest stays in the exact tail
                ready = self.mirror.ready_blocks(row[: covered_end // bs])
                covered_end = covered_end_for(min(limit, ready * bs), self.unit, prompt_end)
                if covered_end <= cfg.sink_tokens:
                    plan.exact_reason[r] = EXACT_NOT_MIRRORED
                    continue
            if self.cost is not None and not self._indexed(spec.cid):
                # one request's bound decides only while it is the prompt's only request so far
                alone = self._requests_over.get(spec.cid, 0) < 2
                bound = answer_bounds[r] if answer_bounds is not None and alone else None
                # how its answer will likely go on, where the runner's bounds can say (answer_lengths.py)
                outlook = answer_bounds.outlook(r) if bound is not None else None
                why_not = self.cost.index_decision(spec.cid, s, bound, outlook)
                if why_not is not None:
                    plan.exact_reason[r] = why_not
                    continue
            refs = []
            for start, size in segment_layout(covered_end, self.unit, self.largest, prompt_end):
                blocks = tuple(row[start // bs : (start + size) // bs])
                key = self.index.canonical_key(SegmentKey(spec.cid, start, size, blocks))
                refs.append(SegmentRef(key, max(start, cfg.sink_tokens)))
            no_room = self._no_index_room(spec.cid, covered_end - cfg.sink_tokens, settings)
            if no_room is not None:
                plan.exact_reason[r] = no_room
                continue
            if background and not self.indexer.ready(spec, refs, settings):
                plan.exact_reason[r] = EXACT_INDEXING
                continue
            plan.sparse.append(r)
            plan.centres[r] = spec
            plan.segments[r] = refs
            plan.covered[r] = covered_end - cfg.sink_tokens
            dense[r][0][1] = cfg.sink_tokens
            dense[r][1][0] = covered_end
        plan.dense_ranges = torch.tensor(dense, dtype=torch.int32).view(num_decodes, 2, 2)
        plan.timed = self.indexer is None or not self.indexer.building()
        return plan

    def _no_index_room(self, cid: int, tokens: int, settings: StepSettings) -> str | None:
        """Why a new prompt's index does not fit (``EXACT_EVICTED``: under the cap;
        ``EXACT_NODE_MEMORY``: in its memory node's free memory less the guard's reserve,
        ``node_memory.py``), or None where it does: ``tokens`` in every sparse layer beside the
        segments in use, at the bytes a token of each layer's last segment took. Under a load of
        long answers the segments in use filled the cap: a new prompt's background job built its
        whole index only to have the install refuse it, and every layer then refused its segments
        again step after step while MAGICPIG's kernel attended it exactly. Now it is served by the
        platform kernel without a build, and indexed once there is room. A prompt holding segments
        already, or being indexed, is not checked again (its growth is checked where it is built);
        nor is budget mode, whose (K, L) the layers choose per request."""
        if self.cap_bytes is None or settings.target_cost is not None or self.index.holds_centre_segments(cid):
            return None
        if self.indexer is not None and self.indexer.pending_for(cid):
            return None
        per_token = self.index.prompt_bytes_per_token(settings.K, settings.L)
        if self._room is None:
            pending_tokens = self.indexer.pending_tokens() if self.indexer is not None else 0
            self._room = self.index.idle_room(self.cap_bytes) - pending_tokens * (per_token or 0)
            self._node_claimed = self.index.prompt_build_need(settings.K, settings.L, pending_tokens)
        # nothing built yet to size it by: build and see, unless the node is short of memory now
        need = 0.0 if per_token is None else per_token * tokens
        if need > self._room:
            return EXACT_EVICTED
        # what its build takes from the node at most (idle segments are evicted, and memory held
        # unused given back, to make room)
        node_need = self.index.prompt_build_need(settings.K, settings.L, tokens)
        if not self.index.make_node_room(int(self._node_claimed + node_need)):
            return EXACT_NODE_MEMORY
        self._room -= need  # the next new prompt of this step fits beside this one, or not
        self._node_claimed += node_need
        return None

    def _indexed(self, cid: int) -> bool:
        """Whether prompt ``cid`` has an index, or one is being built (so no build decision is due)."""
        return self.index.holds_centre_segments(cid) or (self.indexer is not None and self.indexer.tracks(cid))

    def _take_first_decode(self, row: list[int], s: int) -> bool:
        """Whether this decode is its request's first (a prefill chunk ended just before it)."""
        first = s >= 2 and self._prefill_ends.get(row[(s - 2) // self.block_size]) == s - 1
        if first:
            self._prefill_ends.pop(row[(s - 2) // self.block_size], None)
        return first

    def _count_request(self, cid: int) -> None:
        self._requests_over[cid] = min(self._requests_over.pop(cid, 0) + 1, 2)
        while len(self._requests_over) > 4096:
            self._requests_over.popitem(last=False)

    def _centre_for(self, row: list[int], s: int, first_decode: bool) -> CentreSpec | None:
        cfg, bs, index = self.cfg, self.block_size, self.index
        found = index.find_centre(row)
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
                index.inherit_centre(blocks, found)
                return found
        return index.new_centre(blocks, cfg.sink_tokens, end)
