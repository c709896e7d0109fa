"""Budget mode: (K, L) chosen per sparse layer so that the sampled fraction lands on a target.

With ``"target_cost": 0.02`` in ``additional_config["magicpig"]`` nobody picks K and L by hand:

1. **Calibration, on the first requests.** While a sparse layer is uncalibrated it serves its
   decodes exactly (stats reason ``calibrating``; nothing is lost) and records the angles between
   each decode query and the request's centred keys (the keys the index would sample, centred
   exactly as the index centres them): a histogram over [0, pi] per layer. After
   ``calibration_decodes`` (request, layer) decodes the layer is calibrated.
2. **The SimHash collision model.** A key at angle theta from the query agrees on one random
   hyperplane with probability ``1 - theta/pi``, so it collides in one K-bit table with
   ``p = (1 - theta/pi)^K`` and is sampled (>= 2 of L tables) with
   ``P = 1 - (1-p)^L - L p (1-p)^(L-1)``. The expected sampled fraction of a layer is the mean of
   P over its observed (query, key) angles.
3. **The choice.** The largest K for which some L <= ``max_L`` reaches the target (sharper buckets
   concentrate the sample on the keys closest to the query; ``max_L`` bounds memory and lookups),
   then the integer L whose expected fraction is nearest the target (the fraction grows with L;
   integer K alone is too coarse to land within a few percent).

The histograms do not depend on the target, so one calibration serves every target: a second
target (the accuracy harness switches targets at run time) is a new choice from the same
histograms, not a new calibration. Segments are keyed by their layer's (K, L) in the index
(``index.segment_owner``), so a segment hashed under one (K, L) is never read under another.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_magicpig.limits import K_RANGE, L_RANGE

logger = logging.getLogger("vllm.magicpig")  # under vLLM's logger tree, so its handler prints it

THETA_BINS = 2048
_CENTRES = (torch.arange(THETA_BINS, dtype=torch.float64) + 0.5) * (math.pi / THETA_BINS)

DEFAULT_MAX_L = 150  # the default config's L: budget mode uses at most the default index memory
DEFAULT_CALIBRATION_DECODES = 8
# Feedback on the measured fraction (``Budget._feedback``)
FEEDBACK_WINDOW = 16  # served (request, layer) decodes per window, doubled after each correction
FEEDBACK_BAND = 0.1  # a window within +-10% of the target changes nothing
FEEDBACK_MAX_ADJUSTMENTS = 8


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
class _Layer:
    hist: torch.Tensor = field(default_factory=lambda: torch.zeros(THETA_BINS, dtype=torch.float64))
    decodes: int = 0  # (request, layer) decodes observed
    calibrated: bool = False
    choices: dict[float, Choice] = field(default_factory=dict)  # target -> choice
    # feedback (per target): the model's bias seen so far, and the current window's [sampled, candidates, decodes]
    correction: dict[float, float] = field(default_factory=dict)
    window: dict[float, list[int]] = field(default_factory=dict)
    adjustments: dict[float, int] = field(default_factory=dict)


class Budget:
    """One worker's budget-mode state: per-layer calibration histograms and (K, L) per target."""

    def __init__(self, max_L: int = DEFAULT_MAX_L, calibration_decodes: int = DEFAULT_CALIBRATION_DECODES,
                 feedback: bool = True) -> None:
        self.max_L = max_L
        self.feedback = feedback
        self.calibration_decodes = calibration_decodes
        self._lock = threading.Lock()
        self.layers: dict[str, _Layer] = {}
        # (target, layer) -> [sampled keys, candidate keys]: the achieved fraction, per target
        self.sampled: dict[tuple[float, str], list[int]] = {}

    def calibrating(self, layer: str) -> bool:
        st = self.layers.get(layer)
        return st is None or not st.calibrated

    def observe(self, layer: str, hist: torch.Tensor, decodes: int) -> bool:
        """Add ``decodes`` observed decodes' angle histogram; True when this made the layer calibrated."""
        with self._lock:
            st = self.layers.setdefault(layer, _Layer())
            if st.calibrated:
                return False
            st.hist += hist
            st.decodes += decodes
            st.calibrated = st.decodes >= self.calibration_decodes and float(st.hist.sum()) > 0
            return st.calibrated

    def choice(self, layer: str, target: float) -> Choice | None:
        """The layer's (K, L) for ``target``; None while it is calibrating."""
        st = self.layers.get(layer)
        if st is None or not st.calibrated:
            return None
        c = st.choices.get(target)
        if c is None:
            with self._lock:
                c = st.choices[target] = choose_kl(st.hist, target, self.max_L)
            logger.info("MAGICPIG budget: %s calibrated on %d decodes: target %.2f%% -> K=%d L=%d "
                        "(model fraction %.2f%%)", layer, st.decodes, 100 * target, c.K, c.L,
                        100 * c.model_fraction)
        return c

    def add_sampled(self, target: float, layer: str, sampled: int, candidates: int, decodes: int = 1) -> None:
        """Count what the kernel sampled at the layer's choice for ``target``; feed it back (below)."""
        s = self.sampled.setdefault((target, layer), [0, 0])
        s[0] += sampled
        s[1] += candidates
        if self.feedback:
            self._feedback(layer, target, sampled, candidates, decodes)

    def _feedback(self, layer: str, target: float, sampled: int, candidates: int, decodes: int) -> None:
        """Close the loop on the measured fraction. Over windows of served decodes (``FEEDBACK_WINDOW``,
        doubling after each correction, so a correction is rare and cannot oscillate fast), a layer whose
        achieved fraction is off the target by more than ``FEEDBACK_BAND`` learns the model's bias
        (achieved / expected at its choice) and chooses again for the target divided by that bias.
        Its old segments are not reused: the index stores segments under their (K, L)."""
        st = self.layers.get(layer)
        if st is None or target not in st.choices:
            return
        w = st.window.setdefault(target, [0, 0, 0])
        w[0] += sampled
        w[1] += candidates
        w[2] += decodes
        n = st.adjustments.get(target, 0)
        if w[2] < FEEDBACK_WINDOW << min(n, 6) or w[1] == 0:
            return
        achieved = w[0] / w[1]
        st.window[target] = [0, 0, 0]
        if abs(achieved / target - 1) <= FEEDBACK_BAND or n >= FEEDBACK_MAX_ADJUSTMENTS:
            return
        old = st.choices[target]
        if achieved <= 0 or old.model_fraction <= 0:
            return
        with self._lock:
            corr = min(max(achieved / old.model_fraction, 0.1), 10.0)  # the bias at the current choice
            st.correction[target] = corr
            st.adjustments[target] = n + 1
            new = st.choices[target] = choose_kl(st.hist, min(target / corr, 1.0), self.max_L)
        logger.info("MAGICPIG budget: %s achieved %.2f%% for target %.2f%% at K=%d L=%d; model bias %.2f: "
                    "now K=%d L=%d", layer, 100 * achieved, 100 * target, old.K, old.L, corr, new.K, new.L)

    def reset_counters(self) -> None:
        self.sampled.clear()

    def recalibrate(self) -> None:
        """Forget every histogram and choice: the next requests calibrate again."""
        with self._lock:
            self.layers.clear()
            self.sampled.clear()

    def snapshot(self) -> dict[str, Any]:
        """``budget``: per layer the calibration state and, per target used, the chosen (K, L), the
        model's expected fraction and the fraction the kernel achieved since the last stats reset."""
        layers: dict[str, Any] = {}
        for name, st in sorted(self.layers.items()):
            entry: dict[str, Any] = {"calibrated": st.calibrated, "calibration_decodes": st.decodes}
            for target, c in sorted(st.choices.items()):
                s = self.sampled.get((target, name), [0, 0])
                entry[f"{target:g}"] = {"K": c.K, "L": c.L, "model_fraction": round(c.model_fraction, 6),
                                        "sampled_fraction": s[0] / s[1] if s[1] else None,
                                        "model_bias": round(st.correction.get(target, 1.0), 4),
                                        "adjustments": st.adjustments.get(target, 0)}
            layers[name] = entry
        targets: dict[str, Any] = {}
        for (target, _), (s, n) in sorted(self.sampled.items()):
            t = targets.setdefault(f"{target:g}", [0, 0])
            t[0] += s
            t[1] += n
        return {"budget": {
            "max_L": self.max_L, "calibration_decodes_needed": self.calibration_decodes,
            "calibrated_layers": sum(st.calibrated for st in self.layers.values()),
            "calibrating_layers": sum(not st.calibrated for st in self.layers.values()),
            "sampled_fraction_per_target": {t: (s / n if n else None) for t, (s, n) in targets.items()},
            "layers": layers,
        }}

    def summary(self) -> str:
        """The stats log line's budget part (empty when budget mode never ran)."""
        if not self.layers:
            return ""
        done = [st for st in self.layers.values() if st.calibrated]
        parts = [f"budget[calibrated {len(done)}/{len(self.layers)} layers"]
        targets = sorted({t for st in done for t in st.choices})
        for t in targets:
            cs = [st.choices[t] for st in done if t in st.choices]
            s = [v for (tt, _), v in self.sampled.items() if tt == t]
            got = sum(x[0] for x in s) / max(1, sum(x[1] for x in s))
            parts.append(f"target {t:.2%}: K {min(c.K for c in cs)}..{max(c.K for c in cs)} "
                         f"L {min(c.L for c in cs)}..{max(c.L for c in cs)} sampled {got:.2%}")
        return "; ".join(parts) + "]"
