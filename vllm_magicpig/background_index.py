"""A new prompt's index built off the critical path, on one background thread.

Why: indexing a long prompt (every key hashed into L tables, in every sparse layer) takes seconds
(SmolLM2 at 16K tokens: several seconds on one core). Built at the request's first decode, it
stalls the first decode token by that much. Instead, the first decode of a new prompt submits one
job that builds the prompt's segments in every sparse layer, and the request is served exactly
(stats: ``indexing``) until the job's segments are installed, at the start of a later step:
tokens not yet indexed are attended exactly, so nothing is lost meanwhile.

What goes to the background: the segments of a centre none of whose segments is held yet (a
new prompt, or one whose index was evicted or invalidated). The growth of a held index as decoding
fills blocks (``segment_tokens`` at a time, by merging) stays synchronous: it is small. Budget mode
chooses (K, L) from the first decode's query, so it builds at the first decode, as does any decode
method other than the CPU platform's MAGICPIG (``BackgroundIndexer.applies``).

Thread safety: a job reads only the paged KV cache and what it was handed at submission (the
layers' cache views, the centre spec, the projection); it returns new segments. The index is
changed on the engine's thread only (:meth:`BackgroundIndexer.install_finished`). A job whose
centre was invalidated meanwhile (vLLM freed and rewrote its blocks) is dropped unread, so a
torn read of a block being rewritten is never used.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_magicpig import decode_methods
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.index import CentreSpec, IndexStore, SegmentRef, segment_owner
from vllm_magicpig.kv_layout import KVViews

logger = logging.getLogger("vllm.magicpig")
MAX_TRACKED = 1 << 15  # installed centres remembered (a forgotten one with no segments is indexed anew)


@dataclass
class LayerJob:
    """One sparse layer's part of a job: where its cache is and how its segments are hashed."""

    ctx: LayerContext
    kv: KVViews
    projection: torch.Tensor
    K: int
    L: int
    centering: str
    node_need: int = 0  # what its build takes from the memory node at most (0: not known yet)


@dataclass
class IndexJob:
    spec: CentreSpec
    refs: list[SegmentRef]
    layers: list[LayerJob]
    threads: int
    # filled by the background thread
    built: list[tuple[str, tuple, torch.Tensor, list[tuple[SegmentRef, Any]]]] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # what the job took from the cores: its CPU time, its team's included
    error: BaseException | None = None
    short_of_memory: bool = False  # stopped between layers: the node fell to its reserve (node_memory.py)


class BackgroundIndexer:
    """Runs index jobs on one daemon thread, and installs their segments on the engine's thread."""

    def __init__(self, index: IndexStore, ops: Any, stats: Any, cap_bytes: int | None,
                 build: Callable[..., Any], projection: Callable[[int, int, int], torch.Tensor], enabled: bool,
                 run_inline: bool = False) -> None:
        """``build(ops, kv, ref, centre, projection, K, L)`` builds one segment from the cache;
        ``projection(head_dim, K, L)`` is the runtime's shared SimHash projection; ``enabled``: the
        config's ``background_index`` on a platform whose MAGICPIG method is the CPU one.
        ``run_inline``: run each job at submission, on the caller's thread (tests: deterministic);
        its segments are still installed only at the next :meth:`install_finished`."""
        self.index, self.ops, self.stats, self.cap_bytes = index, ops, stats, cap_bytes
        self._build, self._projection, self.enabled = build, projection, enabled
        self.run_inline = run_inline
        self._pending: dict[int, IndexJob] = {}  # cid -> submitted, not installed
        # cids whose prompt index was installed (or failed): the layers grow or rebuild it themselves
        # (also when the cap refused it: then they serve it as ``evicted``). Least recent dropped.
        self._installed: OrderedDict[int, None] = OrderedDict()
        self._done: queue.Queue[IndexJob] = queue.Queue()
        self._todo: queue.Queue[IndexJob] = queue.Queue()
        # The running thread, or None; set and cleared under _lock with the queue checked, so a job
        # put there always finds a thread (_submit, _loop).
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.layers: dict[str, tuple[LayerContext, KVViews]] = {}  # sparse layers seen, and their cache views

    # ------------------------------------------------------------------ engine thread
    def register_layer(self, ctx: LayerContext, kv: KVViews) -> None:
        """A sparse layer and its cache views (again whenever the layer sees another cache tensor)."""
        self.layers[ctx.name] = (ctx, kv)

    def applies(self, settings: Any) -> bool:
        """Whether requests under ``settings`` are indexed in the background (budget mode chooses
        (K, L) from the first decode's query, so it builds then)."""
        return self.enabled and settings.target_cost is None and settings.method == decode_methods.MAGICPIG

    def tracks(self, cid: int) -> bool:
        """Whether prompt ``cid``'s index is being built here, or was installed (or failed) here."""
        return cid in self._pending or cid in self._installed

    def pending_for(self, cid: int) -> bool:
        """Whether prompt ``cid``'s index is being built here now."""
        return cid in self._pending

    def pending_tokens(self) -> int:
        """Tokens a layer's segments will hold once the jobs being built are installed (the room they
        will take, which the planner must not give to another new prompt meanwhile)."""
        return sum(ref.num_tokens for job in self._pending.values() for ref in job.refs)

    def ready(self, spec: CentreSpec, refs: list[SegmentRef], settings: Any) -> bool:
        """True when the request can be sampled now; else its index is (now) being built."""
        cid = spec.cid
        if cid in self._installed:
            self._installed.move_to_end(cid)
            return True
        if cid in self._pending:
            return False
        if self.index.holds_centre_segments(cid) or not self.layers:
            return True  # built at a decode before (or no layer known yet): grown synchronously
        K, L = settings.K, settings.L
        tokens = sum(ref.num_tokens for ref in refs)
        layers = [LayerJob(ctx, kv, self._projection(ctx.head_size, K, L), K, L, settings.centering,
                           self.index.build_need(segment_owner(ctx.name, K, L), tokens))
                  for ctx, kv in self.layers.values()]
        job = IndexJob(spec, list(refs), layers, torch.get_num_threads())
        self._pending[cid] = job
        self.stats.index["background_jobs"] += 1
        if self.run_inline:
            _run(job, self.ops, self._build, self.index.node_guard)
            self._done.put(job)
        else:
            self._submit(job)
        return False

    def install_finished(self) -> None:
        """Install the segments of finished jobs (call after the step's invalidations)."""
        if not self._pending:  # every step calls this; most have nothing in flight
            return
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return
            cid = job.spec.cid
            if self._pending.get(cid) is not job:
                continue  # forgotten meanwhile (clear)
            del self._pending[cid]
            self.stats.build_seconds += job.seconds
            if job.error is None and self.index.on_build is not None:  # its cost, installed or not
                self.index.on_build(sum(ref.num_tokens for ref in job.refs) * len(job.built), job.cpu_seconds)
            if job.error is not None:
                logger.warning("MAGICPIG background indexing failed (%r); the request's index is built at its "
                               "next decode instead", job.error)
                self.stats.index["background_failed"] += 1
                self._mark_installed(cid)  # ready: the layers build it themselves
                continue
            if job.short_of_memory:
                # Not marked installed, as below: the planner serves it exactly (node_memory_low) while
                # the node is short, then submits it again.
                self.stats.index["background_refused_node_memory"] += 1
                self.index.node_guard.note_refusal()
                continue
            if not self.index.has_centre(cid):  # its blocks were rewritten meanwhile: the build is stale
                self.stats.index["background_dropped"] += 1
                continue
            if not self._fits(job):
                # The room the planner saw at submission was taken meanwhile. All or nothing: a prompt
                # indexed in some layers only is planned sparse and attended exactly, whole context,
                # in MAGICPIG's call in the others. Not marked installed: the planner serves it
                # exactly (``evicted``) until its index fits, then submits it again.
                self.stats.index["background_refused"] += 1
                continue
            for name, owner, centre, segs in job.built:
                self.index.set_centre(name, job.spec, centre)
                for ref, seg in segs:
                    self.index.install(owner, ref, seg, self.cap_bytes)
            self._mark_installed(cid)
            self.stats.index["background_installed"] += 1

    def _fits(self, job: IndexJob) -> bool:
        """Whether every segment of the job fits under the cap beside the segments in use."""
        if self.cap_bytes is None:
            return True
        # the sizes teach the planner this prompt's need (and the next's) even when it is refused
        need = sum(self.index.note_size(owner, ref, seg) for _, owner, _, segs in job.built for ref, seg in segs)
        return need <= self.index.idle_room(self.cap_bytes)

    def _mark_installed(self, cid: int) -> None:
        self._installed[cid] = None
        while len(self._installed) > MAX_TRACKED:
            self._installed.popitem(last=False)

    def forget(self) -> None:
        """The index was cleared: nothing pending or installed is valid any more."""
        self._pending.clear()
        self._installed.clear()

    def pending(self) -> int:
        return len(self._pending)

    def building(self) -> bool:
        """Whether a job is queued or running on the background thread now (a finished one waits
        in ``_done`` for its install)."""
        return len(self._pending) > self._done.qsize()

    # ------------------------------------------------------------------ background thread
    def _submit(self, job: IndexJob) -> None:
        with self._lock:
            self._todo.put(job)
            if self._thread is None:
                # daemon: a worker shutting down does not wait for a build nobody will read
                self._thread = threading.Thread(target=self._loop, name="magicpig-index", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        # The thread exits as soon as the queue is empty, and with it the OpenMP pool its builds
        # started. A pool outlives its jobs while its thread lives, and libgomp counts every pool's
        # threads: once they outnumber the cores, every team in the process stops spinning between
        # parallel regions (GOMP's throttled spin count) and sleeps on a futex instead. On a worker
        # given every core (2 OpenMP threads on 2 cores), one finished 2-thread build left each
        # later torch op waking a sleeping thread: MAGICPIG's floor (64-token prompts, all exact)
        # took 43.0 ms a step against CPU_ATTN's 28.5, and its 16K decodes ran 0.86x / 0.93x CPU_ATTN
        # at batch 1 / 4; with the thread exiting, 28.8 ms and 1.18x / 1.46x (benchmarks/results/
        # e2e_decode_amx_threads_all_before.md, e2e_decode_amx_threads_all.md; worker_profile.py
        # counts the context switches).
        while True:
            with self._lock:
                try:
                    job = self._todo.get_nowait()
                except queue.Empty:
                    self._thread = None
                    return
            torch.set_num_threads(job.threads)  # the worker's thread count, in this thread's OpenMP too
            _run(job, self.ops, self._build, self.index.node_guard)
            self._done.put(job)

    def thread_alive(self) -> bool:
        """Whether the background thread is running (it exits when its queue is empty)."""
        with self._lock:
            return self._thread is not None

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until every submitted job has finished (tests, and shutdown-free benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._todo.empty() and self._done.qsize() >= len(self._pending):
                return True
            time.sleep(0.005)
        return False


def _run(job: IndexJob, ops: Any, build: Callable[..., Any], node_guard: Any = None) -> None:
    # Sharing the worker's cores, the build's wall time counts the engine's turns too; its CPU
    # time is what it took from them. This thread is one of the kernel's ``threads`` OpenMP
    # threads, which share the work evenly.
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        for lj in job.layers:
            # The planner admitted the whole prompt against the node's free memory at submission, but
            # engines sharing the node (data parallel) admit theirs at the same moments and build for
            # seconds: checked again before each layer, for that layer's build (segments and hash
            # codes), a job passes the reserve only where another engine took the room since its
            # check, by one layer's build at most (node_memory.py). What it built so far is freed.
            if node_guard is not None and node_guard.shortfall(lj.node_need):
                job.short_of_memory = True
                job.built.clear()
                break
            centring = decode_methods.get_centring(lj.centering)
            centre = centring(lj.ctx, job.spec, lj.kv)
            owner = segment_owner(lj.ctx.name, lj.K, lj.L)
            segs = [(ref, build(ops, lj.kv, ref, centre, lj.projection, lj.K, lj.L)) for ref in job.refs]
            job.built.append((lj.ctx.name, owner, centre, segs))
    except BaseException as e:  # reported on the engine thread, which then builds synchronously
        job.error = e
    job.seconds = time.perf_counter() - t0
    job.cpu_seconds = (time.thread_time() - c0) * max(job.threads, 1)
