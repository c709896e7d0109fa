"""Reading vLLM's paged KV cache: the one module that knows its layouts.

The sparse path never copies the cache: it takes strided views ``[num_blocks, block_size,
Hkv, D]`` of K and V, gathers token runs from them (segment builds, centres) and hands the
views to the kernel, which reads rows through their strides. A new platform's cache layout
is a new ``KVLayout`` here; nothing above this module reads cache shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVViews:
    """Strided K and V views ``[num_blocks, block_size, Hkv, D]`` of one layer's cache."""

    key: torch.Tensor
    value: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.key.shape[1]


class KVLayout(Protocol):
    name: str

    def views(self, kv_cache: torch.Tensor) -> KVViews: ...


class CpuVecLayout:
    """vLLM's CPU attention cache with the "vec" ISA.

    vLLM allocates it as ``[num_blocks, Hkv, block_size, 2 * D]``: each (block, head) region
    holds ``block_size`` rows of K, then ``block_size`` rows of V; inside it K is stored
    column-major (``[D, block_size]``) and V row-major.
    """

    name = "cpu_vec"

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_dim)

    def views(self, kv_cache: torch.Tensor) -> KVViews:
        nb, hkv, n, two_d = kv_cache.shape
        d = two_d // 2
        base = kv_cache.view(nb, hkv, 2 * n, d)
        s_blk, s_head = base.stride(0), base.stride(1)
        k = base.as_strided((nb, n, hkv, d), (s_blk, 1, s_head, n))
        v = base.as_strided((nb, n, hkv, d), (s_blk, d, s_head, 1), storage_offset=base.storage_offset() + n * d)
        return KVViews(k, v)


class FlashLayout:
    """vLLM's CUDA cache for FLASH_ATTN (and TRITON_ATTN): logical ``[num_blocks, Hkv, block_size,
    2 * D]`` per layer, each (block, head, token) cell holding K then V. Whatever the physical order
    (``KVCacheLayout``; MAGICPIG declares LBNHC, so a block is one contiguous ``[N, Hkv, 2D]`` run),
    the views below are the ones FlashAttentionImpl itself takes.
    """

    name = "flash"

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, 2 * head_dim)

    def views(self, kv_cache: torch.Tensor) -> KVViews:
        d = kv_cache.shape[-1] // 2
        k, v = kv_cache.transpose(1, 2).split(d, dim=-1)
        return KVViews(k, v)


def request_blocks(block_table: torch.Tensor, request: int, seq_len: int, block_size: int) -> tuple[int, ...]:
    """The physical block ids that hold tokens [0, seq_len) of one request."""
    return tuple(block_table[request, : (seq_len + block_size - 1) // block_size].tolist())


def gather(view: torch.Tensor, blocks: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Tokens [lo, hi) of a block run as a contiguous ``[n, Hkv, D]`` tensor."""
    n = view.shape[1]
    first, last = lo // n, (hi + n - 1) // n
    rows = view[torch.tensor(blocks[first:last], dtype=torch.long)]  # [nb, N, Hkv, D]
    rows = rows.reshape(-1, view.shape[2], view.shape[3])
    return rows[lo - first * n : hi - first * n].contiguous()
