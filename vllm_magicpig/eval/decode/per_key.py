"""Evaluation-only MagicPIG decode with a centre per key (centrings 'segment', 'pre_rope'):
the decode method ``magicpig_per_key``.

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

from vllm_magicpig.decode_methods import DecodeResult
from vllm_magicpig.eval.decode import centring
from vllm_magicpig.eval.decode.grouped import collision_mask, grouped_logits, grouped_output
from vllm_magicpig.kv_layout import gather, request_blocks

NAME = "magicpig_per_key"


def sampling_prob(cos: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """u = P(Binomial(L, p^K) >= 2) with p = 1 - acos(cos)/pi: the kernel's inclusion probability.
    Written here, not imported from the float64 reference, so the reference stays independent."""
    p = 1.0 - torch.acos(cos.double().clamp(-1, 1)) / math.pi
    hit = p**K
    return (1.0 - (1.0 - hit) ** (L - 1) * (1.0 + (L - 1) * hit)).clamp_min(0.0)


class PerKeyCache:
    """(centres, codes, knorm) of covered keys, by (layer, settings, range, blocks, fingerprint)."""

    def __init__(self, cap_bytes: int = 2 * 2**30) -> None:
        self.cap_bytes = cap_bytes
        self.clear()

    def clear(self) -> None:
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, ...]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple):
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: tuple, value: tuple[torch.Tensor, ...]) -> None:
        self._entries[key] = value
        self._bytes += sum(t.numel() * t.element_size() for t in value)
        while self._bytes > self.cap_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= sum(t.numel() * t.element_size() for t in old)


def key_codes(ops, keys: torch.Tensor, centres: torch.Tensor, projection: torch.Tensor, K: int, L: int):
    """(int16 codes [Hkv, L, n], float32 |k - c| [Hkv, n]) of keys [n, Hkv, D] with per-key centres,
    hashed by the kernel's own routine (a float32 k - c build's arithmetic; a bf16-pairs build's codes
    agree up to float32 ties)."""
    n, hkv, D = keys.shape
    x = keys.float() - centres
    codes = ops.hash_codes(x.reshape(n * hkv, D), projection, K, L).view(n, hkv, L)
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


def _cached_index(ctx, ev, keys_cov, lo: int, hi: int, blocks: tuple):
    """(centres, codes, knorm) of the covered keys, computed once per request and settings."""
    st = ctx.settings
    fingerprint = (float(keys_cov[:, :, 0].float().sum()), float(keys_cov[-1].float().sum()))
    key = (ctx.name, st.centering, st.K, st.L, lo, hi, blocks, fingerprint)
    hit = ev.per_key_cache.get(key)
    if hit is not None:
        return hit
    centres = centring.token_centres(ev, st.centering, ctx.name, keys_cov, lo, ctx.runtime.cfg.segment_tokens)
    value = (centres, *key_codes(ctx.runtime.ops, keys_cov, centres, ctx.projection, st.K, st.L))
    ev.per_key_cache.put(key, value)
    return value


class PerKeyDecode:
    """The decode batch of one sparse layer with per-key centres."""

    name = NAME

    def forward(self, ctx, q: torch.Tensor, kv, plan, out: torch.Tensor) -> DecodeResult:
        from vllm_magicpig.eval.decode.settings import state

        ev, st = state(ctx.runtime), ctx.settings
        R, H, D = q.shape
        qcodes = ctx.runtime.ops.hash_codes(q.reshape(R * H, D), ctx.projection, st.K, st.L).view(R, H, st.L)
        result = DecodeResult(served=[], label=f"magicpig[{st.centering}]")
        for r in range(R):
            s = plan.seq_lens[r]
            blocks = request_blocks(plan.block_table, r, s, kv.block_size)
            keys = gather(kv.key, blocks, 0, s)
            values = gather(kv.value, blocks, 0, s)
            lo, hi = plan.covered_range(r)
            if hi > lo:
                centres, codes, knorm = _cached_index(ctx, ev, keys[lo:hi], lo, hi,
                                                      blocks[: (hi + kv.block_size - 1) // kv.block_size])
                o, sampled = estimate(q[r], keys, values, lo, hi, centres, codes, knorm, qcodes[r], ctx.scale,
                                      st.K, st.L)
                result.served.append(r)
                result.sampled += int(sampled.sum())
            else:
                o, _ = estimate(q[r], keys, values, s, s, None, None, None, None, ctx.scale, st.K, st.L)
            out[r] = o.to(out.dtype)
        return result
