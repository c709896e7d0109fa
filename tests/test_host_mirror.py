"""The host mirror of an accelerator's KV cache (vllm_magicpig/host_mirror.py), run on the CPU.

The cache is a CPU tensor in FLASH_ATTN's layout; the copy engine is ``SyncCopyEngine`` or
``HeldCopies``, a STAND-IN for the CUDA side stream whose copies complete only when the test says
so (what a copy still in flight looks like to the planner). The split decode's exact part is
``helpers.paged_attention_with_lse``, a STAND-IN for FLASH_ATTN.
"""
from __future__ import annotations

import pytest
import torch

from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.host_mirror import HostMirror, SyncCopyEngine
from vllm_magicpig.index import IndexStore
from vllm_magicpig.kv_layout import FlashLayout, gather
from vllm_magicpig.layer import SparseLayer
from vllm_magicpig.planner import StepPlanner
from vllm_magicpig.stats import Stats

from helpers import FakeCam, paged_attention_with_lse, to_paged

D, HKV, G, BS = 64, 2, 2, 16
H = HKV * G
SEED = 2468
LAYERS = ["model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class HeldCopies(SyncCopyEngine):
    """STAND-IN for the CUDA copy engine: copies the data at once, but reports each copy complete
    only after :meth:`complete`; records what the device was told to wait for."""

    def __init__(self) -> None:
        self.events: list[_Event] = []
        self.waited: list[_Event] = []

    def copy_blocks(self, kv, blocks, dst_k, dst_v):
        super().copy_blocks(kv, blocks, dst_k, dst_v)
        self.events.append(_Event())
        return self.events[-1]

    def complete(self) -> None:
        for e in self.events:
            e.done = True

    def order_after(self, event):
        self.waited.append(event)


def _cache(lens, gen):
    ctx = [((torch.randn(n, HKV, D, generator=gen) + 1.0).bfloat16(), torch.randn(n, HKV, D, generator=gen).bfloat16())
           for n in lens]
    _, _, table, cache = to_paged(ctx, BS, spare_blocks=4, generator=gen, layout=FlashLayout())
    return ctx, table, cache


def _prefill_slots(table, r, s):
    """The slots a prefill of request r's first s tokens writes."""
    pos = torch.arange(s)
    return table[r].long()[pos // BS] * BS + pos % BS


def test_completed_blocks_are_staged_per_layer_with_the_cache_rows():
    g = torch.Generator().manual_seed(SEED)
    ctx, table, cache = _cache([100], g)
    kv = FlashLayout().views(cache)
    mirror = HostMirror(SyncCopyEngine(), Stats(), max_bytes=2**30)
    row = table[0].tolist()
    full = row[: 100 // BS]  # 6 full blocks; the 7th (4 tokens) is not complete
    slots = _prefill_slots(table, 0, 100)
    mirror.begin_step(torch.unique(slots // BS).tolist(), torch.unique(slots[slots % BS == BS - 1] // BS).tolist())
    for layer in LAYERS:
        mirror.copy_layer(layer, kv)
    mirror.begin_step([], [])  # next step: the copies have completed
    assert mirror.ready_blocks(row) == 6
    for layer in LAYERS:
        k, v = mirror.rows(layer, tuple(full), 5, 90)
        assert torch.equal(k, gather(kv.key, tuple(full), 5, 90)) and torch.equal(v, ctx[0][1][5:90])
    assert mirror.staged_bytes == 2 * 6 * 2 * BS * HKV * D * 2
    assert mirror.stats.index["blocks_mirrored"] == 12
    mirror.release(LAYERS[0], tuple(full))
    assert mirror.rows(LAYERS[0], tuple(full), 0, 16) is None and mirror.rows(LAYERS[1], tuple(full), 0, 16) is not None
    assert mirror.staged_bytes == 6 * 2 * BS * HKV * D * 2


def test_a_write_into_a_block_drops_its_rows_and_waits_for_its_copy():
    g = torch.Generator().manual_seed(SEED + 1)
    _, table, cache = _cache([64], g)
    kv = FlashLayout().views(cache)
    engine = HeldCopies()
    mirror = HostMirror(engine, Stats(), max_bytes=2**30)
    row = table[0].tolist()[:4]
    mirror.begin_step(row, row)
    mirror.copy_layer(LAYERS[0], kv)
    # vLLM freed block row[2] and reuses it while its copy is in flight
    mirror.begin_step([row[2]], [])
    assert engine.waited == [engine.events[0]]  # the device write is ordered after the copy
    engine.complete()
    mirror.begin_step([], [])
    assert mirror.ready_blocks(row) == 2  # row[2] lost its mirror
    assert mirror.rows(LAYERS[0], tuple(row[:2]), 0, 32) is not None
    assert mirror.rows(LAYERS[0], tuple(row[2:3]), 0, 16) is None


def test_staging_is_bounded_and_oldest_rows_go_first():
    g = torch.Generator().manual_seed(SEED + 2)
    _, table, cache = _cache([128], g)
    kv = FlashLayout().views(cache)
    slot = 2 * BS * HKV * D * 2
    mirror = HostMirror(SyncCopyEngine(), Stats(), max_bytes=5 * slot)
    row = table[0].tolist()[:8]
    mirror.begin_step(row[:4], row[:4])
    mirror.copy_layer(LAYERS[0], kv)
    mirror.begin_step(row[4:], row[4:])
    mirror.copy_layer(LAYERS[0], kv)  # 4 more: 3 of the first step's make room
    assert mirror.staged_bytes == 5 * slot
    first = sorted(row[:4])  # a step's blocks are staged in block order
    for b in first[:3]:
        assert mirror.rows(LAYERS[0], (b,), 0, 16) is None
    assert mirror.rows(LAYERS[0], tuple(first[3:] + row[4:]), 0, 80) is not None
    assert mirror.stats.index["staging_misses"] == 3


def _planner(cfg, mirror):
    from vllm_magicpig.index import IndexStore

    return StepPlanner(cfg, BS, IndexStore(Stats(), cfg.segment_tokens), mirror)


def test_blocks_in_flight_stay_in_the_exact_tail_until_their_copy_completes():
    g = torch.Generator().manual_seed(SEED + 3)
    cfg = MagicPigConfig(sink_tokens=BS, local_window=32, segment_tokens=64, min_sparse_context=256)
    _, table, cache = _cache([700], g)
    kv = FlashLayout().views(cache)
    engine = HeldCopies()
    mirror = HostMirror(engine, Stats(), max_bytes=2**30)
    planner = _planner(cfg, mirror)
    seq = torch.tensor([699], dtype=torch.int32)
    slots = _prefill_slots(table, 0, 699)
    planner.observe_step(FakeCam(seq, table, slot_mapping=slots, num_reqs=1), 0)  # the prefill step
    mirror.copy_layer(LAYERS[0], kv)
    from vllm_magicpig.planner import StepSettings

    st = StepSettings.from_config(cfg)
    seq = torch.tensor([700], dtype=torch.int32)
    decode_slot = _prefill_slots(table, 0, 700)[-1:]
    planner.observe_step(FakeCam(seq, table, slot_mapping=decode_slot), 1)
    plan = planner.plan(FakeCam(seq, table, slot_mapping=decode_slot), 1, st)
    assert plan.sparse == [] and plan.exact_reason == {0: "not_mirrored"}  # nothing waited for
    engine.complete()
    planner.observe_step(FakeCam(seq, table, slot_mapping=decode_slot), 1)
    plan = planner.plan(FakeCam(seq, table, slot_mapping=decode_slot), 1, st)
    assert plan.sparse == [0]
    # what the CPU platform covers: the prompt to its last full block before the local window
    assert plan.covered_range(0) == (BS, ((700 - 32) // BS) * BS)


def test_a_request_on_unmirrored_blocks_gets_them_copied():
    """A prefix-cache hit on blocks never mirrored (or dropped since): the planner asks for them,
    the next forward copies them, and the step after covers them."""
    g = torch.Generator().manual_seed(SEED + 4)
    cfg = MagicPigConfig(sink_tokens=BS, local_window=32, segment_tokens=64, min_sparse_context=256)
    _, table, cache = _cache([500], g)
    kv = FlashLayout().views(cache)
    mirror = HostMirror(SyncCopyEngine(), Stats(), max_bytes=2**30)
    planner = _planner(cfg, mirror)
    from vllm_magicpig.planner import StepSettings

    st = StepSettings.from_config(cfg)
    seq = torch.tensor([500], dtype=torch.int32)
    slot = _prefill_slots(table, 0, 500)[-1:]
    planner.observe_step(FakeCam(seq, table, slot_mapping=slot), 1)
    plan = planner.plan(FakeCam(seq, table, slot_mapping=slot), 1, st)
    assert plan.exact_reason == {0: "not_mirrored"}
    mirror.copy_layer(LAYERS[0], kv)
    assert mirror.stats.index["blocks_mirrored"] == (500 - 32) // BS  # the blocks before the local window
    planner.observe_step(FakeCam(seq, table, slot_mapping=slot), 1)
    assert planner.plan(FakeCam(seq, table, slot_mapping=slot), 1, st).sparse == [0]


@pytest.mark.parametrize("staging_mb", [64, 0], ids=["staged", "staging_full"])
def test_split_decode_through_the_mirror_equals_the_device_gather(staging_mb):
    """Segments built from staged host rows give the same output as segments built from rows
    gathered off the device at the first decode; staged rows are freed once built. With no room
    to stage, the build falls back to the device gather."""
    pytest.importorskip("vllm")
    from vllm_magicpig.backend_cuda import make_cuda_runtime

    g = torch.Generator().manual_seed(SEED + 5)
    cfg = MagicPigConfig(local_window=32, segment_tokens=64, min_sparse_context=256)
    lens = [900, 600]
    ctx, table, cache = _cache(lens, g)
    q = torch.randn(2, H, D, generator=g).bfloat16()
    outs = []
    for mirrored in (True, False):
        rt = make_cuda_runtime(cfg, num_layers=4, block_size=BS, dense_attention=paged_attention_with_lse,
                               mirror_engine=SyncCopyEngine())
        rt.mirror.max_bytes = staging_mb * 2**20
        planner = StepPlanner(rt.cfg, BS, rt.index, rt.mirror if mirrored else None)
        layer = SparseLayer(LayerContext(LAYERS[0], 1, H, HKV, D, D**-0.5, rt))
        kv = FlashLayout().views(cache)
        if mirrored:  # the prefill steps: every prompt block written and completed, then copied
            slots = torch.cat([_prefill_slots(table, r, s - 1) for r, s in enumerate(lens)])
            planner.observe_step(FakeCam(torch.tensor([s - 1 for s in lens], dtype=torch.int32), table,
                                         slot_mapping=slots), 0)
            rt.mirror.copy_layer(LAYERS[0], kv)
        seq = torch.tensor(lens, dtype=torch.int32)
        slots = torch.cat([_prefill_slots(table, r, s)[-1:] for r, s in enumerate(lens)])
        cam = FakeCam(seq, table, slot_mapping=slots)
        planner.observe_step(cam, 2)
        plan = planner.plan(cam, 2, rt.step_settings())
        assert plan.sparse == [0, 1], plan.exact_reason
        out = torch.empty_like(q)
        layer.forward(q, layer.begin(cache, plan), plan, out)
        outs.append(out)
        if mirrored:
            misses = rt.stats.index["staging_misses"]
            assert misses == (0 if staging_mb else 2), rt.stats.index  # one per segment built
            if staging_mb:
                # the two prompts' covered blocks were built and released; the prompt tails stay staged
                tail_blocks = sum(-(-(s - 1) // BS) - 1 - (s - 32) // BS for s in lens)
                assert rt.mirror.staged_bytes == tail_blocks * 2 * BS * HKV * D * 2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("tokens", [5, 64, 65, 700])
def test_a_steps_written_and_completed_blocks_are_the_same_on_both_paths(monkeypatch, tokens):
    """observe_step finds the blocks a step writes (and completes) in Python for small steps and
    with torch for large ones: the same lists either way, padding slots (-1) ignored."""
    from vllm_magicpig import planner as planner_mod

    gen = torch.Generator().manual_seed(tokens)
    slots = torch.randint(0, 40 * BS, (tokens,), generator=gen)
    slots[:: 7] = -1
    slots[1] = 3 * BS + BS - 1  # the last slot of block 3: completes it
    seen = {}
    for small_step in (0, 10_000):
        monkeypatch.setattr(planner_mod, "SMALL_STEP", small_step)
        calls, written = [], []

        class Mirror:
            def __init__(self, calls):
                self.calls = calls

            def begin_step(self, written, completed):
                self.calls.append((list(written), list(completed)))

        cfg = MagicPigConfig()
        index = IndexStore(Stats(), cfg.segment_tokens)
        monkeypatch.setattr(index, "on_blocks_written", written.append)
        p = StepPlanner(cfg, BS, index, Mirror(calls))
        p.observe_step(FakeCam(torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32), slots, num_reqs=1), 1)
        seen[small_step] = (written, calls)
    assert seen[0] == seen[10_000]
    (w,), ((w2, completed),) = seen[0]
    assert w == w2 == sorted({s // BS for s in slots.tolist() if s >= 0}) and 3 in completed
