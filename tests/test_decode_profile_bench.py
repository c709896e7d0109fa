"""benchmarks/decode_profile.py's line count (lines_read): the rows it counts are the union of the
heads' sampled keys (the float64 reference's mask over the segment's own codes), and its id lines
cover exactly the buckets the heads' codes name."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_profile  # noqa: E402

from vllm_magicpig import kernel  # noqa: E402
from vllm_magicpig.eval import reference as ref  # noqa: E402


def test_lines_read_counts_the_union_rows_and_the_named_buckets():
    gen = torch.Generator().manual_seed(11)
    n, hkv, g, D, K, L = 700, 2, 3, 64, 4, 12
    H = hkv * g
    keys = torch.randn(n, hkv, D, generator=gen).bfloat16()
    values = torch.randn(n, hkv, D, generator=gen).bfloat16()
    centre = keys.float().mean(0)
    proj = torch.randn(D, K * L, generator=gen)
    segs = [kernel.build_segment(keys[:400], values[:400], centre, proj, K, L),
            kernel.build_segment(keys[400:], values[400:], centre, proj, K, L)]
    q = torch.randn(1, H, D, generator=gen).bfloat16()
    got = decode_profile.lines_read(q, proj, [segs], K, L)

    qc = kernel.hash_codes(q[0], proj, K, L)
    union_rows, norm_lines, id_lines_lo, id_lines_hi = 0, 0, 0, 0
    for seg in segs:
        codes = seg.codes()  # [Hkv, L, m]
        m = codes.shape[2]
        sampled = ref.sample_mask(qc, codes)  # [H, m]
        for kvh in range(hkv):
            ids = sampled[kvh * g:(kvh + 1) * g].any(0).nonzero().flatten()
            union_rows += ids.numel()
            norm_lines += len({(kvh * m + int(i)) * 4 // 64 for i in ids})
        for h in range(H):
            sizes = (codes[h // g] == qc[h].view(L, 1)).sum(1)  # the bucket each table names
            id_lines_lo += int(((2 * sizes + 63) // 64).sum())  # a bucket's ids: at least this many lines,
            id_lines_hi += int(((2 * sizes + 63) // 64 + (sizes > 0).long()).sum())  # one more where they straddle
    assert union_rows > 0
    assert got["union_rows"] == union_rows
    assert got["norm_lines"] == norm_lines
    assert got["row_lines"] == union_rows * 2 * (D * 2 // 64)  # K and V rows, 2 lines each at d = 64
    assert got["directory"] == len(segs) * H * L
    assert id_lines_lo <= got["bucket_ids"] <= id_lines_hi, (id_lines_lo, got["bucket_ids"], id_lines_hi)
