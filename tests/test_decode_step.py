"""kernel.DecodeStep: the checks every sparse layer of an engine step shares, made once, and the
ops seam's reuse of one step across a step's layers.

The failure a shared step invites is state from one layer leaking into the next (its cache, its
query or output pointer, its segments) or a step outliving what it read. Each test below would
catch one: layers over different caches, queries and segments must each get exactly what a single
call over their own inputs gives, and a block table changed in place must be read anew.
"""
from __future__ import annotations

import random

import pytest
import torch

from vllm_magicpig import kernel as kx
from vllm_magicpig.kv_layout import CpuAmxLayout, CpuVecLayout, KVViews
from vllm_magicpig.ops import CpuKernelOps

from test_kernel import Case

# (layout, its block size): vLLM's AMX blocks are multiples of 32 tokens
LAYOUTS = [(CpuVecLayout, 16), (CpuAmxLayout, 32)]


def new_seed():
    seed = random.randrange(2**31)
    print(f"seed={seed}")  # replay: torch.Generator().manual_seed(seed)
    return seed, torch.Generator().manual_seed(seed)


def layer_like(case: Case, layout, block_size: int, gen: torch.Generator, K: int, L: int):
    """Another layer of ``case``'s step: the same block table and cache geometry, its own cache
    contents, segments, centres and query (as an engine's next layer has)."""
    other = Case(gen, [len(c[0]) for c in case.ctx], case.hkv, case.H // case.hkv, case.D, K, L,
                 layout=layout, block_size=block_size)
    other.query = torch.randn(case.query.shape, generator=gen).to(case.query.dtype)
    cache = case._cache.clone().add_(torch.randn(case._cache.shape, generator=gen).to(case._cache.dtype))
    views = layout.views(cache)
    return other, views.key, views.value


def single_call(case, query, centres, segs, key, value, W, K, L, **kw):
    out = torch.full_like(query, float("nan"))
    cnt = torch.full((query.shape[0], case.H), -1, dtype=torch.int64)
    n = kx.magicpig_decode_attention(query, W, centres, segs, key, value, block_table=case.bt,
                                     dense_ranges=case.dense_ranges, scale=case.scale, K=K, L=L, out=out,
                                     sampled_counts=cnt, **kw)
    return out, cnt, n


@pytest.mark.parametrize("layout,block_size", LAYOUTS, ids=["vec", "amx"])
def test_a_step_gives_each_layer_what_a_single_call_gives(layout, block_size):
    """One step, three layers over different caches, queries, centres and segments, in turn and
    then again in another order: each is bit for bit a single call over its own inputs, and the
    layers' outputs differ (so a step that kept one layer's pointers would fail)."""
    seed, gen = new_seed()
    K, L = 6, 20
    # the last request is too short for a segment: served exactly, with no centre
    base = Case(gen, [300, 129, 16], 2, 3, 64, K, L, layout=layout(), block_size=block_size)
    layers = [(base, base.kview, base.vview)] + [layer_like(base, layout(), block_size, gen, K, L) for _ in range(2)]
    W = base.W  # one projection per (head size, K, L), shared by the layers
    out = torch.empty_like(base.query)
    step = kx.DecodeStep(query=base.query, key_cache=base.kview, value_cache=base.vview, out=out,
                         block_table=base.bt, dense_ranges=base.dense_ranges, K=K, L=L, projection=W)
    outs = {}
    for order in ([0, 1, 2], [2, 0, 1]):
        for i in order:
            c, key, value = layers[i]
            centres = [cen if segs else None for cen, segs in zip(c.centres, c.segs)]
            cnt = torch.full((3, base.H), -1, dtype=torch.int64)
            n = step.attend(c.query, centres, c.segs, key, value, out, scale=base.scale, sampled_counts=cnt)
            ref_out, ref_cnt, ref_n = single_call(base, c.query, centres, c.segs, key, value, W, K, L)
            assert torch.equal(out, ref_out), f"layer {i}, seed={seed}"
            assert torch.equal(cnt, ref_cnt) and n == ref_n == int(cnt.sum()), f"layer {i}, seed={seed}"
            assert n > 0
            if i in outs:
                assert torch.equal(out, outs[i]), f"layer {i} changed between turns, seed={seed}"
            outs[i] = out.clone()
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_a_step_reads_its_block_table_and_ranges_in_place():
    """The step holds the block table and dense ranges it was made with and reads them at every
    call: changed in place between layers, the next layer sees the change."""
    seed, gen = new_seed()
    K, L = 6, 20
    c = Case(gen, [300, 200], 2, 3, 64, K, L)
    centres = list(c.centres)
    out = torch.empty_like(c.query)
    step = kx.DecodeStep(query=c.query, key_cache=c.kview, value_cache=c.vview, out=out, block_table=c.bt,
                         dense_ranges=c.dense_ranges, K=K, L=L, projection=c.W)
    step.attend(c.query, centres, c.segs, c.kview, c.vview, out, scale=c.scale)
    first = out.clone()
    c.dense_ranges[0, 1, 1] -= 7  # the first request's tail ends 7 tokens earlier
    c.bt[1, 0] = c.bt[0, 0]  # the second request's sinks now read the first one's block
    step.attend(c.query, centres, c.segs, c.kview, c.vview, out, scale=c.scale)
    ref_out, _, _ = single_call(c, c.query, centres, c.segs, c.kview, c.vview, c.W, K, L)
    assert torch.equal(out, ref_out), f"seed={seed}"
    assert not torch.equal(out[0], first[0]) and not torch.equal(out[1], first[1]), f"seed={seed}"


def test_a_layer_that_does_not_match_its_step_is_refused():
    seed, gen = new_seed()
    K, L = 6, 20
    c = Case(gen, [300], 2, 3, 64, K, L)
    out = torch.empty_like(c.query)
    step = kx.DecodeStep(query=c.query, key_cache=c.kview, value_cache=c.vview, out=out, block_table=c.bt,
                         dense_ranges=c.dense_ranges, K=K, L=L, projection=c.W)

    def attend(**kw):
        args = dict(query=c.query, centres=list(c.centres), segments=c.segs, key_cache=c.kview,
                    value_cache=c.vview, out=out)
        args.update(kw)
        return step.attend(**args, scale=c.scale)

    assert attend() > 0  # the unmodified layer is fine
    with pytest.raises(ValueError, match="query must have the step's shape"):
        attend(query=torch.cat([c.query, c.query]))
    with pytest.raises(TypeError, match="query"):
        attend(query=c.query.float())
    with pytest.raises(TypeError, match="out"):
        attend(out=out.float())
    with pytest.raises(ValueError, match="key_cache must match the step's cache"):
        attend(key_cache=c.kview[:-1])
    with pytest.raises(ValueError, match="value_cache must match the step's cache"):
        attend(value_cache=c.vview.contiguous().transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match=r"centres\[0\]"):
        attend(centres=[c.centres[0][:, :32]])
    with pytest.raises(ValueError, match="R=1 entries"):
        attend(centres=[])
    with pytest.raises(ValueError, match="has segments but no centre"):
        attend(centres=[None])
    with pytest.raises(TypeError, match="holds a str"):
        attend(segments=[["not a segment"]])
    other = kx.build_segment(*c.ctx[0], c.centres[0], torch.randn(64, 5 * L, generator=gen), 5, L)
    with pytest.raises(ValueError, match=r"segment's \(Hkv, D, K, L"):
        attend(segments=[[other]])
    codes_only = kx.DecodeStep(query=c.query, key_cache=c.kview, value_cache=c.vview, out=out, block_table=c.bt,
                               dense_ranges=c.dense_ranges, K=K, L=L)
    with pytest.raises(ValueError, match="without a projection"):
        codes_only.attend(c.query, list(c.centres), c.segs, c.kview, c.vview, out, scale=c.scale)
    # the step's own inputs are checked once, when it is made
    with pytest.raises(ValueError, match="past the block table"):
        kx.DecodeStep(query=c.query, key_cache=c.kview, value_cache=c.vview, out=out, block_table=c.bt,
                      dense_ranges=torch.tensor([[[0, 4], [290, 10000]]], dtype=torch.int32), K=K, L=L,
                      projection=c.W)
    with pytest.raises(ValueError, match="projection"):
        kx.DecodeStep(query=c.query, key_cache=c.kview, value_cache=c.vview, out=out, block_table=c.bt,
                      dense_ranges=c.dense_ranges, K=K, L=L, projection=c.W[:, :10])


def seam_case(K: int, L: int):
    """Two requests (one too short for a segment), a fresh ops seam over their cache, an output."""
    seed, gen = new_seed()
    c = Case(gen, [300, 129], 2, 3, 64, K, L)
    return seed, c, CpuKernelOps(), KVViews(c.kview, c.vview), torch.empty_like(c.query)


def test_the_ops_seam_reuses_a_step_for_the_layers_of_one_plan_only():
    """CpuKernelOps makes one DecodeStep for the layers that pass the same block table, dense
    ranges and projection objects, and a new one for anything else: a new step's tensors, other
    (K, L, L_read), or a block table it could only read through a copy (non-contiguous)."""
    K, L = 6, 20
    seed, c, ops, kv, out = seam_case(K, L)

    def call(bt=c.bt, dr=c.dense_ranges, W=c.W, L_read=None, query=c.query):
        ops.attend_queries(query, W, list(c.centres), c.segs, kv, bt, dr, c.scale, K, L, out, L_read=L_read)
        return ops._step

    first = call()
    assert call() is first
    assert call(query=c.query.clone()) is first  # another layer's query: the same step
    assert call(bt=c.bt.clone()) is not first
    second = call(dr=c.dense_ranges.clone())
    assert second is not first and call(dr=second.dense_ranges) is second
    assert call(W=c.W.clone()) is not second
    assert call(L_read=L // 2) is not ops._step or ops._step.L_read == L // 2
    wide = torch.zeros(2, 2 * c.bt.shape[1], dtype=torch.int32)
    wide[:, ::2] = c.bt
    strided = wide[:, ::2]
    made = call(bt=strided)
    assert call(bt=strided) is not made  # a copy of the table could go stale: never reused
    ref_out, _, _ = single_call(c, c.query, list(c.centres), c.segs, c.kview, c.vview, c.W, K, L)
    assert torch.equal(out, ref_out), f"seed={seed}"


def test_the_ops_seam_checks_a_layers_tensors_once_and_still_refuses_a_bad_one():
    """The seam asks the step whether it serves a layer's query, caches and output, then lets
    ``attend`` skip those checks (``served=True``). A layer whose output or value cache does not fit
    the step must then get a new step, whose construction names the problem, never a native call
    over the wrong geometry."""
    K, L = 6, 20
    seed, c, ops, kv, out = seam_case(K, L)

    def call(out=out, kv=kv):
        return ops.attend_queries(c.query, c.W, list(c.centres), c.segs, kv, c.bt, c.dense_ranges, c.scale, K, L, out)

    assert call() > 0
    first = ops._step
    assert first.serves(c.query, c.kview, c.vview, out, c.bt, c.dense_ranges, c.W, K, L)
    assert not first.serves(c.query, c.kview, c.vview, out.float(), c.bt, c.dense_ranges, c.W, K, L)
    assert not first.serves(c.query, c.kview, c.vview[:-1], out, c.bt, c.dense_ranges, c.W, K, L)
    assert not first.serves(c.query[:1], c.kview, c.vview, out, c.bt, c.dense_ranges, c.W, K, L)
    with pytest.raises(TypeError, match="out dtype"):
        call(out=out.float())
    with pytest.raises(ValueError, match="value_cache"):
        call(kv=KVViews(c.kview, c.vview[:-1]))
    assert call() > 0  # a good layer after the refusals: a step made anew, the same result
    ref_out, _, _ = single_call(c, c.query, list(c.centres), c.segs, c.kview, c.vview, c.W, K, L)
    assert torch.equal(out, ref_out), f"seed={seed}"
