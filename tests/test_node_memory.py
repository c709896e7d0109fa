"""node_memory.py: the index grows only while its memory node keeps ``node_reserve_mb`` free.

The guard's arithmetic; the store refusing a build the node cannot hold (and evicting idle segments
to make room, as under the cap) on stand-in segments and a stand-in node; the planner and the layer
serving such requests exactly with the reason ``node_memory_low`` at the vLLM seam (no engine); and
end to end, an engine whose node runs short mid-serve (memory taken by this test's process, as
another engine on the node would) serving exactly, then sampling once the memory is back.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import make_llm, stats
from tests.test_backend_unit import BatchSpec, harness, rel_err, vllm_env  # noqa: F401
from tests.test_index import build, merge, ref
from vllm_magicpig.index import REFUSED_CAP, REFUSED_NODE_MEMORY, IndexStore
from vllm_magicpig.node_memory import NodeMemoryGuard
from vllm_magicpig.stats import Stats

MIB, GIB = 2**20, 2**30
LAYER = "model.layers.1.self_attn.attn"


class Node:
    """A stand-in memory node beside one store: what the store's segments took stays taken (freed,
    it waits in the pool) until given back; ``other`` is what other processes hold."""

    def __init__(self, capacity: int, store: IndexStore) -> None:
        self.capacity, self.store = capacity, store
        self.other = self.taken = self.gave_back = 0

    def available(self) -> int:
        self.taken = max(self.taken, self.store.held_bytes())
        return self.capacity - self.other - self.taken

    def give_back(self) -> None:
        self.taken = self.store.held_bytes()
        self.gave_back += 1


RESERVE = 10_000


def guarded_store(free_above_reserve: int) -> tuple[IndexStore, Node]:
    store = IndexStore(Stats(), grow_step=256, active_steps=1)
    node = Node(RESERVE + free_above_reserve, store)
    store.node_guard = NodeMemoryGuard(RESERVE, node.available, node.give_back)
    return store, node


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, r):
        self.calls += 1
        return build(r)  # 4,000 bytes a segment, whatever its tokens


def refs_for(store: IndexStore, n: int) -> list:
    cids = [store.new_centre((10 * i, 10 * i + 1), 4, 256).cid for i in range(1, n + 1)]
    return [ref(c, 0, 256, (10 * i, 10 * i + 1), first=4) for i, c in enumerate(cids, start=1)]


def test_the_room_is_the_free_memory_above_the_reserve_and_memory_held_unused_is_given_back_when_short():
    mem = {"free": 5 * GIB, "pooled": 300 * MIB}

    def give_back():
        mem["free"], mem["pooled"] = mem["free"] + mem["pooled"], 0

    guard = NodeMemoryGuard(512 * MIB, lambda: mem["free"], give_back)
    assert guard.room() == 5 * GIB - 512 * MIB and guard.last_available == 5 * GIB and guard.gave_back == 0
    mem["free"] = 100 * MIB  # short: the pool goes back to the node, which is read again
    assert guard.room() == 400 * MIB - 512 * MIB and guard.gave_back == 1 and mem["pooled"] == 0
    assert "0.39 GiB free" in guard.describe() and "node_reserve_mb (512 MiB)" in guard.describe()
    mem["free"] = 600 * MIB  # room for 88 MiB, not for 100: given back (nothing now) and read again
    assert guard.room(need=100 * MIB) == 88 * MIB and guard.gave_back == 2


def test_a_build_the_node_cannot_hold_is_refused_and_says_why():
    # room for two 4,000-byte segments and the second's build (its hash codes beside it: BUILD_PEAK)
    store, node = guarded_store(12000)
    builds, refs = Counting(), refs_for(store, 3)
    assert store.get_or_build(LAYER, refs[0], builds, merge) is not None
    assert store.get_or_build(LAYER, refs[1], builds, merge) is not None
    # both in use this step (active_steps=1); the node has no room for a third: not even built
    assert store.get_or_build(LAYER, refs[2], builds, merge) is None
    assert builds.calls == 2 and store.last_refusal == REFUSED_NODE_MEMORY and node.gave_back == 1
    idx = store.stats.index
    assert idx["segments_refused"] == 1 and idx["segments_refused_node_memory"] == 1
    assert store.held_bytes() == 8000  # what it held is kept
    node.other -= 4000  # another process freed memory
    assert store.get_or_build(LAYER, refs[2], builds, merge) is not None and builds.calls == 3


def test_idle_segments_are_evicted_and_their_memory_given_back_for_a_build_the_node_is_short_for():
    """The cap has room; the node has none. The idle segment's memory goes to the pool when it is
    evicted and back to the node before the build."""
    store, node = guarded_store(8000)
    builds, refs = Counting(), refs_for(store, 2)
    store.get_or_build(LAYER, refs[0], builds, merge)  # 4,000 left: a build takes twice its segment's bytes
    store.begin_step()
    store.begin_step()  # the first segment is idle
    seg = store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=1 << 30)
    assert seg is not None and store.peek_segment(LAYER, refs[0].key) is None
    assert store.stats.index["segments_evicted"] == 1 and store.held_bytes() == 4000
    assert node.available() - RESERVE == 4000 and node.gave_back >= 1  # the segment's memory went back


def grown_ref(cid: int):
    return ref(cid, 0, 512, (10, 11, 12, 13), first=4)


def test_a_growth_is_checked_for_the_merged_segment_made_beside_its_base():
    """A growth builds its new tokens, then merges them with the base into a new segment while the
    base is still held: the node must hold the part and the whole merged segment, not the part's
    build alone. Here 4,000 bytes a 252-token segment (15.9 a token): the part's build (2 x 256
    tokens) takes 8,127, the growth's peak (256 + 512 tokens) 12,190; the node has 10,000."""
    store = IndexStore(Stats(), grow_step=256, active_steps=2)
    node = Node(RESERVE + 14000, store)
    store.node_guard = NodeMemoryGuard(RESERVE, node.available, node.give_back)
    builds, (base_ref,) = Counting(), refs_for(store, 1)
    assert store.get_or_build(LAYER, base_ref, builds, merge) is not None
    store.begin_step()  # the base is still in use (active_steps=2): it cannot make way
    grown = grown_ref(base_ref.key[0])
    assert store.get_or_build(LAYER, grown, builds, merge) is None
    assert store.last_refusal == REFUSED_NODE_MEMORY and builds.calls == 1
    node.other -= 2200  # room for the merge
    seg = store.get_or_build(LAYER, grown, builds, merge)
    assert seg is not None and seg.tokens == (4, 512) and store.stats.index["segments_merged"] == 1
    assert store.peek_segment(LAYER, base_ref.key) is None  # the base is replaced


def test_before_any_build_a_node_already_short_refuses_it():
    """The layer's bytes a token are unknown until one segment is built: it is built to see, unless
    the node is at its reserve already."""
    store, node = guarded_store(0)
    builds, (r,) = Counting(), refs_for(store, 1)
    assert store.get_or_build(LAYER, r, builds, merge) is None and builds.calls == 0
    assert store.last_refusal == REFUSED_NODE_MEMORY
    node.capacity += 1
    assert store.get_or_build(LAYER, r, builds, merge) is not None and builds.calls == 1


def test_a_refusal_under_the_cap_is_named_for_the_cap():
    store, node = guarded_store(100 * GIB)
    builds, refs = Counting(), refs_for(store, 2)
    assert store.get_or_build(LAYER, refs[0], builds, merge, cap_bytes=6000) is not None
    assert store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=6000) is None
    assert store.last_refusal == REFUSED_CAP and "segments_refused_node_memory" not in store.stats.index


def test_without_a_guard_the_node_is_not_read():
    store = IndexStore(Stats(), grow_step=256, active_steps=1)
    assert store.node_guard is None and store.make_node_room(1 << 60)
    (r,) = refs_for(store, 1)
    assert store.get_or_build(LAYER, r, build, merge) is not None


def test_the_worker_runtime_guards_its_index_with_the_configured_reserve(vllm_env):  # noqa: F811
    from vllm_magicpig.host_memory import node_available_bytes

    h = harness(vllm_env, BatchSpec([3000], [1]), node_reserve_mb=777)
    guard = h.runtime.index.node_guard
    assert guard is not None and guard.reserve_bytes == 777 * MIB
    assert abs(guard.room() + 777 * MIB - node_available_bytes()) < 256 * MIB  # this node, read now


def test_giving_memory_back_empties_the_segment_pool(vllm_env):  # noqa: F811
    """The worker's give-back unmaps the pool's regions (and trims the C allocator), then keeps
    freed regions again within the cap."""
    h = harness(vllm_env, BatchSpec([3000], [1]), K=1, L=64)
    h.step()
    ops = h.runtime.ops
    h.runtime.index.clear()  # the segment's regions go to the pool
    assert ops.memory_pool_stats()["pooled_bytes"] > 0
    limit = ops._kernel.huge_pool_stats()["limit_bytes"]
    h.runtime.index.node_guard._give_back()
    assert ops.memory_pool_stats()["pooled_bytes"] == 0
    assert ops._kernel.huge_pool_stats()["limit_bytes"] == limit


# --------------------------------------------------------------------------- at the vLLM seam


def _short_node(h, free_above_reserve: int) -> Node:
    """Give the harness's index a stand-in node with ``free_above_reserve`` bytes over its reserve."""
    index = h.runtime.index
    reserve = index.node_guard.reserve_bytes
    node = Node(reserve + free_above_reserve, index)
    index.node_guard = NodeMemoryGuard(reserve, node.available, node.give_back)
    return node


def test_a_new_prompt_is_served_exactly_while_its_node_is_short_then_sampled(vllm_env):  # noqa: F811
    h = harness(vllm_env, BatchSpec([3000], [1]), K=1, L=64)
    node = _short_node(h, -1)
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "node_memory_low"} and meta.sparse_plan.sparse == []
    assert torch.equal(out, ref_out)  # the platform kernel served it
    st = h.stats()
    assert st["decode_exact"] == {"node_memory_low": 1} and st["decode_sparse"] == 0, st
    assert st["index"].get("segments_built", 0) == 0, st
    node.capacity += 1 * GIB
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["decode_sparse"] == 1
    assert rel_err(out[0], ref_out[0]) < 2e-2


def test_a_layer_whose_node_runs_short_serves_that_request_exactly_and_says_why(vllm_env):  # noqa: F811
    """Two new prompts in one step, room on the node for one: the planner admits both (nothing built
    yet to size them by), the layer builds the first, learns its bytes a token, and refuses the
    second, which the same call attends exactly."""
    h = harness(vllm_env, BatchSpec([3000, 2600], [1, 1]), K=1, L=64)
    _short_node(h, 1 * MIB)  # ~1.2 KB a token here: the first is built to see, the second (3 MB) does not fit
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.sparse == [0, 1]  # planned sparse
    st = h.stats()
    assert st["decode_sparse"] == 1 and st["decode_exact"] == {"node_memory_low": 1}, st
    assert st["index"]["segments_refused_node_memory"] == 1 and st["index"]["segments_built"] == 1, st
    for r in range(2):
        assert rel_err(out[r], ref_out[r]) < 2e-2, r
    # the next step, the planner knows the bytes a token and serves it by the platform kernel instead
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {1: "node_memory_low"}, meta.sparse_plan.exact_reason


def test_a_background_job_stops_where_the_node_runs_short_and_its_prompt_is_served_exactly(vllm_env):  # noqa: F811
    """The planner admits a new prompt with room on the node; by the time its job builds, another
    engine has taken it: the job stops before the layer, keeps nothing, and the prompt is served
    exactly (``node_memory_low``) until there is room, then indexed again and sampled."""
    from tests.test_background_index import _prefilled

    h = _prefilled(vllm_env, [3000])  # jobs run inline, at submission
    node = _short_node(h, 1 * GIB)
    readings = iter([node.available()])  # the planner's reading; the job's are the next ones
    guard = h.runtime.index.node_guard
    guard._available = lambda: next(readings, guard.reserve_bytes - 1)
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}
    out, ref_out, meta = h.step()  # the job is collected: it built nothing
    assert meta.sparse_plan.exact_reason == {0: "node_memory_low"}, meta.sparse_plan.exact_reason
    assert torch.equal(out, ref_out)
    st = h.stats()
    assert st["index"]["background_refused_node_memory"] == 1 and st["index"].get("segments_built", 0) == 0, st
    assert st["index_bytes"] == 0, st
    guard._available = node.available  # memory is back
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}  # submitted again
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 1
    assert rel_err(out[0], ref_out[0]) < 2e-2


def test_a_background_job_stops_before_a_layer_whose_build_the_node_cannot_hold(vllm_env):  # noqa: F811
    """Once a layer's bytes a token are known, a job checks for its next layer's whole build (the
    segments and their hash codes beside them), not just for free memory above the reserve."""
    from tests.test_backend_unit import SPARSE_LAYER
    from tests.test_background_index import _prefilled
    from vllm_magicpig.index import segment_owner

    h = _prefilled(vllm_env, [3000, 2900])
    node = _short_node(h, 1 * GIB)
    h.spec = BatchSpec([3000], [1])
    h.step()
    _, _, meta = h.step()
    assert meta.sparse_plan.sparse == [0]  # the first prompt indexed: the layer's size is known
    layer_build = h.runtime.index.build_need(segment_owner(SPARSE_LAYER, 1, 64), 2000)
    guard = h.runtime.index.node_guard
    readings = iter([node.available()])  # the planner's; the job's then see room for half a build
    guard._available = lambda: next(readings, guard.reserve_bytes + layer_build // 2)
    h.spec = BatchSpec([3000, 2900], [1, 1])
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {1: "indexing"}
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and meta.sparse_plan.exact_reason == {1: "node_memory_low"}
    st = h.stats()
    assert st["index"]["background_refused_node_memory"] == 1 and st["index"]["background_installed"] == 1, st
    assert rel_err(out[0], ref_out[0]) < 2e-2 and rel_err(out[1], ref_out[1]) < 1e-2


# --------------------------------------------------------------------------- end to end


def _take_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of this process's memory, touched (pages faulted), as another engine's would be."""
    held = torch.empty(nbytes, dtype=torch.uint8)
    held.fill_(1)
    return held


@pytest.mark.e2e
def test_an_engine_whose_node_runs_short_serves_exactly_then_samples_when_memory_is_back(model_path):
    """The engine starts with room (a 2 GiB KV cache, a 4 GiB reserve); then this process takes the
    node's free memory down to 2.5 GiB, below the reserve, as a second engine on the node indexing
    its prompts would. A new prompt is served exactly (``node_memory_low``: nothing built, nothing
    sampled); once the memory is freed, the next is sampled."""
    from vllm import SamplingParams

    from vllm_magicpig import passkey
    from vllm_magicpig.host_memory import node_available_bytes

    reserve_mb = 4096
    llm = make_llm(model_path, magicpig={"node_reserve_mb": reserve_mb})
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [passkey.build(tok, 2000, seed=seed, depth=0.5).text for seed in (1, 2, 3)]

    def sampled_decodes_and_reasons():
        st = stats(llm)
        return st["decode_sparse"], st["decode_exact"].get("node_memory_low", 0), st["index"].get("segments_built", 0)

    llm.generate([prompts[0]], params, use_tqdm=False)  # the layers learn their bytes a token
    sparse0, low0, built0 = sampled_decodes_and_reasons()
    assert sparse0 > 0 and low0 == 0 and built0 > 0
    held = _take_memory(max(0, node_available_bytes() - int(2.5 * GIB)))
    try:
        llm.generate([prompts[1]], params, use_tqdm=False)
        sparse1, low1, built1 = sampled_decodes_and_reasons()
    finally:
        del held
    assert sparse1 == sparse0 and built1 == built0, (sparse0, sparse1, built0, built1)
    assert low1 >= 7 * 28, low1  # every sparse layer of the decodes after the first token
    llm.generate([prompts[2]], params, use_tqdm=False)
    sparse2, low2, built2 = sampled_decodes_and_reasons()
    assert sparse2 > sparse1 and built2 > built1 and low2 == low1
