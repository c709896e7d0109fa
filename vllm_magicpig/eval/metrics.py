"""Fidelity metrics for comparing an approximate (sparse) attention run with an exact one.

Pure functions over Python sequences and numpy; no torch or vllm import (tensors are
accepted by duck typing and converted with ``.detach().float().cpu().numpy()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["Agreement", "token_agreement", "kl_per_position", "mean_kl", "relative_error",
           "max_abs_error", "Interval", "bootstrap_mean", "bootstrap_paired_difference"]


@dataclass(frozen=True)
class Agreement:
    """Result of ``token_agreement``.

    ``prefix_len``: number of leading positions where both sequences agree (position of
    the first divergence). ``length``: ``max(len(a), len(b))``; positions present in only
    one sequence count as disagreements. ``prefix_frac = prefix_len / length`` and
    ``positionwise_frac`` = (number of i < min(len) with a[i] == b[i]) / length.
    Both fractions are 1.0 for two empty sequences.
    """

    prefix_len: int
    length: int
    prefix_frac: float
    positionwise_frac: float


def token_agreement(a_ids: Sequence[int], b_ids: Sequence[int]) -> Agreement:
    """Agreement of two generated token-id sequences (e.g. greedy outputs of the exact and
    the approximate run): up to the first divergence, and position by position."""
    a, b = list(a_ids), list(b_ids)
    length = max(len(a), len(b))
    if length == 0:
        return Agreement(0, 0, 1.0, 1.0)
    prefix = 0
    for x, y in zip(a, b):
        if x != y:
            break
        prefix += 1
    same = sum(1 for x, y in zip(a, b) if x == y)
    return Agreement(prefix, length, prefix / length, same / length)


def _lp(v: Any) -> float:
    """A logprob value: a float, or an object with ``.logprob`` (vLLM ``Logprob``)."""
    return float(getattr(v, "logprob", v))


def _kl_one(p: Mapping[Any, Any], q: Mapping[Any, Any]) -> float:
    if not p:
        raise ValueError("empty logprob dict for P")
    lp = {t: _lp(v) for t, v in p.items()}
    lq = {t: _lp(v) for t, v in q.items()}
    # tokens of P's top-k absent from Q's dict: their q is at most the smallest q in Q's
    # dict and at most Q's leftover mass; give each min(those, leftover / (m + 1))
    missing = [t for t in lp if t not in lq]
    q_left = max(1.0 - sum(math.exp(v) for v in lq.values()), 1e-10)
    if missing:
        q_miss = q_left / (len(missing) + 1)
        if lq:
            q_miss = min(q_miss, math.exp(min(lq.values())))
        floor = math.log(max(q_miss, 1e-30))
    else:
        floor = 0.0
    kl = 0.0
    p_in = q_in = 0.0
    for t, lpt in lp.items():
        pt = math.exp(lpt)
        lqt = lq.get(t, floor)
        kl += pt * (lpt - lqt)
        p_in += pt
        q_in += math.exp(lqt)
    # the rest of the vocabulary as one lumped outcome
    p_rest = max(1.0 - p_in, 0.0)
    q_rest = max(1.0 - q_in, 1e-10)
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def kl_per_position(logprobs_p: Sequence[Mapping[Any, Any]],
                    logprobs_q: Sequence[Mapping[Any, Any]]) -> list[float]:
    """Approximate KL(P || Q) at each position from top-k logprob dicts (see ``mean_kl``)."""
    return [_kl_one(p, q) for p, q in zip(logprobs_p, logprobs_q)]


def mean_kl(logprobs_p: Sequence[Mapping[Any, Any]],
            logprobs_q: Sequence[Mapping[Any, Any]]) -> float:
    """Mean over positions of an approximate KL(P || Q), P = reference (exact attention),
    Q = approximation, from per-position dicts ``token -> logprob`` (floats or vLLM
    ``Logprob`` objects) holding only each run's top-k tokens. Positions are paired up to
    the shorter sequence; for a meaningful number both runs should be scored on the same
    tokens (e.g. prompt logprobs of one text, or teacher-forced outputs).

    Approximation: the vocabulary is coarsened into P's top-k tokens plus one "rest"
    outcome, and KL is computed between the two coarsened distributions,
    ``sum_{t in topk(P)} p_t log(p_t/q_t) + p_rest log(p_rest/q_rest)`` with
    ``p_rest = 1 - sum p_t`` and ``q_rest = 1 - sum q_t`` (clamped at 1e-10).
    If ``m`` tokens of P's top-k are missing from Q's dict, each gets
    ``q = min(smallest q in Q's dict, (1 - sum of Q's dict) / (m + 1))`` (both are upper
    bounds on the true value; the ``m + 1`` keeps some mass for the rest outcome).
    With exact q for every token the coarsened KL is a lower bound of the full KL (merging
    outcomes never increases KL, data-processing inequality); it is exact when P's top-k
    covers (almost) all of P's mass and Q's dict contains P's top-k. Treat it as a
    relative, not absolute, measure; use the same k for every configuration compared.
    """
    vals = kl_per_position(logprobs_p, logprobs_q)
    if not vals:
        raise ValueError("no positions to compare")
    return float(sum(vals) / len(vals))


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor without importing torch
        x = x.detach()
        if hasattr(x, "float"):
            x = x.float()
        x = x.cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def relative_error(approx: Any, exact: Any, eps: float = 1e-12) -> float:
    """``||approx - exact||_F / max(||exact||_F, eps)`` over all elements (numpy arrays,
    nested lists or torch tensors; computed in float64)."""
    a, e = _to_numpy(approx), _to_numpy(exact)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {e.shape}")
    return float(np.linalg.norm((a - e).ravel()) / max(float(np.linalg.norm(e.ravel())), eps))


def max_abs_error(approx: Any, exact: Any) -> float:
    """Largest absolute element-wise difference."""
    a, e = _to_numpy(approx), _to_numpy(exact)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {e.shape}")
    return float(np.max(np.abs(a - e))) if a.size else 0.0


# ----------------------------------------------------------------------------- bootstrap intervals
@dataclass(frozen=True)
class Interval:
    """A point estimate and its bootstrap percentile interval (``level``, e.g. 0.95)."""

    estimate: float
    low: float
    high: float
    level: float
    n: int  # prompts resampled

    def within(self, bound: float) -> bool:
        """True when ``bound`` or better lies inside the interval, i.e. ``high >= bound``: for a paired
        difference (method - reference) and ``bound = -2``, "within 2 points" cannot be rejected."""
        return self.high >= bound

    def __str__(self) -> str:
        return f"{self.estimate:.1f} [{self.low:.1f}, {self.high:.1f}]"


def _strata(scores: Mapping[Any, Sequence[float]] | Sequence[float]) -> list[np.ndarray]:
    if isinstance(scores, Mapping):
        groups = [np.asarray(v, dtype=np.float64) for _, v in sorted(scores.items(), key=lambda kv: str(kv[0]))]
    else:
        groups = [np.asarray(scores, dtype=np.float64)]
    groups = [g for g in groups if g.size]
    if not groups:
        raise ValueError("bootstrap needs at least one score")
    return groups


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    a = (1 - level) / 2
    lo, hi = np.quantile(draws, [a, 1 - a])
    return float(lo), float(hi)


def bootstrap_mean(scores: Mapping[Any, Sequence[float]] | Sequence[float], *, n_boot: int = 4000,
                   level: float = 0.95, seed: int = 0) -> Interval:
    """The mean score with a percentile bootstrap interval over prompts.

    ``scores``: per-prompt scores, or a mapping task -> per-prompt scores. With tasks, the estimate is
    the mean of the task means (the harness's "avg") and prompts are resampled within each task
    (stratified), so every draw keeps each task's sample count."""
    groups = _strata(scores)
    rng = np.random.default_rng(seed)
    est = float(np.mean([g.mean() for g in groups]))
    draws = np.zeros(n_boot)
    for g in groups:
        idx = rng.integers(0, g.size, size=(n_boot, g.size))
        draws += g[idx].mean(axis=1)
    draws /= len(groups)
    lo, hi = _percentiles(draws, level)
    return Interval(est, lo, hi, level, sum(g.size for g in groups))


def bootstrap_paired_difference(scores: Mapping[Any, Sequence[float]] | Sequence[float],
                                reference: Mapping[Any, Sequence[float]] | Sequence[float], *,
                                n_boot: int = 4000, level: float = 0.95, seed: int = 0) -> Interval:
    """``mean(scores) - mean(reference)`` over the same prompts, with a paired bootstrap interval:
    each draw resamples prompts (within each task) and takes both methods' scores on the same
    prompts, so the prompt-to-prompt variance both share cancels."""
    if isinstance(scores, Mapping) != isinstance(reference, Mapping) or (
            isinstance(scores, Mapping) and set(map(str, scores)) != set(map(str, reference))):
        raise ValueError("paired scores need the same tasks on both sides")
    a, b = _strata(scores), _strata(reference)
    if [g.size for g in a] != [g.size for g in b]:
        raise ValueError(f"paired scores need the same prompts: sizes {[g.size for g in a]} vs "
                         f"{[g.size for g in b]}")
    diffs = [x - y for x, y in zip(a, b)]
    return bootstrap_mean({i: d for i, d in enumerate(diffs)} if len(diffs) > 1 else diffs[0], n_boot=n_boot,
                          level=level, seed=seed)
