"""host_memory.py: the CPU worker's KV cache and MAGICPIG's index share the worker's memory budget,
and where they cannot both fit, start-up fails naming the fix. The plan on made-up sizes, the
patched worker method on a stand-in worker, and (e2e) a real engine on vLLM's default memory sizing,
which before this left the index no room and was OOM-killed while indexing its second prompt."""
from __future__ import annotations

import types

import pytest

from vllm_magicpig import host_memory
from vllm_magicpig.config import MagicPigConfigError, parse_config

GIB, MIB = 2**30, 2**20


def cfg(**magicpig):
    return parse_config({"magicpig": magicpig})


def test_vllm_sized_kv_cache_gives_the_default_cap_its_room():
    plan = host_memory.plan_worker_memory(cfg(), kv_bytes=20 * GIB, kv_explicit=False, available_bytes=21 * GIB)
    assert plan.index_mb == 4096 and plan.kv_bytes == 16 * GIB
    assert "4096 MiB" in plan.note and "16.00 GiB" in plan.note


def test_an_unset_cap_takes_at_most_half_of_a_small_kv_budget():
    plan = host_memory.plan_worker_memory(cfg(), kv_bytes=3 * GIB, kv_explicit=False, available_bytes=4 * GIB)
    assert plan.index_mb == 1536 and plan.kv_bytes == 3 * GIB - 1536 * MIB


def test_a_given_cap_is_kept_while_it_leaves_the_kv_cache_something():
    plan = host_memory.plan_worker_memory(cfg(index_memory_mb=3072), kv_bytes=4 * GIB, kv_explicit=False,
                                          available_bytes=5 * GIB)
    assert plan.index_mb == 3072 and plan.kv_bytes == 1 * GIB


@pytest.mark.parametrize("cap_mb", [4096, 5000])
def test_a_given_cap_that_leaves_the_kv_cache_nothing_fails_naming_the_fix(cap_mb):
    with pytest.raises(MagicPigConfigError) as e:
        host_memory.plan_worker_memory(cfg(index_memory_mb=cap_mb), kv_bytes=4 * GIB, kv_explicit=False,
                                       available_bytes=5 * GIB)
    msg = str(e.value)
    assert "index_memory_mb" in msg and "--gpu-memory-utilization" in msg and "at most 2048" in msg


def test_a_user_sized_kv_cache_is_kept_where_the_cap_fits_beside_it():
    plan = host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=10 * GIB)
    assert plan.kv_bytes == 2 * GIB and plan.index_mb == 4096
    # with the working margin exactly: fits; one byte less free: does not
    fit = 2 * GIB + 4096 * MIB + host_memory.WORKING_MARGIN
    host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=fit)
    with pytest.raises(MagicPigConfigError):
        host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=fit - 1)


@pytest.mark.parametrize("available_gib, fix", [(10, '"index_memory_mb": 1536 or less'), (8.4, "free memory")])
def test_a_user_sized_kv_cache_and_a_cap_that_do_not_fit_fail_naming_the_fix(available_gib, fix):
    with pytest.raises(MagicPigConfigError) as e:
        host_memory.plan_worker_memory(cfg(), kv_bytes=8 * GIB, kv_explicit=True,
                                       available_bytes=int(available_gib * GIB))
    msg = str(e.value)
    assert "VLLM_CPU_KVCACHE_SPACE" in msg and "its default" in msg and fix in msg, msg


def test_a_user_sized_kv_cache_and_cap_leave_the_nodes_reserve_free():
    """A node_reserve_mb above the working margin is what must stay free beside the KV cache and the
    cap: a cap that fits only below it would never be reached (node_memory.py stops the index there)."""
    fit = 2 * GIB + 4096 * MIB + 3072 * MIB
    plan = host_memory.plan_worker_memory(cfg(node_reserve_mb=3072), kv_bytes=2 * GIB, kv_explicit=True,
                                          available_bytes=fit)
    assert "3072 MiB to spare (node_reserve_mb)" in plan.note, plan.note
    with pytest.raises(MagicPigConfigError) as e:
        host_memory.plan_worker_memory(cfg(node_reserve_mb=3072), kv_bytes=2 * GIB, kv_explicit=True,
                                       available_bytes=fit - 1)
    assert "3072 MiB to spare (node_reserve_mb)" in str(e.value) and '"index_memory_mb": 4095 or less' in str(e.value)


def test_ranks_on_one_node_check_their_user_sized_caches_and_caps_together():
    """Two ranks on one memory node plan at the same moment, each seeing all of its free memory: a
    2 GiB KV cache and the default 4 GiB cap fit one rank in 10 GiB, and two only in 13 GiB."""
    one = 2 * GIB + 4096 * MIB + host_memory.WORKING_MARGIN
    plan = host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=2 * one,
                                          ranks_on_node=2)
    assert plan.kv_bytes == 2 * GIB and plan.index_mb == 4096 and "each of the 2 ranks" in plan.note
    with pytest.raises(MagicPigConfigError) as e:
        host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=10 * GIB,
                                       ranks_on_node=2)
    msg = str(e.value)
    # 5 GiB a rank, less the KV cache and the margin: 2560 MiB of cap each
    assert "each of the 2 ranks on this memory node" in msg and '"index_memory_mb": 2560 or less' in msg, msg
    host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=True, available_bytes=10 * GIB)  # alone


def test_ranks_on_one_node_share_the_budget_vllm_gave_each_as_if_alone():
    """vLLM sizes each rank's KV cache to --gpu-memory-utilization of the whole node less that
    rank's weights (20 GiB = 21.5 - 1.5): two ranks share the 21.5, each 10.75 less its 1.5 of
    weights, 9.25 GiB, and the default cap comes out of that."""
    plan = host_memory.plan_worker_memory(cfg(), kv_bytes=20 * GIB, kv_explicit=False, available_bytes=21 * GIB,
                                          ranks_on_node=2, weights_bytes=3 * GIB // 2)
    assert plan.index_mb == 4096 and plan.kv_bytes == 9 * GIB + GIB // 4 - 4096 * MIB, plan
    assert "this rank's share of the 20.00 GiB" in plan.note and "1 more rank" in plan.note, plan.note
    alone = host_memory.plan_worker_memory(cfg(), kv_bytes=20 * GIB, kv_explicit=False, available_bytes=21 * GIB,
                                           weights_bytes=3 * GIB // 2)
    assert alone.kv_bytes == 16 * GIB  # one rank: the weights are already out of vLLM's figure


def test_a_node_share_that_leaves_the_kv_cache_nothing_fails_naming_the_fix():
    with pytest.raises(MagicPigConfigError) as e:
        host_memory.plan_worker_memory(cfg(), kv_bytes=2 * GIB, kv_explicit=False, available_bytes=21 * GIB,
                                       ranks_on_node=4, weights_bytes=2 * GIB)
    msg = str(e.value)
    assert "4 ranks" in msg and "--gpu-memory-utilization" in msg and "VLLM_CPU_KVCACHE_SPACE" in msg, msg


class StandInWorker:
    """A STAND-IN for vLLM's CPUWorker: its determine_available_memory returns a fixed size."""

    def __init__(self, kv_bytes, backend="MAGICPIG", explicit=None, magicpig=None):
        self.kv_bytes = kv_bytes
        self.vllm_config = types.SimpleNamespace(
            attention_config=types.SimpleNamespace(backend=types.SimpleNamespace(name=backend)),
            cache_config=types.SimpleNamespace(kv_cache_memory_bytes=explicit),
            additional_config={"magicpig": dict(magicpig or {}), "other": 1})

    def determine_available_memory(self):
        return self.kv_bytes


@pytest.fixture
def patched():
    cls = type("Worker", (StandInWorker,), {})
    host_memory.patch(cls)
    host_memory.patch(cls)  # idempotent: one wrapper
    return cls


def test_the_patched_worker_takes_the_cap_out_of_its_kv_cache(patched):
    assert patched(20 * GIB).determine_available_memory() == 16 * GIB
    assert patched(20 * GIB, backend="CPU_ATTN").determine_available_memory() == 20 * GIB  # not MAGICPIG's


def test_a_shrunk_cap_reaches_the_runtime_through_the_workers_config(patched):
    w = patched(3 * GIB, magicpig={"K": 8})
    before = w.vllm_config.additional_config
    assert w.determine_available_memory() == 3 * GIB - 1536 * MIB
    after = w.vllm_config.additional_config
    assert after == {"magicpig": {"K": 8, "index_memory_mb": 1536}, "other": 1}
    assert before == {"magicpig": {"K": 8}, "other": 1}  # the dict it had is not changed in place
    assert parse_config(after).index_memory_mb == 1536
    assert w.determine_available_memory() == 3 * GIB - 1536 * MIB  # asked again: the same


def test_the_patched_worker_checks_a_user_sized_cache_against_free_memory(patched, monkeypatch):
    monkeypatch.setattr(host_memory, "node_available_bytes", lambda: 6 * GIB)
    assert patched(1 * GIB, explicit=1 * GIB).determine_available_memory() == 1 * GIB
    with pytest.raises(MagicPigConfigError, match="VLLM_CPU_KVCACHE_SPACE"):
        patched(2 * GIB, explicit=2 * GIB).determine_available_memory()


def _available_bytes() -> int:
    return host_memory.node_available_bytes()


def _wait_for_free_memory(target: int, timeout_s: float = 120) -> None:
    import gc
    import time

    gc.collect()
    t0 = time.monotonic()
    while _available_bytes() < target and time.monotonic() - t0 < timeout_s:
        time.sleep(1)


@pytest.mark.e2e
def test_an_engine_on_vllms_default_memory_sizing_leaves_the_index_its_room(model_path, monkeypatch):
    """No VLLM_CPU_KVCACHE_SPACE: vLLM sizes the KV cache to fill --gpu-memory-utilization of the
    node (here all but 2.5 GiB of what is free now, as its 0.92 default does on an idle 24 GB machine).
    The index's cap must stay free after start-up, and two 7K-token prompts are indexed and sampled
    with the engine alive. Before host_memory, ~0.6 GiB stayed free and the second prompt's index
    got the worker OOM-killed."""
    import psutil
    from vllm import SamplingParams

    from tests.conftest import make_llm, stats
    from vllm_magicpig import passkey

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    total = psutil.virtual_memory().total
    free_before = _available_bytes()
    # at most ~21 GiB for vLLM, so a larger machine does not zero a huge KV cache (it would then have
    # room without the plan, and the test checks only that the plan leaves it)
    utilization = round((min(free_before, 24 * GIB) - 2.5 * GIB) / total, 3)
    cap_mb = 4096
    llm = make_llm(model_path, magicpig={"index_memory_mb": cap_mb}, gpu_memory_utilization=utilization)
    free_after_start = _available_bytes()
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for seed in (1, 2):
        llm.generate([passkey.build(tok, 7000, seed=seed, depth=0.5).text], params, use_tqdm=False)
    st = stats(llm)
    del llm
    _wait_for_free_memory(free_before - 2 * GIB)  # the engine's processes exit after del: the next test needs it
    assert free_after_start > 0.9 * cap_mb * MIB, (free_after_start / GIB, utilization)
    assert st["decode_sparse"] > 0 and st["index"]["segments_built"] == 2 * 28, st
    assert 0 < st["index_bytes"] + st["mirror_bytes"] <= cap_mb * MIB, st
    assert st["index_cap_bytes"] == cap_mb * MIB, st  # the worker runs the cap it was given


@pytest.mark.server
def test_a_server_whose_kv_cache_leaves_the_cap_no_room_exits_at_startup_naming_the_fix(model_path, tmp_path):
    """A 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE, which vLLM itself accepts) and an index cap larger
    than the machine: the server exits before it serves, never answering /health, and says what to
    change. Before host_memory it started, and its index could outgrow the machine mid-serve."""
    import time

    import psutil

    from vllm_magicpig.eval.openai_server import healthy, launch, stop

    cap_mb = psutil.virtual_memory().total // MIB + 1024
    srv = launch(model_path, tmp_path / "server.log", {"index_memory_mb": cap_mb}, max_model_len=4096,
                 kv_cache_gb=1)
    t0, became_healthy = time.monotonic(), False
    try:
        while srv.proc.poll() is None and time.monotonic() - t0 < 180:
            became_healthy |= healthy(srv.url)
            time.sleep(0.5)
        rc = srv.proc.poll()
    finally:
        stop(srv.proc)
    out = srv.log()
    assert rc is not None and rc != 0 and not became_healthy, (rc, srv.tail())
    for part in ("VLLM_CPU_KVCACHE_SPACE", f"index cap ({cap_mb} MiB, index_memory_mb)", '"index_memory_mb": '):
        assert part in out, (part, srv.tail())
