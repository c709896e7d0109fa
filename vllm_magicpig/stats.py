"""Counters that show what MAGICPIG did, one ``Stats`` per worker runtime.

Users see them in the log every ``log_stats_interval`` steps; tests and scripts read them from
the workers with ``llm.collective_rpc("magicpig_stats")`` (the method is added to vLLM's worker
wrapper by ``register()``). Extensions add their own sections with :meth:`Stats.add_section`.

Units: a "decode" is one (request, layer) decode attention computation, so one
generated token of a 30-layer model counts 30 decodes.
"""
from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any, Callable

# Why a decode was served exactly. Kept as constants so tests and docs agree.
EXACT_SHORT_CONTEXT = "short_context"
EXACT_DENSE_LAYER = "dense_layer"
EXACT_EVICTED = "evicted"  # index over its memory cap: the uncovered tokens ran exactly
EXACT_METHOD = "decode_method_exact"
# accelerator platforms: no block past the sinks is mirrored to host memory yet (copies in flight)
EXACT_NOT_MIRRORED = "not_mirrored"
# this worker's timings predict that sampling the context would be slower than exact attention
EXACT_SAMPLING_SLOWER = "sampling_slower"
# a new prompt's index is being built on the background thread (background_index.py)
EXACT_INDEXING = "indexing"
# a new prompt's index waits until its exact decodes would have saved its build's cost (cost_model.py)
EXACT_INDEX_DEFERRED = "index_deferred"
# ... and would not have paid back before the request's max_tokens end it (answer_bounds.py)
EXACT_INDEX_CANNOT_PAY = "index_cannot_pay"
# its index would leave the memory node less free than node_reserve_mb (node_memory.py)
EXACT_NODE_MEMORY = "node_memory_low"
EXACT_REASONS = (EXACT_SHORT_CONTEXT, EXACT_DENSE_LAYER, EXACT_EVICTED, EXACT_METHOD, EXACT_NOT_MIRRORED,
                 EXACT_SAMPLING_SLOWER, EXACT_INDEXING, EXACT_INDEX_DEFERRED, EXACT_INDEX_CANNOT_PAY,
                 EXACT_NODE_MEMORY)
# index entries that describe what is held now, not events: kept by a reset
_GAUGES = ("segments_live", "staged_bytes")


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # name -> (snapshot, reset, summary): counters owned by another part, shown beside ours
        self._sections: dict[str, tuple[Callable[[], dict], Callable[[], None] | None,
                                        Callable[[], str] | None]] = {}
        self.index_bytes = 0
        self.mirror_bytes = 0
        # the most index + mirror bytes ever held at once (a gauge of the worker's life: no reset)
        self.held_bytes_peak = 0
        # the index's cap (index_memory_mb as this worker runs it: on CPU it may have been sized to fit
        # beside the KV cache, host_memory.py), so a dashboard sets the bytes held against it
        self.index_cap_bytes = 0
        self.index: Counter[str] = Counter()
        # called before the counters are read or reset: counts kept elsewhere for speed join them
        self._flushes: list[Callable[[], None]] = []
        self.reset()

    def add_flush(self, flush: Callable[[], None]) -> None:
        """``flush()`` adds counts kept elsewhere (``exact_tally.py``) to ours before every read."""
        self._flushes.append(flush)

    def flush(self) -> None:
        for flush in self._flushes:
            flush()

    def reset(self) -> None:
        """Zero the counters. The index gauges (bytes, live segments) describe what is
        held now, so they survive a reset."""
        self.flush()  # what happened before the reset goes with it
        held = {k: self.index[k] for k in _GAUGES if k in self.index}
        self.steps = 0
        self.decode_sparse = 0
        self.decode_exact: Counter[str] = Counter()
        self.decode_by_method: Counter[str] = Counter()  # sparse decodes by the method that served them
        self.prefill_tokens = 0
        self.prefill_chunks = 0
        self.layer_calls: Counter[str] = Counter()
        # per layer: [sampled keys, candidate keys] summed over query heads
        self.sampled: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.index = Counter()
        self.build_seconds = 0.0
        self.sparse_seconds = 0.0
        self.index.update(held)
        for _, reset, _ in self._sections.values():
            if reset is not None:
                reset()

    def add_section(self, name: str, snapshot: Callable[[], dict], reset: Callable[[], None] | None = None,
                    summary: Callable[[], str] | None = None) -> None:
        """Merge ``snapshot()``'s keys into every snapshot; ``reset()`` runs with ours; ``summary()``
        (if given; empty = nothing) is appended to the log line."""
        self._sections[name] = (snapshot, reset, summary)

    def count_layer(self, layer_name: str) -> None:
        self.layer_calls[layer_name] += 1

    def add_sampled(self, layer_name: str, sampled: int, candidates: int) -> None:
        s = self.sampled[layer_name]
        s[0] += sampled
        s[1] += candidates

    def sampled_fraction(self) -> float | None:
        tot_s = sum(v[0] for v in self.sampled.values())
        tot_c = sum(v[1] for v in self.sampled.values())
        return tot_s / tot_c if tot_c else None

    def snapshot(self) -> dict[str, Any]:
        self.flush()
        with self._lock:
            per_layer = {name: (v[0] / v[1] if v[1] else None) for name, v in sorted(self.sampled.items())}
            out = {
                "steps": self.steps,
                "decode_sparse": self.decode_sparse,
                "decode_exact": dict(self.decode_exact),
                "decode_by_method": dict(self.decode_by_method),
                "prefill_tokens": self.prefill_tokens,
                "prefill_chunks": self.prefill_chunks,
                "layer_calls": dict(self.layer_calls),
                "sampled_fraction": self.sampled_fraction(),
                # raw sums, so a dashboard can take the fraction over a window (rate / rate)
                "sampled_keys": sum(v[0] for v in self.sampled.values()),
                "candidate_keys": sum(v[1] for v in self.sampled.values()),
                "sampled_fraction_per_layer": per_layer,
                "index": dict(self.index),
                "index_bytes": self.index_bytes,
                "mirror_bytes": self.mirror_bytes,
                "held_bytes_peak": self.held_bytes_peak,
                "index_cap_bytes": self.index_cap_bytes,
                "build_seconds": round(self.build_seconds, 4),
                "sparse_seconds": round(self.sparse_seconds, 4),
            }
            for snapshot, _, _ in self._sections.values():
                out.update(snapshot())
            return out

    def summary_line(self) -> str:
        self.flush()
        frac = self.sampled_fraction()
        exact = ", ".join(f"{k}={v}" for k, v in sorted(self.decode_exact.items())) or "none"
        extra = [text for _, _, summary in self._sections.values() if summary is not None and (text := summary())]
        return (
            f"MAGICPIG stats: steps={self.steps} decode_sparse={self.decode_sparse} "
            f"decode_exact[{exact}] prefill_tokens={self.prefill_tokens} "
            f"sampled_fraction={'n/a' if frac is None else f'{frac:.2%}'} "
            f"segments={dict(self.index)} index_MiB={self.index_bytes / 2**20:.1f} "
            f"mirror_MiB={self.mirror_bytes / 2**20:.1f}"
        ) + "".join(" " + t for t in extra)


def empty_snapshot() -> dict[str, Any]:
    """What a worker without MAGICPIG layers reports."""
    return Stats().snapshot()


def merge_snapshots(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the snapshots of several workers (tensor parallel) into one view."""
    if len(snaps) == 1:
        return snaps[0]
    out: dict[str, Any] = {"workers": snaps}
    for key in ("steps", "decode_sparse", "prefill_tokens", "prefill_chunks", "index_bytes", "mirror_bytes",
                "held_bytes_peak", "pooled_bytes", "index_cap_bytes"):
        out[key] = sum(s.get(key, 0) for s in snaps)
    for key in ("decode_exact", "decode_by_method", "index", "layer_calls"):
        c: Counter[str] = Counter()
        for s in snaps:
            c.update(s[key])
        out[key] = dict(c)
    return out
