"""The MAGICPIG attention backend on vLLM's CPU platform: thin subclasses of its CPU attention.

Prefill tokens (and prefill chunks of mixed batches), dense layers and short contexts
go to the platform's own kernel (``CPUAttentionBackendImpl``), unchanged. Decode
requests of sparse layers go through :meth:`MagicPigImpl.forward_decode`, which hands
them to the device-agnostic decode path (``planner.py``, ``layer.py``) over this
platform's KV layout and ops (``kv_layout.CpuVecLayout`` or ``CpuAmxLayout``, as vLLM's
CPU attention chose; ``ops.CpuKernelOps``).
"""
from __future__ import annotations

import vllm_magicpig

vllm_magicpig.require_vllm()

from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_magicpig.backend_common import (  # noqa: E402
    MagicPigBuilderMixin,
    MagicPigDeclarations,
    MagicPigImplMixin,
    MagicPigMetadata,
)
from vllm_magicpig.config import MagicPigConfigError  # noqa: E402
from vllm_magicpig.kv_layout import CPU_LAYOUTS  # noqa: E402
from vllm_magicpig.runtime import MagicPigRuntime  # noqa: E402

__all__ = ["MagicPigBackend", "MagicPigMetadataBuilder", "MagicPigImpl", "MagicPigMetadata"]


class MagicPigBackend(MagicPigDeclarations, CPUAttentionBackend):
    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(32)]

    @staticmethod
    def get_impl_cls() -> type["MagicPigImpl"]:
        return MagicPigImpl

    @staticmethod
    def get_builder_cls() -> type["MagicPigMetadataBuilder"]:
        return MagicPigMetadataBuilder


class MagicPigMetadataBuilder(MagicPigBuilderMixin, CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # The sparse kernel reads K/V rows out of vLLM's cache, whose layout inside a block
        # depends on the ISA vLLM chose: "vec" (K column-major, V row-major), or on CPUs with
        # AMX tiles "amx" (bf16 pairs in 16-token / 16-element tiles), whose prefill attention
        # runs 3.3-3.5x faster than "vec"'s at SmolLM2's shape (benchmarks/cpu_attn_isas.py).
        # MAGICPIG keeps vLLM's choice.
        if self.isa not in CPU_LAYOUTS:
            raise MagicPigConfigError(
                f"MAGICPIG needs vLLM's 'vec' or 'amx' CPU attention layout (x86-64, head_dim and block "
                f"size multiples of 32); this machine/config selected {self.isa!r}"
            )
        layout = CPU_LAYOUTS[self.isa]()
        self._init_magicpig(vllm_config, lambda cfg, **kw: MagicPigRuntime(cfg, layout=layout, **kw))


class MagicPigImpl(MagicPigImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, with MAGICPIG's decode for sparse layers (the mixin)."""
