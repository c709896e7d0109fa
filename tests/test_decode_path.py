"""The decode path's pieces without an engine: vLLM's cache layout as we read it,
the segment layout, and the evaluation baselines against exact attention."""
from __future__ import annotations

import math

import pytest
import torch

from vllm_magicpig import kernel
from vllm_magicpig.config import MagicPigConfig
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.index import segment_owner
from vllm_magicpig.kv_layout import CpuVecLayout, gather
from vllm_magicpig.layer import SparseLayer
from vllm_magicpig.planner import DecodePlan, StepPlanner, StepSettings, covered_end_for, segment_layout

from helpers import FakeCam, make_runtime


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
    kv = CpuVecLayout().views(cache)
    assert torch.equal(gather(kv.key, tuple(blocks), 0, n), key)
    assert torch.equal(gather(kv.value, tuple(blocks), 0, n), value)
    # an interior range, as segments and centres read it
    assert torch.equal(gather(kv.key, tuple(blocks), 5, block + 9), key[5 : block + 9])


@pytest.mark.parametrize("end,unit,largest", [(512, 512, 32768), (13 * 512, 512, 4096), (40 * 128, 128, 2048)])
def test_segment_layout_is_few_full_segments_and_one_growing(end, unit, largest):
    segs = segment_layout(end, unit, largest)
    pos = 0
    for i, (start, size) in enumerate(segs):
        assert start == pos and size % unit == 0 and 0 < size <= largest
        if i < len(segs) - 1:
            assert size == largest and start % largest == 0  # full segments never change
        pos += size
    assert pos == end
    assert len(segs) == -(-end // largest)  # as few as possible
    # a longer context keeps every full segment and only grows the last one
    longer = segment_layout(end + unit, unit, largest)
    assert longer[: len(segs) - 1] == segs[:-1]


@pytest.mark.parametrize("prompt_end,unit,largest", [(16384, 512, 32768), (40960, 512, 32768), (512, 512, 4096)])
def test_prompt_segments_never_change_as_decoding_grows(prompt_end, unit, largest):
    """The prompt's segments (up to the tokens covered at its first decode) stay as they are while
    decoded tokens are covered: those get segments of their own, starting at the prompt's end,
    whose last one grows a unit at a time."""
    prompt = segment_layout(prompt_end, unit, largest, prompt_end)
    assert prompt == segment_layout(prompt_end, unit, largest)  # nothing decoded yet: the plain layout
    for extra in range(unit, 3 * largest, 7 * unit):
        segs = segment_layout(prompt_end + extra, unit, largest, prompt_end)
        assert segs[: len(prompt)] == prompt
        decoded = segs[len(prompt):]
        assert decoded[0][0] == prompt_end and sum(size for _, size in decoded) == extra
        assert all(size == largest for _, size in decoded[:-1]) and 0 < decoded[-1][1] <= largest
        assert all(size % unit == 0 for _, size in decoded)
    # covered short of the prompt's end (a GPU mirror still copying): the prompt's part grows
    assert segment_layout(prompt_end - unit, unit, largest, prompt_end) == segment_layout(prompt_end - unit, unit,
                                                                                          largest)


@pytest.mark.parametrize("prompt_end,unit", [(16256, 512), (16384, 512), (1024, 512), (3968, 256)])
def test_cover_reaches_the_prompts_last_block_then_grows_in_units(prompt_end, unit):
    """The prompt is covered up to its last full block before the local window (not rounded down
    to a unit, which left up to a unit of prompt tokens in every step's exact tail); past it, whole
    units of decoded tokens; short of it, whole units."""
    window, block = 64, 128
    for s in range(prompt_end + window, prompt_end + window + 3 * unit + 1, 37):
        end = covered_end_for(s - window, unit, prompt_end)
        assert end == prompt_end + ((s - window - prompt_end) // unit) * unit
        assert window <= s - end < window + unit  # the exact tail: the window plus under a unit
    # the first decode of a prompt of n tokens: its exact tail is the window plus under a block
    for n in range(prompt_end + window, prompt_end + window + block):
        assert covered_end_for(n - window, unit, prompt_end) == prompt_end and n - prompt_end < window + block
    for limit in range(0, prompt_end, 53):  # short of the prompt's end: whole units
        assert covered_end_for(limit, unit, prompt_end) == (limit // unit) * unit
    ends = [covered_end_for(x, unit, prompt_end) for x in range(0, prompt_end + 4 * unit)]
    assert ends == sorted(ends)  # monotonic: the mirror's limit and the window's combine by min


def _exact(q, keys, values, scale, group):
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    w = torch.softmax(torch.einsum("shd,hd->hs", k, q.float()) * scale, dim=1)
    return torch.einsum("hs,shd->hd", w, v)


@pytest.mark.parametrize("method", ["topk", "quest"])
def test_baselines_full_budget_is_exact_and_small_budget_is_not(method):
    from vllm_magicpig.eval.decode.baselines import BaselineDecode

    d, hkv, group, block, s = 64, 3, 3, 128, 1000
    H = hkv * group
    cache = _vec_cache(10, hkv, block, d)
    blocks = list(range(10))[:8]
    key = torch.randn(s, hkv, d, dtype=torch.bfloat16)
    value = torch.randn(s, hkv, d, dtype=torch.bfloat16)
    _write(cache, key, value, torch.arange(s, dtype=torch.int64))
    ctx = LayerContext("layer", 1, H, hkv, d, 1 / math.sqrt(d), make_runtime(MagicPigConfig()))
    kv = CpuVecLayout().views(cache)
    q = torch.randn(1, H, d, dtype=torch.bfloat16) * 3
    bt = torch.tensor([blocks], dtype=torch.int32)
    dense = torch.tensor([[[0, 4], [900, s]]], dtype=torch.int32)
    ref = _exact(q[0], key, value, ctx.scale, group)
    for frac, should_match in ((1.0, True), (0.02, False)):
        ctx.settings = StepSettings(method, 10, 150, "request", {"budget_fraction": frac, "quest_page_size": 16})
        plan = DecodePlan(ctx.settings, 1, bt, [s], dense, [0])
        out = torch.full((1, H, d), float("nan"))
        BaselineDecode(method).forward(ctx, q, kv, plan, out)
        err = float((out[0] - ref).norm() / ref.norm())
        assert (err < 1e-5) == should_match, (frac, err)


def test_layer_forward_matches_reference_estimator_across_growth_and_merges():
    """The whole per-layer path (planner, centre, segments with levels, vLLM cache reads,
    kernel) equals the float64 estimator over the same codes, before and after the
    context grows enough for the decoded tokens' segment to be built and then to merge."""
    from vllm_magicpig.eval import reference

    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    d, hkv, group, block = 64, 3, 3, 128
    H = hkv * group
    cfg = MagicPigConfig(segment_tokens=256, min_sparse_context=512)
    lens = [1400, 2300]
    grow = 600  # in two steps: covered_end passes one unit boundary (the decoded tokens' segment), then another (merge)
    nbr = math.ceil((max(lens) + grow) / block)
    cache = torch.zeros(1 + 2 * nbr, hkv, block, 2 * d, dtype=torch.bfloat16)
    bt = (torch.randperm(2 * nbr, generator=g) + 1).view(2, nbr).to(torch.int32)  # disjoint, shuffled
    off = torch.randn(hkv, d, generator=g) * 2
    keys = [(torch.randn(n + grow, hkv, d, generator=g) + off).bfloat16() for n in lens]
    vals = [torch.randn(n + grow, hkv, d, generator=g).bfloat16() for n in lens]
    for r, n in enumerate(lens):
        slots = bt[r].long().repeat_interleave(block)[: n + grow] * block + torch.arange(n + grow) % block
        _write(cache, keys[r], vals[r], slots)
    rt = make_runtime(cfg)
    layer = SparseLayer(LayerContext("model.layers.1.self_attn.attn", 1, H, hkv, d, d ** -0.5, rt))
    planner = StepPlanner(cfg, block, rt.index)
    settings = StepSettings("magicpig", 10, 150, "request")
    built_before = None
    for step, extra in enumerate((0, grow // 2, grow)):
        seq = torch.tensor([n + extra for n in lens], dtype=torch.int32)
        plan = planner.plan(FakeCam(seq, bt), len(lens), settings)
        assert plan.sparse == [0, 1], f"seed {seed}"
        q = (torch.randn(len(lens), H, d, generator=g) - 0.5 * off.repeat_interleave(group, 0)).bfloat16()
        out = torch.full((len(lens), H, d), float("nan"), dtype=torch.bfloat16)
        layer.forward(q, layer.begin(cache, plan), plan, out)
        proj = layer.ctx.projection
        qcodes = kernel.hash_codes(q.reshape(-1, d), proj, 10, 150).view(len(lens), H, 150)
        for r in range(len(lens)):
            s = int(seq[r])
            lo, hi = int(plan.dense_ranges[r, 0, 1]), int(plan.dense_ranges[r, 1, 0])
            assert lo == cfg.sink_tokens and s - hi >= cfg.local_window, f"seed {seed}"
            if step == 0:  # the prompt is covered to its last full block before the window (2300: 2176, not 2048)
                assert s - hi < cfg.local_window + block, (s, hi)
            segs = [rt.index.get_segment(segment_owner(layer.ctx.name, 10, 150), ref.key) for ref in plan.segments[r]]
            kcodes = torch.zeros(hkv, 150, s, dtype=torch.int64)
            kcodes[:, :, lo:hi] = torch.cat([sg.codes() for sg in segs], dim=2).long()
            covered = torch.zeros(s, dtype=torch.bool)
            covered[lo:hi] = True
            spec = plan.centres[r]
            centre = keys[r][spec.start : spec.end].float().mean(0)
            ref_out, _, sampled = reference.magicpig_attention(
                q[r], keys[r][:s], vals[r][:s], centre, proj, 10, 150, covered, layer.ctx.scale,
                query_codes=qcodes[r], kcodes=kcodes)
            assert 0 < sampled.float().mean() < 0.5, f"seed {seed}"
            err = float((out[r].double() - ref_out).norm() / ref_out.norm())
            assert err < 2e-2, f"seed {seed} step {step} request {r}: rel err {err}"
        if step == 0:
            built_before = dict(rt.stats.index)
    after = dict(rt.stats.index)
    assert after.get("segments_merged", 0) > built_before.get("segments_merged", 0), (built_before, after)
