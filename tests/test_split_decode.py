"""The CUDA path's device-agnostic pieces, run on the CPU: device-side hashing, the exact part's
virtual block table, and the whole split decode (exact part + host-sampled segments, merged by
LSE) against the float64 estimator and the single-call kernel.

The exact part's paged attention is ``helpers.paged_attention_with_lse``, a torch STAND-IN for
FLASH_ATTN; the merge is vLLM's own ``merge_attn_states`` (its torch path on the CPU).
"""
from __future__ import annotations

import pytest
import torch

from vllm_magicpig import device_ops, kernel
from vllm_magicpig.config import MagicPigConfig, parse_config
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.eval import reference as ref
from vllm_magicpig.index import segment_owner
from vllm_magicpig.kv_layout import FlashLayout, gather
from vllm_magicpig.layer import SparseLayer
from vllm_magicpig.planner import StepPlanner
from vllm_magicpig.runtime import simhash_projection

from helpers import FakeCam, paged_attention_with_lse, to_paged

D, HKV, G, BS = 64, 3, 3, 16
H = HKV * G
SEED = 4321  # pinned: the sampled-fraction assertions are statistical


def split_runtime(cfg: MagicPigConfig):
    pytest.importorskip("vllm")
    from vllm_magicpig.backend_cuda import make_cuda_runtime

    return make_cuda_runtime(cfg, num_layers=4, block_size=BS, dense_attention=paged_attention_with_lse)


def test_device_hash_equals_kernel_hash_except_float_ties():
    g = torch.Generator().manual_seed(SEED)
    for d, K, L in ((64, 10, 150), (128, 16, 8), (64, 1, 2)):
        x = torch.randn(3000, d, generator=g) + 0.5
        W = simhash_projection(d, K, L, seed=7)
        mine, theirs = device_ops.hash_codes(x, W, K, L), kernel.hash_codes(x, W, K, L)
        differ = (mine != theirs).nonzero().tolist()
        margin = ref.projection_margin(x, W, K, L)  # [N, L, K]
        for row, table in differ:  # only where a projection is within float32 rounding of 0
            assert float(margin[row, table].min()) < 1e-6, (d, K, L, row, table)
        assert len(differ) <= 3, differ


def _filled_flash_cache(contexts, gen):
    """A CPU tensor in FLASH_ATTN's cache layout holding each (keys, values) at shuffled blocks."""
    _, _, table, cache = to_paged(contexts, BS, spare_blocks=2, generator=gen, layout=FlashLayout())
    return cache, table


def test_flash_layout_views_are_what_flash_attention_reads():
    g = torch.Generator().manual_seed(SEED)
    keys = torch.randn(100, HKV, D, generator=g).bfloat16()
    vals = torch.randn(100, HKV, D, generator=g).bfloat16()
    cache, table = _filled_flash_cache([(keys, vals)], g)
    # FlashAttentionImpl: key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, -1)
    kc, vc = cache.transpose(1, 2).split(D, dim=-1)
    kv = FlashLayout().views(cache)
    assert torch.equal(kv.key, kc) and torch.equal(kv.value, vc)
    blocks = tuple(table[0].tolist())
    assert torch.equal(gather(kv.key, blocks, 3, 77), keys[3:77])
    assert torch.equal(gather(kv.value, blocks, 0, 100), vals)


def _plan(cfg, rt, seq_lens, table):
    planner = StepPlanner(rt.cfg, BS, rt.index)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return planner, planner.plan(FakeCam(seq, table), len(seq_lens), rt.step_settings())


def test_exact_blocks_and_segments_cover_each_context_once():
    g = torch.Generator().manual_seed(SEED)
    cfg = MagicPigConfig(sink_tokens=4, local_window=24, segment_tokens=64, min_sparse_context=300)
    rt = split_runtime(cfg)
    assert rt.cfg.sink_tokens == BS  # the exact part runs in whole blocks: sinks rounded up
    seq_lens = [1000, 301, 200, 777]
    table = torch.randperm(400, generator=g)[: 4 * 63].view(4, 63).to(torch.int32)
    _, plan = _plan(cfg, rt, seq_lens, table)
    assert plan.sparse == [0, 1, 3] and plan.exact_reason == {2: "short_context"}
    vtable, lens = device_ops.dense_block_tables(plan.block_table, plan.seq_lens, plan.dense_ranges, BS)
    for r, s in enumerate(seq_lens):
        seen = torch.zeros(s, dtype=torch.int64)
        # the exact part: virtual row position i holds the physical block of some context position
        phys_to_pos = {int(table[r, b]): b * BS for b in range(-(-s // BS))}
        n = int(lens[r])
        for i in range(n):
            block = int(vtable[r, i // BS])
            pos = phys_to_pos[block] + i % BS
            assert pos < s
            seen[pos] += 1
        for seg in plan.segments.get(r, []):
            _, start, size, _ = seg.key
            seen[seg.first_token : start + size] += 1
        assert bool((seen == 1).all()), (r, s, (seen != 1).nonzero().flatten()[:10].tolist())


def _run_split(cfg, contexts, queries, gen, steps=1):
    rt = split_runtime(cfg)
    cache, table = _filled_flash_cache(contexts, gen)
    layer = SparseLayer(LayerContext("model.layers.1.self_attn.attn", 1, H, HKV, D, D**-0.5, rt))
    _, plan = _plan(cfg, rt, [k.shape[0] for k, _ in contexts], table)
    out = torch.full(queries.shape, float("nan"), dtype=queries.dtype)
    layer.forward(queries, layer.begin(cache, plan), plan, out)
    return rt, layer, cache, table, plan, out


def _contexts(gen, lens, offset_scale=2.0):
    off = torch.randn(HKV, D, generator=gen) * offset_scale
    ctx = [((torch.randn(n, HKV, D, generator=gen) + off).bfloat16(), torch.randn(n, HKV, D, generator=gen).bfloat16())
           for n in lens]
    q = (torch.randn(len(lens), H, D, generator=gen) - 0.5 * off.repeat_interleave(G, 0)).bfloat16()
    return ctx, q


def test_split_decode_equals_the_float64_estimator():
    """The split path (exact blocks on the 'device', segments on the host kernel, LSE merge)
    computes the same estimator as the float64 reference fed with the same codes."""
    g = torch.Generator().manual_seed(SEED)
    cfg = MagicPigConfig(local_window=32, segment_tokens=128, min_sparse_context=256)
    contexts, q = _contexts(g, [1500, 900, 200])
    rt, layer, _, _, plan, out = _run_split(cfg, contexts, q, g)
    assert plan.sparse == [0, 1]
    st = rt.stats.snapshot()
    assert st["decode_sparse"] == 2 and st["decode_by_method"] == {"magicpig": 2}, st
    assert 0 < st["sampled_fraction"] < 0.5, st
    proj = layer.ctx.projection
    qcodes = device_ops.hash_codes(q.reshape(-1, D), proj, 10, 150).view(3, H, 150)
    for r, (keys, vals) in enumerate(contexts):
        s = keys.shape[0]
        covered = torch.zeros(s, dtype=torch.bool)
        kcodes = torch.zeros(HKV, 150, s, dtype=torch.int64)
        centre = torch.zeros(HKV, D)
        if r in plan.sparse:
            lo, hi = plan.covered_range(r)
            covered[lo:hi] = True
            segs = [rt.index.get_segment(segment_owner(layer.ctx.name, 10, 150), ref_.key) for ref_ in plan.segments[r]]
            kcodes[:, :, lo:hi] = torch.cat([sg.codes() for sg in segs], dim=2).long()
            spec = plan.centres[r]
            centre = keys[spec.start : spec.end].float().mean(0)
        want, _, _ = ref.magicpig_attention(q[r], keys, vals, centre, proj, 10, 150, covered, D**-0.5,
                                            query_codes=qcodes[r], kcodes=kcodes)
        err = float((out[r].double() - want).norm() / want.norm())
        assert err < 2e-2, (r, err)


def test_split_decode_equals_the_single_call_kernel():
    """Merging the two parts by LSE equals one kernel call over the same segments with the exact
    ranges attended in it (fp32 queries and outputs, so only summation order differs)."""
    g = torch.Generator().manual_seed(SEED + 1)
    cfg = MagicPigConfig(local_window=32, segment_tokens=128, min_sparse_context=256)
    contexts, q = _contexts(g, [2000, 700])
    q = q.float()
    rt, layer, cache, _, plan, out = _run_split(cfg, contexts, q, g)
    assert plan.sparse == [0, 1]
    # The same contexts in vLLM's CPU layout, one kernel call with dense ranges.
    kview, vview, bt, _ = to_paged(contexts, BS, generator=g)
    proj = layer.ctx.projection
    codes = device_ops.hash_codes(q.reshape(-1, D), proj, 10, 150).view(2, H, 150)
    centres = torch.stack([rt.index.centre(layer.ctx.name, plan.centres[r], None)[1] for r in range(2)])
    qdc = (q.view(2, HKV, G, D) * centres[:, :, None, :]).sum(-1).view(2, H)
    owner = segment_owner(layer.ctx.name, 10, 150)
    segs = [[rt.index.get_segment(owner, ref_.key) for ref_ in plan.segments[r]] for r in range(2)]
    single = torch.empty(2, H, D)
    kernel.sparse_decode_attention(q, codes, qdc, segs, kview, vview, block_table=bt,
                                   dense_ranges=plan.dense_ranges, scale=D**-0.5, K=10, L=150, out=single)
    torch.testing.assert_close(out, single, rtol=1e-4, atol=1e-5)


def test_exact_requests_are_exact_attention_in_the_split_path():
    g = torch.Generator().manual_seed(SEED + 2)
    cfg = MagicPigConfig(local_window=32, segment_tokens=128, min_sparse_context=1000)
    contexts, q = _contexts(g, [1500, 400, 999])
    _, _, _, _, plan, out = _run_split(cfg, contexts, q, g)
    assert plan.sparse == [0] and set(plan.exact_reason) == {1, 2}
    for r in (1, 2):
        keys, vals = contexts[r]
        want, _ = ref.exact_attention(q[r], keys, vals, D**-0.5)
        err = float((out[r].double() - want).norm() / want.norm())
        assert err < 1e-2, (r, err)


def test_split_decode_over_the_cap_is_served_exactly_and_counted():
    g = torch.Generator().manual_seed(SEED + 3)
    # parsed, as a user's config is: a cap the user set is kept (unset, the CUDA runtime sizes it)
    cfg = parse_config({"magicpig": dict(local_window=32, segment_tokens=128, min_sparse_context=256,
                                         index_memory_mb=1)})
    contexts, q = _contexts(g, [6000])
    rt, _, _, _, _, out = _run_split(cfg, contexts, q, g)
    st = rt.stats.snapshot()
    assert st["decode_exact"] == {"evicted": 1} and st["decode_sparse"] == 0, st
    keys, vals = contexts[0]
    want, _ = ref.exact_attention(q[0], keys, vals, D**-0.5)
    assert float((out[0].double() - want).norm() / want.norm()) < 1e-2


def test_segments_built_from_device_codes_match_host_built_segments():
    g = torch.Generator().manual_seed(SEED + 4)
    keys = (torch.randn(777, HKV, D, generator=g) + 1).bfloat16()
    vals = torch.randn(777, HKV, D, generator=g).bfloat16()
    centre = keys.float().mean(0)
    W = simhash_projection(D, 10, 150, seed=3)
    codes = device_ops.centred_key_codes(keys, centre, W, 10, 150)
    seg = kernel.build_segment_from_codes(keys, vals, centre, codes, 10, 150)
    host = kernel.build_segment(keys, vals, centre, W, 10, 150)
    differ = (seg.codes() != host.codes()).float().mean().item()
    assert differ < 1e-4, differ  # float32 ties only
    assert (seg.index_bytes, seg.mirror_bytes) == (host.index_bytes, host.mirror_bytes)
