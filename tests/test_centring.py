"""Evaluation-only centrings: RoPE helper, calibration sums, and the per-key-centre torch
estimator against the float64 reference (and the C++ kernel where one centre per request)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vllm_magicpig import kernel
from vllm_magicpig.eval import reference
from vllm_magicpig.eval.decode import centring
from vllm_magicpig.eval.decode import per_key as per_token_centres
from vllm_magicpig.eval.decode import settings as control
from vllm_magicpig.ops import CpuKernelOps
from vllm_magicpig.runtime import simhash_projection as projection

from helpers import make_runtime, to_paged


def _rope_complex(x: torch.Tensor, pos: torch.Tensor, theta: float, factor: float = 1.0) -> torch.Tensor:
    """Independent neox RoPE: dims (j, j + D/2) as one complex number times e^{i p w_j}."""
    D = x.shape[-1]
    half = D // 2
    w = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / D)
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    rot = torch.polar(torch.ones(len(pos), half, dtype=torch.float64), (pos.double() / factor)[:, None] * w)
    z = z * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_rope_matches_complex_rotation_and_inverts(factor):
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rope = centring.Rope(64, 100000.0, factor)
    x = torch.randn(50, 3, 64, generator=g)
    pos = torch.randint(0, 8192, (50,), generator=g)
    y = rope.rotate(x, pos)
    torch.testing.assert_close(y.double(), _rope_complex(x, pos, 100000.0, factor), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(rope.rotate(y, pos, inverse=True), x, atol=2e-4, rtol=1e-4)


def test_rope_from_hf_config():
    class Cfg:
        rope_parameters = {"rope_theta": 5e5, "rope_type": "linear", "factor": 8.0}

    class Yarn:
        rope_parameters = {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}

    assert centring.Rope.from_hf_config(Cfg(), 64) == centring.Rope(64, 5e5, 8.0)
    assert centring.Rope.from_hf_config(Yarn(), 64) is None


def test_calibration_means_match_direct_computation():
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    rope = centring.Rope(32, 10000.0)
    cal = centring.LayerCalibration(2, 32)
    a, b = torch.randn(40, 2, 32, generator=g), torch.randn(25, 2, 32, generator=g)
    cal.add(a, rope)
    cal.add(b, rope)
    # positions 10..30: a covers all, b covers 10..24
    want = torch.cat([a[10:30], b[10:25]]).double().mean(0).float()
    torch.testing.assert_close(cal.position_mean(10, 30), want)
    # past the longest calibration text: only the positions seen count
    torch.testing.assert_close(cal.position_mean(30, 100), a[30:40].double().mean(0).float())
    pre = torch.cat([rope.rotate(a, torch.arange(40), inverse=True), rope.rotate(b, torch.arange(25), inverse=True)])
    torch.testing.assert_close(cal.pre_rope_mean(), pre.double().mean(0).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="calibrate with longer text"):
        cal.position_mean(100, 200)


def test_piece_bounds_cut_on_the_absolute_grid():
    assert centring.piece_bounds(4, 1100, 512) == [(4, 512), (512, 1024), (1024, 1100)]
    assert centring.piece_bounds(512, 1024, 512) == [(512, 1024)]
    assert centring.piece_bounds(7, 7, 512) == []


def test_segment_centres_are_piece_means():
    keys = torch.randn(600, 3, 16)
    c = centring.token_centres(None, "segment", "layer", keys, 100, 256)  # positions 100..699
    torch.testing.assert_close(c[0], keys[:156].mean(0))
    torch.testing.assert_close(c[200], keys[156:412].mean(0))
    torch.testing.assert_close(c[-1], keys[412:].mean(0))


def _case(g, s, H, hkv, D, lo, hi):
    keys = (torch.randn(s, hkv, D, generator=g) + 2.0 * torch.randn(1, hkv, D, generator=g)).bfloat16()
    values = torch.randn(s, hkv, D, generator=g).bfloat16()
    q = torch.randn(H, D, generator=g).bfloat16().float()
    return q, keys, values


@pytest.mark.parametrize("s,H,hkv,lo,hi,K,L,centering", [
    (700, 9, 3, 4, 600, 6, 40, "segment"),   # odd heads, GQA 3
    (700, 9, 3, 4, 600, 6, 40, "pre_rope"),
    (300, 5, 1, 4, 260, 4, 20, "segment"),   # 5 query heads on one KV head
    (40, 4, 2, 4, 20, 3, 10, "pre_rope"),    # tiny context
    (500, 6, 2, 4, 400, 16, 2, "segment"),   # K=16, L=2: almost nothing sampled
])
def test_per_key_estimator_matches_float64_reference(s, H, hkv, lo, hi, K, L, centering):
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    D = 64
    q, keys, values = _case(g, s, H, hkv, D, lo, hi)
    rope = centring.Rope(D, 10000.0)
    ev = SimpleNamespace(calibration={}, rope=rope)  # the evaluation state a worker runtime holds
    if centering == "pre_rope":
        cal = centring.LayerCalibration(hkv, D)
        cal.add(torch.randn(800, hkv, D, generator=g) + 1.0, rope)
        ev.calibration["test.layer"] = cal
    centres = centring.token_centres(ev, centering, "test.layer", keys[lo:hi], lo, 128)
    proj = projection(D, K, L, seed=int(torch.randint(0, 1000, (), generator=g)))
    codes, knorm = per_token_centres.key_codes(CpuKernelOps(), keys[lo:hi], centres, proj, K, L)
    qcodes = kernel.hash_codes(q, proj, K, L)
    scale = 1 / math.sqrt(D)
    out, sampled = per_token_centres.estimate(q, keys, values, lo, hi, centres, codes, knorm, qcodes, scale, K, L)

    covered = torch.zeros(s, dtype=torch.bool)
    covered[lo:hi] = True
    full_centres = torch.zeros(s, hkv, D)
    full_centres[lo:hi] = centres
    kc = torch.zeros(hkv, L, s, dtype=torch.long)
    kc[:, :, lo:hi] = codes.long()
    ref, _, ref_sampled = reference.magicpig_attention(q, keys, values, full_centres, proj, K, L, covered, scale,
                                                       query_codes=qcodes, kcodes=kc)
    assert torch.equal(sampled, ref_sampled[:, lo:hi])
    torch.testing.assert_close(out.double(), ref, atol=2e-4, rtol=2e-3)
    # the centred norms are |k - c_i|, not |k - mean|
    torch.testing.assert_close(knorm, (keys[lo:hi].float() - centres).norm(dim=-1).T)


def test_per_key_estimator_with_one_centre_equals_the_kernel():
    g = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ())))
    s, H, hkv, D, K, L, lo, hi = 900, 9, 3, 64, 8, 60, 4, 832
    q, keys, values = _case(g, s, H, hkv, D, lo, hi)
    centre = keys[lo:hi].float().mean(0)
    proj = projection(D, K, L, seed=3)
    codes, knorm = per_token_centres.key_codes(CpuKernelOps(), keys[lo:hi], centre.expand(hi - lo, hkv, D), proj,
                                               K, L)
    qcodes = kernel.hash_codes(q, proj, K, L)
    scale = 1 / math.sqrt(D)
    out, sampled = per_token_centres.estimate(q, keys, values, lo, hi, centre.expand(hi - lo, hkv, D), codes,
                                              knorm, qcodes, scale, K, L)
    kview, vview, bt, _ = to_paged([(keys, values)], 16, generator=g)
    seg = kernel.build_segment(keys[lo:hi], values[lo:hi], centre, proj, K, L)
    dense = torch.tensor([[[0, lo], [hi, s]]], dtype=torch.int32)
    kq = torch.empty(1, H, D)
    counts = torch.zeros(1, H, dtype=torch.int64)
    qdc = torch.einsum("hd,hd->h", q, centre[torch.arange(H) // (H // hkv)]).view(1, H)
    kernel.sparse_decode_attention(q.view(1, H, D), qcodes.view(1, H, L), qdc, [[seg]], kview, vview,
                                   block_table=bt, dense_ranges=dense, scale=scale, K=K, L=L, out=kq,
                                   sampled_counts=counts)
    assert int(counts.sum()) == int(sampled.sum()) > 0
    torch.testing.assert_close(out, kq[0], atol=2e-3, rtol=2e-2)


def test_eval_centrings_need_calibration_and_name_the_fix():
    rt = make_runtime()
    with pytest.raises(ValueError, match="calibrate=True"):
        control.set_eval(rt, centering="global")
    with pytest.raises(ValueError, match="not one of"):
        control.set_eval(rt, centering="sideways")
    assert control.set_eval(rt, centering="segment")["centering"] == "segment"  # needs no calibration
    assert rt.step_settings().method == "magicpig_per_key"  # a per-key centring runs the torch method
    control.set_eval(rt)
    assert rt.step_settings().method == "magicpig"


def test_pre_rope_coherence_is_one_for_one_rotated_key_and_low_for_random_keys():
    rope = centring.Rope(64, 100000.0)
    base = torch.randn(1, 2, 64).expand(300, 2, 64)
    same = centring.LayerCalibration(2, 64)
    same.add(rope.rotate(base, torch.arange(300)), rope)  # one key, rotated to 300 positions
    assert same.pre_rope_coherence() > 0.999
    spread = centring.LayerCalibration(2, 64)
    spread.add(torch.randn(300, 2, 64), rope)
    assert spread.pre_rope_coherence() < 0.3
