"""The worker profile benchmark (benchmarks/worker_profile.py): its in-worker profiler and its table,
without an engine (the engine path is the same _engine and warm-up as e2e_decode's)."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import worker_profile  # noqa: E402


def _busy(n: int) -> int:  # Python arithmetic only: its own time is all of its time
    x = 0
    for i in range(n):
        x += i * i
    return x


def _wakes(n: int) -> None:  # n voluntary context switches: waits on an event another thread sets
    for _ in range(n):
        ev = threading.Event()
        threading.Timer(0.001, ev.set).start()
        ev.wait()


def test_the_profiler_times_the_workers_calls_and_counts_its_context_switches():
    class Worker:
        pass

    w = Worker()
    worker_profile.start_profile(w)
    t0 = time.perf_counter()
    _busy(300_000)
    busy_s = time.perf_counter() - t0
    _wakes(20)
    prof = worker_profile.stop_profile(w)
    busy = [v for k, v in prof["calls"].items() if k.endswith("(_busy)")]
    assert len(busy) == 1 and busy[0][0] == 1 and 0.5 * busy_s < busy[0][1] <= busy_s, (busy, busy_s)
    assert prof["voluntary_switches"] >= 20, prof
    assert prof["wall_s"] >= busy_s and prof["user_s"] > 0


def test_the_table_puts_the_calls_that_moved_most_first_per_step():
    profiles = {"CPU_ATTN": {"calls": {"mm": [10, 1.0], "rope": [10, 0.1], "attn": [10, 2.0]}},
                "MAGICPIG": {"calls": {"mm": [10, 1.5], "rope": [10, 0.9], "sparse": [8, 0.4]}}}
    lines = worker_profile.table(profiles, steps=10, top=3)
    assert lines[2:] == ["| `attn` | 1.0 | 200.000 | 0.0 | 0.000 |",   # -2.0 s
                         "| `rope` | 1.0 | 10.000 | 1.0 | 90.000 |",   # +0.8 s
                         "| `mm` | 1.0 | 100.000 | 1.0 | 150.000 |"]   # +0.5 s
