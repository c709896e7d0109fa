"""The KV layouts read what vLLM's CPU attention writes: random K/V stored by vLLM's own
``cpu_attn_reshape_and_cache`` in a layout's ISA, read back through the layout's views."""
from __future__ import annotations

import pytest
import torch

from vllm_magicpig.kv_layout import CPU_LAYOUTS, CpuAmxLayout, gather, logical_blocks


def _written_by_vllm(isa, layout, num_blocks, block_size, hkv, d, seed):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size - 5  # the last block part-filled
    keys = torch.randn(n, hkv, d, generator=gen).bfloat16()
    values = torch.randn(n, hkv, d, generator=gen).bfloat16()
    cache = torch.randn(*layout.cache_shape(num_blocks + 2, block_size, hkv, d), generator=gen).bfloat16()
    blocks = tuple(torch.randperm(num_blocks + 2, generator=gen)[:num_blocks].tolist())
    slots = torch.tensor(blocks).repeat_interleave(block_size)[:n] * block_size + torch.arange(n) % block_size
    kc, vc = cache.view(num_blocks + 2, hkv, 2 * block_size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, kc, vc, slots, isa)
    return layout.views(cache), blocks, keys, values


@pytest.mark.parametrize("isa", ["vec", "amx"])
@pytest.mark.parametrize("block_size,hkv,d", [(128, 3, 64), (32, 2, 128), (64, 1, 64)])
def test_views_read_what_vllm_wrote(isa, block_size, hkv, d):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("vLLM picks its AMX cache layout only on CPUs with AMX tiles; this one has none")
    layout = CPU_LAYOUTS[isa]()
    views, blocks, keys, values = _written_by_vllm(isa, layout, 5, block_size, hkv, d, seed=block_size + d)
    assert views.block_size == block_size and views.num_kv_heads == hkv and views.head_dim == d
    n = keys.shape[0]
    assert torch.equal(gather(views.key, blocks, 0, n), keys)
    assert torch.equal(gather(views.value, blocks, 0, n), values)
    lo, hi = block_size - 3, 3 * block_size + 7  # a run across block boundaries
    assert torch.equal(gather(views.key, blocks, lo, hi), keys[lo:hi])
    assert torch.equal(gather(views.value, blocks, lo, hi), values[lo:hi])
    second = logical_blocks(views.value, torch.tensor([blocks[1]]))[0]
    assert torch.equal(second, values[block_size : 2 * block_size])


def test_amx_layout_rejects_shapes_its_tiles_do_not_divide():
    with pytest.raises(ValueError, match="multiples of 16"):
        CpuAmxLayout().views(torch.zeros(2, 1, 24, 128, dtype=torch.bfloat16))


def test_the_kernel_rejects_a_view_that_is_neither_4_d_nor_tiled_6_d():
    from vllm_magicpig import kernel as kx

    k = torch.zeros(2, 16, 1, 4, 16, dtype=torch.bfloat16)  # 5-D: no layout of ours
    with pytest.raises(ValueError, match="4-D view .* or a 6-D tiled one"):
        kx.sparse_decode_attention(torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 4, dtype=torch.int32),
                                   torch.zeros(1, 1), [[]], k, k, block_table=torch.zeros(1, 1, dtype=torch.int32),
                                   dense_ranges=torch.zeros(1, 2, 2, dtype=torch.int32), scale=1.0, K=2, L=4,
                                   out=torch.empty(1, 1, 64, dtype=torch.bfloat16))
