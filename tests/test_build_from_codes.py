"""kernel.build_segment_from_codes: a segment built from precomputed codes (as the GPU path hashes
keys next to the cache) is the segment build_segment makes from the same keys, values and centre.

Inputs are fresh random every run; each test draws its seed with test_kernel's ``new_seed`` and
puts it in every assertion message (replay with MAGICPIG_TEST_SEED).
"""
from __future__ import annotations

import pytest
import torch

from vllm_magicpig import kernel as kx

from helpers import to_paged
from test_kernel import PATHS, make_keys, new_seed

SINK, TAIL, G = 4, 4, 2  # dense tokens before / after the segment; query heads per KV head


def as_int16(codes):
    """int32 codes in [0, 2^16) as int16 holding the same uint16 bit patterns."""
    return torch.where(codes >= 1 << 15, codes - (1 << 16), codes).to(torch.int16)


def decode(seg, ctx, centre, codes, D, K, L, gen, force_scalar):
    """One request whose context is ctx = (keys, values) [SINK + n + TAIL, Hkv, D]: the segment
    covers [SINK, SINK + n), the rest is dense.  Half the query heads take the codes of a token of
    the segment (so they sample at least it), the other half random codes."""
    keys, vals = ctx
    hkv = keys.shape[1]
    H = hkv * G
    n = seg.num_tokens
    kview, vview, bt, _ = to_paged([ctx], 16, generator=gen)
    query = torch.randn(1, H, D, generator=gen).to(keys.dtype)
    qcodes = torch.randint(0, 1 << K, (1, H, L), generator=gen, dtype=torch.int32)
    for h in range(0, H, 2):
        qcodes[0, h] = codes[h // G, :, int(torch.randint(0, n, (1,), generator=gen))]
    kvh = torch.arange(H) // G
    qdc = (query[0].double() * centre.double()[kvh]).sum(-1).float().view(1, H)
    ranges = torch.tensor([[[0, SINK], [SINK + n, SINK + n + TAIL]]], dtype=torch.int32)
    out = torch.full((1, H, D), float("nan"), dtype=keys.dtype)
    lse = torch.full((1, H), float("nan"))
    cnt = torch.full((1, H), -7, dtype=torch.int64)
    kx.sparse_decode_attention(query, qcodes, qdc, [[seg]], kview, vview, block_table=bt, dense_ranges=ranges,
                               scale=D ** -0.5, K=K, L=L, out=out, lse=lse, sampled_counts=cnt,
                               force_scalar=force_scalar)
    return out, lse, cnt


# A covering set of the (dtype, Hkv, D, K, L, n) grid rather than its 216-case product: each value
# of every factor appears, with the edges (n = 1, K = 16 with its compact directory, L = 2) paired.
CASES = [
    (torch.bfloat16, 1, 64, 4, 2, 1),
    (torch.bfloat16, 3, 128, 10, 150, 1000),
    (torch.float16, 3, 64, 16, 40, 17),
    (torch.float16, 1, 128, 10, 2, 1000),
    (torch.bfloat16, 3, 64, 16, 150, 1),
    (torch.float16, 3, 128, 4, 40, 1000),
    (torch.bfloat16, 1, 128, 16, 2, 17),
    (torch.float16, 1, 64, 10, 150, 17),
]


@pytest.mark.parametrize("dtype,hkv,D,K,L,n", CASES)
def test_from_codes_equals_build(dtype, hkv, D, K, L, n):
    seed, gen = new_seed()
    msg = f"seed={seed} dtype={dtype} hkv={hkv} D={D} K={K} L={L} n={n}"
    keys, vals = make_keys(SINK + n + TAIL, hkv, D, gen, dtype=dtype)
    sk, sv = keys[SINK:SINK + n], vals[SINK:SINK + n]
    centre = sk.float().mean(0)
    W = torch.randn(D, K * L, generator=gen)
    seg = kx.build_segment(sk, sv, centre, W, K, L)
    codes = seg.codes()
    assert codes.shape == (hkv, L, n) and codes.dtype == torch.int32, msg
    # int32 codes, and int16 ones (uint16 bit patterns: negative for K = 16 codes >= 2^15).
    for got in (kx.build_segment_from_codes(sk, sv, centre, codes, K, L),
                kx.build_segment_from_codes(sk, sv, centre, as_int16(codes), K, L)):
        assert (got.num_tokens, got.num_kv_heads, got.head_dim, got.K, got.L, got.dtype) == \
            (n, hkv, D, K, L, dtype), msg
        assert got._c.dense_directory == seg._c.dense_directory, msg
        assert torch.equal(got.codes(), codes), f"codes differ ({msg})"
        assert got.index_bytes == seg.index_bytes, f"index bytes {got.index_bytes} != {seg.index_bytes} ({msg})"
        assert got.mirror_bytes == seg.mirror_bytes, msg
        for fs in PATHS:
            # The same draws for both segments: replay the generator from one state.
            state = gen.get_state()
            want = decode(seg, (keys, vals), centre, codes, D, K, L, gen, fs)
            gen.set_state(state)
            have = decode(got, (keys, vals), centre, codes, D, K, L, gen, fs)
            assert not torch.isnan(want[0]).any(), msg
            for name, a, b in zip(("out", "lse", "sampled_counts"), want, have):
                assert torch.equal(a, b), f"{name} differs from build_segment's ({msg} force_scalar={fs})"


def test_bad_codes_raise():
    seed, gen = new_seed()
    n, hkv, D, K, L = 50, 2, 64, 6, 20
    keys, vals = make_keys(n, hkv, D, gen)
    centre = keys.float().mean(0)
    seg = kx.build_segment(keys, vals, centre, torch.randn(D, K * L, generator=gen), K, L)
    codes = seg.codes()
    kx.build_segment_from_codes(keys, vals, centre, codes, K, L)  # the unmodified call is fine

    def bad(c, **kw):
        return kx.build_segment_from_codes(keys, vals, centre, c, kw.pop("K", K), L, **kw)

    too_big = codes.clone()
    too_big[1, 3, 7] = 1 << K
    negative = codes.clone()
    negative[0, 0, 0] = -1
    for c in (too_big, negative, as_int16(negative), codes + (1 << K)):
        with pytest.raises(ValueError, match=r"2\^K"):
            bad(c)
    with pytest.raises(ValueError, match=r"2\^K"):
        bad(codes, K=5)  # the codes use all 6 bits (n * L draws: some code is >= 32)
    for c in (codes[:, :, :-1], codes.transpose(0, 2), codes[0], codes.unsqueeze(0), codes[:, :5]):
        with pytest.raises(ValueError, match="codes must have shape"):
            bad(c)
    for c in (codes.long(), codes.float(), codes.to(torch.uint8), codes.to(torch.uint16)):
        with pytest.raises(TypeError, match="codes must have dtype"):
            bad(c)
    with pytest.raises(TypeError, match="Tensor"):
        bad(codes.tolist())
    with pytest.raises(ValueError, match="K must"):
        bad(codes, K=17)
    with pytest.raises(ValueError, match="tokens"):
        kx.build_segment_from_codes(keys[:0], vals[:0], centre, codes[:, :, :0], K, L)
    with pytest.raises(ValueError, match="centre"):
        kx.build_segment_from_codes(keys, vals, centre[:, :32], codes, K, L)
    with pytest.raises(TypeError, match="values dtype"):
        kx.build_segment_from_codes(keys, vals.half(), centre, codes, K, L)
    # A non-contiguous view of valid codes is fine.
    wide = torch.zeros(hkv, L, 2 * n, dtype=torch.int32)
    wide[:, :, ::2] = codes
    assert torch.equal(bad(wide[:, :, ::2]).codes(), codes), f"seed={seed}"


def test_c_entry_point_rejects_bad_codes():
    """Straight into _C (past kernel.py's checks): bad sizes and out-of-range codes raise
    ValueError from bindings.cpp / segment.cpp, never an out-of-bounds write."""
    seed, gen = new_seed()
    n, hkv, D, K, L = 40, 2, 64, 5, 8
    keys, vals = make_keys(n, hkv, D, gen)
    centre = keys.float().mean(0)
    codes = torch.randint(0, 1 << K, (hkv, L, n), generator=gen, dtype=torch.int32)
    c16 = codes.to(torch.int16)
    base = dict(keys=keys.data_ptr(), values=vals.data_ptr(), n=n, hkv=hkv, d=D, dtype=0, centre=centre.data_ptr(),
                codes=codes.data_ptr(), code_bytes=4, K=K, L=L)
    for ok in (base, {**base, "codes": c16.data_ptr(), "code_bytes": 2}):
        seg = kx.Segment(kx._C.build_segment_from_codes(**ok))
        assert torch.equal(seg.codes(), codes), f"seed={seed}"
    big = codes.clone()
    big[1, 7, 39] = 1 << K
    big16 = c16.clone()
    big16[0, 0, 0] = -1  # uint16 0xffff
    for bad in (dict(n=0), dict(n=kx.MAX_SEGMENT_TOKENS + 1), dict(hkv=0), dict(d=40), dict(dtype=2), dict(K=0),
                dict(K=17), dict(L=1), dict(keys=0), dict(codes=0), dict(code_bytes=8), dict(code_bytes=3),
                dict(codes=big.data_ptr()), dict(codes=big16.data_ptr(), code_bytes=2)):
        with pytest.raises(ValueError):
            kx._C.build_segment_from_codes(**{**base, **bad})
