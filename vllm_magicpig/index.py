"""The CPU-side LSH index: centres, segments, their life cycle and the memory cap.

vLLM gives attention backends no request ids, only block tables and sequence lengths,
so everything here is keyed by KV block ids:

* A **centre** (the per-request key mean the paper subtracts before hashing) is
  registered under the block ids of the prompt blocks it was computed from. A request
  finds its centre as the longest registered block run that prefixes its block table,
  so requests whose prompts share those blocks (prefix caching) share the centre.
* A **segment** is an LSH index over a run of full blocks, keyed by
  ``(centre id, first token, size, block ids)``. A prompt is cut into segments of at most
  ``max_segment_tokens`` at its first decode, which never change (requests over the same
  prompt share them); the decoded tokens get segments of their own, the last of which grows
  in steps of ``segment_tokens`` by merging (the new tokens are indexed alone, then
  concatenated bucket by bucket), so lookups stay few at long context and the uncovered tail
  stays under ``segment_tokens`` (``planner.segment_layout``).
* Full KV blocks are immutable while allocated, so a KV write into a block that a
  centre or segment covers means vLLM freed and reused it: those entries are dropped.
* The store is capped (``index_memory_mb``); least recently used segments go first, but never
  those of a request still decoding (``ACTIVE_STEPS``). A request whose segments cannot be held
  is attended exactly (stats: ``evicted``), and they are not built while there is no room; a new
  prompt whose whole index would not fit is planned exact before any layer tries
  (``idle_room``, ``planner.StepPlanner._no_index_room``).
* Growth also stops where the memory node would keep less than ``node_reserve_mb`` free, whatever
  the cap (``node_guard``: other engines and processes share the node; ``node_memory.py``); such
  requests are attended exactly too (stats: ``node_memory_low``).

The store owns the whole segment life cycle (:meth:`IndexStore.get_or_build`: find, grow by
merging, replace; :meth:`IndexStore.reserve`: evict, or refuse so the caller serves the
request exactly). How a segment is built from the KV cache is the caller's (a callback), so
the store is device-agnostic.

One ``IndexStore`` per worker runtime holds every layer's entries, so the block bookkeeping
runs once per step, not once per layer.
"""
from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from vllm_magicpig.stats import Stats

Segment = Any  # an ops-level segment: has index_bytes and mirror_bytes


class SegmentKey(tuple):
    """(centre id, first token, size, block ids), hashed once. Every sparse layer looks its
    segments up by key at every step, and a plain tuple hashes its block ids (128 of them at 16K
    tokens) at every lookup, three lookups a segment. Equal to the plain tuple of its fields (and
    hashed the same), so either finds the other's entries; the store hands out one object per key
    (:meth:`IndexStore.canonical_key`), so a lookup's comparison stops at identity."""

    def __new__(cls, cid: int, start: int, size: int, blocks: tuple[int, ...]) -> "SegmentKey":
        key = super().__new__(cls, (cid, start, size, blocks))
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return SegmentKey, tuple(self)


def segment_owner(layer: str, K: int, L: int) -> tuple[str, int, int]:
    """What segments are stored under (the ``layer`` argument of the segment methods): the layer
    and the (K, L) its segments are hashed with. Under another (K, L) (another request's or target's
    budget-mode choice, a refinement, a run-time override) none of them is found; unused ones age out by
    LRU. So a segment hashed under one (K, L) is never read under another. Centres stay per layer
    name: they do not depend on (K, L)."""
    return (layer, K, L)


@dataclass(frozen=True)
class CentreSpec:
    """Where a centre's keys come from: tokens [start, end) of ``blocks``."""

    cid: int
    blocks: tuple[int, ...]
    start: int
    end: int


@dataclass
class SegmentRef:
    """A planned segment: ``key`` = (cid, start, size, blocks); tokens [first_token, start + size)
    are indexed (the first segment of a request skips the sinks)."""

    key: SegmentKey
    first_token: int

    @property
    def num_tokens(self) -> int:
        _, start, size, _ = self.key
        return start + size - self.first_token


@dataclass
class _CentreEntry:
    blocks: tuple[int, ...]  # the block run this entry is found under
    spec: CentreSpec  # the centre it resolves to (an inherited entry points to an older spec)


# A segment used within this many engine steps belongs to a request still decoding, and the cap
# never evicts it for another request's: when the index cannot hold every decoding request's
# segments, the requests it holds keep being sampled and the others are served exactly. Evicting
# the least recently used instead evicted segments that a later layer of the same step, or the
# next step, needed again: a long-answer load (21 requests of 2-7K tokens against a 2 GB cap,
# serve_load --answer-tokens 512) built 2,761 segments and evicted 2,585, 178 s of its one core.
# A request that the cost model serves exactly between its exploring steps (one in 16) touches its
# segments at those steps only, so the window spans two of them.
ACTIVE_STEPS = 32

# Why a segment was not built or kept (``IndexStore.last_refusal``): no room under
# ``index_memory_mb`` beside the segments in use, or none on the memory node (``node_memory.py``).
REFUSED_CAP = "cap"
REFUSED_NODE_MEMORY = "node_memory"
# A build's peak against the segment it makes: the segment, and its hash codes (2 bytes per token,
# table and head, as its bucket ids are) in a scratch array while it is sorted (cpp/segment.cpp).
# The mirror needs no scratch, so 2 overstates it a little.
BUILD_PEAK = 2


class IndexStore:
    def __init__(self, stats: Stats, grow_step: int, active_steps: int = ACTIVE_STEPS) -> None:
        """``grow_step``: the tokens a growing segment gains at a time (``segment_tokens``);
        ``active_steps``: segments used within that many steps are not evicted (``ACTIVE_STEPS``)."""
        self.stats = stats
        self.grow_step = grow_step
        self.active_steps = active_steps
        # told (tokens, seconds) of every build, here (a growth's new tokens included) or on the
        # background thread: the cost model learns from it what indexing a token costs
        self.on_build: Callable[[int, float], None] | None = None
        self.step = 0
        self._next_cid = 1
        # centre entries, found by the first block of the run
        self._centres_by_first: dict[int, list[_CentreEntry]] = defaultdict(list)
        self._centre_specs: dict[int, CentreSpec] = {}
        self._centre_tensors: dict[tuple[str, int], torch.Tensor] = {}
        # segments: (layer, key) -> Segment, in LRU order
        self._segments: OrderedDict[tuple[str, SegmentKey], Segment] = OrderedDict()
        self._last_used: dict[tuple[str, SegmentKey], int] = {}
        self._keys_by_cid: dict[int, set[SegmentKey]] = defaultdict(set)
        self._layers_by_key: dict[SegmentKey, set[str]] = defaultdict(set)
        self._canonical: dict[SegmentKey, SegmentKey] = {}  # a held key -> the object it is held under
        # block id -> what depends on it
        self._block_segments: dict[int, set[SegmentKey]] = defaultdict(set)
        self._block_centres: dict[int, set[int]] = defaultdict(set)
        self.index_bytes = 0
        self.mirror_bytes = 0
        # layer -> bytes a token of its last stored (or refused) segment took, index and mirror:
        # what a new segment's room is checked against before it is built (_no_room)
        self._bytes_per_token: dict[Hashable, float] = {}
        # checks the index's growth against its memory node's free memory (node_memory.py); None:
        # against the cap only (the runtime sets it)
        self.node_guard: Any = None
        self.last_refusal: str | None = None  # why the latest refused segment was refused

    # ------------------------------------------------------------------ centres
    def find_centre(self, row: list[int]) -> CentreSpec | None:
        """The centre registered under the longest block run that prefixes ``row``."""
        if not row:
            return None
        best = None
        for entry in self._centres_by_first.get(row[0], ()):
            n = len(entry.blocks)
            if n <= len(row) and (best is None or n > len(best.blocks)) and tuple(row[:n]) == entry.blocks:
                best = entry
        return best.spec if best else None

    def new_centre(self, blocks: tuple[int, ...], start: int, end: int) -> CentreSpec:
        spec = CentreSpec(self._next_cid, blocks, start, end)
        self._next_cid += 1
        self._centre_specs[spec.cid] = spec
        self._add_centre_entry(blocks, spec)
        self.stats.index["centres_computed"] += 1
        return spec

    def inherit_centre(self, blocks: tuple[int, ...], spec: CentreSpec) -> None:
        """Register ``spec`` (a prefix's centre) under a longer prompt's blocks too."""
        self._add_centre_entry(blocks, spec)
        self.stats.index["centres_inherited"] += 1

    def _add_centre_entry(self, blocks: tuple[int, ...], spec: CentreSpec) -> None:
        self._centres_by_first[blocks[0]].append(_CentreEntry(blocks, spec))
        for b in blocks:
            self._block_centres[b].add(spec.cid)

    def centre(self, layer: str, spec: CentreSpec, compute: Callable[[CentreSpec], torch.Tensor]) -> torch.Tensor:
        """The layer's centre tensor of ``spec``, computed on first need."""
        c = self._centre_tensors.get((layer, spec.cid))
        if c is None:
            c = self._centre_tensors[(layer, spec.cid)] = compute(spec)
        return c

    def has_centre(self, cid: int) -> bool:
        """Whether centre ``cid`` is still registered (not invalidated nor cleared)."""
        return cid in self._centre_specs

    def set_centre(self, layer: str, spec: CentreSpec, centre: torch.Tensor) -> None:
        """The layer's centre tensor of ``spec``, computed elsewhere (the background indexer)."""
        self._centre_tensors.setdefault((layer, spec.cid), centre)

    def holds_centre_segments(self, cid: int) -> bool:
        """Whether any layer holds a segment built on centre ``cid``."""
        return bool(self._keys_by_cid.get(cid))

    def _drop_centre(self, cid: int) -> None:
        spec = self._centre_specs.pop(cid, None)
        if spec is None:
            return
        for first, entries in list(self._centres_by_first.items()):
            kept = [e for e in entries if e.spec.cid != cid]
            for e in entries:
                if e.spec.cid == cid:
                    for b in e.blocks:
                        refs = self._block_centres.get(b)
                        if refs is not None:
                            refs.discard(cid)
                            if not refs:
                                del self._block_centres[b]
            if kept:
                self._centres_by_first[first] = kept
            else:
                del self._centres_by_first[first]
        for key in [k for k in self._centre_tensors if k[1] == cid]:
            del self._centre_tensors[key]
        for key in list(self._keys_by_cid.pop(cid, ())):
            self._drop_key_everywhere(key)
        self.stats.index["centres_invalidated"] += 1

    # ------------------------------------------------------------------ segment life cycle
    def get_or_build(self, layer: Hashable, ref: SegmentRef, build: Callable[[SegmentRef], Segment],
                     merge: Callable[[Sequence[Segment]], Segment], cap_bytes: int | None = None) -> Segment | None:
        """The layer's segment for ``ref``: found; else the longest held segment with the same
        centre and start, grown by indexing only the new tokens and merging (no re-hashing);
        else built whole. A grown base is dropped unless another request used it this step.
        With ``cap_bytes``, least recently used segments are evicted to make room for a new one
        before it is stored; when the segments of requests still decoding (used within
        ``active_steps`` steps) leave no room, the new one is
        not stored and None is returned (the caller serves the request exactly), so the store
        never holds more than the cap. Where the layer's earlier segments say it would not fit,
        it is not built either: under load a store full of segments in use refused, and rebuilt
        the next step, the same segments step after step (a server spent 935 s building 24,026
        segments, 20,532 of them refused: ``benchmarks/serve_load.py --answer-tokens 512``)."""
        seg = self.get_segment(layer, ref.key)
        if seg is not None:
            return seg
        cid, start, size, blocks = ref.key
        block_size = size // len(blocks)
        for shorter in range(size - self.grow_step, 0, -self.grow_step):
            base_key = SegmentKey(cid, start, shorter, blocks[: shorter // block_size])
            base = self.peek_segment(layer, base_key)
            if base is None:
                continue
            why = self._no_room(layer, size - shorter, cap_bytes, merged=size)  # the base makes way
            if why is not None:
                return self._refuse(why)
            rest = self._build(build, SegmentRef(SegmentKey(cid, start + shorter, size - shorter,
                                                            blocks[shorter // block_size :]), start + shorter))
            t0 = time.perf_counter()
            seg = merge([base, rest])
            self.stats.build_seconds += time.perf_counter() - t0
            self.stats.index["segments_merged"] += 1
            if not self.used_this_step(layer, base_key):  # nobody else reads it now
                self.drop_segment(layer, base_key)
            return self._store(layer, ref, seg, cap_bytes)
        why = self._no_room(layer, ref.num_tokens, cap_bytes)
        if why is not None:
            return self._refuse(why)
        return self._store(layer, ref, self._build(build, ref), cap_bytes)

    def _no_room(self, layer: Hashable, tokens: int, cap_bytes: int | None, merged: int = 0) -> str | None:
        """Why ``tokens`` more tokens of the layer's segments would not fit, at the bytes a token of
        its last segment took, once the segments no request still uses are evicted (evicting them
        as needed): under the cap (``REFUSED_CAP``), or in its memory node's free memory less the
        guard's reserve (``REFUSED_NODE_MEMORY``). None: they fit. Until the layer built one they
        are built to see, unless the node is short of memory already. ``merged``: see build_need."""
        per_token = self._bytes_per_token.get(layer)
        need = 0 if per_token is None else int(per_token * tokens)
        if per_token is not None and cap_bytes is not None and not self.enforce_cap(cap_bytes - need):
            return REFUSED_CAP
        return None if self.make_node_room(self.build_need(layer, tokens, merged)) else REFUSED_NODE_MEMORY

    def build_need(self, layer: Hashable, tokens: int, merged: int = 0) -> int:
        """What building ``tokens`` of the layer's segments takes from the memory node at most: the
        segments, and their hash codes beside them while they are sorted into buckets (a scratch
        array the size of the tables, freed after). A growth (``merged``: the grown segment's
        tokens) then merges the new part with its base into a new segment while both are held, the
        base freed only after: its peak is the new part and the whole merged segment, where that is
        more (a 16K-token segment grown by 512 tokens, the default step: 17x the part's build).
        0 until the layer built one (nothing to size by)."""
        per_token = self._bytes_per_token.get(layer)
        return 0 if per_token is None else int(per_token * max(BUILD_PEAK * tokens, tokens + merged))

    def make_node_room(self, need: int) -> bool:
        """Whether the memory node can give the index ``need`` more bytes (0: any at all) and keep
        the guard's reserve free, after memory held unused and then the segments no request still
        uses are given back to it (evicting them as needed). True without a guard. False is a
        refusal: the guard logs it (rate-limited)."""
        guard = self.node_guard
        if guard is None:
            return True
        while short := guard.shortfall(need):  # memory held unused is given back first
            held = self.held_bytes()
            self.enforce_cap(held - short)  # evicts idle segments, least recently used first
            if self.held_bytes() == held:  # all in use
                guard.note_refusal()
                return False
            # Their memory went to the pool, given back at the next check; the node is read again
            # rather than credited with their bytes, as a segment still referenced (a growth's own
            # base) frees none.
        return True

    def held_bytes(self) -> int:
        """What the store's segments hold: hash tables and K/V mirror."""
        return self.index_bytes + self.mirror_bytes

    def _layers_bytes_per_token(self, K: int, L: int) -> list[float]:
        """Each layer's bytes a token hashed with (K, L) (owners made by ``segment_owner``), from its
        last segment; layers that built none are not listed."""
        return [v for owner, v in self._bytes_per_token.items() if isinstance(owner, tuple) and owner[1:] == (K, L)]

    def prompt_bytes_per_token(self, K: int, L: int) -> float | None:
        """Bytes a token takes in the segments of every layer hashed with (K, L); None until one was built."""
        per_layer = self._layers_bytes_per_token(K, L)
        return sum(per_layer) if per_layer else None

    def prompt_build_need(self, K: int, L: int, tokens: int) -> int:
        """What indexing ``tokens`` in every layer hashed with (K, L) takes from the memory node at
        most: every layer's segments, and the build scratch of the one being built (``build_need``);
        0 until one was built."""
        per_layer = self._layers_bytes_per_token(K, L)
        return int((sum(per_layer) + (BUILD_PEAK - 1) * max(per_layer)) * tokens) if per_layer else 0

    def idle_room(self, cap_bytes: int) -> int:
        """Bytes a new prompt's index could take under the cap without evicting a segment in use:
        the cap less what the segments used within ``active_steps`` steps hold. Nothing is evicted
        here. The store is in least-recently-used order, so those are its last entries."""
        in_use = 0
        for k in reversed(self._segments):
            if not self._in_use(k):
                break
            seg = self._segments[k]
            in_use += seg.index_bytes + seg.mirror_bytes
        return cap_bytes - in_use

    def _refuse(self, why: str = REFUSED_CAP) -> None:
        self.stats.index["segments_refused"] += 1  # no room: not kept
        if why == REFUSED_NODE_MEMORY:
            self.stats.index["segments_refused_node_memory"] += 1
        self.last_refusal = why
        return None

    def install(self, layer: Hashable, ref: SegmentRef, seg: Segment, cap_bytes: int | None = None) -> Segment | None:
        """Store a segment built elsewhere (the background indexer), counted as built; under the
        cap as :meth:`get_or_build` stores (None: no room, not kept)."""
        self._count_built(ref)
        return self._store(layer, ref, seg, cap_bytes)

    def _store(self, layer: Hashable, ref: SegmentRef, seg: Segment, cap_bytes: int | None) -> Segment | None:
        need = self.note_size(layer, ref, seg)
        if cap_bytes is not None and not self.enforce_cap(cap_bytes - need):
            return self._refuse()
        self.put_segment(layer, ref.key, seg)
        return seg

    def note_size(self, layer: Hashable, ref: SegmentRef, seg: Segment) -> int:
        """The layer's bytes per token, from a segment stored or refused (so the next is sized before
        it is built); returns the segment's bytes."""
        need = seg.index_bytes + seg.mirror_bytes
        self._bytes_per_token[layer] = need / max(ref.num_tokens, 1)
        return need

    def _build(self, build: Callable[[SegmentRef], Segment], ref: SegmentRef) -> Segment:
        t0 = time.perf_counter()
        seg = build(ref)
        seconds = time.perf_counter() - t0
        self.stats.build_seconds += seconds
        self._count_built(ref)
        if self.on_build is not None:
            self.on_build(ref.num_tokens, seconds)
        return seg

    def _count_built(self, ref: SegmentRef) -> None:
        self.stats.index["segments_built"] += 1
        self.stats.index["tokens_indexed"] += ref.num_tokens

    def reserve(self, layer: Hashable, refs: Sequence[SegmentRef], cap_bytes: int) -> bool:
        """Fit the store under ``cap_bytes`` by evicting least recently used segments that no
        request used within ``active_steps`` steps. When that is not enough, drop ``refs``' segments of this layer and
        return False: the caller serves that request exactly (they are rebuilt when there is room)."""
        if self.enforce_cap(cap_bytes):
            return True
        self.drop_refs(layer, refs)
        return False

    def drop_refs(self, layer: Hashable, refs: Sequence[SegmentRef]) -> None:
        """Give up a request's segments of this layer (it is served exactly), freeing room for others."""
        for ref in refs:
            self.drop_segment(layer, ref.key)

    def begin_step(self) -> None:
        """A new engine step: "used this step" starts afresh."""
        self.step += 1

    # ------------------------------------------------------------------ segments
    def canonical_key(self, key: SegmentKey) -> SegmentKey:
        """The key object segments equal to ``key`` are held under, if any layer holds one; else
        ``key``. The planner makes a step's keys through this, so the layers' lookups compare keys
        by identity rather than block id by block id."""
        return self._canonical.get(key, key)

    def get_segment(self, layer: Hashable, key: SegmentKey) -> Segment | None:
        k = (layer, key)
        seg = self._segments.get(k)
        if seg is not None:
            self._segments.move_to_end(k)
            self._last_used[k] = self.step
        return seg

    def peek_segment(self, layer: Hashable, key: SegmentKey) -> Segment | None:
        """Like get_segment, without counting as a use."""
        return self._segments.get((layer, key))

    def used_this_step(self, layer: Hashable, key: SegmentKey) -> bool:
        return self._last_used.get((layer, key)) == self.step

    def put_segment(self, layer: Hashable, key: SegmentKey, seg: Segment) -> None:
        k = (layer, key)
        self._segments[k] = seg
        self._last_used[k] = self.step
        self._keys_by_cid[key[0]].add(key)
        self._layers_by_key[key].add(layer)
        self._canonical.setdefault(key, key)
        for b in key[3]:
            self._block_segments[b].add(key)
        self.index_bytes += seg.index_bytes
        self.mirror_bytes += seg.mirror_bytes
        self._publish()

    def drop_segment(self, layer: Hashable, key: SegmentKey) -> None:
        seg = self._segments.pop((layer, key), None)
        if seg is None:
            return
        self._last_used.pop((layer, key), None)
        self.index_bytes -= seg.index_bytes
        self.mirror_bytes -= seg.mirror_bytes
        layers = self._layers_by_key.get(key)
        if layers is not None:
            layers.discard(layer)
            if not layers:
                del self._layers_by_key[key]
                self._canonical.pop(key, None)
                self._keys_by_cid.get(key[0], set()).discard(key)
                for b in key[3]:
                    refs = self._block_segments.get(b)
                    if refs is not None:
                        refs.discard(key)
                        if not refs:
                            del self._block_segments[b]
        self._publish()

    def _drop_key_everywhere(self, key: SegmentKey) -> None:
        for layer in list(self._layers_by_key.get(key, ())):
            self.drop_segment(layer, key)

    def _in_use(self, k: tuple[Hashable, SegmentKey]) -> bool:
        """Whether segment ``k`` was used within ``active_steps`` steps: a request still decoding holds it."""
        last = self._last_used.get(k)
        return last is not None and last > self.step - self.active_steps

    def enforce_cap(self, cap_bytes: int) -> bool:
        """Evict least recently used segments not used within ``active_steps`` steps. True if under the cap."""
        while self.index_bytes + self.mirror_bytes > cap_bytes and self._segments:
            k, _ = next(iter(self._segments.items()))
            if self._in_use(k):
                return False  # everything left belongs to requests still decoding
            self.drop_segment(*k)
            self.stats.index["segments_evicted"] += 1
        return self.index_bytes + self.mirror_bytes <= cap_bytes

    # ------------------------------------------------------------------ life cycle
    def on_blocks_written(self, blocks) -> None:
        """A KV write landed in these blocks: drop what was built from their old content."""
        for b in blocks:
            for cid in list(self._block_centres.pop(b, ())):
                self._drop_centre(cid)
            for key in list(self._block_segments.get(b, ())):
                self._drop_key_everywhere(key)
                self.stats.index["segments_invalidated"] += 1

    def _publish(self) -> None:
        self.stats.index_bytes = self.index_bytes
        self.stats.mirror_bytes = self.mirror_bytes
        self.stats.held_bytes_peak = max(self.stats.held_bytes_peak, self.index_bytes + self.mirror_bytes)
        self.stats.index["segments_live"] = len(self._segments)

    def clear(self) -> None:
        # Centre ids stay unique for the worker's life: state outside the index is keyed by them
        # (budget mode's per-request choices), so a new prompt must never reuse a cleared one's id.
        next_cid, on_build, guard = self._next_cid, self.on_build, self.node_guard
        self.__init__(self.stats, self.grow_step, self.active_steps)
        self._next_cid, self.on_build, self.node_guard = next_cid, on_build, guard
        self._publish()

    def __len__(self) -> int:
        return len(self._segments)
