"""Torch pieces of the split decode (``split_decode.py``) that run on the accelerator, next to
the KV cache, and on any device in tests: SimHash codes computed the kernel's way, the centred
codes of a segment's keys, the exact part's virtual block table, and the LSE merge.

Nothing here imports vLLM or needs a GPU; ``tests/test_split_decode.py`` runs it on the CPU.
"""
from __future__ import annotations

import torch


def hash_codes(x: torch.Tensor, projection: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """int32 ``[N, L]`` SimHash codes of rows ``x [N, D]`` on ``x``'s device: bit j of code l is
    ``x . W[:, l*K + j] > 0`` in float32, as the C++ kernel computes them. The two agree except
    where a projection is within float32 rounding of zero (summation order differs)."""
    n = x.shape[0]
    bits = (x.to(torch.float32) @ projection.to(x.device)) > 0  # [N, K*L]
    weights = torch.bitwise_left_shift(torch.ones(K, dtype=torch.int32, device=x.device),
                                       torch.arange(K, dtype=torch.int32, device=x.device))
    return (bits.view(n, L, K).to(torch.int32) * weights).sum(-1, dtype=torch.int32)


def centred_key_codes(keys: torch.Tensor, centre: torch.Tensor, projection: torch.Tensor, K: int,
                      L: int) -> torch.Tensor:
    """int32 ``[Hkv, L, n]`` codes of ``keys [n, Hkv, D]`` minus ``centre [Hkv, D]``: the layout
    ``kernel.build_segment_from_codes`` takes (and ``Segment.codes()`` returns)."""
    n, hkv, d = keys.shape
    x = keys.to(torch.float32) - centre.to(torch.float32)
    codes = hash_codes(x.reshape(n * hkv, d), projection, K, L)
    return codes.view(n, hkv, L).permute(1, 2, 0).contiguous()


def dense_block_tables(block_table: torch.Tensor, seq_lens: list[int], dense_ranges: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact part of every decode request as whole blocks, for a paged attention kernel.

    A sampled request's exact tokens are its sinks ``[0, sink_end)`` (rounded up to whole blocks
    by the split runtime) and the tail ``[covered_end, s)`` (``covered_end`` is block-aligned):
    its virtual row is ``row[:sink_end // bs] + row[covered_end // bs : cdiv(s, bs)]`` and its
    dense length ``sink_end + s - covered_end``. A request served exactly keeps its real row and
    length ``s``. Returns (int32 ``[R, cols]`` block table, int32 ``[R]`` lengths) on the CPU.
    """
    rows, lens = [], []
    for r, s in enumerate(seq_lens):
        sink_end, tail_start = int(dense_ranges[r, 0, 1]), int(dense_ranges[r, 1, 0])
        nblocks = -(-s // block_size)
        if tail_start >= s:  # exact: the whole context
            rows.append(block_table[r, :nblocks].tolist())
            lens.append(s)
            continue
        if sink_end % block_size or tail_start % block_size:
            raise ValueError(f"request {r}: exact ranges [0, {sink_end}) + [{tail_start}, {s}) are not whole blocks "
                             f"of {block_size} tokens (plan with sink_tokens rounded up to the block size)")
        rows.append(block_table[r, : sink_end // block_size].tolist()
                    + block_table[r, tail_start // block_size : nblocks].tolist())
        lens.append(sink_end + s - tail_start)
    cols = max(len(row) for row in rows) if rows else 1
    table = torch.zeros(len(rows), cols, dtype=torch.int32)
    for r, row in enumerate(rows):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table, torch.tensor(lens, dtype=torch.int32)


def merge_states(output: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor, b_out: torch.Tensor,
                 b_lse: torch.Tensor) -> None:
    """``output [R, H, D]`` = the softmax over both parts' keys, from each part's output and
    natural-log LSE ``[H, R]``; an empty part (LSE -inf) contributes nothing. vLLM's own
    ``merge_attn_states`` (a CUDA kernel on the GPU, torch on the CPU)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    merge_attn_states(output, a_out, a_lse.contiguous(), b_out, b_lse.contiguous())
