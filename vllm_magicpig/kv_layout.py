"""Reading vLLM's paged KV cache: the one module that knows its layouts.

The sparse path never copies the cache: it takes strided views of K and V, gathers token runs
from them (segment builds, centres) and hands the views to the kernel, which reads rows through
their strides. A view is ``[num_blocks, block_size, Hkv, D]``, or, for a layout that tiles tokens
and elements (AMX), ``[num_blocks, block_size / a, a, Hkv, D / b, b]``: the same axes, each of
token and element split in two, so that every layout is one strided tensor. A new platform's
cache layout is a new ``KVLayout`` here; nothing above this module reads cache shapes.
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
        return block_size(self.key)

    @property
    def num_kv_heads(self) -> int:
        return num_kv_heads(self.key)

    @property
    def head_dim(self) -> int:
        return head_dim(self.key)


def block_size(view: torch.Tensor) -> int:
    """Tokens per block of a 4-D or 6-D (split) view."""
    return view.shape[1] * view.shape[2] if view.dim() == 6 else view.shape[1]


def num_kv_heads(view: torch.Tensor) -> int:
    return view.shape[3] if view.dim() == 6 else view.shape[2]


def head_dim(view: torch.Tensor) -> int:
    return view.shape[4] * view.shape[5] if view.dim() == 6 else view.shape[3]


def logical_blocks(view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Blocks ``index`` of a view as ``[len(index), block_size, Hkv, D]`` (a copy for a split view)."""
    rows = view.index_select(0, index)
    return rows.reshape(len(index), block_size(view), num_kv_heads(view), head_dim(view))


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


class CpuAmxLayout(CpuVecLayout):
    """vLLM's CPU attention cache with the "amx" ISA (x86 CPUs with AMX tiles, bf16).

    The allocation is the "vec" one, ``[num_blocks, Hkv, block_size, 2 * D]``: per (block, head)
    ``block_size * D`` elements of K, then as many of V, each tiled for AMX's bf16 pairs. K is in
    groups of 16 tokens, each ``[D / 2][16 tokens][2 elements]``, so element (t, j) sits at
    ``(t // 16) * 16 D + (j // 2) * 32 + (t % 16) * 2 + j % 2``; V is in groups of 16 elements,
    each ``[block_size / 2][16 elements][2 tokens]``: ``(j // 16) * 16 block_size + (t // 2) * 32 +
    (j % 16) * 2 + t % 2``. (Read off vLLM's ``cpu_attn_reshape_and_cache(..., "amx")``;
    test_kv_layouts.py checks it against that op.) Only the views differ from "vec"'s.
    """

    name = "cpu_amx"

    def views(self, kv_cache: torch.Tensor) -> KVViews:
        nb, hkv, n, two_d = kv_cache.shape
        d = two_d // 2
        if n % 16 or d % 16:
            raise ValueError(f"the AMX cache layout needs block_size and head_dim multiples of 16, got {n}, {d}")
        s_blk, s_head, off = kv_cache.stride(0), kv_cache.stride(1), kv_cache.storage_offset()
        k = kv_cache.as_strided((nb, n // 16, 16, hkv, d // 2, 2), (s_blk, 16 * d, 2, s_head, 32, 1), off)
        v = kv_cache.as_strided((nb, n // 2, 2, hkv, d // 16, 16), (s_blk, 32, 1, s_head, 16 * n, 2), off + n * d)
        return KVViews(k, v)


# vLLM's CPU attention ISAs (``CPUAttentionMetadataBuilder.isa``) whose cache layouts are read here.
CPU_LAYOUTS: dict[str, type[CpuVecLayout]] = {"vec": CpuVecLayout, "amx": CpuAmxLayout}


def amx_granted() -> bool:
    """Whether this process can run vLLM's AMX attention kernel: the CPU has AMX tiles and Linux
    granted their state, asked for here. An engine's oneDNN matmuls ask before attention first
    runs; a test or benchmark that calls vLLM's AMX kernel directly must ask itself, or its first
    tile instruction dies of SIGILL."""
    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


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
    n = block_size(view)
    first, last = lo // n, (hi + n - 1) // n
    rows = logical_blocks(view, torch.tensor(blocks[first:last], dtype=torch.long, device=view.device))
    rows = rows.reshape(-1, num_kv_heads(view), head_dim(view))
    return rows[lo - first * n : hi - first * n].contiguous()
