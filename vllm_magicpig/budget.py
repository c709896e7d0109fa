"""Budget mode: (K, L) chosen per sparse layer and request so that the sampled fraction lands on a target.

With ``"target_cost": 0.02`` in ``additional_config["magicpig"]`` nobody picks K and L by hand:

1. **The SimHash collision model.** A key at angle theta from the query agrees on one random
   hyperplane with probability ``1 - theta/pi``, so it collides in one K-bit table with
   ``p = (1 - theta/pi)^K`` and is sampled (>= 2 of L tables) with
   ``P = 1 - (1-p)^L - L p (1-p)^(L-1)``. The expected sampled fraction is the mean of P over the
   (query head, key) angles. Measured on SmolLM2, this expectation over one decode's own angles
   matches what the kernel samples at that decode to within a few percent.
2. **Per request, from its own angles.** The angle distribution, and so the fraction at a fixed
   (K, L), moves with the context: at (10, 150) SmolLM2 samples 2.4% of a 2K context and 4.1% of
   an 8K one. A choice made per layer on other requests cannot hold across contexts, so each
   request chooses in each sparse layer at its first decode, from the angles between that decode's
   query heads and the request's centred keys (the keys the index samples, centred as the index
   centres them), and samples at once: nothing is served exactly to calibrate.
3. **Refinement.** One query is a noisy sample of the request's queries (its fraction differs from
   the request's mean by up to ~30%). The angles of the request's first ``calibration_decodes``
   decodes are pooled; if the first choice's expected fraction over the pool is off the target by
   more than ``REFINE_BAND``, the request chooses again from the pool (its segments are then
   rebuilt once, under the new (K, L)). Refining at 2, 4, 8 pooled decodes as well measured no
   better on SmolLM2 (noise-level differences), so it is done once. Then the choice holds until
   the request's indexed context has grown by ``REGROW`` (a long generation, or a turn inheriting
   a shorter prefix's centre): then it is chosen afresh.
4. **The choice.** The largest K for which some L <= ``max_L`` reaches the target (sharper buckets
   concentrate the sample on the keys closest to the query; ``max_L`` bounds memory and lookups),
   then the integer L whose expected fraction is nearest the target (the fraction grows with L;
   integer K alone is too coarse to land within a few percent).

A request is known by its centre (``CentreSpec.cid``): the planner gives a prompt its centre at the
first decode, and a prefix-cache hit on the same prompt shares it, with the same keys. Segments are
keyed by their (K, L) in the index (``index.segment_owner``), so a segment hashed under one (K, L)
is never read under another.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_magicpig.limits import K_RANGE, L_RANGE

logger = logging.getLogger("vllm.magicpig")  # under vLLM's logger tree, so its handler prints it

THETA_BINS = 2048
_CENTRES = (torch.arange(THETA_BINS, dtype=torch.float64) + 0.5) * (math.pi / THETA_BINS)

DEFAULT_MAX_L = 150  # the default config's L: budget mode uses at most the default index memory
DEFAULT_CALIBRATION_DECODES = 8  # SmolLM2 2K-8K, 1-4%: 4 (band 10%) left 3 of 252 layer rows off +-25%, 8 none
REFINE_BAND = 0.05  # a first choice whose expectation over the pooled angles is within +-5% holds
REGROW = 1.5  # re-choose when the request's indexed keys have grown by this factor since its choice
MAX_TRACKED = 1 << 15  # (layer, request, target) choices remembered, least recently used dropped


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
class _RequestChoice:
    choice: Choice
    chosen_at: int  # the request's indexed keys when chosen
    hist: torch.Tensor | None  # pooled angles while refining; None once the choice holds
    decodes: int = 1


@dataclass
class _LayerTally:
    """One (target, layer)'s record since the last stats reset: choices made and what was sampled."""

    last: Choice | None = None
    choices: int = 0
    refined: int = 0
    K_range: list[int] = field(default_factory=list)  # [min, max]
    L_range: list[int] = field(default_factory=list)
    sampled: int = 0
    candidates: int = 0

    def record(self, c: Choice) -> None:
        self.last = c
        self.choices += 1
        self.K_range = [min(self.K_range[0], c.K), max(self.K_range[1], c.K)] if self.K_range else [c.K, c.K]
        self.L_range = [min(self.L_range[0], c.L), max(self.L_range[1], c.L)] if self.L_range else [c.L, c.L]


class Budget:
    """One worker's budget-mode state: each (layer, request, target)'s (K, L), and per-layer tallies."""

    def __init__(self, max_L: int = DEFAULT_MAX_L, calibration_decodes: int = DEFAULT_CALIBRATION_DECODES) -> None:
        self.max_L = max_L
        self.calibration_decodes = calibration_decodes
        self._lock = threading.Lock()
        self._requests: OrderedDict[tuple[str, int, float], _RequestChoice] = OrderedDict()
        self._tally: dict[tuple[float, str], _LayerTally] = {}

    def request_choice(self, layer: str, request: int, target: float, indexed: int,
                       angles: Callable[[], torch.Tensor]) -> Choice:
        """The (K, L) of ``request`` (its centre id) in ``layer`` for ``target`` at a decode over
        ``indexed`` keys; ``angles()`` gives this decode's angle histogram, and is called only while
        the request chooses or refines (it costs a pass over the request's keys)."""
        key = (layer, request, target)
        with self._lock:
            entry = self._requests.get(key)
            if entry is not None:
                self._requests.move_to_end(key)
        if entry is None or indexed >= REGROW * entry.chosen_at:
            hist = angles()
            entry = _RequestChoice(choose_kl(hist, target, self.max_L), indexed,
                                   hist if self.calibration_decodes > 1 else None)
            with self._lock:
                self._requests[key] = entry
                while len(self._requests) > MAX_TRACKED:
                    self._requests.popitem(last=False)
                self._tally_of(target, layer).record(entry.choice)
            return entry.choice
        if entry.hist is not None:
            entry.hist += angles()
            entry.decodes += 1
            if entry.decodes >= self.calibration_decodes:
                hist, entry.hist = entry.hist, None
                self._refine(layer, target, entry, hist)
        return entry.choice

    def _refine(self, layer: str, target: float, entry: _RequestChoice, hist: torch.Tensor) -> None:
        """Per the module docs, step 3: choose again from the pooled angles if the first choice is off."""
        old = entry.choice
        if abs(expected_fraction(hist, old.K, old.L) / target - 1) <= REFINE_BAND:
            return
        new = choose_kl(hist, target, self.max_L)
        if (new.K, new.L) == (old.K, old.L):
            return
        entry.choice = new
        logger.debug("MAGICPIG budget: %s refined for target %.2f%%: K=%d L=%d -> K=%d L=%d", layer, 100 * target,
                     old.K, old.L, new.K, new.L)
        with self._lock:
            tally = self._tally_of(target, layer)
            tally.record(new)
            tally.refined += 1

    def _tally_of(self, target: float, layer: str) -> _LayerTally:
        return self._tally.setdefault((target, layer), _LayerTally())

    def add_sampled(self, target: float, layer: str, sampled: int, candidates: int) -> None:
        """Count what the kernel sampled in ``layer`` at the choices for ``target``."""
        with self._lock:
            t = self._tally_of(target, layer)
            t.sampled += sampled
            t.candidates += candidates

    def choosing(self) -> int:
        """(layer, request, target) choices still pooling angles."""
        return sum(e.hist is not None for e in list(self._requests.values()))

    def reset_counters(self) -> None:
        with self._lock:
            self._tally.clear()

    def forget(self) -> None:
        """Forget every request's choice: the next decodes choose afresh."""
        with self._lock:
            self._requests.clear()
            self._tally.clear()

    def snapshot(self) -> dict[str, Any]:
        """``budget``: per layer and target used since the last stats reset, the latest choice (K, L,
        its expected fraction), the range of choices, how many were made and refined, and the fraction
        the kernel achieved."""
        layers: dict[str, Any] = {}
        targets: dict[str, list[int]] = {}
        with self._lock:
            tallies = sorted(self._tally.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        for (target, name), t in tallies:
            if t.last is None:
                continue
            layers.setdefault(name, {})[f"{target:g}"] = {
                "K": t.last.K, "L": t.last.L, "model_fraction": round(t.last.model_fraction, 6),
                "K_range": t.K_range, "L_range": t.L_range, "choices": t.choices, "refined": t.refined,
                "sampled_fraction": t.sampled / t.candidates if t.candidates else None}
            agg = targets.setdefault(f"{target:g}", [0, 0])
            agg[0] += t.sampled
            agg[1] += t.candidates
        return {"budget": {
            "max_L": self.max_L, "calibration_decodes": self.calibration_decodes,
            "requests_tracked": len(self._requests), "requests_refining": self.choosing(),
            "sampled_fraction_per_target": {k: (s / n if n else None) for k, (s, n) in targets.items()},
            "layers": layers,
        }}

    def summary(self) -> str:
        """The stats log line's budget part (empty when budget mode never ran)."""
        with self._lock:
            tallies = list(self._tally.items())
        if not tallies:
            return ""
        parts = []
        for target in sorted({key[0] for key, _ in tallies}):
            ts = [v for (tt, _), v in tallies if tt == target and v.last is not None]
            if not ts:
                continue
            got = sum(v.sampled for v in ts) / max(1, sum(v.candidates for v in ts))
            parts.append(f"target {target:.2%}: {len(ts)} layers, K {min(v.K_range[0] for v in ts)}.."
                         f"{max(v.K_range[1] for v in ts)} L {min(v.L_range[0] for v in ts)}.."
                         f"{max(v.L_range[1] for v in ts)}, {sum(v.choices for v in ts)} choices "
                         f"({sum(v.refined for v in ts)} refined), sampled {got:.2%}")
        return f"budget[{'; '.join(parts)}]" if parts else ""
