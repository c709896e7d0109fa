"""Evaluation-only key centrings beyond the per-request mean, and their calibration.

The paper centres keys by the mean of each request's own prompt keys. The accuracy
harness compares that with three alternatives (``magicpig_set_eval(centering=...)``):

* ``global``: one centre per (layer, KV head) that does not look at the request: the
  mean of calibration keys over the same positions as the request's indexed range
  (post-RoPE keys drift with position, so positions are matched).
* ``segment``: each ``segment_tokens`` piece of the indexed range has its own mean.
* ``pre_rope``: a per-(layer, KV head) mean of *un-rotated* calibration keys, rotated to
  each key's position. A key's code then depends only on the key and its position,
  never on the request, so codes could be shared by every request holding that token.

``global`` has one centre per request, so it is a registered centring of the production
MAGICPIG method (the C++ kernel). ``segment`` and ``pre_rope`` give every key its own centre,
which the kernel's per-request ``q . c`` correction cannot express; they run in
:mod:`vllm_magicpig.eval.decode.per_key`.

Calibration: with ``magicpig_set_eval(calibrate=True)`` every decode step adds the
cached keys of each decode request (positions ``[0, seq_len - 1)``) to per-layer sums.
Calibration requests should decode two tokens (one decode step each), on text that is
not evaluated, at least as long as the prompts to be served.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_magicpig.kv_layout import gather, request_blocks

EVAL_CENTERINGS = ("global", "segment", "pre_rope")
NEEDS_CALIBRATION = ("global", "pre_rope")


@dataclass(frozen=True)
class Rope:
    """The model's rotary embedding (default or linear-scaled, neox "rotate half" layout)."""

    head_dim: int
    theta: float
    linear_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, hf_config, head_dim: int) -> "Rope | None":
        """The RoPE of a Llama-style config, or None when it is not a kind handled here."""
        params = getattr(hf_config, "rope_parameters", None) or {}
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if theta is None or kind not in ("default", "linear"):
            return None
        factor = float(params.get("factor", scaling.get("factor", 1.0))) if kind == "linear" else 1.0
        return cls(head_dim, float(theta), factor)

    def _cos_sin(self, positions: torch.Tensor):
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(half, dtype=torch.float64) * 2 / self.head_dim))
        ang = (positions.double() / self.linear_factor)[:, None] * inv_freq[None, :]  # [n, D/2]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x [n, Hkv, D] (float) to ``positions`` [n]; ``inverse`` undoes the rotation."""
        cos, sin = self._cos_sin(positions)
        if inverse:
            sin = -sin
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LayerCalibration:
    """Key sums of one layer over calibration requests: by position, and un-rotated."""

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        self.pos_sum = torch.zeros(0, num_kv_heads, head_dim, dtype=torch.float64)
        self.pos_count = torch.zeros(0, dtype=torch.float64)
        self.pre_sum = torch.zeros(num_kv_heads, head_dim, dtype=torch.float64)
        self.pre_count = 0
        self.pre_norm_sum = torch.zeros(num_kv_heads, dtype=torch.float64)
        self.requests = 0

    def add(self, keys: torch.Tensor, rope: Rope | None) -> None:
        """Keys [n, Hkv, D] of one request, positions 0..n-1."""
        n = keys.shape[0]
        if n > self.pos_sum.shape[0]:
            grow = n - self.pos_sum.shape[0]
            self.pos_sum = torch.cat([self.pos_sum, self.pos_sum.new_zeros(grow, *self.pos_sum.shape[1:])])
            self.pos_count = torch.cat([self.pos_count, self.pos_count.new_zeros(grow)])
        k = keys.double()
        self.pos_sum[:n] += k
        self.pos_count[:n] += 1
        if rope is not None:
            pre = rope.rotate(keys.float(), torch.arange(n), inverse=True).double()
            self.pre_sum += pre.sum(0)
            self.pre_norm_sum += pre.norm(dim=-1).sum(0)
            self.pre_count += n
        self.requests += 1

    def position_mean(self, start: int, end: int) -> torch.Tensor:
        """float32 [Hkv, D]: mean calibration key over positions [start, end) (those seen)."""
        end = min(end, self.pos_sum.shape[0])
        count = float(self.pos_count[start:end].sum()) if end > start else 0.0
        if count == 0:
            raise RuntimeError(f"no calibration keys at positions [{start}, {end}): calibrate with longer text")
        return (self.pos_sum[start:end].sum(0) / count).float()

    def pre_rope_coherence(self) -> float:
        """|mean of un-rotated keys| / mean |key|, averaged over KV heads: 1 when every key
        points the same way before RoPE, near 0 when their directions are spread."""
        if self.pre_count == 0:
            return float("nan")
        return float((self.pre_sum.norm(dim=-1) / self.pre_norm_sum).mean())

    def pre_rope_mean(self) -> torch.Tensor:
        if self.pre_count == 0:
            raise RuntimeError("no pre-RoPE calibration: the model's RoPE kind is not supported")
        return (self.pre_sum / self.pre_count).float()


def calibrate(ev, layer_name: str, keys: torch.Tensor) -> None:
    """Add one request's keys [n, Hkv, D] (positions 0..n-1) to the layer's calibration."""
    if layer_name not in ev.calibration:
        ev.calibration[layer_name] = LayerCalibration(keys.shape[1], keys.shape[2])
    ev.calibration[layer_name].add(keys, ev.rope)


def calibration_summary(ev) -> dict:
    if not ev.calibration:
        return {"layers": 0, "requests": 0, "positions": 0}
    any_layer = next(iter(ev.calibration.values()))
    return {"layers": len(ev.calibration), "requests": any_layer.requests,
            "positions": int((any_layer.pos_count > 0).sum()),
            "pre_rope_coherence": {name: c.pre_rope_coherence() for name, c in ev.calibration.items()}}


def check_available(ev, centering: str) -> None:
    """Raise a ValueError naming the fix when ``centering`` cannot run in this worker."""
    if centering in NEEDS_CALIBRATION and not ev.calibration:
        raise ValueError(f"centering {centering!r} needs calibration first: "
                         "magicpig_set_eval(calibrate=True), then decode 2 tokens of unrelated long text")
    if centering == "pre_rope" and ev.rope is None:
        raise ValueError("centering 'pre_rope' supports default and linear RoPE only; this model has another kind")


class CalibrationObserver:
    """Layer observer: with ``calibrate=True``, every decode request's cached keys (positions
    [0, seq_len - 1)) are added to the calibration of each sparse layer."""

    def before_decode(self, ctx, kv, plan) -> None:
        from vllm_magicpig.eval.decode.settings import state

        ev = state(ctx.runtime)
        if not ev.override.calibrate:
            return
        for r, s in enumerate(plan.seq_lens):
            if s >= 2:
                blocks = request_blocks(plan.block_table, r, s, kv.block_size)
                calibrate(ev, ctx.name, gather(kv.key, blocks, 0, s - 1).float())

    def after_decode(self, ctx, query, kv, plan, out, result) -> None:
        pass


def global_centre(ctx, spec, kv) -> torch.Tensor:
    """The ``global`` centring: the calibration's mean key over the request's indexed positions."""
    from vllm_magicpig.eval.decode.settings import state

    return state(ctx.runtime).calibration[ctx.name].position_mean(spec.start, spec.end)


def piece_bounds(lo: int, hi: int, unit: int) -> list[tuple[int, int]]:
    """[lo, hi) cut on the absolute ``unit`` grid (the per-segment centring's pieces)."""
    out, a = [], lo
    while a < hi:
        b = min(hi, (a // unit + 1) * unit)
        out.append((a, b))
        a = b
    return out


def token_centres(ev, centering: str, layer_name: str, keys: torch.Tensor, lo: int, unit: int) -> torch.Tensor:
    """float32 [n, Hkv, D]: the centre of each key of ``keys`` (positions lo .. lo+n-1)."""
    n = keys.shape[0]
    if centering == "segment":
        out = torch.empty(n, *keys.shape[1:], dtype=torch.float32)
        for a, b in piece_bounds(lo, lo + n, unit):
            out[a - lo : b - lo] = keys[a - lo : b - lo].float().mean(0)
        return out
    if centering == "pre_rope":
        mu = ev.calibration[layer_name].pre_rope_mean()
        return ev.rope.rotate(mu.expand(n, *mu.shape), torch.arange(lo, lo + n))
    raise ValueError(f"centering {centering!r} has one centre per request, not per token")
