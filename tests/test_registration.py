"""register(): what the vLLM plugin changes, its idempotence and its spawn-safety.

No engine is started here; the fresh-interpreter tests use `subprocess` so that nothing
registered in this pytest process can leak into what they prove.
"""
from __future__ import annotations

import importlib.metadata
import pickle
import subprocess
import sys
import textwrap

import pytest

import vllm_magicpig

MARK = "_magicpig_wrapped"


def _run_fresh(code: str, *, stdin: bytes | None = None, timeout: float = 120) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], input=stdin,
                       capture_output=True, timeout=timeout)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.returncode == 0, f"fresh interpreter failed (rc={r.returncode}):\n{out}\n{err[-4000:]}"
    return out


def _wrapped_functions(fn) -> list:
    """The functions a wrapper closes over (the originals it wraps)."""
    import types

    cells = [c.cell_contents for c in (fn.__closure__ or ())]
    return [c for c in cells if isinstance(c, types.FunctionType)]


@pytest.fixture(scope="module")
def registered():
    vllm_magicpig.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum


# --------------------------------------------------------------------------- idempotence


def test_register_is_idempotent(registered):
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def state():
        return (
            AttentionBackendEnum["MAGICPIG"],
            CpuPlatform.__dict__["get_attn_backend_cls"].__func__,
            CpuPlatform.__dict__["check_and_update_config"].__func__,
            AttentionBackendEnum.__reduce_ex__,
            WorkerWrapperBase.magicpig_stats,
        )

    before = state()
    vllm_magicpig.register()  # a second (third) call must change nothing and not raise
    vllm_magicpig.register()
    after = state()
    assert [a is b for a, b in zip(before, after)] == [True] * len(before)

    # The member exists exactly once.
    assert [m.name for m in AttentionBackendEnum].count("MAGICPIG") == 1
    member = AttentionBackendEnum["MAGICPIG"]
    assert member.get_path() == vllm_magicpig.BACKEND_PATH
    assert member.get_class().get_name() == "MAGICPIG"  # Attention.__init__ looks the name up

    # Each patched function is wrapped once: marked, and wrapping an unmarked original.
    for fn in after[1:4]:
        assert getattr(fn, MARK, False), f"{fn.__qualname__} lacks the {MARK} marker"
        assert fn.__module__ == "vllm_magicpig.platform_hooks"
        inner = _wrapped_functions(fn)
        assert inner, f"{fn.__qualname__} wraps no original function"
        for f in inner:
            assert not getattr(f, MARK, False), f"{fn.__qualname__} wraps an already-wrapped function"
            assert f.__module__ != "vllm_magicpig.platform_hooks", f"{fn.__qualname__} wraps {f.__qualname__}"


def test_register_idempotent_in_fresh_process():
    """Registering twice from scratch (as vLLM's several plugin-loading call sites may) is fine,
    and vLLM's own plugin loader finds and runs the entry point."""
    out = _run_fresh("""
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert "MAGICPIG" not in AttentionBackendEnum.__members__, "registered before any plugin load"
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        assert "MAGICPIG" in AttentionBackendEnum.__members__, "vLLM's plugin loader did not register it"
        import vllm_magicpig
        vllm_magicpig.register(); vllm_magicpig.register()
        from vllm.platforms.cpu import CpuPlatform
        import types
        f = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
        inner = [c.cell_contents for c in f.__closure__ if isinstance(c.cell_contents, types.FunctionType)]
        print("OK", [m.name for m in AttentionBackendEnum].count("MAGICPIG"),
              getattr(f, "_magicpig_wrapped", False), len(inner),
              any(getattr(i, "_magicpig_wrapped", False) for i in inner))
    """)
    assert out.strip().splitlines()[-1] == "OK 1 True 1 False", out


def test_import_has_no_side_effects():
    out = _run_fresh("""
        import sys, vllm_magicpig
        print("OK", sorted(m for m in ("vllm", "torch") if m in sys.modules))
    """)
    assert out.strip().splitlines()[-1] == "OK []", out


# --------------------------------------------------------------------------- spawn-safety


def test_member_unpickles_in_fresh_process(registered):
    """vLLM's spawned engine/worker processes unpickle the config (holding the member)
    before loading plugins. The child here never calls register(): unpickling must."""
    AttentionBackendEnum = registered
    payload = {"backend": AttentionBackendEnum["MAGICPIG"], "other": AttentionBackendEnum.CPU_ATTN}
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    assert b"_lookup_backend" in data  # pickled by name, through the plugin
    # In this process the round trip gives the identical members.
    back = pickle.loads(data)
    assert back["backend"] is AttentionBackendEnum["MAGICPIG"]
    assert back["other"] is AttentionBackendEnum.CPU_ATTN

    out = _run_fresh("""
        import pickle, sys
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        assert "MAGICPIG" not in AttentionBackendEnum.__members__, "already registered in the child"
        obj = pickle.loads(sys.stdin.buffer.read())
        b = obj["backend"]
        print("OK", type(b) is AttentionBackendEnum, b.name, b.get_path(),
              b is AttentionBackendEnum["MAGICPIG"], obj["other"] is AttentionBackendEnum.CPU_ATTN)
    """, stdin=data)
    assert out.strip().splitlines()[-1] == (
        f"OK True MAGICPIG {vllm_magicpig.BACKEND_PATH} True True"
    ), out


def test_other_members_still_pickle_by_value(registered):
    AttentionBackendEnum = registered
    for m in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.FLASH_ATTN):
        data = pickle.dumps(m)
        assert b"vllm_magicpig" not in data, f"{m.name} pickles through the plugin"
        assert pickle.loads(data) is m


# --------------------------------------------------------------------------- CPU platform selection


def _selector(**kw):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    args = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128)
    args.update(kw)
    return AttentionSelectorConfig(**args)


def test_cpu_platform_selects_magicpig(registered):
    from vllm.platforms.cpu import CpuPlatform

    AttentionBackendEnum = registered
    path = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum["MAGICPIG"], _selector(), num_heads=9)
    assert path == vllm_magicpig.BACKEND_PATH
    cpu_path = AttentionBackendEnum.CPU_ATTN.get_path()
    assert CpuPlatform.get_attn_backend_cls(None, _selector(), num_heads=9) == cpu_path
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CPU_ATTN, _selector(), num_heads=9) == cpu_path
    assert path != cpu_path


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(head_size=96), "head_size"),
        (dict(has_sliding_window=True), "sliding window"),
        (dict(has_sink=True), "sink"),
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
    ],
)
def test_cpu_platform_rejects_unservable_layer(registered, kw, reason):
    """A layer MAGICPIG cannot serve raises (it is never silently swapped for CPU_ATTN)."""
    from vllm.platforms.cpu import CpuPlatform

    with pytest.raises(ValueError, match="MAGICPIG cannot serve this attention layer") as ei:
        CpuPlatform.get_attn_backend_cls(registered["MAGICPIG"], _selector(**kw), num_heads=9)
    assert reason in str(ei.value), str(ei.value)
    assert "drop --attention-backend MAGICPIG" in str(ei.value)


# --------------------------------------------------------------------------- entry point and RPCs


def test_entry_point():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    mine = [ep for ep in eps if ep.name == "magicpig"]
    assert len(mine) == 1, eps
    assert mine[0].value == "vllm_magicpig:register"
    assert mine[0].load() is vllm_magicpig.register


def test_worker_rpc_methods(registered):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_magicpig import runtime

    from helpers import make_runtime

    rt = make_runtime()
    runtime.install(rt)
    try:
        snap = WorkerWrapperBase.magicpig_stats(object())
        assert snap == rt.stats.snapshot() and "decode_sparse" in snap
        WorkerWrapperBase.magicpig_set_decode_method(object(), "exact")
        assert rt.step_settings().method == "exact"
        with pytest.raises(ValueError, match="not one of"):
            WorkerWrapperBase.magicpig_set_decode_method(object(), "dense")
        WorkerWrapperBase.magicpig_set_decode_method(object(), None)
        assert rt.step_settings().method == "magicpig"
        rt.stats.decode_sparse += 3
        WorkerWrapperBase.magicpig_reset_stats(object())
        assert rt.stats.decode_sparse == 0
    finally:
        runtime.install(None)
    # a worker without MAGICPIG layers answers with empty counters
    assert WorkerWrapperBase.magicpig_stats(object())["decode_sparse"] == 0
