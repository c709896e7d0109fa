"""A new prompt's index built off the critical path (``background_index.py``).

At the vLLM seam (the builder and impl of test_backend_unit, no engine): the first decode of a new
prompt is served exactly by the platform kernel, with the reason ``indexing``, while a job builds its
segments; a later step installs them and samples. A job over blocks rewritten meanwhile is dropped.
Then end to end through vLLM: the counters show exact ``indexing`` decodes, then sampled ones from
segments the background thread built.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.conftest import make_llm, stats
from tests.test_backend_unit import HKV, SPARSE_LAYER, BatchSpec, D, harness, rel_err, vllm_env  # noqa: F401
from vllm_magicpig import passkey


def _prefilled(vllm_env, seq_lens, inline=True, **magicpig):  # noqa: F811
    """A harness whose prompts went through a prefill step (so the sparse layer and its cache are
    known, as in vLLM), now decoding."""
    h = harness(vllm_env, BatchSpec(seq_lens, seq_lens), K=1, L=64, background_index=True, **magicpig)
    h.runtime.indexer.run_inline = inline
    h.step()  # the prefill step
    h.spec = BatchSpec(seq_lens, [1] * len(seq_lens))
    return h


def test_first_decode_is_exact_while_indexing_then_sampled_from_the_installed_segments(vllm_env):  # noqa: F811
    h = _prefilled(vllm_env, [3000, 2600])
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [] and meta.sparse_plan.exact_reason == {0: "indexing", 1: "indexing"}
    assert torch.equal(out, ref)  # the platform kernel served the step
    st = h.stats()
    assert st["decode_exact"] == {"indexing": 2} and st["decode_sparse"] == 0, st
    assert st["index"]["background_jobs"] == 2 and st["index"].get("segments_live", 0) == 0, st
    out, ref, meta = h.step()  # the jobs' segments are installed before this step is planned
    assert meta.sparse_plan.sparse == [0, 1]
    st = h.stats()
    assert st["decode_sparse"] == 2 and st["index"]["background_installed"] == 2, st
    # the layer found them: nothing was built at the decode
    assert st["index"]["segments_built"] == 2 and st["index"]["segments_live"] == 2, st
    assert st["build_seconds"] > 0
    for r in range(2):
        assert rel_err(out[r], ref[r]) < 2e-2, r


def test_installed_segments_equal_a_build_at_the_first_decode(vllm_env):  # noqa: F811
    """The background job builds the very segments the layer would (same centre, keys, codes)."""
    h = _prefilled(vllm_env, [3000])
    h.step()
    h.step()
    sync = harness(vllm_env, BatchSpec([3000], [1]), K=1, L=64)  # background off; same seed, same cache
    sync.step()
    (key_bg, seg_bg), = [(k, s) for k, s in h.runtime.index._segments.items()]
    (key_sync, seg_sync), = [(k, s) for k, s in sync.runtime.index._segments.items()]
    assert key_bg[0] == key_sync[0] and key_bg[1][1:3] == key_sync[1][1:3]  # layer, (K, L); start, size
    assert torch.equal(seg_bg.codes(), seg_sync.codes())


def test_a_job_over_blocks_rewritten_meanwhile_is_dropped(vllm_env):  # noqa: F811
    h = _prefilled(vllm_env, [3000])
    h.step()  # submits; the (inline) job is done but not installed
    # vLLM freed the request's blocks and another prompt's prefill rewrites them
    h.keys[0] = (torch.randn(3000, HKV, D, generator=h.gen) - h.offset).bfloat16()
    h.values[0] = torch.randn(3000, HKV, D, generator=h.gen).bfloat16()
    h.spec = BatchSpec([3000], [3000])
    h.step()
    st = h.stats()
    assert st["index"]["background_dropped"] == 1 and st["index"].get("segments_live", 0) == 0, st
    h.spec = BatchSpec([3000], [1])
    _, _, meta = h.step()  # the new prompt's first decode: indexed afresh
    assert meta.sparse_plan.exact_reason == {0: "indexing"}
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0]
    assert rel_err(out[0], ref[0]) < 2e-2  # stale segments would attend the old keys


def test_the_background_thread_builds_and_the_engine_thread_installs(vllm_env):  # noqa: F811
    h = _prefilled(vllm_env, [3000], inline=False)
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}
    assert h.runtime.indexer.wait_idle(timeout=120)
    assert h.stats()["index"].get("segments_live", 0) == 0  # built, not installed: the engine thread installs
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 1
    assert rel_err(out[0], ref[0]) < 2e-2


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for(cond, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_the_background_thread_and_its_openmp_pool_exit_when_its_queue_drains(vllm_env):  # noqa: F811
    """libgomp stops spin-waiting in every team of the process once the threads of its pools outnumber
    the cores, and a pool lives as long as the thread that started it: the indexer's thread must not
    outlive its jobs (background_index._loop). A later prompt starts a new one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        h = _prefilled(vllm_env, [3000], inline=False)
        torch.randn(1 << 20).exp()  # the engine thread's own 2-thread team exists before the count
        before = _os_threads()
        _, _, meta = h.step()
        assert meta.sparse_plan.exact_reason == {0: "indexing"}
        assert h.runtime.indexer.wait_idle(timeout=120)
        assert _wait_for(lambda: not h.runtime.indexer.thread_alive())
        assert _wait_for(lambda: _os_threads() <= before), (_os_threads(), before)
        _, _, meta = h.step()
        assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 1
        # a new prompt in the same blocks: indexed by a new thread, which exits in turn
        h.keys[0] = (torch.randn(3000, HKV, D, generator=h.gen) - h.offset).bfloat16()
        h.values[0] = torch.randn(3000, HKV, D, generator=h.gen).bfloat16()
        h.spec = BatchSpec([3000], [3000])
        h.step()
        h.spec = BatchSpec([3000], [1])
        _, _, meta = h.step()
        assert meta.sparse_plan.exact_reason == {0: "indexing"}
        assert h.runtime.indexer.wait_idle(timeout=120)
        out, ref, meta = h.step()
        assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 2
        assert rel_err(out[0], ref[0]) < 2e-2
        assert _wait_for(lambda: _os_threads() <= before), (_os_threads(), before)
    finally:
        torch.set_num_threads(threads)


def test_budget_mode_builds_at_the_first_decode(vllm_env):  # noqa: F811
    """Budget mode chooses (K, L) from the first decode's query: no background job."""
    h = harness(vllm_env, BatchSpec([3000], [3000]), background_index=True, target_cost=0.05)
    h.step()
    h.spec = BatchSpec([3000], [1])
    _, _, meta = h.step()
    assert meta.sparse_plan.sparse == [0]
    assert h.stats()["index"].get("background_jobs", 0) == 0


def test_a_build_tells_the_cost_model_its_cost(vllm_env):  # noqa: F811
    """What an index costs is measured from this worker's builds (background and at a decode)."""
    h = _prefilled(vllm_env, [3000])
    h.step()
    h.step()  # installs: the job's tokens x layers and its CPU time reach the cost model
    build = h.runtime.cost.build
    indexed = h.stats()["index"]["tokens_indexed"]
    assert build.builds == 1 and build._tokens == indexed > 2500, (build._tokens, indexed)
    assert 0 < build._seconds <= h.stats()["build_seconds"] * 2 + 0.05  # CPU time x threads, not wall time
    sync = harness(vllm_env, BatchSpec([3000], [1]), K=1, L=64)  # built at the first decode
    sync.step()
    assert sync.runtime.cost.build.builds == len(sync.runtime.index._segments) >= 1


def test_a_new_prompts_index_waits_until_its_exact_decodes_would_have_paid_for_it(vllm_env):  # noqa: F811
    """With measured costs that make the build worth 2.5 steps of savings, the first two decodes
    are served exactly by the platform kernel (``index_deferred``), the third submits the build."""
    h = _prefilled(vllm_env, [3000])
    cost = h.runtime.cost  # the planner's: synthetic timings, seconds where real ones are milliseconds
    for keys in range(1000, 100_000, 500):
        cost.observe_exact(1, keys, 0.5 + keys * 1e-6)
        cost.observe_sparse(1, keys, keys * 1e-6)  # sampling saves 0.5 s a step
    cost.observe_build(3000, 3000 * 1.25 / 3000)  # 1.25 s for a 3000-token prompt: 2.5 steps' savings
    for _ in range(2):
        out, ref, meta = h.step()
        assert meta.sparse_plan.exact_reason == {0: "index_deferred"} and torch.equal(out, ref)
    assert h.stats()["index"].get("background_jobs", 0) == 0
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and rel_err(out[0], ref[0]) < 2e-2
    st = h.stats()
    assert st["decode_exact"] == {"index_deferred": 2, "indexing": 1} and st["decode_sparse"] == 1, st


def test_the_builder_takes_the_runners_answer_bounds_once(vllm_env):  # noqa: F811
    """The bounds the runner published for a step (answer_bounds.py) decide that step's plan, then
    are gone: a step no runner published for (or with fewer rows than its decodes) plans unbounded."""
    from vllm_magicpig.answer_bounds import ListedBounds

    h = _prefilled(vllm_env, [3000])
    cost = h.runtime.cost
    for keys in range(1000, 100_000, 500):
        cost.observe_exact(1, keys, 0.5 + keys * 1e-6)
        cost.observe_sparse(1, keys, keys * 1e-6)  # sampling saves 0.5 s a step
    cost.observe_build(3000, 3000 * 1.25 / 3000)  # the build: 2.5 steps' savings
    h.runtime.answer_bounds = ListedBounds([2])  # two decodes left: 1 s saved at most, against a 1.25 s build
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "index_cannot_pay"} and h.runtime.answer_bounds is None
    _, _, meta = h.step()  # nothing published: ski rental alone (its account has 1 s saved so far)
    assert meta.sparse_plan.exact_reason == {0: "index_deferred"}
    h.runtime.answer_bounds = ListedBounds([])  # fewer bounds than decodes: not used
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"}  # 1.5 s saved: the build is submitted


def test_timings_taken_while_a_build_shares_the_core_do_not_teach_the_cost_model(vllm_env):  # noqa: F811
    """A background build shares the worker's cores: the decodes beside it ran up to ~50% slower
    (107.6 against 72.1 ms a step at 4K), which is not what exact attention costs. Such steps are
    not timed."""
    import threading

    h = _prefilled(vllm_env, [3000], inline=False)
    indexer, cost = h.runtime.indexer, h.runtime.cost
    release = threading.Event()
    build = indexer._build

    def held_build(*args, **kwargs):  # the build runs while the engine decodes
        release.wait(timeout=60)
        return build(*args, **kwargs)

    indexer._build = held_build
    exact_before = cost.exact.steps
    _, _, meta = h.step()  # submits the job; the platform kernel serves the decode
    assert meta.sparse_plan.exact_reason == {0: "indexing"}
    _, _, meta = h.step()  # the job is still running
    assert indexer.building() and not meta.sparse_plan.timed
    assert cost.exact.steps == exact_before  # neither step's layer timings reached the fit
    release.set()
    assert indexer.wait_idle(timeout=120) and not indexer.building()
    _, _, meta = h.step()  # installs; nothing building: timed again
    assert meta.sparse_plan.timed and meta.sparse_plan.sparse == [0]
    h.runtime.stats.flush()  # the layers' records reach the fit when read or at the next plan (sparse_tally.py)
    assert cost.sparse.steps > 0


@pytest.mark.e2e
def test_engine_serves_exactly_while_indexing_then_samples(model_path):
    llm = make_llm(model_path, magicpig={"log_stats_interval": 0, "background_index": True})
    tok = llm.get_tokenizer()
    prompt = passkey.build(tok, 3000, seed=41, depth=0.5)
    from vllm import SamplingParams

    out = llm.generate([prompt.text], SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    st = stats(llm)
    sparse_layers = 28
    decodes = (len(out.token_ids) - 1) * sparse_layers
    assert st["decode_exact"].get("indexing", 0) >= sparse_layers, st  # at least the first decode step
    assert st["decode_sparse"] > 0 and st["index"]["background_installed"] == 1, st
    assert st["decode_sparse"] + st["decode_exact"]["indexing"] == decodes, st
    assert prompt.pass_key in out.text
    del llm


def test_a_job_whose_index_no_longer_fits_is_not_installed_in_part(vllm_env):  # noqa: F811
    """The room the planner saw at submission was taken before the install: none of the job's
    segments is installed (a prompt indexed in some layers only would be attended exactly in MAGICPIG's
    call in the others), the prompt is served exactly as ``evicted`` while it does not fit, and it is
    indexed again once it does."""
    h = _prefilled(vllm_env, [3000], index_memory_mb=64)
    h.step()  # submits; the (inline) job is done but not installed
    index = h.runtime.index
    real_room = index.idle_room
    index.idle_room = lambda cap: 0  # another request's segments took the room meanwhile
    out, ref, meta = h.step()
    st = h.stats()
    assert st["index"]["background_refused"] == 1 and st["index"].get("background_installed", 0) == 0, st
    assert st["index"].get("segments_live", 0) == 0 and meta.sparse_plan.exact_reason == {0: "evicted"}
    assert torch.equal(out, ref)  # the platform kernel served it
    index.idle_room = real_room
    _, _, meta = h.step()  # room again: indexed afresh
    assert meta.sparse_plan.exact_reason == {0: "indexing"} and h.stats()["index"]["background_jobs"] == 2
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["index"]["background_installed"] == 1
    assert rel_err(out[0], ref[0]) < 2e-2


def test_the_room_of_a_job_being_built_is_not_given_to_another_new_prompt(vllm_env):  # noqa: F811
    """A new prompt arrives while another's job is being built, with room for one index: it is served
    exactly as ``evicted`` (its install, or the first's, would otherwise refuse one of them after both
    were built)."""
    from tests.test_index import FakeSegment
    from vllm_magicpig.index import SegmentKey, SegmentRef, segment_owner

    h = _prefilled(vllm_env, [3000, 2900], inline=False)
    index, indexer = h.runtime.index, h.runtime.indexer
    indexer._submit = lambda job: None  # jobs stay pending: being built throughout this test
    # the layer's size, as a first segment teaches it: 1,000 bytes a token (a stand-in segment)
    index.note_size(segment_owner(SPARSE_LAYER, 1, 64), SegmentRef(SegmentKey(0, 0, 1000, ()), 0),
                    FakeSegment((0, 1000), index_bytes=1_000_000, mirror_bytes=0))
    index.idle_room = lambda cap: 4_000_000  # room for one index of ~2.9K tokens, not two
    h.spec = BatchSpec([3000], [1])
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing"} and indexer.pending_tokens() > 2800
    h.spec = BatchSpec([3000, 2900], [1, 1])
    _, _, meta = h.step()
    assert meta.sparse_plan.exact_reason == {0: "indexing", 1: "evicted"}, meta.sparse_plan.exact_reason
    assert h.stats()["index"]["background_jobs"] == 1
