"""On a platform MAGICPIG has no decode path for (ROCm, XPU, ...), selecting it fails
at start-up with a message naming the fix, instead of crashing at the first decode."""
from __future__ import annotations

import types

import pytest


def test_non_cpu_platform_refuses_magicpig_at_startup(monkeypatch):
    import vllm.platforms as platforms
    from vllm.platforms.interface import Platform

    import vllm_magicpig
    from vllm_magicpig import platform_hooks

    vllm_magicpig.register()
    seen = []

    class FakeGpuPlatform(Platform):
        device_name = "fakegpu"

        @classmethod
        def check_and_update_config(cls, vllm_config):
            seen.append(vllm_config)

    monkeypatch.setattr(platforms, "_current_platform", FakeGpuPlatform())
    platform_hooks._patch_other_platform()
    platform_hooks._patch_other_platform()  # idempotent

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def cfg(backend):
        return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend))

    with pytest.raises(ValueError, match="CPU platform.*and on CUDA.*fakegpu.*Drop --attention-backend MAGICPIG"):
        FakeGpuPlatform.check_and_update_config(cfg(AttentionBackendEnum["MAGICPIG"]))
    assert seen == []
    # other backends still reach the platform's own check
    other = cfg(None)
    FakeGpuPlatform.check_and_update_config(other)
    assert seen == [other]
