"""The decode path's pieces without an engine: vLLM's cache layout as we read it,
the segment layout, and the evaluation baselines against exact attention."""
from __future__ import annotations

import math

import pytest
import torch

from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.control import StepSettings
from vllm_magicpig.sparse_decode import DecodePlan, LayerState, segment_layout


def _vec_cache(num_blocks, hkv, block, d, dtype=torch.bfloat16):
    return torch.full((num_blocks, hkv, block, 2 * d), float("nan"), dtype=dtype)


def _write(cache, key, value, slots):
    """Write through vLLM's own CPU cache-write op, exactly as the backend does."""
    from vllm import _custom_ops as ops

    nb, hkv, n, two_d = cache.shape
    kv = cache.view(nb, hkv, 2 * n, two_d // 2)
    key_cache, value_cache = kv.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")


@pytest.mark.parametrize("d,hkv,block", [(64, 3, 128), (128, 2, 32)])
def test_views_read_back_what_vllm_wrote(d, hkv, block):
    torch.manual_seed(torch.seed() % 2**31)
    nb, n = 12, 5 * block - 7
    cache = _vec_cache(nb, hkv, block, d)
    blocks = torch.randperm(nb)[: math.ceil(n / block)].tolist()
    slots = torch.tensor([blocks[i // block] * block + i % block for i in range(n)], dtype=torch.int64)
    key = torch.randn(n, hkv, d, dtype=torch.bfloat16)
    value = torch.randn(n, hkv, d, dtype=torch.bfloat16)
    _write(cache, key, value, slots)
    kview, vview = LayerState._views(None, cache)
    assert torch.equal(LayerState._gather(kview, tuple(blocks), 0, n), key)
    assert torch.equal(LayerState._gather(vview, tuple(blocks), 0, n), value)
    # an interior range, as segments and centres read it
    assert torch.equal(LayerState._gather(kview, tuple(blocks), 5, block + 9), key[5 : block + 9])


@pytest.mark.parametrize("end,unit,largest", [(256, 256, 32768), (13 * 256, 256, 1024), (40 * 128, 128, 2048)])
def test_segment_layout_is_aligned_binary_and_covers(end, unit, largest):
    segs = segment_layout(end, unit, largest)
    pos = 0
    for start, size in segs:
        assert start == pos and size % unit == 0 and size <= largest
        assert start % size == 0  # aligned: a longer context reuses these segments
        assert (size // unit) & (size // unit - 1) == 0  # a power-of-two level
        pos += size
    assert pos == end
    sizes = [s for _, s in segs]
    assert sizes == sorted(sizes, reverse=True)


def _exact(q, keys, values, scale, group):
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    w = torch.softmax(torch.einsum("shd,hd->hs", k, q.float()) * scale, dim=1)
    return torch.einsum("hs,shd->hd", w, v)


@pytest.mark.parametrize("method", ["topk", "quest"])
def test_baselines_full_budget_is_exact_and_small_budget_is_not(method):
    from vllm_magicpig import baselines

    d, hkv, group, block, s = 64, 3, 3, 128, 1000
    H = hkv * group
    cache = _vec_cache(10, hkv, block, d)
    blocks = list(range(10))[:8]
    key = torch.randn(s, hkv, d, dtype=torch.bfloat16)
    value = torch.randn(s, hkv, d, dtype=torch.bfloat16)
    _write(cache, key, value, torch.arange(s, dtype=torch.int64))
    state = LayerState(MagicPigConfig(), "layer", 1, H, hkv, d, 1 / math.sqrt(d))
    kview, vview = state._views(cache)
    q = torch.randn(1, H, d, dtype=torch.bfloat16) * 3
    bt = torch.tensor([blocks], dtype=torch.int32)
    dense = torch.tensor([[[0, 4], [900, s]]], dtype=torch.int32)
    ref = _exact(q[0], key, value, state.scale, group)
    for frac, should_match in ((1.0, True), (0.02, False)):
        state.settings = StepSettings(method, 10, 150, "request", frac, 16)
        plan = DecodePlan(state.settings, 1, bt, [s], dense, [0])
        out = torch.full((1, H, d), float("nan"))
        baselines.forward(state, q, kview, vview, plan, out)
        err = float((out[0] - ref).norm() / ref.norm())
        assert (err < 1e-5) == should_match, (frac, err)
