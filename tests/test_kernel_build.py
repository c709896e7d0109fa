"""What the built extension holds, read off its machine code.

The kernel's row loops prefetch the sampled K/V rows, the keys' norms and the bucket directory
ahead of use.  From d1c1615 (2026-12-01, which moved them into helpers) to e98c1e9 GCC 12 deleted
all but one of them, with no sign in any output: a plain inline helper whose only effect is
__builtin_prefetch counts as free of side effects, and a call to it that is not inlined first is
dropped (cpp/common.h, MP_PREFETCH).  The outputs are bit for bit the same either way, so only
the machine code shows it; this test reads it.
"""
from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections import Counter

import pytest

from vllm_magicpig import _C

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None,
                                reason="reads x86-64 machine code with binutils' objdump")

# The functions whose loops walk memory far larger than the caches, each by a pattern of its
# demangled name (a static helper may be inlined into its caller or cloned, so the patterns take
# either): the AVX2 and AVX-512 q.k passes, their V passes, and retrieval's bucket walk.
LOOPS = {
    "AVX2 q.k pass": r"mp::attend_avx2\(",
    "AVX2 V pass": r"values_walk8<false, 8>",
    "AVX-512 q.k pass": r"mp::attend_avx512\(|qk_avx512",
    "AVX-512 V pass": r"values_block<\d, false>",
    "bucket walk": r"mp::retrieve\(",
}


def prefetches_by_function() -> Counter:
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", _C.__file__], capture_output=True,
                          text=True, check=True).stdout
    counts: Counter = Counter()
    function = ""
    for line in text.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            counts[function] += 0
        elif "prefetcht" in line:
            counts[function] += 1
    return counts


def test_every_row_loop_keeps_its_prefetches():
    counts = prefetches_by_function()
    for loop, pattern in LOOPS.items():
        found = {f: n for f, n in counts.items() if re.search(pattern, f)}
        assert found, f"no function matches {pattern!r} ({loop}): renamed? update LOOPS"
        assert any(found.values()), (f"the {loop} has no prefetch instruction left in {sorted(found)}: the compiler "
                                     f"dropped them (see cpp/common.h, MP_PREFETCH)")
