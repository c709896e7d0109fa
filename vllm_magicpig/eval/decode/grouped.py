"""Grouped-query attention pieces in torch for the evaluation-only decode methods
(:mod:`.baselines`, :mod:`.per_key`).

They work per KV head group instead of expanding keys and values to every query head,
which keeps one request's layer at 8K tokens at a few milliseconds on one core.
"""
from __future__ import annotations

import torch


def grouped_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q . k for q [H, D] and keys [s, Hkv, D] (float): [H, s]; head h reads KV head h // (H/Hkv)."""
    H, D = q.shape
    s, hkv, _ = keys.shape
    return torch.bmm(q.view(hkv, H // hkv, D), keys.permute(1, 2, 0)).reshape(H, s)


def grouped_output(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """sum_s w[h, s] v[s, kv(h)] for weights [H, s] and values [s, Hkv, D] (float): [H, D]."""
    H, s = weights.shape
    hkv, D = values.shape[1], values.shape[2]
    return torch.bmm(weights.view(hkv, H // hkv, s), values.permute(1, 0, 2)).reshape(H, D)


def collision_mask(codes: torch.Tensor, query_codes: torch.Tensor) -> torch.Tensor:
    """bool [H, n]: key i collides with query head h in >= 2 of the L tables.

    codes int16 [Hkv, L, n]; query_codes [H, L]. One table at a time with a uint8
    counter: far cheaper than materialising the [H, L, n] comparison. The counter saturates
    at 2 (all that matters), so it cannot wrap past 255 at large L.
    """
    hkv, L, n = codes.shape
    H = query_codes.shape[0]
    qc = query_codes.to(torch.int16).view(hkv, H // hkv, L)
    count = torch.zeros(hkv, H // hkv, n, dtype=torch.uint8)
    for t in range(L):
        count += codes[:, None, t, :] == qc[:, :, t, None]
        count.clamp_(max=2)
    return (count >= 2).view(H, n)
