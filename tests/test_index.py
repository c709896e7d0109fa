"""The index's life cycle on its own: centre lookup and inheritance, invalidation by KV writes,
growth by merging, and the memory cap. Segments here are stand-ins (objects with byte sizes):
the index is device-agnostic and never looks inside them."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_magicpig.index import ACTIVE_STEPS, IndexStore, SegmentKey, SegmentRef, segment_owner
from vllm_magicpig.stats import Stats

LAYER, OTHER = "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"


@dataclass
class FakeSegment:
    """Stand-in for a kernel segment: the store reads only the byte counts."""

    tokens: tuple  # (first, end) token range, to check what merges produce
    index_bytes: int = 1000
    mirror_bytes: int = 3000


def build(ref: SegmentRef) -> FakeSegment:
    _, start, size, _ = ref.key
    return FakeSegment((ref.first_token, start + size))


def merge(parts) -> FakeSegment:
    assert all(a.tokens[1] == b.tokens[0] for a, b in zip(parts, parts[1:])), "merge of non-adjacent parts"
    return FakeSegment((parts[0].tokens[0], parts[-1].tokens[1]), sum(p.index_bytes for p in parts),
                       sum(p.mirror_bytes for p in parts))


@pytest.fixture
def store():
    # A segment counts as in use for one step: the eviction mechanics, step by step. The default
    # window (ACTIVE_STEPS) has its own test.
    return IndexStore(Stats(), grow_step=256, active_steps=1)


def ref(cid: int, start: int, size: int, blocks: tuple, first: int | None = None) -> SegmentRef:
    return SegmentRef((cid, start, size, blocks), start if first is None else first)


# --------------------------------------------------------------------------- centres


def test_centre_is_found_by_the_longest_registered_prefix(store):
    short = store.new_centre((10, 11), 4, 256)
    long = store.new_centre((10, 11, 12, 13), 4, 512)
    assert store.find_centre([10, 11, 12, 13, 14]) == long
    assert store.find_centre([10, 11, 99]) == short
    assert store.find_centre([11, 10]) is None
    assert store.find_centre([]) is None


def test_inherited_centre_is_found_under_the_longer_prompt(store):
    spec = store.new_centre((1, 2), 4, 256)
    store.inherit_centre((1, 2, 3, 4), spec)
    assert store.find_centre([1, 2, 3, 4, 5]) == spec
    assert store.stats.index["centres_inherited"] == 1 and store.stats.index["centres_computed"] == 1


def test_centre_tensor_is_computed_once_per_layer(store):
    spec = store.new_centre((1, 2), 4, 256)
    calls = []
    for layer in (LAYER, LAYER, OTHER):
        store.centre(layer, spec, lambda s: calls.append(s) or len(calls))
    assert len(calls) == 2  # once for each layer


# --------------------------------------------------------------------------- segments


def test_growth_merges_only_the_new_tokens_and_drops_the_base(store):
    spec = store.new_centre((1, 2, 3, 4), 4, 512)
    a = store.get_or_build(LAYER, ref(spec.cid, 0, 256, (1, 2), first=4), build, merge)
    assert a.tokens == (4, 256)
    store.begin_step()
    grown = store.get_or_build(LAYER, ref(spec.cid, 0, 512, (1, 2, 3, 4), first=4), build, merge)
    assert grown.tokens == (4, 512)
    idx = store.stats.index
    assert idx["segments_built"] == 2 and idx["segments_merged"] == 1 and idx["tokens_indexed"] == 252 + 256
    assert store.peek_segment(LAYER, (spec.cid, 0, 256, (1, 2))) is None  # the base is replaced
    assert len(store) == 1


def test_a_base_another_request_used_this_step_is_kept(store):
    spec = store.new_centre((1, 2, 3, 4), 4, 512)
    base_ref = ref(spec.cid, 0, 256, (1, 2), first=4)
    store.get_or_build(LAYER, base_ref, build, merge)  # a request that still needs the short one
    store.get_or_build(LAYER, ref(spec.cid, 0, 512, (1, 2, 3, 4), first=4), build, merge)
    assert store.peek_segment(LAYER, base_ref.key) is not None and len(store) == 2


def test_kv_write_into_a_block_drops_its_segments_and_centres(store):
    spec = store.new_centre((1, 2), 4, 256)
    store.get_or_build(LAYER, ref(spec.cid, 0, 256, (1, 2), first=4), build, merge)
    store.get_or_build(OTHER, ref(spec.cid, 0, 256, (1, 2), first=4), build, merge)
    other = store.new_centre((7, 8), 4, 256)
    store.get_or_build(LAYER, ref(other.cid, 0, 256, (7, 8), first=4), build, merge)
    store.on_blocks_written([2])
    assert store.find_centre([1, 2, 3]) is None
    assert store.peek_segment(LAYER, (spec.cid, 0, 256, (1, 2))) is None
    assert store.peek_segment(OTHER, (spec.cid, 0, 256, (1, 2))) is None  # in every layer
    assert store.find_centre([7, 8]) == other and len(store) == 1  # untouched blocks keep theirs
    assert store.index_bytes == 1000 and store.mirror_bytes == 3000


def test_cap_evicts_least_recently_used_but_never_what_this_step_uses(store):
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20, 30)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20, 30))]
    store.get_or_build(LAYER, refs[0], build, merge)
    store.get_or_build(LAYER, refs[1], build, merge)
    store.begin_step()
    store.get_or_build(LAYER, refs[1], build, merge)  # used again this step
    store.get_or_build(LAYER, refs[2], build, merge)
    assert store.reserve(LAYER, [refs[2]], cap_bytes=8000)  # evicts refs[0] only
    assert store.peek_segment(LAYER, refs[0].key) is None
    assert store.stats.index["segments_evicted"] == 1 and len(store) == 2
    # Both remaining segments are in use now: a cap below them cannot be met by eviction, so the
    # request's own segments are dropped and the caller serves it exactly.
    assert not store.reserve(LAYER, [refs[2]], cap_bytes=4000)
    assert store.peek_segment(LAYER, refs[1].key) is not None  # in use by another request: kept
    assert store.peek_segment(LAYER, refs[2].key) is None
    assert store.stats.index["segments_evicted"] == 1


def test_with_a_cap_room_is_made_before_a_new_segment_is_stored(store):
    """The held bytes never pass the cap while older segments can be evicted: eviction comes
    first, so the peak gauge stays at the cap (4000 bytes per segment here)."""
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20, 30, 40)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20, 30, 40))]
    for r in refs:
        store.begin_step()  # each request in its own step: the older ones are evictable
        store.get_or_build(LAYER, r, build, merge, cap_bytes=8000)
        assert store.reserve(LAYER, [r], cap_bytes=8000)
    assert store.stats.held_bytes_peak == 8000
    assert store.stats.index["segments_evicted"] == 2 and len(store) == 2
    assert store.peek_segment(LAYER, refs[3].key) is not None and store.peek_segment(LAYER, refs[0].key) is None
    # Without the cap at build time, the store would hold three segments before reserve evicts one.
    other = IndexStore(Stats(), grow_step=256, active_steps=1)
    for r in refs[:3]:
        other.begin_step()
        other.get_or_build(LAYER, r, build, merge)
        other.reserve(LAYER, [r], cap_bytes=8000)
    assert other.stats.held_bytes_peak == 12000


def test_a_segment_that_cannot_fit_beside_the_ones_in_use_is_not_kept(store):
    """Every held segment is in use this step and a new one would pass the cap: it is not stored
    (get_or_build returns None, the caller serves that request exactly), so the store never holds
    more than the cap."""
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20, 30)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20, 30))]
    assert store.get_or_build(LAYER, refs[0], build, merge, cap_bytes=8000) is not None
    assert store.get_or_build(LAYER, refs[1], build, merge, cap_bytes=8000) is not None
    assert store.get_or_build(LAYER, refs[2], build, merge, cap_bytes=8000) is None
    # refused before it was built: the layer's segments so far take 4000 bytes for 252 tokens
    assert store.stats.index["segments_refused"] == 1 and store.stats.index["segments_built"] == 2
    assert store.stats.held_bytes_peak == 8000 and len(store) == 2
    store.begin_step()  # next step the older ones are evictable again
    assert store.get_or_build(LAYER, refs[2], build, merge, cap_bytes=8000) is not None
    assert store.stats.index["segments_built"] == 3 and store.stats.held_bytes_peak == 8000


def counting(fn):
    """``fn``, counting its calls in ``.calls``."""
    def wrapped(*args):
        wrapped.calls += 1
        return fn(*args)
    wrapped.calls = 0
    return wrapped


def test_a_segment_that_cannot_fit_is_not_built_step_after_step(store):
    """A store full of segments in use refuses a new one before building it, every step it stays
    full; the first segment of a layer is built to learn its size, as is one whose owner differs."""
    builds = counting(build)
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20, 30)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20, 30))]
    for _ in range(5):
        store.begin_step()
        assert store.get_or_build(LAYER, refs[0], builds, merge, cap_bytes=8000) is not None
        assert store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=8000) is not None
        assert store.get_or_build(LAYER, refs[2], builds, merge, cap_bytes=8000) is None
    assert builds.calls == 2 and store.stats.index["segments_refused"] == 5
    # another layer has no segment yet: its first one is built (and refused: the cap is shared)
    assert store.get_or_build("other", refs[2], builds, merge, cap_bytes=8000) is None
    assert builds.calls == 3 and store.stats.index["segments_refused"] == 6
    # without a cap nothing is refused
    assert store.get_or_build(LAYER, refs[2], builds, merge) is not None and builds.calls == 4


def test_a_growth_is_checked_for_room_for_its_new_tokens_only(store):
    """Growing a segment by merging needs room for the new tokens (the base makes way); where even
    that is not there, nothing is built."""
    builds = counting(build)
    spec = store.new_centre((1, 2), 4, 256)
    other = store.new_centre((7, 8), 4, 256)
    base = ref(spec.cid, 0, 256, (1, 2), first=4)
    grown = ref(spec.cid, 0, 512, (1, 2, 3, 4), first=4)
    assert store.get_or_build(LAYER, ref(other.cid, 0, 256, (7, 8)), builds, merge, cap_bytes=12000) is not None
    assert store.get_or_build(LAYER, base, builds, merge, cap_bytes=12000) is not None  # 2 x 4000 held
    store.begin_step()
    store.get_segment(LAYER, ref(other.cid, 0, 256, (7, 8)).key)  # in use this step: not evictable
    seg = store.get_or_build(LAYER, grown, builds, merge, cap_bytes=12000)  # +256 tokens: ~4000 more fits
    assert seg is not None and seg.tokens == (4, 512) and builds.calls == 3
    assert store.peek_segment(LAYER, base.key) is None  # the base made way
    store.begin_step()
    store.get_segment(LAYER, ref(other.cid, 0, 256, (7, 8)).key)
    store.get_segment(LAYER, grown.key)
    longer = ref(spec.cid, 0, 768, (1, 2, 3, 4, 5, 6), first=4)
    assert store.get_or_build(LAYER, longer, builds, merge, cap_bytes=12000) is None  # 12000 held, all in use
    assert builds.calls == 3 and store.stats.index["segments_refused"] == 1


def test_clear_keeps_the_counters(store):
    spec = store.new_centre((1, 2), 4, 256)
    store.get_or_build(LAYER, ref(spec.cid, 0, 256, (1, 2), first=4), build, merge)
    store.clear()
    assert len(store) == 0 and store.find_centre([1, 2]) is None
    assert store.stats.index["segments_built"] == 1 and store.stats.index["segments_live"] == 0


def test_centre_ids_are_never_reused_after_a_clear(store):
    """Budget mode keys each request's (K, L) by its centre id: a prompt after a clear must get a new id."""
    first = store.new_centre((1, 2), 4, 256)
    store.clear()
    assert store.new_centre((3, 4), 4, 256).cid > first.cid


# --------------------------------------------------------------------------- keys


def test_a_segment_key_equals_and_hashes_as_its_plain_tuple():
    blocks = tuple(range(1000, 1128))
    key = SegmentKey(3, 0, 16384, blocks)
    plain = (3, 0, 16384, blocks)
    assert key == plain and hash(key) == hash(plain)
    assert {plain: 1}[key] == 1 and {key: 2}[plain] == 2
    assert SegmentKey(3, 0, 16384, blocks[:-1] + (7,)) != key


def test_the_store_hands_out_the_key_object_its_segments_are_held_under(store):
    """So a layer's lookup of a planned key compares by identity; a key no layer holds any more is
    not handed out (the table would otherwise grow with every prompt ever served)."""
    blocks = (5, 6, 7, 8)
    held = SegmentKey(1, 0, 256, blocks)
    fresh = SegmentKey(1, 0, 256, blocks)
    assert store.canonical_key(fresh) is fresh  # nothing held yet
    store.get_or_build(LAYER, SegmentRef(held, 4), build, merge)
    store.get_or_build(OTHER, SegmentRef(held, 4), build, merge)
    assert store.canonical_key(fresh) is held
    assert store.get_segment(LAYER, fresh) is store.get_segment(LAYER, held) is not None
    store.drop_segment(LAYER, held)
    assert store.canonical_key(fresh) is held  # the other layer still holds it
    store.drop_segment(OTHER, held)
    assert store.canonical_key(fresh) is fresh
    assert store._canonical == {}


def test_segments_of_requests_still_decoding_are_not_evicted_for_another_request():
    """Two requests decoding together whose segments do not both fit: under the default window the
    first keeps its segment and is sampled every step, the second is refused without a build; once
    the first stops for ACTIVE_STEPS steps, its segment makes way. (Evicting the least recently used
    instead rebuilt and evicted the two in turn, one build a step.)"""
    store = IndexStore(Stats(), grow_step=256)
    assert store.active_steps == ACTIVE_STEPS
    builds = counting(build)
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20))]
    for _ in range(3 * ACTIVE_STEPS):
        store.begin_step()
        assert store.get_or_build(LAYER, refs[0], builds, merge, cap_bytes=6000) is not None
        assert store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=6000) is None
    assert builds.calls == 1 and store.stats.index["segments_evicted"] == 0
    for step in range(ACTIVE_STEPS):  # the first request has finished
        store.begin_step()
        got = store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=6000)
        assert (got is not None) == (step == ACTIVE_STEPS - 1), step
    assert builds.calls == 2 and store.stats.index["segments_evicted"] == 1
    # At the start of a step nothing has been used in it yet: with a one-step window the background
    # indexer's install of another prompt evicted a request decoding since the step before (whose
    # layers then rebuilt it, evicting others in turn); with the default window it is refused.
    for window, evicts in ((1, True), (ACTIVE_STEPS, False)):
        s = IndexStore(Stats(), grow_step=256, active_steps=window)
        s.begin_step()
        assert s.get_or_build(LAYER, refs[0], build, merge, cap_bytes=6000) is not None
        s.begin_step()
        assert (s.install(LAYER, refs[1], build(refs[1]), cap_bytes=6000) is not None) == evicts
        assert (s.peek_segment(LAYER, refs[0].key) is None) == evicts


# --------------------------------------------------------------------------- planning under the cap


def test_idle_room_is_the_cap_less_the_segments_in_use_and_evicts_nothing(store):
    specs = [store.new_centre((b, b + 1), 4, 256) for b in (10, 20, 30)]
    owner = segment_owner(LAYER, 10, 150)
    assert store.prompt_bytes_per_token(10, 150) is None  # nothing built yet
    store.get_or_build(owner, ref(specs[0].cid, 0, 256, (10, 11), first=4), build, merge)
    store.begin_step()
    store.get_or_build(owner, ref(specs[1].cid, 0, 256, (20, 21), first=4), build, merge)
    store.get_or_build(segment_owner(OTHER, 10, 150), ref(specs[2].cid, 0, 256, (30, 31), first=4), build, merge)
    # in use this step (active_steps=1): the second and third (4000 bytes each); the first is idle
    assert store.idle_room(20000) == 12000 and len(store) == 3
    # two layers' segments of 252 tokens, 4000 bytes each; another (K, L) has none
    assert store.prompt_bytes_per_token(10, 150) == pytest.approx(2 * 4000 / 252)
    assert store.prompt_bytes_per_token(8, 150) is None


def test_a_new_prompt_whose_index_would_not_fit_is_planned_exact_until_there_is_room():
    """Beside a request whose segments fill the cap, a new prompt is served exactly as ``evicted``
    without a build (the layers would build and refuse it, or MAGICPIG's kernel attend it exactly);
    once that request has stopped for ``active_steps`` steps, it is planned sparse. Two new prompts
    in one step are admitted while the room lasts."""
    from vllm_magicpig.config import MagicPigConfig
    from vllm_magicpig.planner import StepPlanner, StepSettings

    from helpers import FakeCam

    cfg = MagicPigConfig(min_sparse_context=256, local_window=32, segment_tokens=64)
    settings = StepSettings.from_config(cfg)
    owner = segment_owner(LAYER, cfg.K, cfg.L)
    index = IndexStore(Stats(), cfg.segment_tokens, active_steps=2)
    planner = StepPlanner(cfg, 16, index, cap_bytes=6000)  # one request's 4000-byte segment fits, not two
    tables = {name: torch.arange(i * 64, (i + 1) * 64, dtype=torch.int32) for i, name in enumerate("ABC")}

    def step(names):
        planner.observe_step(FakeCam(torch.tensor([1000] * len(names), dtype=torch.int32), None), len(names))
        cam = FakeCam(torch.tensor([1000] * len(names), dtype=torch.int32), torch.stack([tables[n] for n in names]))
        plan = planner.plan(cam, len(names), settings)
        for r in plan.sparse:  # the sparse layer: find or build the planned segments
            for seg_ref in plan.segments[r]:
                assert index.get_or_build(owner, seg_ref, build, merge, cap_bytes=6000) is not None
        return {names[r]: plan.exact_reason.get(r, "sampled") for r in range(len(names))}

    assert step("A") == {"A": "sampled"}
    built = index.stats.index["segments_built"]
    for _ in range(3):
        assert step("AB") == {"A": "sampled", "B": "evicted"}
    assert index.stats.index["segments_built"] == built and index.stats.index["segments_refused"] == 0
    assert step("B") == {"B": "evicted"}  # A's segment is still in its window
    assert step("B") == {"B": "sampled"}  # now idle: B's build evicts it
    assert index.stats.index["segments_evicted"] == 1
    assert step("BC") == {"B": "sampled", "C": "evicted"}
    for _ in range(2):  # B has finished too: nothing in use
        index.begin_step()
    assert step("CA") == {"C": "sampled", "A": "evicted"}  # room for one of two new prompts: the first
