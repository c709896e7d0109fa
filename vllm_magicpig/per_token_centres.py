"""Evaluation-only MagicPIG decode with a centre per key (centrings 'segment', 'pre_rope').

The estimator is the kernel's: a covered key is sampled when its SimHash code matches the
query's in >= 2 of L tables; a sampled key's logit is ``scale * q.k - log(u + 1e-4)``
with ``u`` the inclusion probability at cos = (q.k - q.c_i) / (|q| |k - c_i|); sinks and
the local window are attended exactly; one softmax over both. The kernel can only add
back one ``q . c`` per request, so centrings that give each key its own centre ``c_i``
run here, in torch, one request at a time: correct, not fast.

Centres, key codes and centred norms depend only on the keys and the settings, so they are cached
per (layer, settings, indexed range, block ids, a fingerprint of the keys) and reused by
every step of a request; the cache is bounded and cleared when the settings change.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from vllm_magicpig import centring, kernel
from vllm_magicpig.eval_attention import collision_mask, grouped_logits, grouped_output
from vllm_magicpig.reference import sampling_prob
from vllm_magicpig.stats import STATS

_CACHE: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = OrderedDict()
_CACHE_CAP_BYTES = 2 * 2**30
_cache_bytes = 0


def clear() -> None:
    global _cache_bytes
    _CACHE.clear()
    _cache_bytes = 0


def key_codes(keys: torch.Tensor, centres: torch.Tensor, projection: torch.Tensor, K: int, L: int):
    """(int16 codes [Hkv, L, n], float32 |k - c| [Hkv, n]) of keys [n, Hkv, D] with per-key centres,
    hashed by the kernel's own routine (same float32 arithmetic as a segment build)."""
    n, hkv, D = keys.shape
    x = keys.float() - centres
    codes = kernel.hash_codes(x.reshape(n * hkv, D), projection, K, L).view(n, hkv, L)
    return codes.permute(1, 2, 0).to(torch.int16).contiguous(), x.norm(dim=-1).T.contiguous()


def estimate(q, keys, values, lo: int, hi: int, centres, codes, knorm, qcodes, scale: float, K: int, L: int):
    """One request: q [H, D]; keys/values [s, Hkv, D]; keys [lo, hi) are covered (LSH-sampled)
    with centres [hi-lo, Hkv, D], codes [Hkv, L, hi-lo], knorm [Hkv, hi-lo]; the rest is
    exact. Returns (out float32 [H, D], sampled bool [H, hi-lo])."""
    H, D = q.shape
    hkv = keys.shape[1]
    q = q.float()
    qk = grouped_logits(q, keys.float())  # [H, s]
    logits = qk * scale
    if hi > lo:
        qc = grouped_logits(q, centres)  # q . c_i: [H, hi-lo]
        kv = torch.arange(H) // (H // hkv)
        den = q.norm(dim=-1, keepdim=True) * knorm[kv]
        cos = torch.where(den > 1e-30, (qk[:, lo:hi] - qc) / den.clamp_min(1e-30), torch.zeros_like(qc))
        u = sampling_prob(cos, K, L).float()
        sampled = collision_mask(codes, qcodes)
        logits[:, lo:hi] = torch.where(sampled, logits[:, lo:hi] - torch.log(u + 1e-4), -math.inf)
    else:
        sampled = torch.zeros(H, 0, dtype=torch.bool)
    w = torch.softmax(logits, dim=1).nan_to_num(0.0)  # a row with nothing to attend gives 0
    return grouped_output(w, values.float()), sampled


def _cached_index(state, keys_cov, lo: int, hi: int, blocks: tuple):
    """(centres, codes, knorm) of the covered keys, computed once per request and settings."""
    global _cache_bytes
    st = state.settings
    fingerprint = (float(keys_cov[:, :, 0].float().sum()), float(keys_cov[-1].float().sum()))
    key = (state.name, st.centering, st.K, st.L, lo, hi, blocks, fingerprint)
    hit = _CACHE.get(key)
    if hit is not None:
        _CACHE.move_to_end(key)
        return hit
    centres = centring.token_centres(st.centering, state.name, keys_cov, lo, state.cfg.segment_tokens, state.rope)
    value = (centres, *key_codes(keys_cov, centres, state.proj, st.K, st.L))
    _CACHE[key] = value
    _cache_bytes += sum(t.numel() * t.element_size() for t in value)
    while _cache_bytes > _CACHE_CAP_BYTES and len(_CACHE) > 1:
        _, old = _CACHE.popitem(last=False)
        _cache_bytes -= sum(t.numel() * t.element_size() for t in old)
    return value


def forward(state, q: torch.Tensor, kview, vview, plan, out: torch.Tensor) -> None:
    """The decode batch of one sparse layer (LayerState ``state``) with per-key centres."""
    st = state.settings
    R, H, D = q.shape
    bs = kview.shape[1]
    qcodes = kernel.hash_codes(q.reshape(R * H, D), state.proj, st.K, st.L).view(R, H, st.L)
    for r in range(R):
        s = plan.seq_lens[r]
        blocks = tuple(plan.block_table[r, : (s + bs - 1) // bs].tolist())
        keys = state._gather(kview, blocks, 0, s)
        values = state._gather(vview, blocks, 0, s)
        lo = hi = s
        if r in plan.sparse:
            lo, hi = int(plan.dense_ranges[r, 0, 1]), int(plan.dense_ranges[r, 1, 0])
        if hi > lo:
            centres, codes, knorm = _cached_index(state, keys[lo:hi], lo, hi, blocks[: (hi + bs - 1) // bs])
            o, sampled = estimate(q[r], keys, values, lo, hi, centres, codes, knorm, qcodes[r], state.scale,
                                  st.K, st.L)
            STATS.decode_sparse += 1
            STATS.decode_baseline[f"magicpig[{st.centering}]"] += 1
            STATS.add_sampled(state.name, int(sampled.sum()), (hi - lo) * H)
        else:
            o, _ = estimate(q[r], keys, values, s, s, None, None, None, None, state.scale, st.K, st.L)
        out[r] = o.to(out.dtype)
    plan.count_exact()
    if st.measure_error and plan.sparse:
        state.record_error(q, kview, vview, plan, out, list(plan.sparse))
