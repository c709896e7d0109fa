"""The MAGICPIG attention backend on vLLM's CPU platform: thin subclasses of its CPU attention.

Prefill tokens (and prefill chunks of mixed batches), dense layers and short contexts
go to the platform's own kernel (``CPUAttentionBackendImpl``), unchanged. Decode
requests of sparse layers go through :meth:`MagicPigImpl.forward_decode`, which hands
them to the device-agnostic decode path (``planner.py``, ``layer.py``) over this
platform's KV layout and ops (``kv_layout.CpuVecLayout``, ``ops.CpuKernelOps``).
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
        # The sparse kernel reads K/V rows out of vLLM's cache, whose layout inside a
        # block depends on the ISA. "vec" (K column-major, V row-major) is the layout it
        # knows; AMX tiles would be unreadable, so AMX machines are moved to "vec".
        if self.isa == "amx":
            self.isa = "vec"
            self._set_isa_to_layers(layer_names)
        if self.isa != "vec":
            raise MagicPigConfigError(
                f"MAGICPIG needs vLLM's 'vec' CPU attention layout (x86-64, head_dim and block "
                f"size multiples of 32); this machine/config selected {self.isa!r}"
            )
        self._init_magicpig(vllm_config)


class MagicPigImpl(MagicPigImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, with MAGICPIG's decode for sparse layers (the mixin)."""
