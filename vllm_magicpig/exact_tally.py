"""The decodes the platform kernel served in one engine step, tallied in the layer loop and
folded into the counters and the cost model once.

Whenever sampling does not pay (a short context, the cost model's ``sampling_slower``, a prompt
whose index is deferred or still building) MAGICPIG hands a layer's decodes to the platform's own
kernel, and every dense layer always does. "Never slower than exact" needs those layers to cost
what they cost under the platform's backend. Counting each layer's decodes by reason, binding the
layer's settings and feeding the cost model one layer at a time took ~15 us of Python a layer,
0.4-0.5 ms of a 30-layer step at the vLLM seam (``benchmarks/exact_service.py``), more inside an
engine, where the interpreter's data is cold between layers. So a layer served by the platform
adds its count and its kernel time to the step's tally (two attribute updates), and the tally is
folded into ``Stats`` and ``DecodeCostModel`` when the next step is planned or the stats are read.
"""
from __future__ import annotations

from typing import Any

from vllm_magicpig.stats import EXACT_DENSE_LAYER


class ExactTally:
    """One step's layers served by the platform kernel, over all of the step's decode requests."""

    __slots__ = ("num_decodes", "reasons", "context_keys", "timed", "dense_layers", "planned_layers", "seconds",
                 "timed_layers")

    def __init__(self, num_decodes: int, reasons: list[str], context_keys: int, timed: bool) -> None:
        """``reasons``: in a sparse layer, each decode request's exact reason (the plan's; empty
        when the step samples some: then the step's exact requests have a tally of their own,
        ``backend_common.DecodeSplit``, and the sparse layers count the sampled ones);
        ``context_keys``: the keys of all decode requests; ``timed``: a pure decode step whose
        layer times may teach the cost model (no prefill in it, no build beside it)."""
        self.num_decodes = num_decodes
        self.reasons = reasons
        self.context_keys = context_keys
        self.timed = timed
        self.dense_layers = 0
        self.planned_layers = 0  # sparse layers whose plan sampled no request
        self.seconds = 0.0  # the platform kernel's time over the timed layers
        self.timed_layers = 0

    def add(self, dense: bool, seconds: float) -> None:
        """A layer's decodes went to the platform kernel, which took ``seconds``."""
        if dense:
            self.dense_layers += 1
        else:
            self.planned_layers += 1
        if self.timed:
            self.seconds += seconds
            self.timed_layers += 1

    def fold(self, stats: Any, cost: Any) -> None:
        """Into the counters (decodes by reason) and the cost model (exact attention's time per
        layer, as ``timed_layers`` observations of their mean: the same fit)."""
        if self.dense_layers:
            stats.decode_exact[EXACT_DENSE_LAYER] += self.dense_layers * self.num_decodes
        if self.planned_layers:
            for reason in self.reasons:
                stats.decode_exact[reason] += self.planned_layers
        if cost is not None and self.timed_layers:
            cost.observe_exact(self.num_decodes, self.context_keys, self.seconds / self.timed_layers,
                               self.timed_layers)
        self.dense_layers = self.planned_layers = self.timed_layers = 0
        self.seconds = 0.0
