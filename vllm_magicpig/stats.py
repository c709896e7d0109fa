"""Per-process counters that show what MAGICPIG did.

Each vLLM worker process has one ``STATS``. Users see it in the log every
``log_stats_interval`` steps; tests and scripts read it from the workers with
``llm.collective_rpc("magicpig_stats")`` (the method is added to vLLM's worker
wrapper by ``register()``).

Units: a "decode" is one (request, layer) decode attention computation, so one
generated token of a 30-layer model counts 30 decodes.
"""
from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any

# Why a decode was served exactly. Kept as constants so tests and docs agree.
EXACT_SHORT_CONTEXT = "short_context"
EXACT_DENSE_LAYER = "dense_layer"
EXACT_EVICTED = "evicted"  # index over its memory cap: the uncovered tokens ran exactly
EXACT_METHOD = "decode_method_exact"
EXACT_REASONS = (EXACT_SHORT_CONTEXT, EXACT_DENSE_LAYER, EXACT_EVICTED, EXACT_METHOD)


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Zero the counters. The index gauges (bytes, live segments) describe what is
        held now, so they survive a reset."""
        gauges = {k: getattr(self, k, 0) for k in ("index_bytes", "mirror_bytes")}
        live = getattr(self, "index", Counter()).get("segments_live")
        self.steps = 0
        self.decode_sparse = 0
        self.decode_exact: Counter[str] = Counter()
        self.decode_baseline: Counter[str] = Counter()  # evaluation-only methods
        self.prefill_tokens = 0
        self.prefill_chunks = 0
        self.layer_calls: Counter[str] = Counter()
        # per layer: [sampled keys, candidate keys] summed over query heads
        self.sampled: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self.index: Counter[str] = Counter()
        self.index_bytes = 0
        self.mirror_bytes = 0
        self.errors: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # eval: rel. error sums
        self.build_seconds = 0.0
        self.sparse_seconds = 0.0
        self.index_bytes, self.mirror_bytes = gauges["index_bytes"], gauges["mirror_bytes"]
        if live is not None:
            self.index["segments_live"] = live

    def count_layer(self, layer_name: str) -> None:
        self.layer_calls[layer_name] += 1

    def add_sampled(self, layer_name: str, sampled: int, candidates: int) -> None:
        s = self.sampled[layer_name]
        s[0] += sampled
        s[1] += candidates

    def add_error(self, layer_name: str, rel_err: float) -> None:
        e = self.errors[layer_name]
        e[0] += rel_err
        e[1] += 1

    def sampled_fraction(self) -> float | None:
        tot_s = sum(v[0] for v in self.sampled.values())
        tot_c = sum(v[1] for v in self.sampled.values())
        return tot_s / tot_c if tot_c else None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            per_layer = {
                name: (v[0] / v[1] if v[1] else None) for name, v in sorted(self.sampled.items())
            }
            return {
                "steps": self.steps,
                "decode_sparse": self.decode_sparse,
                "decode_exact": dict(self.decode_exact),
                "decode_baseline": dict(self.decode_baseline),
                "prefill_tokens": self.prefill_tokens,
                "prefill_chunks": self.prefill_chunks,
                "layer_calls": dict(self.layer_calls),
                "sampled_fraction": self.sampled_fraction(),
                "sampled_fraction_per_layer": per_layer,
                "index": dict(self.index),
                "relative_error_per_layer": {
                    name: v[0] / v[1] for name, v in sorted(self.errors.items()) if v[1]
                },
                "index_bytes": self.index_bytes,
                "mirror_bytes": self.mirror_bytes,
                "build_seconds": round(self.build_seconds, 4),
                "sparse_seconds": round(self.sparse_seconds, 4),
            }

    def summary_line(self) -> str:
        frac = self.sampled_fraction()
        exact = ", ".join(f"{k}={v}" for k, v in sorted(self.decode_exact.items())) or "none"
        return (
            f"MAGICPIG stats: steps={self.steps} decode_sparse={self.decode_sparse} "
            f"decode_exact[{exact}] prefill_tokens={self.prefill_tokens} "
            f"sampled_fraction={'n/a' if frac is None else f'{frac:.2%}'} "
            f"segments={dict(self.index)} index_MiB={self.index_bytes / 2**20:.1f} "
            f"mirror_MiB={self.mirror_bytes / 2**20:.1f}"
        )


STATS = Stats()


def merge_snapshots(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the snapshots of several workers (tensor parallel) into one view."""
    if len(snaps) == 1:
        return snaps[0]
    out: dict[str, Any] = {"workers": snaps}
    for key in ("steps", "decode_sparse", "prefill_tokens", "prefill_chunks", "index_bytes", "mirror_bytes"):
        out[key] = sum(s[key] for s in snaps)
    for key in ("decode_exact", "decode_baseline", "index", "layer_calls"):
        c: Counter[str] = Counter()
        for s in snaps:
            c.update(s[key])
        out[key] = dict(c)
    return out
