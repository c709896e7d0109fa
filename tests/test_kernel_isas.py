"""The kernel as it runs on older CPUs: a subset of tests/test_kernel.py in fresh processes with
MAGICPIG_ISA capping the path.

In-process tests reach the scalar paths through force_scalar, and the fastest SIMD path this CPU
has through the default; the paths in between (AVX2 on an AVX-512 machine) and a process where
the scalar hash, build and attention are the default everywhere are only reached this way.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_magicpig import kernel as kx

from test_kernel import new_seed

ROOT = Path(__file__).resolve().parents[1]
SUBSET = [
    "test_codes_match_reference",
    "test_estimator_matches_reference",
    "test_merge_equals_single_build",
    "test_bad_inputs_raise",
    "test_c_entry_points_reject_bad_sizes",
    "test_active_isa_reported",  # asserts active_isa() is the cap
]
# The twins, where a SIMD path runs: its hash and attention against the scalar ones.
TWINS = ["test_scalar_hash_matches_fast", "test_fast_path_matches_scalar"]


def run_subset(isa: str, tests: list[str]) -> str:
    seed, _ = new_seed()
    env = {**os.environ, "MAGICPIG_ISA": isa, "MAGICPIG_TEST_SEED": str(seed)}
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_kernel.py",
           "-k", " or ".join(tests)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = f"MAGICPIG_ISA={isa} seed={seed}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, log
    assert "test_kernel.py::test_active_isa_reported PASSED" in r.stdout, log
    assert "test_kernel.py::test_estimator_matches_reference[True-d128_gqa4_bf16] PASSED" in r.stdout, log
    return r.stdout


def test_kernel_subset_scalar_only():
    run_subset("scalar", SUBSET)


@pytest.mark.skipif(kx.ISA_NAMES.index(kx.cpu_isa()) < kx.ISA_NAMES.index("avx2"), reason="this CPU has no AVX2")
def test_kernel_subset_on_avx2():
    out = run_subset("avx2", SUBSET + TWINS)
    # the AVX2 path ran against the scalar twin, not skipped as absent
    assert "test_estimator_matches_reference[False-d128_gqa4_bf16] PASSED" in out, out[-3000:]
    assert "test_fast_path_matches_scalar[fp32_query-dtype0] PASSED" in out, out[-3000:]
    assert "test_scalar_hash_matches_fast[10-150-64] PASSED" in out, out[-3000:]


@pytest.mark.skipif(kx.cpu_isa() != "amx", reason="this CPU has no AMX: avx512_bf16 is its default path")
def test_kernel_subset_on_avx512_bf16_below_amx():
    """On an AMX CPU the default path hashes keys on tiles; the AVX-512 BF16 pair dot product, which
    CPUs without AMX run, is reached by capping the path."""
    out = run_subset("avx512_bf16", SUBSET + TWINS + ["test_which_key_hash_a_build_takes"])
    assert "test_which_key_hash_a_build_takes PASSED" in out, out[-3000:]  # it asserts bf16_pairs there
    assert "test_scalar_hash_matches_fast[10-150-64] PASSED" in out, out[-3000:]
    assert "test_codes_match_reference[10-150-1500-bf16_valued] PASSED" in out, out[-3000:]


def test_unknown_isa_is_refused_at_import():
    env = {**os.environ, "MAGICPIG_ISA": "avx1024"}
    r = subprocess.run([sys.executable, "-c", "import vllm_magicpig.kernel"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "MAGICPIG_ISA='avx1024' is not one of scalar, avx2" in r.stderr, r.stderr[-2000:]
