"""The kernel as it runs on a CPU without AVX-512, in a fresh process with MAGICPIG_NO_AVX512=1.

In-process tests on an AVX-512 machine reach the scalar paths only through force_scalar; this runs
a representative subset of tests/test_kernel.py where the kernel cannot see AVX-512 at all, so the
scalar hash, the scalar segment build and the scalar attention are the default everywhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_kernel import new_seed

ROOT = Path(__file__).resolve().parents[1]
SUBSET = " or ".join([
    "test_codes_match_reference",
    "test_estimator_matches_reference",
    "test_merge_equals_single_build",
    "test_bad_inputs_raise",
    "test_c_entry_points_reject_bad_sizes",
    "test_active_isa_reported",  # asserts active_isa() == "scalar" under MAGICPIG_NO_AVX512
])


def test_kernel_subset_without_avx512():
    seed, _ = new_seed()
    env = {**os.environ, "MAGICPIG_NO_AVX512": "1", "MAGICPIG_TEST_SEED": str(seed)}
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/test_kernel.py", "-k", SUBSET]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = f"seed={seed}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, log
    assert "test_kernel.py::test_active_isa_reported PASSED" in r.stdout, log
    assert "test_kernel.py::test_estimator_matches_reference[True-d128_gqa4_bf16] PASSED" in r.stdout, log
