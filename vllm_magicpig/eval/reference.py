"""Plain-torch ground truth for the MagicPIG estimator (float64 on demand).

Slow and simple on purpose: tests and benchmarks compare the C++ kernel against these functions.
Shapes follow the kernel: keys/values [n, Hkv, D], queries [H, D], query head h uses KV head
h // (H // Hkv).
"""
from __future__ import annotations

import math

import torch


def simhash_codes(x: torch.Tensor, projection: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """int64 [N, L]: code_l(x) = sum_j 2^j [x . W[:, l*K + j] > 0], computed in float64."""
    proj = x.double() @ projection.double()
    bits = (proj > 0).view(x.shape[0], L, K).long()
    return (bits << torch.arange(K)).sum(-1)


def projection_margin(x: torch.Tensor, projection: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """float64 [N, L, K]: |x . w| / (|x| |w|), to spot sign bits that float32 rounding may flip."""
    x = x.double()
    w = projection.double()
    m = (x @ w).abs() / (x.norm(dim=-1, keepdim=True) * w.norm(dim=0, keepdim=True)).clamp_min(1e-300)
    return m.view(x.shape[0], L, K)


def key_codes(keys, centre, projection, K, L) -> torch.Tensor:
    """int64 [Hkv, L, n]: codes of the centred keys k - c (centre [Hkv, D], or [n, Hkv, D]
    for a centre per key)."""
    c = centre.double()
    kc = keys.double() - (c.unsqueeze(0) if c.dim() == 2 else c)  # [n, Hkv, D]
    return torch.stack([simhash_codes(kc[:, h], projection, K, L).T for h in range(keys.shape[1])])


def sample_mask(query_codes, kcodes) -> torch.Tensor:
    """bool [H, n]: key i is sampled for head h iff its code matches in >= 2 tables.

    query_codes [H, L], kcodes [Hkv, L, n]."""
    H, hkv = query_codes.shape[0], kcodes.shape[0]
    kv = torch.arange(H) // (H // hkv)
    hits = (kcodes[kv].long() == query_codes.long().unsqueeze(-1)).sum(1)  # [H, n]
    return hits >= 2


def sampling_prob(cos: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """u = P(Binomial(L, p^K) >= 2) with p = 1 - acos(cos)/pi, float64."""
    p = 1.0 - torch.acos(cos.double().clamp(-1, 1)) / math.pi
    P1 = p ** K
    return (1.0 - (1.0 - P1) ** (L - 1) * (1.0 + (L - 1) * P1)).clamp_min(0.0)


def magicpig_attention(query, keys, values, centre, projection, K, L, covered, scale,
                       query_codes=None, kcodes=None, query_dot_centre=None):
    """The estimator for one request: one softmax over sampled covered keys (logit
    scale*q.k - log(u + 1e-4)) and dense (uncovered) keys (logit scale*q.k).

    query [H, D]; keys/values [n, Hkv, D]; centre [Hkv, D] (or [n, Hkv, D]: a centre per
    key, whose q.c then differs per key); covered bool [n].
    Codes default to float64 SimHash; pass the kernel's codes to test everything after hashing.
    Returns (out [H, D] f64, lse [H] f64, sampled bool [H, n]).
    """
    H, D = query.shape
    n, hkv, _ = keys.shape
    kv = torch.arange(H) // (H // hkv)
    q = query.double()
    k = keys.double()[:, kv].transpose(0, 1)  # [H, n, D]
    v = values.double()[:, kv].transpose(0, 1)
    c = centre.double()
    c = c[kv].unsqueeze(1) if c.dim() == 2 else c[:, kv].transpose(0, 1)  # [H, 1 or n, D]
    if query_codes is None:
        query_codes = simhash_codes(query, projection, K, L)
    if kcodes is None:
        kcodes = key_codes(keys, centre, projection, K, L)
    if n == 0:
        return torch.zeros(H, D, dtype=torch.float64), torch.full((H,), -math.inf, dtype=torch.float64), \
            torch.zeros(H, 0, dtype=torch.bool)
    covered = covered.bool()
    sampled = sample_mask(query_codes, kcodes) & covered.unsqueeze(0)
    qk = torch.einsum("hd,hnd->hn", q, k)
    qc = (q.unsqueeze(1) * c).sum(-1) if query_dot_centre is None else query_dot_centre.double().unsqueeze(-1)
    kn = (k - c).norm(dim=-1)
    den = q.norm(dim=-1, keepdim=True) * kn
    cos = torch.where(den > 1e-30, (qk - qc) / den.clamp_min(1e-300), torch.zeros_like(qk))
    u = sampling_prob(cos, K, L)
    s = scale * qk - torch.where(covered.unsqueeze(0), torch.log(u + 1e-4), torch.zeros_like(u))
    keep = sampled | ~covered.unsqueeze(0)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    w = torch.where(keep, torch.exp(s - lse.unsqueeze(-1).clamp_min(-1e300)), torch.zeros_like(s))
    out = torch.einsum("hn,hnd->hd", w, v)
    empty = ~keep.any(-1)
    out[empty] = 0.0
    return out, lse, sampled


def exact_attention(query, keys, values, scale):
    """Full softmax attention for one request (float64): (out [H, D], lse [H])."""
    H = query.shape[0]
    kv = torch.arange(H) // (H // keys.shape[1])
    k = keys.double()[:, kv].transpose(0, 1)
    v = values.double()[:, kv].transpose(0, 1)
    s = scale * torch.einsum("hd,hnd->hn", query.double(), k)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v), lse


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 copy of x [..., D] as an int8 mirror holds it: each row scaled by max|x| / 127 and
    rounded to integers in [-127, 127] (half to even), computed in float32 step by step as the
    kernel's ``quantize_int8`` does, so the values agree bit for bit."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: a true division (a scalar may become * 1/s)
    q = torch.round(x * (c127 / safe)).clamp(-127, 127)
    scale = torch.where(amax > 0, amax / c127, torch.zeros_like(amax))
    return (scale * q).double()
