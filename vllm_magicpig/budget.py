"""Budget mode: (K, L) chosen per sparse layer and request so that the sampled fraction lands on a target.

With ``"target_cost": 0.02`` in ``additional_config["magicpig"]`` nobody picks K and L by hand:

1. **The request's own angles.** At a request's first sparse decode, each sparse layer measures the
   angles between that decode's query heads and the request's candidate keys (the tokens the index
   samples, centred exactly as the index centres them): a histogram over [0, pi]. This costs about
   one exact decode's q.k and needs no calibration phase: the fraction depends on the layer, the
   text and the context length (at a fixed (10, 150) on SmolLM2 it rises from 2.4% at 2K to 4.1%
   at 8K), so one choice per layer cannot hold across contexts; one per request can.
2. **The SimHash collision model.** A key at angle theta from the query agrees on one random
   hyperplane with probability ``1 - theta/pi``, so it collides in one K-bit table with
   ``p = (1 - theta/pi)^K`` and is sampled (>= 2 of L tables) with
   ``P = 1 - (1-p)^L - L p (1-p)^(L-1)``. The expected sampled fraction is the mean of P over the
   observed (query, key) angles.
3. **The choice.** The largest K for which some L <= ``max_L`` reaches the target (sharper buckets
   concentrate the sample on the keys closest to the query; ``max_L`` bounds memory and lookups),
   then the integer L whose expected fraction is nearest the target (the fraction grows with L;
   integer K alone is too coarse to land within a few percent).
4. **Feedback.** The first query predicts later ones imperfectly. Each layer compares what the kernel
   sampled with what the model expected for the same decodes and learns the ratio (its bias);
   requests chosen later aim at ``target / bias``. Indexed requests keep their (K, L): nothing is
   rebuilt.

A choice is remembered per (layer, request centre, target): requests sharing a prompt prefix share
the centre, the segments and the choice. The index stores segments under their (K, L)
(``index.segment_owner``), so a segment hashed under one (K, L) is never read under another; the
layer runs the decode method once per distinct (K, L) in a batch (``layer.py``).
"""
from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_magicpig.limits import K_RANGE, L_RANGE

logger = logging.getLogger("vllm.magicpig")  # under vLLM's logger tree, so its handler prints it

THETA_BINS = 2048
_CENTRES = (torch.arange(THETA_BINS, dtype=torch.float64) + 0.5) * (math.pi / THETA_BINS)

DEFAULT_MAX_L = 150  # the default config's L: budget mode uses at most the default index memory
# Feedback on the measured fraction (``Budget._feedback``)
FEEDBACK_WINDOW = 16  # served (request, layer) decodes per window
FEEDBACK_BAND = 0.1  # a window whose achieved / expected ratio is within 10% of the current bias changes nothing
MAX_REQUEST_CHOICES = 1 << 16  # (layer, centre, target) choices kept; the oldest are forgotten first


# ----------------------------------------------------------------------------- the collision model
def sample_probability(theta: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """P(sampled) of keys at angles ``theta`` (radians) from the query: >= 2 of L K-bit tables collide."""
    p = (1.0 - theta.to(torch.float64) / math.pi).clamp(0.0, 1.0) ** K
    log_miss = torch.log1p(-p.clamp(max=1.0 - 1e-16))  # (1 - p) > 0: L * log stays finite
    none = torch.exp(L * log_miss)
    one = L * p * torch.exp((L - 1) * log_miss)
    return (1.0 - none - one).clamp(0.0, 1.0)


def expected_fraction(hist: torch.Tensor, K: int, L: int) -> float:
    """The expected sampled fraction over the angle histogram ``hist`` ([THETA_BINS] counts)."""
    total = float(hist.sum())
    if total <= 0:
        return 0.0
    return float((hist.to(torch.float64) * sample_probability(_CENTRES, K, L)).sum()) / total


@dataclass(frozen=True)
class Choice:
    K: int
    L: int
    model_fraction: float  # the expected sampled fraction at (K, L) over the calibration angles (no feedback)


def choose_kl(hist: torch.Tensor, target: float, max_L: int = DEFAULT_MAX_L) -> Choice:
    """Per the module docs: the largest K that reaches ``target`` with L <= max_L, then the L nearest it."""
    max_L = max(L_RANGE[0], min(max_L, L_RANGE[1]))
    K = K_RANGE[0]
    for k in range(K_RANGE[1], K_RANGE[0] - 1, -1):
        if expected_fraction(hist, k, max_L) >= target:
            K = k
            break
    # smallest L with f(K, L) >= target (f grows with L), by bisection; then the nearer of L-1, L
    lo, hi = L_RANGE[0], max_L
    if expected_fraction(hist, K, hi) < target:  # unreachable even at K=1: as many samples as allowed
        return Choice(K, hi, expected_fraction(hist, K, hi))
    while lo < hi:
        mid = (lo + hi) // 2
        if expected_fraction(hist, K, mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    best = min({max(L_RANGE[0], lo - 1), lo}, key=lambda n: abs(expected_fraction(hist, K, n) - target))
    return Choice(K, best, expected_fraction(hist, K, best))


def angle_histogram(query: torch.Tensor, centred_keys: torch.Tensor) -> torch.Tensor:
    """Histogram ([THETA_BINS] float64 counts, on the CPU) of the angles between every query head
    ``query [H, D]`` and every centred key of its KV head ``centred_keys [n, Hkv, D]``."""
    H, D = query.shape
    n, hkv, _ = centred_keys.shape
    q = query.to(torch.float32)
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k = centred_keys.to(torch.float32)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # a zero key counts at pi/2
    cos = torch.einsum("hgd,nhd->hgn", q.view(hkv, H // hkv, D), k)
    theta = torch.acos(cos.clamp(-1.0, 1.0))
    return torch.histc(theta.flatten(), bins=THETA_BINS, min=0.0, max=math.pi).to("cpu", torch.float64)


# ----------------------------------------------------------------------------- per-runtime state
@dataclass
class _LayerState:
    bias: dict[float, float] = field(default_factory=dict)  # target -> achieved / model, learned by feedback
    window: dict[float, list[float]] = field(default_factory=dict)  # target -> [sampled, expected, decodes]
    corrections: dict[float, int] = field(default_factory=dict)
    last: dict[float, Choice] = field(default_factory=dict)  # target -> the latest request's choice
    kl_range: dict[float, list[int]] = field(default_factory=dict)  # target -> [K min, K max, L min, L max]
    requests: dict[float, int] = field(default_factory=dict)  # target -> requests chosen for


class Budget:
    """One worker's budget-mode state: each (layer, request centre)'s (K, L) per target, and each
    layer's learned model bias."""

    def __init__(self, max_L: int = DEFAULT_MAX_L, feedback: bool = True) -> None:
        self.max_L = max_L
        self.feedback = feedback
        self._lock = threading.Lock()
        self.layers: dict[str, _LayerState] = {}
        # (layer, centre id, target) -> Choice, oldest first
        self._choices: OrderedDict[tuple[str, int, float], Choice] = OrderedDict()
        # (target, layer) -> [sampled keys, candidate keys]: the achieved fraction, per target
        self.sampled: dict[tuple[float, str], list[int]] = {}

    def bias(self, layer: str, target: float) -> float:
        st = self.layers.get(layer)
        return st.bias.get(target, 1.0) if st is not None else 1.0

    def request_choice(self, layer: str, cid: int, target: float) -> Choice | None:
        """The (K, L) chosen for this request centre in this layer, or None before its first decode."""
        return self._choices.get((layer, cid, target))

    def choose(self, layer: str, cid: int, target: float, hist: torch.Tensor) -> Choice:
        """Choose the request centre's (K, L) from its angle histogram, for the target divided by the
        layer's learned bias, and remember it (its segments are hashed with it)."""
        with self._lock:
            st = self.layers.setdefault(layer, _LayerState())
            bias = st.bias.get(target, 1.0)
            c = choose_kl(hist, min(target / bias, 1.0), self.max_L)
            self._choices[(layer, cid, target)] = c
            while len(self._choices) > MAX_REQUEST_CHOICES:
                self._choices.popitem(last=False)
            st.last[target] = c
            st.requests[target] = st.requests.get(target, 0) + 1
            r = st.kl_range.get(target)
            st.kl_range[target] = [c.K, c.K, c.L, c.L] if r is None else [
                min(r[0], c.K), max(r[1], c.K), min(r[2], c.L), max(r[3], c.L)]
        return c

    def add_sampled(self, target: float, layer: str, sampled: int, candidates: int, expected: float,
                    decodes: int = 1) -> None:
        """Count what the kernel sampled (``expected``: what the model predicted for the same decodes,
        sum of model fraction x candidates) and feed it back."""
        s = self.sampled.setdefault((target, layer), [0, 0])
        s[0] += sampled
        s[1] += candidates
        if self.feedback:
            self._feedback(layer, target, sampled, expected, decodes)

    def _feedback(self, layer: str, target: float, sampled: int, expected: float, decodes: int) -> None:
        """Close the loop on the measured fraction: over windows of ``FEEDBACK_WINDOW`` served decodes,
        the ratio achieved / expected is the model's bias in this layer (the first decode's angles
        predict later decodes imperfectly); when it moves by more than ``FEEDBACK_BAND`` the layer's bias
        becomes the geometric mean of the old one and the new ratio. Requests chosen afterwards aim at
        ``target / bias``; requests already indexed keep their (K, L) (nothing is rebuilt)."""
        st = self.layers.setdefault(layer, _LayerState())
        w = st.window.setdefault(target, [0.0, 0.0, 0])
        w[0] += sampled
        w[1] += expected
        w[2] += decodes
        if w[2] < FEEDBACK_WINDOW or w[1] <= 0:
            return
        ratio = w[0] / w[1]
        st.window[target] = [0.0, 0.0, 0]
        old = st.bias.get(target, 1.0)
        if ratio <= 0 or abs(ratio / old - 1) <= FEEDBACK_BAND:
            return
        st.bias[target] = min(max(math.sqrt(old * ratio), 0.1), 10.0)
        st.corrections[target] = st.corrections.get(target, 0) + 1
        logger.debug("MAGICPIG budget: %s achieved/expected %.2f at target %.2f%%: bias %.2f -> %.2f", layer, ratio,
                     100 * target, old, st.bias[target])

    def reset_counters(self) -> None:
        self.sampled.clear()

    def snapshot(self) -> dict[str, Any]:
        """``budget``: per layer and target used: the latest request's (K, L) and the range over
        requests, its model fraction, the learned bias, and the fraction the kernel achieved since the
        last stats reset."""
        layers: dict[str, Any] = {}
        for name, st in sorted(self.layers.items()):
            entry: dict[str, Any] = {}
            for target, c in sorted(st.last.items()):
                s = self.sampled.get((target, name), [0, 0])
                k0, k1, l0, l1 = st.kl_range[target]
                entry[f"{target:g}"] = {"K": c.K, "L": c.L, "K_range": [k0, k1], "L_range": [l0, l1],
                                        "requests": st.requests.get(target, 0),
                                        "model_fraction": round(c.model_fraction, 6),
                                        "sampled_fraction": s[0] / s[1] if s[1] else None,
                                        "model_bias": round(st.bias.get(target, 1.0), 4),
                                        "corrections": st.corrections.get(target, 0)}
            layers[name] = entry
        targets: dict[str, list[int]] = {}
        for (target, _), (s, n) in sorted(self.sampled.items()):
            t = targets.setdefault(f"{target:g}", [0, 0])
            t[0] += s
            t[1] += n
        return {"budget": {
            "max_L": self.max_L,
            "sampled_fraction_per_target": {t: (s / n if n else None) for t, (s, n) in targets.items()},
            "layers": layers,
        }}

    def summary(self) -> str:
        """The stats log line's budget part (empty when budget mode never ran)."""
        if not self.layers:
            return ""
        parts = []
        targets = sorted({t for st in self.layers.values() for t in st.last})
        for t in targets:
            rs = [st.kl_range[t] for st in self.layers.values() if t in st.kl_range]
            s = [v for (tt, _), v in self.sampled.items() if tt == t]
            got = sum(x[0] for x in s) / max(1, sum(x[1] for x in s))
            parts.append(f"target {t:.2%}: K {min(r[0] for r in rs)}..{max(r[1] for r in rs)} "
                         f"L {min(r[2] for r in rs)}..{max(r[3] for r in rs)} sampled {got:.2%}")
        return "budget[" + "; ".join(parts) + "]"
