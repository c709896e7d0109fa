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

import torch  # noqa: E402
from vllm import envs  # noqa: E402
from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_magicpig import cost_calibration  # noqa: E402
from vllm_magicpig.backend_common import (  # noqa: E402
    MagicPigBuilderMixin,
    MagicPigDeclarations,
    MagicPigImplMixin,
    MagicPigMetadata,
    logger,
)
from vllm_magicpig.config import MagicPigConfigError  # noqa: E402
from vllm_magicpig.kv_layout import CPU_LAYOUTS, amx_granted  # noqa: E402
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
        self._calibrate_cost_model(vllm_config)

    def _calibrate_cost_model(self, vllm_config) -> None:
        """Time sampling, exact attention and a build at start-up (``cost_calibration.py``), once per
        worker (every builder of a worker shares its runtime), before the first request."""
        rt = self.runtime
        if rt.cost is None or not rt.cfg.cost_calibration or rt.cost.calibration is not None:
            return
        if self.isa == "amx":
            amx_granted()  # vLLM's AMX kernel needs the tile state, which no matmul may have asked for yet
        shape = cost_calibration.LayerShape(self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
                                            self.dtype)
        try:
            record = cost_calibration.calibrate(
                rt.cost, rt.cfg, shape, rt.ops, rt.projection(self.head_dim, rt.cfg.K, rt.cfg.L), rt.layout.views,
                CpuDecodeKernel(self), vllm_config.model_config.max_model_len)
        except Exception as e:  # noqa: BLE001 - a prior, not a requirement: serve, learning from requests
            rt.cost.calibration = {"failed": f"{type(e).__name__}: {e}"}
            logger.warning("MAGICPIG could not calibrate its cost model at start-up (%s: %s); it learns from the "
                           "requests served instead (first prompts of a context range are indexed to time them)",
                           type(e).__name__, e)
            return
        logger.info("MAGICPIG cost model calibrated at start-up: %s", record)


class CpuDecodeKernel:
    """vLLM's CPU decode attention over a paged cache, called as ``CPUAttentionBackendImpl`` calls
    it for a decode-only batch (causal, no soft cap, alibi or sinks: what MAGICPIG serves), with
    the scheduler metadata the builder would make: the exact side of the start-up calibration."""

    def __init__(self, builder: CPUAttentionMetadataBuilder) -> None:
        self.builder = builder
        self._meta: dict[tuple[int, int], tuple] = {}  # built once per shape, as once per engine step

    def __call__(self, query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                 seq_len: int) -> torch.Tensor:
        """Every request of ``query [R, H, D]`` attends its first ``seq_len`` keys -> the output."""
        from vllm import _custom_ops as ops

        b = self.builder
        R = query.shape[0]
        if (R, seq_len) not in self._meta:
            qsl = torch.arange(R + 1, dtype=torch.int32)
            seq = torch.full((R,), seq_len, dtype=torch.int32)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=R, num_heads=b.num_heads, num_kv_heads=b.num_kv_heads, head_dim=b.head_dim, seq_lens=seq,
                dtype=b.dtype, query_start_loc=qsl, causal=True, sliding_window_size=b.window_size, isa=b.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=b.kv_cache_dtype)
            self._meta[(R, seq_len)] = (qsl, seq, meta, torch.empty_like(query))
        qsl, seq, meta, out = self._meta[(R, seq_len)]
        nb, hkv, bs, _ = cache.shape
        key_cache, value_cache = cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=qsl, seq_lens=seq, scale=b.head_dim ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=b.window_size, block_table=block_table, softcap=0, scheduler_metadata=meta, s_aux=None,
            kv_cache_dtype=b.kv_cache_dtype)
        return out


class MagicPigImpl(MagicPigImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention impl, with MAGICPIG's decode for sparse layers (the mixin)."""
