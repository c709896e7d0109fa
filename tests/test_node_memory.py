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
    """A stand-in memory node: free bytes and pooled bytes the test sets."""

    def __init__(self, free: int, pooled: int = 0) -> None:
        self.free, self.pooled = free, pooled


def guarded_store(node: Node, reserve: int = 10_000) -> IndexStore:
    store = IndexStore(Stats(), grow_step=256, active_steps=1)
    store.node_guard = NodeMemoryGuard(reserve, lambda: node.free, lambda: node.pooled)
    return store


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, r):
        self.calls += 1
        return build(r)  # 4,000 bytes a segment, whatever its tokens


def test_the_room_is_the_free_memory_above_the_reserve_plus_what_the_pool_holds():
    node = Node(free=5 * GIB, pooled=300 * MIB)
    guard = NodeMemoryGuard(512 * MIB, lambda: node.free, lambda: node.pooled)
    assert guard.room() == 5 * GIB - 512 * MIB + 300 * MIB and guard.last_available == 5 * GIB
    node.free, node.pooled = 100 * MIB, 0
    assert guard.room() == 100 * MIB - 512 * MIB  # short: negative
    assert "0.10 GiB free" in guard.describe() and "node_reserve_mb (512 MiB)" in guard.describe()


def test_a_build_the_node_cannot_hold_is_refused_and_says_why():
    node = Node(free=10_000 + 8000)  # room for two 4,000-byte segments
    store, builds = guarded_store(node), Counting()
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20, 30)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20, 30))]
    assert store.get_or_build(LAYER, refs[0], builds, merge) is not None
    node.free -= 4000  # the first segment's memory came from the node
    assert store.get_or_build(LAYER, refs[1], builds, merge) is not None
    node.free -= 4000
    # both in use this step (active_steps=1); the node has no room for a third: not even built
    assert store.get_or_build(LAYER, refs[2], builds, merge) is None
    assert builds.calls == 2 and store.last_refusal == REFUSED_NODE_MEMORY
    idx = store.stats.index
    assert idx["segments_refused"] == 1 and idx["segments_refused_node_memory"] == 1
    assert store.held_bytes() == 8000  # what it held is kept
    node.free += 4000  # another process gave memory back
    assert store.get_or_build(LAYER, refs[2], builds, merge) is not None and builds.calls == 3


def test_idle_segments_make_way_for_a_build_the_node_is_short_for():
    """An idle segment's memory goes to the pool and the next build reuses it: the store evicts it
    as it would under the cap, though the cap itself has room."""
    node = Node(free=10_000 + 4000)
    store, builds = guarded_store(node), Counting()
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20))]
    store.get_or_build(LAYER, refs[0], builds, merge)
    node.free -= 4000  # at the reserve now
    store.begin_step()
    store.begin_step()  # the first segment is idle
    seg = store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=1 << 30)
    assert seg is not None and store.peek_segment(LAYER, refs[0].key) is None
    assert store.stats.index["segments_evicted"] == 1 and store.held_bytes() == 4000


def test_before_any_build_a_node_already_short_refuses_it():
    """The layer's bytes a token are unknown until one segment is built: it is built to see, unless
    the node is below its reserve already."""
    node = Node(free=10_000 - 1)
    store, builds = guarded_store(node), Counting()
    spec = store.new_centre((1, 2), 4, 256)
    r = ref(spec.cid, 0, 256, (1, 2), first=4)
    assert store.get_or_build(LAYER, r, builds, merge) is None and builds.calls == 0
    assert store.last_refusal == REFUSED_NODE_MEMORY
    node.free = 10_000 + 1
    assert store.get_or_build(LAYER, r, builds, merge) is not None and builds.calls == 1


def test_a_refusal_under_the_cap_is_named_for_the_cap():
    node = Node(free=100 * GIB)
    store, builds = guarded_store(node), Counting()
    cids = [store.new_centre((b, b + 1), 4, 256).cid for b in (10, 20)]
    refs = [ref(c, 0, 256, (b, b + 1), first=4) for c, b in zip(cids, (10, 20))]
    assert store.get_or_build(LAYER, refs[0], builds, merge, cap_bytes=6000) is not None
    assert store.get_or_build(LAYER, refs[1], builds, merge, cap_bytes=6000) is None
    assert store.last_refusal == REFUSED_CAP and "segments_refused_node_memory" not in store.stats.index


def test_without_a_guard_the_node_is_not_read():
    store = IndexStore(Stats(), grow_step=256, active_steps=1)
    assert store.node_cap() is None
    spec = store.new_centre((1, 2), 4, 256)
    assert store.get_or_build(LAYER, ref(spec.cid, 0, 256, (1, 2), first=4), build, merge) is not None


def test_the_worker_runtime_guards_its_index_with_the_configured_reserve(vllm_env):  # noqa: F811
    h = harness(vllm_env, BatchSpec([3000], [1]), node_reserve_mb=777)
    guard = h.runtime.index.node_guard
    assert guard is not None and guard.reserve_bytes == 777 * MIB
    assert 0 < guard.room() + 777 * MIB - h.runtime.ops.memory_pool_stats()["pooled_bytes"] == guard.last_available


# --------------------------------------------------------------------------- at the vLLM seam


def _short_node(h, free_above_reserve: int) -> Node:
    """Give the harness's index a stand-in node with ``free_above_reserve`` bytes over its reserve."""
    guard = h.runtime.index.node_guard
    node = Node(free=guard.reserve_bytes + free_above_reserve)
    h.runtime.index.node_guard = NodeMemoryGuard(guard.reserve_bytes, lambda: node.free, lambda: node.pooled)
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
    node.free += 1 * GIB
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
    readings = iter([node.free])  # the planner's reading; the job's is the next
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
    guard._available = lambda: node.free  # memory is back
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}  # submitted again
    out, ref_out, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 1
    assert rel_err(out[0], ref_out[0]) < 2e-2


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
