"""Evaluation-only decode baselines at a matched key budget: exact TopK and Quest.

They are decode methods of MAGICPIG's decode path (same dense sinks and local window,
same indexed range), so the accuracy harness compares the selection rules and nothing
else. Plain torch, one request at a time: correct, not fast.

* ``topk``: the ``budget_fraction`` of indexed keys with the highest exact q.k (an
  oracle; it reads every key).
* ``quest``: keys are grouped in pages of ``quest_page_size`` tokens; a page's upper
  bound on q.k is sum_d max(q_d * min_d, q_d * max_d) over its keys' per-channel
  minimum and maximum; the highest-bound pages are attended in full.
"""
from __future__ import annotations

import math

import torch

from vllm_magicpig.decode_methods import DecodeResult
from vllm_magicpig.eval.decode.grouped import grouped_logits, grouped_output
from vllm_magicpig.kv_layout import gather, request_blocks


def _select(method: str, logits: torch.Tensor, keys: torch.Tensor, q: torch.Tensor, lo: int, hi: int,
            budget: int, page: int) -> torch.Tensor:
    """Boolean [H, s] mask of the indexed keys in [lo, hi) chosen for each query head."""
    H, s = logits.shape
    mask = torch.zeros(H, s, dtype=torch.bool)
    n = hi - lo
    if n <= 0 or budget <= 0:
        return mask
    if method == "topk":
        idx = torch.topk(logits[:, lo:hi], min(budget, n), dim=1).indices + lo
        mask.scatter_(1, idx, True)
        return mask
    # quest: pages on the absolute token grid, clipped to [lo, hi); keys may hold one row
    # per KV head (Hk divides H) and are then shared by that head's query group
    Hk, D = keys.shape[1], keys.shape[2]
    first, last = lo // page, (hi - 1) // page
    n_pages = last - first + 1
    pad_lo, pad_hi = first * page, (last + 1) * page
    k = torch.zeros(pad_hi - pad_lo, Hk, D, dtype=keys.dtype)
    k[lo - pad_lo : hi - pad_lo] = keys[lo:hi]
    valid = torch.zeros(pad_hi - pad_lo, dtype=torch.bool)
    valid[lo - pad_lo : hi - pad_lo] = True
    big = torch.finfo(keys.dtype).max
    kmin = torch.where(valid[:, None, None], k, big).view(n_pages, page, Hk, D).amin(1)
    kmax = torch.where(valid[:, None, None], k, -big).view(n_pages, page, Hk, D).amax(1)
    # kmin/kmax: [pages, Hk, D]; q: [H, D] -> bound [H, pages]
    qg = q.view(Hk, H // Hk, 1, D)
    lo_t, hi_t = kmin.permute(1, 0, 2).unsqueeze(1), kmax.permute(1, 0, 2).unsqueeze(1)  # [Hk, 1, pages, D]
    bound = torch.maximum(qg * lo_t, qg * hi_t).sum(-1).reshape(H, n_pages)
    # pages enough for the budget (partial edge pages make the whole range need one more)
    take = n_pages if budget >= n else min(n_pages, max(1, math.ceil(budget / page)))
    pages = torch.topk(bound, take, dim=1).indices  # [H, take]
    tok = (pages[:, :, None] + first) * page + torch.arange(page)  # [H, take, page]
    tok = tok.reshape(H, -1)  # absolute positions, some outside [lo, hi) on edge pages
    inside = (tok >= lo) & (tok < hi)
    # set only the inside positions: scattering `inside` at clamped indices would write
    # False over a chosen key s-1 when hi == s and the last page is partial
    rows = torch.arange(H)[:, None].expand_as(tok)
    mask[rows[inside], tok[inside]] = True
    return mask


class BaselineDecode:
    """``topk`` or ``quest`` at ``budget_fraction`` of each request's indexed keys."""

    def __init__(self, name: str) -> None:
        self.name = name

    def forward(self, ctx, q: torch.Tensor, kv, plan, out: torch.Tensor) -> DecodeResult:
        options = ctx.settings.options
        R, H, D = q.shape
        result = DecodeResult(served=[])
        for r in range(R):
            s = plan.seq_lens[r]
            blocks = request_blocks(plan.block_table, r, s, kv.block_size)
            keys = gather(kv.key, blocks, 0, s).float()  # [s, Hkv, D]
            values = gather(kv.value, blocks, 0, s).float()
            qr = q[r].float()
            logits = grouped_logits(qr, keys) * ctx.scale  # [H, s]
            keep = torch.ones(H, s, dtype=torch.bool)
            lo, hi = plan.covered_range(r)
            if hi > lo:
                keep[:, lo:hi] = False
                budget = math.ceil(options["budget_fraction"] * (hi - lo))
                chosen = _select(self.name, logits, keys, qr, lo, hi, budget, options["quest_page_size"])
                keep |= chosen
                result.served.append(r)
                result.sampled += int(chosen.sum())
            w = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=1)  # [H, s]
            out[r] = grouped_output(w, values).to(out.dtype)
        return result
