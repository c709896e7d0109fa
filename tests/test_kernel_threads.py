"""The kernel's ``num_threads``: an explicit count overrides torch's (a vLLM CUDA worker calls
torch.set_num_threads(1), and the extension shares torch's OpenMP runtime), and the thread count
never changes a result.

The set_num_threads test runs in a subprocess so this process's torch setting is left alone.
Seeds as in test_kernel.py (replay with MAGICPIG_TEST_SEED).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_magicpig import kernel as kx

from test_kernel import PATHS, Case, new_seed

ROOT = Path(__file__).resolve().parents[1]


def threads_case(gen):
    """Two requests, two KV heads, segments and dense chunks: 14 work units, enough for any team."""
    return Case(gen, [3000, 1200], 2, 4, 64, 8, 40, seg_sizes=[[1500, 1400], [1100]])


def run(case, force_scalar=False, num_threads=None):
    R = len(case.ctx)
    out = torch.full((R, case.H, case.D), float("nan"), dtype=case.query.dtype)
    lse = torch.full((R, case.H), float("nan"))
    cnt = torch.full((R, case.H), -7, dtype=torch.int64)
    kx.sparse_decode_attention(case.query, case.qcodes, case.qdc, case.segs, case.kview, case.vview,
                               block_table=case.bt, dense_ranges=case.dense_ranges, scale=case.scale, K=case.K,
                               L=case.L, out=out, lse=lse, sampled_counts=cnt, force_scalar=force_scalar,
                               num_threads=num_threads)
    return out, lse, cnt


# Runs in a fresh interpreter with tests/ on sys.path and MAGICPIG_TEST_SEED set by the parent.
CHILD = """
import torch
torch.set_num_threads(1)
from vllm_magicpig import kernel as kx
from test_kernel import PATHS, new_seed
from test_kernel_threads import run, threads_case

seed, gen = new_seed()
assert kx.max_threads() == 1, f"max_threads() = {kx.max_threads()} after torch.set_num_threads(1)"
case = threads_case(gen)
for fs in PATHS:
    default = run(case, fs)
    assert kx._C.last_team_size() == 1, f"num_threads=None ran {kx._C.last_team_size()} threads (force_scalar={fs})"
    two = run(case, fs, num_threads=2)
    assert kx._C.last_team_size() == 2, f"num_threads=2 ran {kx._C.last_team_size()} threads (force_scalar={fs})"
    assert kx.max_threads() == 1, "an explicit num_threads must not change the default"
    assert not torch.isnan(default[0]).any()
    # Bit for bit: each work unit writes its own partial and the merge reads them in unit order.
    for name, a, b in zip(("out", "lse", "sampled_counts"), default, two):
        assert torch.equal(a, b), f"{name} differs between 1 and 2 threads (force_scalar={fs})"
print("CHILD OK")
"""


def test_num_threads_overrides_torch_setting():
    seed, _ = new_seed()
    env = {**os.environ, "MAGICPIG_TEST_SEED": str(seed)}
    for var in ("OMP_THREAD_LIMIT", "OMP_DYNAMIC"):  # either could shrink the team below 2
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = f"seed={seed}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0 and "CHILD OK" in r.stdout, log


def test_default_is_max_threads():
    """None asks for omp_get_max_threads(), which follows torch's setting in this process."""
    seed, gen = new_seed()
    assert kx.max_threads() == torch.get_num_threads(), f"seed={seed}"
    c = Case(gen, [500], 1, 2, 64, 6, 20)
    run(c)
    assert kx._C.last_team_size() == kx.max_threads(), f"seed={seed}"
    run(c, num_threads=3)  # more threads than units or cores is allowed
    assert kx._C.last_team_size() == 3, f"seed={seed}"


@pytest.mark.parametrize("force_scalar", PATHS)
def test_thread_count_never_changes_results(force_scalar):
    """Every entry point with an OpenMP region gives the same bits on 1, 2 and 3 threads."""
    seed, gen = new_seed()
    msg = f"seed={seed} force_scalar={force_scalar}"
    c = threads_case(gen)
    want = run(c, force_scalar, num_threads=1)
    for nt in (2, 3, None):
        for name, a, b in zip(("out", "lse", "sampled_counts"), want, run(c, force_scalar, num_threads=nt)):
            assert torch.equal(a, b), f"{name} differs between 1 and {nt} threads ({msg})"
    keys, vals = c.ctx[0]
    sk, sv = keys[4:2904], vals[4:2904]  # the tokens of c.segs[0]
    x = c.query.reshape(-1, c.D).float()
    first = {}
    for nt in (1, 2, 3, None):
        seg = kx.build_segment(sk, sv, c.centres[0], c.W, c.K, c.L, force_scalar=force_scalar, num_threads=nt)
        got = {
            "build_segment": seg,
            "build_segment_from_codes": kx.build_segment_from_codes(sk, sv, c.centres[0], seg.codes(), c.K, c.L,
                                                                    num_threads=nt),
            "merge_segments": kx.merge_segments(c.segs[0], num_threads=nt),
            "hash_codes": kx.hash_codes(x, c.W, c.K, c.L, force_scalar=force_scalar, num_threads=nt),
        }
        for name, v in got.items():
            v = v if isinstance(v, torch.Tensor) else (v.codes(), v.index_bytes, v.mirror_bytes)
            w = first.setdefault(name, v)
            same = torch.equal(v, w) if isinstance(v, torch.Tensor) else torch.equal(v[0], w[0]) and v[1:] == w[1:]
            assert same, f"{name} differs between 1 and {nt} threads ({msg})"


@pytest.mark.parametrize("force_scalar", PATHS)
def test_one_call_hashing_split_never_changes_results(force_scalar):
    """The one-call decode hashes the queries in jobs of (request, block of tables), more blocks per
    request when requests are fewer than threads (a single request's tables split across the team).
    Its codes, q . c and so its output are the same bits on 1, 2, 3 and 7 threads (blocks of 40, 20,
    14 and 6 tables, the last ones short), for one request and for two, and equal the two-step call
    with codes from hash_codes."""
    seed, gen = new_seed()
    msg = f"seed={seed} force_scalar={force_scalar}"
    c = threads_case(gen)
    for rows in ([0], [0, 1]):
        R = len(rows)
        query = c.query[rows].contiguous()
        segs = [c.segs[r] for r in rows]
        centres = [c.centres[r] for r in rows]
        bt, dense = c.bt[rows].contiguous(), c.dense_ranges[rows].contiguous()
        kw = dict(block_table=bt, dense_ranges=dense, scale=c.scale, K=c.K, L=c.L, force_scalar=force_scalar)

        codes = kx.hash_codes(query.reshape(-1, c.D), c.W, c.K, c.L, force_scalar=force_scalar).view(R, c.H, c.L)
        qdc = c.qdc[rows].contiguous()  # q . c summed in float64, as the native call sums it
        want_out = torch.full((R, c.H, c.D), float("nan"), dtype=query.dtype)
        want_cnt = torch.full((R, c.H), -7, dtype=torch.int64)
        kx.sparse_decode_attention(query, codes, qdc, segs, c.kview, c.vview, out=want_out, sampled_counts=want_cnt,
                                   **kw)
        assert int(want_cnt.sum()) > 0, msg  # the case samples, so the codes matter
        for nt in (1, 2, 3, 7):
            out = torch.full((R, c.H, c.D), float("nan"), dtype=query.dtype)
            cnt = torch.full((R, c.H), -7, dtype=torch.int64)
            kx.magicpig_decode_attention(query, c.W, centres, segs, c.kview, c.vview, out=out, sampled_counts=cnt,
                                         num_threads=nt, **kw)
            assert torch.equal(cnt, want_cnt), f"R={R} nt={nt} counts ({msg})"
            assert torch.equal(out, want_out), f"R={R} nt={nt} output ({msg})"


def test_bad_num_threads_raise():
    seed, gen = new_seed()
    c = Case(gen, [300], 1, 2, 64, 6, 20)
    keys, vals = c.ctx[0]
    seg = c.segs[0][0]
    calls = {
        "sparse_decode_attention": lambda nt: run(c, num_threads=nt),
        "hash_codes": lambda nt: kx.hash_codes(c.query[0].float(), c.W, 6, 20, num_threads=nt),
        "build_segment": lambda nt: kx.build_segment(keys, vals, c.centres[0], c.W, 6, 20, num_threads=nt),
        "build_segment_from_codes": lambda nt: kx.build_segment_from_codes(keys[4:284], vals[4:284], c.centres[0],
                                                                           seg.codes(), 6, 20, num_threads=nt),
        "merge_segments": lambda nt: kx.merge_segments([seg, seg], num_threads=nt),
    }
    for call in calls.values():
        call(None)
        call(1)
        for bad in (True, False, 2.0, "2", torch.tensor(2)):
            with pytest.raises(TypeError, match="num_threads"):
                call(bad)
        for bad in (0, -1, kx._MAX_THREADS + 1, 2**31):
            with pytest.raises(ValueError, match="num_threads"):
                call(bad)
