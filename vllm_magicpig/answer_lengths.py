"""How long answers run, learned from the requests this worker has seen, so that a new prompt is
indexed at its first decode when its answer will most likely run long enough to pay the build back.

Why: the cost model defers a new prompt's build, ski-rental style, until its exact decodes would
have saved what the build costs (``cost_model.py``). That never costs more than twice the best
choice made in hindsight, and it costs exactly that when answers run long: the decodes served
exactly while waiting cost the build again. vLLM's runner sees every request finish and how many
tokens it generated of its ``max_tokens``; over a workload's requests that says how likely a new
answer is to go on. Where it is likely enough, building at once saves the wait (a 16K-token prompt
on SmolLM2 waits ~80 decodes, ~3 s of the worker's core, before ski rental builds it).

The estimate: Kaplan-Meier over the fraction of ``max_tokens`` an answer reached. A finished
request is an event at its fraction; a request still running is censored at what it has generated
so far (in a burst of requests, later ones start before the first have finished, and those that
have run long already are the evidence). Requests are grouped by the power of 2 of their
``max_tokens`` (a client asking for 512 tokens is not one leaving it to the model's length), and a
group with too few observations falls back to all requests together. Beyond the last observation
the survival is taken as 0, so an estimate of the decodes to come errs short. A request's outlook
is the survival curve conditioned on what it has generated, in tokens from now.

``answer_bounds.py`` records the finished requests (from vLLM's runner) and collects the running
ones; the planner hands a request's outlook to the cost model, which decides.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Iterable, Sequence

WINDOW = 256  # finished answers remembered per group: a workload that changes is followed
# Observations a survival curve needs beyond the request's own progress before it is trusted. Few:
# the decision it feeds risks at most one build per request, the same worst case ski rental has.
MIN_ANSWERS = 4


def _group(max_tokens: int) -> int:
    return int(math.log2(max(max_tokens, 1)))


class Outlook:
    """A request's remaining answer as a survival curve in tokens from now: ``survives(k)`` is the
    probability it generates more than ``k`` more tokens, ``expected(k0, k1)`` the expected number
    of its tokens k0 < k <= k1 from now (both conditioned on what it has generated)."""

    __slots__ = ("_max_tokens", "_start", "_times", "_survival")

    def __init__(self, max_tokens: int, start: float, times: list[float], survival: list[float]) -> None:
        """``times``: ascending fractions of ``max_tokens`` after ``start`` where the curve steps (the
        last one is the last observation, past which the curve is 0); ``survival[i]``: its value on
        [times[i - 1], times[i]) (``times[-1]`` before the first step: ``start``)."""
        self._max_tokens, self._start, self._times, self._survival = max_tokens, start, times, survival

    def survives(self, k: float) -> float:
        t = self._start + k / self._max_tokens
        i = bisect.bisect_right(self._times, t)
        return self._survival[i] if i < len(self._times) else 0.0

    def expected(self, k0: float = 0.0, k1: float = math.inf) -> float:
        """Tokens expected in (k0, k1] from now: the curve's integral, in tokens."""
        lo = self._start + k0 / self._max_tokens
        hi = self._start + k1 / self._max_tokens
        area, prev = 0.0, self._start
        for t, s in zip(self._times, self._survival):
            a, b = max(prev, lo), min(t, hi)
            if b > a:
                area += s * (b - a)
            prev = t
            if prev >= hi:
                break
        return area * self._max_tokens


class AnswerLengths:
    """Finished answers per group of ``max_tokens``, and outlooks from them (module docs)."""

    def __init__(self, window: int = WINDOW, min_answers: int = MIN_ANSWERS) -> None:
        self.min_answers = min_answers
        self._finished: dict[int, deque[float]] = {}
        self._window = window
        self.recorded = 0

    def record(self, generated: int, max_tokens: int | None) -> None:
        """A request finished having generated ``generated`` of at most ``max_tokens`` tokens."""
        if not max_tokens or max_tokens <= 0:
            return
        fractions = self._finished.setdefault(_group(max_tokens), deque(maxlen=self._window))
        fractions.append(min(max(generated, 0) / max_tokens, 1.0))
        self.recorded += 1

    def outlook(self, generated: int, max_tokens: int | None,
                running: Iterable[tuple[int, int | None]] = ()) -> Outlook | None:
        """The outlook of a request that has generated ``generated`` of at most ``max_tokens``, from the
        finished answers and the ``running`` requests' ``(generated, max_tokens)`` (censored: their
        answers go on at least that far); None while too few observations reach past it."""
        if not max_tokens or max_tokens <= 0:
            return None
        start = generated / max_tokens
        group = _group(max_tokens)
        censored: dict[int, list[float]] = {}
        for g, m in running:
            if m and m > 0:
                censored.setdefault(_group(m), []).append(min(g / m, 1.0))
        own = self._curve(start, list(self._finished.get(group, ())), censored.get(group, []))
        if own is not None:
            return Outlook(max_tokens, start, *own)
        pooled = self._curve(start, [f for fs in self._finished.values() for f in fs],
                             [f for fs in censored.values() for f in fs])
        return None if pooled is None else Outlook(max_tokens, start, *pooled)

    def _curve(self, start: float, events: Sequence[float],
               censored: Sequence[float]) -> tuple[list[float], list[float]] | None:
        """Kaplan-Meier over the observations past ``start``: (step times, survival before each step,
        the last step being the last observation), or None with fewer than ``min_answers`` of them."""
        obs = sorted([(f, True) for f in events if f > start] + [(f, False) for f in censored if f > start])
        if len(obs) < self.min_answers:
            return None
        times: list[float] = []
        survival: list[float] = []
        s, at_risk, i = 1.0, len(obs), 0
        while i < len(obs):
            t, deaths, leaving = obs[i][0], 0, 0
            while i < len(obs) and obs[i][0] == t:
                deaths += obs[i][1]
                leaving += 1
                i += 1
            times.append(t)
            survival.append(s)
            s *= 1.0 - deaths / at_risk
            at_risk -= leaving
        return times, survival

    def snapshot(self) -> dict:
        return {"answers_recorded": self.recorded,
                "answer_groups": {1 << g: len(fs) for g, fs in sorted(self._finished.items())}}
