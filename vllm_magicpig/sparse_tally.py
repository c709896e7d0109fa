"""What the sparse layers served and sampled, and how long they took, recorded in the layer loop
and folded into the counters and the cost model once a step.

A sparse layer used to update half a dozen counters and feed the cost model's fit (a lock, a
least-squares update) itself: ~15 us of Python a layer inside an engine, where the interpreter's
data is cold between layers (the reason ``exact_tally.py`` gives for the layers the platform kernel
serves). Now a layer appends one record, and the records are folded together, warm, when the next
step is planned or the stats are read (``Stats.flush``), so every read sees every layer.
"""
from __future__ import annotations

from typing import Any


class SparseTally:
    """The sparse layers' records since the last fold (the runtime keeps one for the worker's life)."""

    __slots__ = ("_served", "_timed")

    def __init__(self) -> None:
        self._served: list[tuple[str, str, int, int, int]] = []
        self._timed: list[tuple[int, int, float]] = []

    def served(self, layer_name: str, label: str, requests: int, sampled: int, candidates: int) -> None:
        """A layer served ``requests`` decodes sparse by method ``label``, sampling ``sampled`` of
        ``candidates`` keys (summed over requests and query heads)."""
        self._served.append((layer_name, label, requests, sampled, candidates))

    def timed(self, requests: int, keys: int, seconds: float) -> None:
        """A layer sampled every one of ``requests`` decodes (``keys`` in all) in ``seconds``: an
        observation for the cost model."""
        self._timed.append((requests, keys, seconds))

    def fold(self, stats: Any, cost: Any) -> None:
        served, self._served = self._served, []
        for layer_name, label, requests, sampled, candidates in served:
            stats.decode_sparse += requests
            stats.decode_by_method[label] += requests
            stats.add_sampled(layer_name, sampled, candidates)
        timed, self._timed = self._timed, []
        if cost is None:
            return
        # A step's layers share (requests, keys): one counted observation of their mean per run of
        # equal shapes, the same least-squares fit as one observation a layer (LinearCost.add).
        i = 0
        while i < len(timed):
            requests, keys, _ = timed[i]
            j, total = i, 0.0
            while j < len(timed) and timed[j][0] == requests and timed[j][1] == keys:
                total += timed[j][2]
                j += 1
            cost.observe_sparse(requests, keys, total / (j - i), j - i)
            i = j
