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
   better on SmolLM2 (noise-level differences), so it is done once. The (K, L) then holds until
   the request's indexed context has grown by ``REGROW`` (a long generation, or a turn inheriting
   a shorter prefix's centre): then it is chosen afresh.
4. **The choice.** The largest K for which some L <= ``max_L`` reaches the target (sharper buckets
   concentrate the sample on the keys closest to the query; ``max_L`` bounds memory and lookups),
   then the integer L whose expected fraction is nearest the target (the fraction grows with L;
   integer K alone is too coarse to land within a few percent).
5. **Steering.** Queries drift as a generation goes on: on SmolLM2 at 16K a choice that was on
   target over the first decodes sampled 0.65-1.28x the target per layer over 96 decodes.
   So segments are hashed with ``BUILD_HEADROOM`` times the chosen L tables, and the kernel reads
   only the first L of them (``L_read``; the first L tables of a segment are exactly a segment of
   L tables, so the estimator is unchanged). After the refinement, every ``STEER_DECODES``
   decodes the fraction the kernel sampled for the request is compared with the target; off by
   more than ``STEER_BAND``, L moves within the built tables to where the model, scaled by the
   measured / expected ratio, meets the target: no rehash. Only a drift the tables built cannot
   follow chooses (K, L) again, for the scaled model, and rehashes. A refinement (step 3) that
   keeps K and fits the tables built rehashes nothing either.

A request is known by its centre (``CentreSpec.cid``): the planner gives a prompt its centre at the
first decode, and a prefix-cache hit on the same prompt shares it, with the same keys. Segments are
keyed by their (K, tables built) in the index (``index.segment_owner``), so a segment hashed under
one (K, L) is never read under another K or with more tables than it has.
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

# Twice the default config's L (tables built: up to 2.5x, BUILD_HEADROOM): with L <= 150, budget mode at 2% had
# to take K ~10 with L near the cap and scored 9 points below full attention at 4K (paired 95%
# interval [-14.5, -4.1], README); with L <= 300 it takes a larger K, concentrating the sample on
# the nearest keys, and passes at 4K and 8K
DEFAULT_MAX_L = 300
DEFAULT_CALIBRATION_DECODES = 8  # SmolLM2 2K-8K, 1-4%: 4 (band 10%) left 3 of 252 layer rows off +-25%, 8 none
# Tables hashed per chosen table: room to steer the fraction up (~1.25^2 = 1.56x at small collision
# probabilities, where the fraction grows as L^2) without rehashing; down needs no room
BUILD_HEADROOM = 1.25
STEER_DECODES = 8  # decodes per steering window: one decode's fraction is noisy (+-15%), 8 average it
STEER_BAND = 0.10  # a window within +-10% of the target leaves L alone
MAX_CORRECTION = 4.0  # a rehash aims the model at most this far from the target (a window sampling ~nothing)
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
    L: int  # tables read
    model_fraction: float  # the expected sampled fraction at (K, L) over the calibration angles (no feedback)
    L_built: int = 0  # tables hashed, >= L (segments are keyed by (K, L_built)); 0: L

    def __post_init__(self) -> None:
        if not self.L_built:
            object.__setattr__(self, "L_built", self.L)


def built_tables(L: int) -> int:
    """Tables to hash for a chosen L: ``BUILD_HEADROOM`` times as many, within the kernel's range."""
    return min(L_RANGE[1], math.ceil(BUILD_HEADROOM * L))


def nearest_L(fraction: Callable[[int], float], target: float, lo: int, hi: int) -> int:
    """The L in [lo, hi] whose ``fraction(L)`` (growing with L) is nearest ``target``."""
    if fraction(hi) < target:
        return hi
    a, b = lo, hi
    while a < b:  # smallest L reaching the target
        mid = (a + b) // 2
        if fraction(mid) >= target:
            b = mid
        else:
            a = mid + 1
    return min({max(lo, a - 1), a}, key=lambda n: abs(fraction(n) - target))


def choose_kl(hist: torch.Tensor, target: float, max_L: int = DEFAULT_MAX_L) -> Choice:
    """Per the module docs: the largest K that reaches ``target`` with L <= max_L, then the L nearest
    it; its segments get ``built_tables(L)`` tables."""
    max_L = max(L_RANGE[0], min(max_L, L_RANGE[1]))
    K = K_RANGE[0]
    for k in range(K_RANGE[1], K_RANGE[0] - 1, -1):
        if expected_fraction(hist, k, max_L) >= target:
            K = k
            break
    # (unreachable even at K=1: as many samples as allowed, L = max_L)
    best = nearest_L(lambda n: expected_fraction(hist, K, n), target, L_RANGE[0], max_L)
    return Choice(K, best, expected_fraction(hist, K, best), built_tables(best))


def steer(choice: Choice, hist: torch.Tensor, target: float, ratio: float) -> Choice:
    """Per the module docs, step 5: the L, within the built tables, where the model over ``hist``
    times ``ratio`` (measured / expected at ``choice``) meets ``target`` (same K, same tables)."""
    L = nearest_L(lambda n: ratio * expected_fraction(hist, choice.K, n), target, L_RANGE[0], choice.L_built)
    return Choice(choice.K, L, expected_fraction(hist, choice.K, L), choice.L_built)


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
    pooled: torch.Tensor | None = None  # the refinement's pooled angles: steering's model
    window: list[int] = field(default_factory=lambda: [0, 0, 0])  # steering: sampled, candidates, decodes


@dataclass
class _LayerTally:
    """One (target, layer)'s record since the last stats reset: choices made and what was sampled."""

    last: Choice | None = None
    choices: int = 0
    refined: int = 0
    steered: int = 0
    rehashed: int = 0  # steers that needed more tables than were built
    K_range: list[int] = field(default_factory=list)  # [min, max]
    L_range: list[int] = field(default_factory=list)
    sampled: int = 0
    candidates: int = 0

    def record(self, c: Choice, steered: bool = False) -> None:
        self.last = c
        self.choices += not steered
        self.steered += steered
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
                                   hist.clone() if self.calibration_decodes > 1 else None, pooled=hist)
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
                entry.pooled = hist
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
        if new.K == old.K and new.L_built <= old.L_built:  # the tables built serve it, with room to steer
            new = Choice(new.K, new.L, new.model_fraction, old.L_built)
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

    def add_request_sampled(self, layer: str, request: int, target: float, sampled: int, candidates: int) -> None:
        """What the kernel sampled for ``request`` in ``layer`` at one decode: per the module docs,
        step 5, every ``STEER_DECODES`` decodes after the refinement its L is steered to the target."""
        with self._lock:
            entry = self._requests.get((layer, request, target))
        if entry is None or entry.hist is not None or entry.pooled is None:  # unknown, or still calibrating
            return
        w = entry.window
        w[0] += sampled
        w[1] += candidates
        w[2] += 1
        if w[2] < STEER_DECODES:
            return
        measured = w[0] / w[1] if w[1] else 0.0
        entry.window = [0, 0, 0]
        if abs(measured / target - 1) <= STEER_BAND:
            return
        old = entry.choice
        ratio = measured / max(expected_fraction(entry.pooled, old.K, old.L), 1e-12)
        new = steer(old, entry.pooled, target, ratio)
        rehash = False
        if new.L == old.L_built and ratio * new.model_fraction < target * (1 - STEER_BAND):
            # the tables built cannot reach the target: choose again, for the model scaled by the drift
            aim = target / min(max(ratio, 1 / MAX_CORRECTION), MAX_CORRECTION)
            new = choose_kl(entry.pooled, min(aim, 0.5), self.max_L)
            rehash = (new.K, new.L_built) != (old.K, old.L_built)
        if (new.K, new.L, new.L_built) == (old.K, old.L, old.L_built):  # nowhere to go
            return
        entry.choice = new
        logger.debug("MAGICPIG budget: %s steered for target %.2f%%: sampled %.3f%%, K %d L %d (of %d) -> K %d L %d "
                     "(of %d)", layer, 100 * target, 100 * measured, old.K, old.L, old.L_built, new.K, new.L,
                     new.L_built)
        with self._lock:
            tally = self._tally_of(target, layer)
            tally.record(new, steered=True)
            tally.rehashed += rehash

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
        """``budget``: per layer and target used since the last stats reset, the latest choice (K, L
        read, L built, its expected fraction), the range of choices, how many were made, refined and
        steered, and the fraction the kernel achieved."""
        layers: dict[str, Any] = {}
        targets: dict[str, list[int]] = {}
        with self._lock:
            tallies = sorted(self._tally.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        for (target, name), t in tallies:
            if t.last is None:
                continue
            layers.setdefault(name, {})[f"{target:g}"] = {
                "K": t.last.K, "L": t.last.L, "L_built": t.last.L_built,
                "model_fraction": round(t.last.model_fraction, 6), "K_range": t.K_range, "L_range": t.L_range,
                "choices": t.choices, "refined": t.refined, "steered": t.steered, "rehashed": t.rehashed,
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
                         f"({sum(v.refined for v in ts)} refined, {sum(v.steered for v in ts)} steered), "
                         f"sampled {got:.2%}")
        return f"budget[{'; '.join(parts)}]" if parts else ""
