"""Limits shared by the config, the kernel's Python face and the C++ kernel: defined once.

This module imports neither vLLM nor torch, so the config parser can use it in the front end.
The maximum segment size is the C++ kernel's (token ids inside a segment are 16-bit); the
kernel module checks at import that the extension agrees with the value here.
"""
from __future__ import annotations

# SimHash bits per table: a code indexes a 2^K bucket directory (uint16 offsets, K <= 16).
K_RANGE = (1, 16)
# Hash tables: a key is sampled on >= 2 collisions, so L >= 2; the upper bound keeps the
# per-token index (2 bytes per table) and the per-query lookups bounded.
L_RANGE = (2, 1024)
# Token ids inside a segment are uint16 and bucket offsets too: at most 2^15 tokens.
MAX_SEGMENT_TOKENS = 32768
# The kernel's vector loops step 16 lanes; 64 and 128 are the head sizes that are tested.
SUPPORTED_HEAD_SIZES = (64, 128)
# The only KV / model dtypes the kernel reads (plain 16-bit rows).
SUPPORTED_DTYPES = ("bfloat16", "float16")


def in_range(value: int, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= value <= bounds[1]
