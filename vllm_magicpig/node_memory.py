"""The index's growth checked against the memory its node has free, while the engine serves.

``host_memory.py`` plans a worker's KV cache and index cap at start-up, for the ranks of its own
parallel world. The cap is a promise, not memory taken: the index grows as prompts are indexed,
and what else allocates from the node meanwhile is out of that plan's sight. vLLM starts each of a
dense model's ``--data-parallel-size`` engines as a world of one (``reconfigure_for_independent_dp_rank``),
so each plans alone and counts the others' caps as free memory; other processes come and go. Left
at that, indexes that each fit their cap could together outgrow the node, and the kernel's OOM
killer would end a worker mid-serve.

So before the index takes memory from the node (a segment built or grown), the guard checks that
the node keeps ``node_reserve_mb`` free afterwards. Where it would not, the segment is not built,
its request is served exactly, and the stats count the reason ``node_memory_low``. Nothing is
lost: the request's tokens are those of exact attention, and it is indexed once memory is back.

Memory the index holds already does not count against it. A dropped segment's memory waits in
the huge-page pool (``cpp/huge_pool.h``) and the next build reuses it, so what a build may take is

    room = node's free memory - reserve + pooled bytes

and evicting an idle segment (its memory goes to the pool, or back to the node) leaves the room as
it was while freeing the store's bytes: the index's effective cap is ``held + room``, and the store
evicts idle segments under it as it does under ``index_memory_mb``.

The check is not atomic across processes: two engines may pass it at one moment. So it is made
before every layer's segments are built, at the layer's first decode and on the background thread
alike (``background_index._run``, which stops a prompt's job between layers and frees what it
built): each engine overshoots by one layer's segments at most (~12 MB for a 7K-token prompt at
K=10, L=150, SmolLM2's shapes), far less than the reserve.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

MIB = 2**20
# While the node stays short, the warning repeats at most this often (a refusal can come every step).
WARN_EVERY_S = 60.0
logger = logging.getLogger("vllm.magicpig")


class NodeMemoryGuard:
    def __init__(self, reserve_bytes: int, available: Callable[[], int], pooled: Callable[[], int]) -> None:
        """``available()``: the free memory of the node the index allocates from (read at each
        check: a file read, only on the paths where the index grows); ``pooled()``: the bytes of
        freed segments kept for reuse."""
        self.reserve_bytes = reserve_bytes
        self._available = available
        self._pooled = pooled
        self.last_available: int | None = None  # the latest reading, for the log and the stats
        self._warned_at: float | None = None

    def room(self) -> int:
        """Bytes the index may still take before the node's free memory falls to the reserve."""
        self.last_available = self._available()
        return self.last_available - self.reserve_bytes + self._pooled()

    def note_refusal(self) -> None:
        """A build was refused for the node's memory: say so in the log, at most every WARN_EVERY_S."""
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            logger.warning("%s", self.describe())

    def describe(self) -> str:
        """One line for the log: what the guard saw and what to change."""
        free = "?" if self.last_available is None else f"{self.last_available / 2**30:.2f} GiB"
        return (f"MAGICPIG: this memory node has {free} free, and the index keeps node_reserve_mb "
                f"({self.reserve_bytes // MIB} MiB) free: new prompts are served exactly (node_memory_low) until "
                "memory is back. Other engines or processes share the node; fix: a smaller index_memory_mb or KV "
                "cache per engine, or fewer engines on this node")


def worker_guard(reserve_mb: int, ops) -> NodeMemoryGuard:
    """The guard of a worker whose index allocates through ``ops`` (its pool's stats), reading the
    free memory of the worker's memory node as vLLM's CPU worker does."""
    from vllm_magicpig.host_memory import node_available_reader

    return NodeMemoryGuard(reserve_mb * MIB, node_available_reader(),
                           lambda: int(ops.memory_pool_stats().get("pooled_bytes", 0)))
