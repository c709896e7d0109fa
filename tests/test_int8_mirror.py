"""The int8 mirror: segments that keep their sampled K/V rows as 8-bit values with a scale per row.

The kernel's estimator over an int8 mirror is its estimator over the dequantized rows (the
reference's ``int8_rows``, bit for bit the kernel's quantizer), with the sampled keys those of
the cache's own keys. These tests hold it to the float64 reference on fresh, replayable seeds,
check that the twins agree, that merging keeps the rows, and that the memory halves.
"""
from __future__ import annotations

import pytest
import torch

from vllm_magicpig import kernel as kx
from vllm_magicpig.eval import reference as ref

from test_kernel import CONFIGS, HAS_FAST, PATHS, TWIN_RTOL, Case, check_case, make_keys, new_seed, pinned_seed


def test_quantizer_matches_reference_bit_for_bit():
    """The rows an int8 segment keeps equal int8_rows of its input, bit for bit, and lie within half
    a step of it: including an all-zero row, a row with one non-zero, and rows near the ends of
    the bf16 range, and a row whose codes fall exactly half-way between integers (rounded to even,
    as torch.round does). A cache-dtype segment keeps its input as it is."""
    seed, gen = new_seed()
    D = 64
    keys, vals = make_keys(40, 2, D, gen)
    keys[3, 0] = 0
    vals[5, 1] = 0
    vals[6, 0] = 0
    vals[6, 0, 7] = -3.0
    keys[7] *= 1e30
    # max|x| = 127, so x * 127 / max|x| = x: the halves must round to even (half away gives 1, 3, -1, -3)
    halves = torch.tensor([127.0, 0.5, 2.5, -0.5, -2.5, 1.5, -1.5, 126.5])
    vals[9, 1] = halves.repeat(D // len(halves)).to(vals.dtype)
    vals[8] *= 1e-30
    W = torch.randn(D, 40, generator=gen)
    centre = keys.float().mean(0)
    k8, v8 = kx.build_segment(keys, vals, centre, W, 4, 10, mirror="int8").rows()
    for name, x, got in (("K", keys, k8), ("V", vals, v8)):
        want = ref.int8_rows(x)
        assert torch.equal(got.double(), want), f"{name} rows differ (seed={seed})"
        # Half a step, plus the float32 rounding of scale * q.
        bound = x.float().abs().amax(-1, keepdim=True).double() / 254 + 1e-6 * x.double().abs()
        assert ((want - x.double()).abs() <= bound).all(), f"{name} (seed={seed})"
    assert (k8[3, 0] == 0).all() and v8[6, 0, 7] == -3.0 and (v8[6, 0].count_nonzero() == 1)
    assert v8[9, 1, :8].tolist() == [127.0, 0.0, 2.0, -0.0, -2.0, 2.0, -2.0, 126.0]
    kc, vc = kx.build_segment(keys, vals, centre, W, 4, 10).rows()
    assert torch.equal(kc, keys.float()) and torch.equal(vc, vals.float())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("force_scalar", PATHS)
def test_estimator_matches_reference(name, force_scalar):
    """Every estimator configuration of test_kernel, its segments built with an int8 mirror, against
    the float64 estimator over the dequantized rows (dense tokens stay the cache's)."""
    seed, gen = new_seed()
    lens, hkv, G, D, K, L, extra = CONFIGS[name]
    case = Case(gen, lens, hkv, G, D, K, L, mirror="int8", **extra)
    check_case(case, seed, force_scalar, f"{name} int8")


def test_same_samples_and_half_the_memory():
    """An int8 segment has the same codes as a cache-dtype one over the same keys (so the same keys
    are sampled), and 2D + 12 bytes a token per KV head against 4D + 4; built from those codes it is
    the same segment, rows and all."""
    seed, gen = new_seed()
    n, hkv, D, K, L = 3000, 2, 128, 10, 150
    keys, vals = make_keys(n, hkv, D, gen)
    centre, W = keys.float().mean(0), torch.randn(D, K * L, generator=gen)
    a = kx.build_segment(keys, vals, centre, W, K, L)
    b = kx.build_segment(keys, vals, centre, W, K, L, mirror="int8")
    assert (a.mirror, b.mirror) == ("cache", "int8")
    assert torch.equal(a.codes(), b.codes()), f"seed={seed}"
    assert a.index_bytes == b.index_bytes
    assert a.mirror_bytes == n * hkv * (4 * D + 4) and b.mirror_bytes == n * hkv * (2 * D + 12)
    c = kx.build_segment_from_codes(keys, vals, centre, b.codes(), K, L, mirror="int8")
    assert c.mirror == "int8" and torch.equal(c.codes(), b.codes()), f"seed={seed}"
    for x, y in zip(c.rows(), b.rows()):
        assert torch.equal(x, y), f"built from codes != built (seed={seed})"


def test_merge_keeps_rows_and_refuses_mixed_mirrors():
    seed, gen = new_seed()
    for K, L, sizes in ((10, 30, [1500, 500]), (11, 20, [700, 300, 1000])):
        c = Case(gen, [2100], 2, 3, 64, K, L, seg_sizes=[sizes], mirror="int8")
        keys, vals = c.ctx[0]
        whole = kx.build_segment(keys[4:2004], vals[4:2004], c.centres[0], c.W, K, L, mirror="int8")
        merged = kx.merge_segments(c.segs[0])
        assert merged.mirror == "int8" and merged.mirror_bytes == whole.mirror_bytes
        assert torch.equal(merged.codes(), whole.codes()), f"seed={seed} K={K}"
        for x, y in zip(merged.rows(), whole.rows()):
            assert torch.equal(x, y), f"merged rows differ (seed={seed} K={K})"
        for fs in PATHS:
            for x, y in zip(c.run(fs, segs=[[whole]]), c.run(fs, segs=[[merged]])):
                assert torch.equal(x, y), f"merged != single build (seed={seed} K={K} force_scalar={fs})"
    keys, vals = make_keys(100, 1, 64, gen)
    W = torch.randn(64, 40, generator=gen)
    a = kx.build_segment(keys[:50], vals[:50], torch.zeros(1, 64), W, 4, 10)
    b = kx.build_segment(keys[50:], vals[50:], torch.zeros(1, 64), W, 4, 10, mirror="int8")
    with pytest.raises(ValueError, match="mirror"):
        kx.merge_segments([a, b])
    with pytest.raises(ValueError, match="mirror must be one of"):
        kx.build_segment(keys, vals, torch.zeros(1, 64), W, 4, 10, mirror="fp8")


@pytest.mark.skipif(not HAS_FAST, reason="no SIMD path on this CPU")
def test_fast_path_matches_scalar():
    """The twins dequantize with one rounding each, so their rows are the same bits; the outputs
    differ only as the cache-dtype twins do (FMA and summation order)."""
    seed, gen = new_seed()
    c = Case(gen, [5000, 2000], 2, 4, 128, 9, 100, seg_sizes=[[3000, 1900], [1900]], qdtype=torch.float32,
             mirror="int8")
    o1, l1, c1 = c.run(True)
    o2, l2, c2 = c.run(False)
    msg = f"seed={seed}"
    assert torch.equal(c1, c2), msg
    bound = TWIN_RTOL * o2.double().abs().amax(-1, keepdim=True)
    assert ((o1.double() - o2.double()).abs() <= bound).all(), f"output gap ({msg})"
    assert ((l1 - l2).abs() <= TWIN_RTOL * l2.abs().clamp_min(1)).all(), f"lse gap ({msg})"


@pytest.mark.parametrize("pinned", [7, 1234])
@pytest.mark.parametrize("query_scale", [1.0, 4.0])
def test_int8_error_is_small_against_the_sampling_error(pinned, query_scale):
    """What the int8 rows cost in accuracy, at K = 10, L = 150 on 8K tokens with a common key offset,
    flat and peaked attention: the output moves from the cache-dtype mirror's by under a tenth of
    what sampling already moves it from exact attention (pinned seeds: a statistical statement)."""
    seed, gen = pinned_seed(pinned)
    kw = dict(seg_sizes=[[8000]], sink=4, window=60, query_scale=query_scale)
    base = Case(gen, [8064], 2, 4, 128, 10, 150, **kw)
    i8 = Case(pinned_seed(pinned)[1], [8064], 2, 4, 128, 10, 150, mirror="int8", **kw)
    assert torch.equal(base.query, i8.query)
    out_b = base.run(False)[0][0].double()
    out_8 = i8.run(False)[0][0].double()
    keys, vals = base.ctx[0]
    exact, _ = ref.exact_attention(base.query[0], keys, vals, base.scale)
    sampling = (out_b - exact).norm(dim=-1).mean().item()
    gap = (out_8 - out_b).norm(dim=-1).mean().item()
    assert 0 < gap < 0.1 * sampling, f"int8 gap {gap:.3g} vs sampling error {sampling:.3g} (seed={seed})"
