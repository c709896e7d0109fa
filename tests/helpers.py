"""Test fixtures shared by several test files (kept out of the package)."""
from __future__ import annotations

import contextlib

import torch

from vllm_magicpig.kv_layout import CpuVecLayout, logical_blocks


def to_paged(contexts, block_size, spare_blocks=3, generator=None, layout=None):
    """Scatter contiguous contexts (a list of (keys, values), each [n_r, Hkv, D]) into one paged
    cache in one of vLLM's layouts (default: the CPU "vec" one), with random physical block ids
    and junk elsewhere.

    Returns (key_view, value_view, block_table int32 [R, max_blocks], cache); the views are the
    layout's views, the ones the backend passes to the kernel.
    """
    layout = layout if layout is not None else CpuVecLayout()
    hkv, D = contexts[0][0].shape[1:]
    dtype = contexts[0][0].dtype
    nblk = [max(1, -(-k.shape[0] // block_size)) for k, _ in contexts]
    total = sum(nblk) + spare_blocks
    perm = torch.randperm(total, generator=generator)
    shape = layout.cache_shape(total, block_size, hkv, D)
    cache = torch.randn(*shape, generator=generator).to(dtype)
    views = layout.views(cache)
    bt = torch.zeros(len(contexts), max(nblk), dtype=torch.int32)
    p = 0
    for r, (k, v) in enumerate(contexts):
        for b in range(nblk[r]):
            phys = int(perm[p])
            p += 1
            bt[r, b] = phys
            lo, hi = b * block_size, min(k.shape[0], (b + 1) * block_size)
            if hi > lo:
                for view, rows in ((views.key, k), (views.value, v)):
                    block = logical_blocks(view, torch.tensor([phys]))[0]  # [block_size, Hkv, D]
                    block[: hi - lo] = rows[lo:hi]
                    view[phys].copy_(block.view(view.shape[1:]))  # the layout's own (maybe tiled) axes
    return views.key, views.value, bt, cache


class FakeCam:
    """The CommonAttentionMetadata fields the planner reads (for planner-only tests; the
    backend tests build a real CommonAttentionMetadata)."""

    def __init__(self, seq_lens, block_table, slot_mapping=None, num_reqs=None):
        self.seq_lens = seq_lens
        self.block_table_tensor = block_table
        self.slot_mapping = slot_mapping if slot_mapping is not None else torch.empty(0, dtype=torch.int64)
        self.num_actual_tokens = self.slot_mapping.numel()
        self.num_reqs = num_reqs if num_reqs is not None else len(seq_lens)
        self.seq_lens_cpu_upper_bound = seq_lens


def make_runtime(cfg=None, num_layers: int = 4):
    """A fresh worker runtime (index, counters, projections, extension state) for one test."""
    from vllm_magicpig.config import MagicPigConfig
    from vllm_magicpig.runtime import MagicPigRuntime

    return MagicPigRuntime(cfg if cfg is not None else MagicPigConfig(), num_layers=num_layers)


def paged_attention_with_lse(query, kv, block_table, seq_lens, scale, max_seq_len=None):
    """STAND-IN for FLASH_ATTN's paged decode with ``return_softmax_lse=True`` (the split decode's
    exact part on the GPU), in plain torch: one query token per request attends the first
    ``seq_lens[r]`` tokens of its block-table row. Returns (out ``[R, H, D]`` in the query's dtype,
    natural-log lse ``[H, R]`` float32; -inf and zeros for an empty row)."""
    R, H, D = query.shape
    bs, hkv = kv.key.shape[1], kv.key.shape[2]
    out = torch.zeros(R, H, D, dtype=torch.float32)
    lse = torch.full((H, R), float("-inf"))
    for r in range(R):
        n = int(seq_lens[r])
        if n == 0:
            continue
        blocks = block_table[r, : -(-n // bs)].long()
        k = kv.key[blocks].reshape(-1, hkv, D)[:n].float()
        v = kv.value[blocks].reshape(-1, hkv, D)[:n].float()
        kv_head = torch.arange(H) // (H // hkv)
        logits = torch.einsum("hd,nhd->hn", query[r].float(), k[:, kv_head]) * scale
        lse[:, r] = torch.logsumexp(logits, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), v[:, kv_head])
    return out.to(query.dtype), lse


@contextlib.contextmanager
def torch_threads_kept():
    """A benchmark's main() sets torch's threads to the worker's one core; the test process keeps its own."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
