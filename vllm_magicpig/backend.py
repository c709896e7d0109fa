"""The MAGICPIG attention backend on vLLM's CPU platform: thin subclasses of its CPU attention.

Prefill tokens (and prefill chunks of mixed batches), dense layers and short contexts
go to the platform's own kernel (``CPUAttentionBackendImpl``), unchanged. Decode
requests of sparse layers go through :meth:`MagicPigImpl.forward_decode`, which hands
them to the device-agnostic decode path (``planner.py``, ``layer.py``) over this
platform's KV layout and ops (``kv_layout.CpuVecLayout``, ``ops.CpuKernelOps``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import vllm_magicpig

vllm_magicpig.require_vllm()

import torch  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.attention.backend import AttentionType, MultipleOf  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402
from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata  # noqa: E402

from vllm_magicpig import runtime as runtimes  # noqa: E402
from vllm_magicpig.config import MagicPigConfigError  # noqa: E402
from vllm_magicpig.decode_methods import LayerContext  # noqa: E402
from vllm_magicpig.layer import SparseLayer  # noqa: E402
from vllm_magicpig.limits import SUPPORTED_HEAD_SIZES  # noqa: E402
from vllm_magicpig.planner import DecodePlan, StepPlanner  # noqa: E402
from vllm_magicpig.runtime import MagicPigRuntime  # noqa: E402
from vllm_magicpig.stats import EXACT_DENSE_LAYER  # noqa: E402

logger = init_logger("vllm.magicpig")  # under vLLM's logger tree, so its handler prints it


class MagicPigBackend(CPUAttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    # fp8 caches pack K/V differently; the sparse kernel reads plain 16-bit rows.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return vllm_magicpig.BACKEND_NAME  # the registered enum name

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(32)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @staticmethod
    def get_impl_cls() -> type["MagicPigImpl"]:
        return MagicPigImpl

    @staticmethod
    def get_builder_cls() -> type["MagicPigMetadataBuilder"]:
        return MagicPigMetadataBuilder


@dataclass
class MagicPigMetadata:
    """Per-step metadata, shared by every layer (per-layer state lives on the impl)."""

    full: CPUAttentionMetadata  # the whole batch, for exact layers
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: CPUAttentionMetadata | None  # decode requests only (exact decode)
    prefill: CPUAttentionMetadata | None  # prefill requests only, when mixed with decodes
    runtime: MagicPigRuntime
    sparse_plan: DecodePlan | None = None

    # vLLM reads these names on metadata objects in a few generic places.
    @property
    def num_actual_tokens(self) -> int:
        return self.full.num_actual_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.full.slot_mapping


class MagicPigMetadataBuilder(CPUAttentionMetadataBuilder):
    # Decodes first, so the decode/prefill split is a prefix of the batch.
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if vllm_config.speculative_config is not None:
            raise MagicPigConfigError("MAGICPIG does not support speculative decoding; drop --speculative-config")
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
        self.runtime = runtimes.attach(vllm_config)
        self.planner = StepPlanner(self.runtime.cfg, self.block_size, self.runtime.index)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> MagicPigMetadata:
        cam = common_attn_metadata
        full = super().build(common_prefix_len, cam, fast_build)
        # A 1-token chunk that is still prefilling has an incomplete prompt: keep it exact.
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=1, treat_short_extends_as_decodes=False
        )
        rt = self.runtime
        stats = rt.stats
        stats.steps += 1
        if num_prefills:
            stats.prefill_chunks += num_prefills
            stats.prefill_tokens += cam.num_actual_tokens - num_decode_tokens
        decode = prefill = None
        if num_decodes and num_prefills:
            d_cam, p_cam = split_attn_metadata(
                [
                    UBatchSlice(slice(0, num_decodes), slice(0, num_decode_tokens)),
                    UBatchSlice(
                        slice(num_decodes, cam.num_reqs), slice(num_decode_tokens, cam.num_actual_tokens)
                    ),
                ],
                cam,
            )
            decode = super().build(0, d_cam, fast_build)
            prefill = super().build(0, p_cam, fast_build)
        elif num_decodes:
            decode = full
        self.planner.observe_step(cam, num_decodes)
        plan = self.planner.plan(cam, num_decodes, rt.step_settings()) if num_decodes else None
        if rt.cfg.log_stats_interval and stats.steps % rt.cfg.log_stats_interval == 0:
            logger.info(stats.summary_line())
        return MagicPigMetadata(
            full=full,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            decode=decode,
            prefill=prefill,
            runtime=rt,
            sparse_plan=plan,
        )


class MagicPigImpl(CPUAttentionBackendImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs) -> None:
        # Backstops for what the start-up checks already reject; they name the layer feature.
        if alibi_slopes is not None:
            raise MagicPigConfigError("MAGICPIG does not support ALiBi; run this model without MAGICPIG")
        if sliding_window is not None:
            raise MagicPigConfigError("MAGICPIG does not support sliding-window attention")
        if sinks is not None:
            raise MagicPigConfigError("MAGICPIG does not support learned attention sinks")
        if logits_soft_cap:
            raise MagicPigConfigError("MAGICPIG does not support logit soft-capping")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        # Which layer this is, and whether it is dense, is known at the first forward (from the
        # layer's name and the runtime on the metadata).
        self.layer_index: int | None = None
        self.sparse_layer: SparseLayer | None = None

    def _resolve_layer(self, layer, rt: MagicPigRuntime) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_index = extract_layer_index(layer.layer_name)
        if self.layer_index not in rt.dense_layers:
            self.sparse_layer = SparseLayer(LayerContext(layer.layer_name, self.layer_index, self.num_heads,
                                                         self.num_kv_heads, self.head_size, self.scale, rt))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("MAGICPIG does not support fused output quantization")
        if attn_metadata is None:  # profiling / warm-up
            return output
        meta: MagicPigMetadata = attn_metadata
        if self.layer_index is None:
            self._resolve_layer(layer, meta.runtime)
        meta.runtime.stats.count_layer(layer.layer_name)
        nd = meta.num_decode_tokens
        if meta.num_decodes == 0 or self.sparse_layer is None:
            if meta.num_decodes:
                meta.runtime.stats.decode_exact[EXACT_DENSE_LAYER] += meta.num_decodes
            return super().forward(layer, query, key, value, kv_cache, meta.full, output)
        if meta.num_prefills:
            t = meta.full.num_actual_tokens
            super().forward(layer, query[nd:t], key[nd:t], value[nd:t], kv_cache, meta.prefill, output[nd:t])
        self.forward_decode(layer, query[:nd], key[:nd], value[:nd], kv_cache, meta, output[:nd])
        return output

    def forward_decode(self, layer, query, key, value, kv_cache, meta: MagicPigMetadata, output) -> None:
        """Decode attention for the batch's decode requests in a sparse layer."""
        plan = meta.sparse_plan
        kv = self.sparse_layer.begin(kv_cache, plan)
        if not plan.sparse:
            # Nothing to sample this step: the platform kernel is the fastest exact path.
            self.sparse_layer.account_exact(plan)
            super().forward(layer, query, key, value, kv_cache, meta.decode, output)
            return
        self.sparse_layer.forward(query, kv, plan, output)
