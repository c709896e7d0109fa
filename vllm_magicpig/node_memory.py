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

What a build may take is the node's free memory less the reserve. Memory the worker holds without
using it, freed segments kept in the huge-page pool (``cpp/huge_pool.h``) and the allocator's free
pages (a build's scratch), is not counted as room: a build reuses a pooled region only where one
fits, and takes the rest fresh (two data-parallel engines, one holding 1.3 GB in its pool, took the
node to 0.2 GB free while both guards counted that pool as room). Where the room is short, that memory
is given back to the node first and the node read again; idle segments are evicted and their memory
given back too (``IndexStore.make_node_room``), before a build is refused.

A build is checked for its peak: its segments, and their hash codes beside them while they are
sorted (``index.BUILD_PEAK``); a growth, for its new tokens and the merged segment, made while its
base is still held (``IndexStore.build_need``). The check is not atomic across processes: two engines may pass it at
one moment. So it is made before every layer's build, at the layer's first decode and on the
background thread alike (``background_index._run``, which stops a prompt's job between layers and
frees what it built): engines that check at one moment each take at most one layer's build past
the reserve (~24 MB for a 7K-token prompt at K=10, L=150, SmolLM2's shapes), far less than it.
``benchmarks/data_parallel_memory.py`` runs two engines whose caps fit one.
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
    def __init__(self, reserve_bytes: int, available: Callable[[], int],
                 give_back: Callable[[], None] | None = None) -> None:
        """``available()``: the free memory of the node the index allocates from (read at each
        check: a file read, only on the paths where the index grows); ``give_back()``: return memory
        the worker holds without using it to the node."""
        self.reserve_bytes = reserve_bytes
        self._available = available
        self._give_back = give_back
        self.last_available: int | None = None  # the latest reading, for the log and the stats
        self.gave_back = 0  # times memory was given back for a short room
        self._warned_at: float | None = None

    def room(self, need: int = 0) -> int:
        """Bytes the index may still take before the node's free memory falls to the reserve. Where
        that is short of ``need`` (or of one byte), memory held unused is given back first."""
        room = self._read() - self.reserve_bytes
        if room < max(need, 1) and self._give_back is not None:
            self._give_back()
            self.gave_back += 1
            room = self._read() - self.reserve_bytes
        return room

    def shortfall(self, need: int) -> int:
        """Bytes the node lacks for ``need`` more (at least one) with the reserve kept free, memory
        held unused given back first where short; 0: they fit."""
        return max(0, max(need, 1) - self.room(need))

    def _read(self) -> int:
        self.last_available = self._available()
        return self.last_available

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
    """The guard of a worker whose index allocates through ``ops``, reading the free memory of the
    worker's memory node as vLLM's CPU worker does."""
    from vllm_magicpig.host_memory import node_available_reader

    def give_back() -> None:
        ops.release_pooled()
        trim_allocator()

    return NodeMemoryGuard(reserve_mb * MIB, node_available_reader(), give_back)


def trim_allocator() -> None:
    """Return the C allocator's free pages to the OS (glibc's malloc_trim, every arena): a build's
    scratch (hash codes, gathered rows) is freed into the arena of the thread that built it, and
    stays counted against the node until trimmed. Nothing where the C library has no malloc_trim."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes

        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None
