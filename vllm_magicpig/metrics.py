"""MAGICPIG's counters on vLLM's Prometheus ``/metrics`` endpoint.

The counters live in each worker process (``runtime.current().stats``); ``/metrics`` is served by
the API server process. This module bridges the two with a **stat logger plugin** (entry point
group ``vllm.stat_logger_plugins``, name ``magicpig``), which pulls the workers' snapshots over the
existing named worker RPC ``magicpig_stats`` and sets ``prometheus_client`` metrics in the API
server, next to vLLM's own.

Why this route, in vLLM 0.32 (paths under ``vllm/``):

* ``/metrics`` serves ``get_prometheus_registry()`` (``entrypoints/serve/instrumentator/metrics.py``,
  ``v1/metrics/prometheus.py``): the API server's in-process ``REGISTRY``, unless
  ``PROMETHEUS_MULTIPROC_DIR`` is set. vLLM sets that directory only when it runs several API
  servers (``entrypoints/cli/serve.py``: ``setup_multiprocess_prometheus()`` under
  ``api_server_count > 1``). In the default layout (one API server, one engine core, one worker per
  rank) metrics written in a worker reach no registry that ``/metrics`` reads, and setting the
  directory ourselves would switch all of vLLM's metrics to multiprocess collection.
* vLLM's own engine metrics flow worker -> scheduler -> ``SchedulerStats`` -> the front end's stat
  loggers (``v1/metrics/loggers.py``). Riding that path would mean patching the model runner's
  output, the scheduler and the output processor.
* Endpoint plugins (``vllm.endpoint_plugins``) add routes, not metrics, and load only when named
  in ``VLLM_PLUGINS``, which would then also filter the general plugin that registers MAGICPIG.
* Stat logger plugins are loaded by ``AsyncLLM`` in the API server process only
  (``plugins/__init__.py``, ``v1/metrics/loggers.py: load_stat_logger_plugin_factories``,
  ``v1/engine/async_llm.py``) and are handed every engine step's output (``record``) inside the
  server's event loop. ``AsyncLLM.collective_rpc`` reaches every worker rank through the engine
  core's utility channel (``v1/engine/core_client.py``), and ``magicpig_stats`` is a named
  method, so no insecure serialization is needed.

How it behaves:

* The plugin does nothing unless the server runs ``--attention-backend MAGICPIG``.
* Polling: a background task, at most once per ``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's own stat
  logging interval, default 10), and only after engine activity (plus one fetch at start-up, so the
  series exist from the start, and one trailing fetch after activity stops). The event loop never
  waits on the RPC; while one is in flight no other starts. The engine core answers it between
  steps, so a value lags the workers by at most one interval plus one step.
* Labels: ``model_name`` and ``engine`` as on vLLM's metrics, plus ``rank``: the worker's rank in
  its engine (the order of ``collective_rpc``'s replies). With tensor parallelism every rank counts
  the decodes of its own heads and holds its own share of the index: sum the bytes over ranks, and
  read decode counts per rank (``max by (reason)``), not summed.
* Counters are kept monotonic across ``magicpig_reset_stats`` (a drop in a worker's value, or in
  its step count, is taken as a reset and the new value as the increment).
* With several API servers (``--api-server-count``, multiprocess Prometheus), only the server with
  client index 0 exports, so the counters, which the multiprocess collector sums over processes,
  are not multiplied; gauges use ``multiprocess_mode="mostrecent"`` like vLLM's.
* The metrics are created unregistered and exported through one forwarding collector:
  ``PrometheusStatLogger`` unregisters every collector whose name starts with ``vllm:`` when it is
  created (after the plugin loggers), and the forwarder has no name.

Side effect of any installed stat logger plugin (vLLM's rule, not ours): ``AsyncLLM`` then keeps
stats on even under ``--disable-log-stats`` ("custom stat loggers were found"), also when the
server runs another backend.
"""
from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from vllm import envs
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_magicpig import serves_magicpig
from vllm_magicpig.stats import EXACT_REASONS

logger = init_logger(__name__)

RPC = "magicpig_stats"
PREFIX = "vllm:magicpig_"
LABELS = ("model_name", "engine", "rank")
SEGMENT_EVENTS = ("built", "merged", "evicted", "invalidated", "refused")
CENTRE_EVENTS = ("computed", "inherited", "invalidated")
SPARSE_METHOD = "magicpig"  # the production decode method; always present as a (maybe zero) series


@dataclass(frozen=True)
class _Metrics:
    decodes: Counter
    sampled_fraction: Gauge
    sampled_keys: Counter
    candidate_keys: Counter
    index_bytes: Gauge
    mirror_bytes: Gauge
    pooled_bytes: Gauge
    held_bytes_peak: Gauge
    index_cap_bytes: Gauge
    segments_live: Gauge
    segments: Counter
    centres: Counter
    tokens_indexed: Counter
    build_seconds: Counter
    sparse_seconds: Counter
    built_on_outlook: Counter
    sampling_pays_from: Gauge
    budget_K: Gauge
    budget_L: Gauge
    budget_L_built: Gauge
    budget_fraction: Gauge

    def all(self) -> list:
        return list(vars(self).values())


class _Forwarder:
    """A nameless collector yielding the MAGICPIG metrics (see the module docstring)."""

    def __init__(self, metrics: _Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []

    def collect(self):
        for metric in self._metrics.all():
            yield from metric.collect()


_metrics_lock = threading.Lock()
_metrics: _Metrics | None = None


def metrics() -> _Metrics:
    """The process's MAGICPIG metrics, created (and exported through ``REGISTRY``) on first use."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
                return Counter(PREFIX + name, doc, labelnames=LABELS + extra, registry=None)

            def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
                return Gauge(PREFIX + name, doc, labelnames=LABELS + extra, registry=None,
                             multiprocess_mode="mostrecent")

            m = _Metrics(
                decodes=counter(
                    "decodes", "MAGICPIG decode attention computations, one per (request, layer). served=sparse: "
                    "reason is the decode method that served them; served=exact: why vLLM's kernel served them "
                    f"({', '.join(EXACT_REASONS)}).", ("served", "reason")),
                sampled_fraction=gauge(
                    "sampled_fraction", "Keys sampled / candidate keys over the sparse decodes since the worker "
                    "started (or since magicpig_reset_stats)."),
                # these two have samples only where Stats.snapshot() reports sampled_keys / candidate_keys
                sampled_keys=counter("sampled_keys", "Keys attended through the LSH sample, summed over query heads "
                                     "(where the workers report it)."),
                candidate_keys=counter("candidate_keys", "Indexed keys the sparse decodes sampled from, summed over "
                                       "query heads (where the workers report it)."),
                index_bytes=gauge("index_bytes", "Bytes held by the MAGICPIG hash tables and key norms."),
                mirror_bytes=gauge("mirror_bytes", "Bytes held by the row-major K/V mirror of indexed tokens."),
                pooled_bytes=gauge("pooled_bytes", "Memory of dropped segments kept for reuse by later builds (huge "
                                   "pages, already faulted); with index and mirror bytes it stays within "
                                   "index_memory_mb."),
                held_bytes_peak=gauge("held_bytes_peak", "The most index + mirror bytes the worker has held at once "
                                      "(compare with index_cap_bytes)."),
                index_cap_bytes=gauge("index_cap_bytes", "The index's cap (index_memory_mb as the worker runs it: on "
                                      "CPU, sized to fit beside the KV cache where it was not set)."),
                segments_live=gauge("segments_live", "Index segments held now."),
                segments=counter("segments", "Index segments built, merged (grown), evicted at the memory cap, "
                                 "invalidated by a KV write, refused (no room beside those in use).", ("event",)),
                centres=counter("centres", "Per-request key centres computed, inherited from a prefix, "
                                "invalidated.", ("event",)),
                tokens_indexed=counter("tokens_indexed", "Tokens hashed into new segments."),
                build_seconds=counter("build_seconds", "Seconds spent building and merging index segments."),
                sparse_seconds=counter("sparse_seconds", "Seconds spent in sparse decode attention."),
                built_on_outlook=counter(
                    "prompts_built_on_outlook", "Prompts indexed at their first decode, before ski rental had "
                    "paid for them, because answers like their request's have run long (answer_lengths.py)."),
                sampling_pays_from=gauge(
                    "sampling_pays_from_keys", "The cost model's line: the shortest context (keys, one request) "
                    "from which sampling is predicted to pay; decodes at shorter contexts are served exactly "
                    "(sampling_slower). +Inf: at no context up to 1M keys. No series until the model predicts."),
                budget_K=gauge("budget_K", "Budget mode: the K of a sparse layer's latest request choice for a target.",
                               ("layer", "target")),
                budget_L=gauge("budget_L", "Budget mode: the L (tables read, as steered) of a sparse layer's latest "
                               "request choice for a target.", ("layer", "target")),
                budget_L_built=gauge("budget_L_built", "Budget mode: the tables hashed for that choice (L may be "
                                     "steered up to it without rehashing).", ("layer", "target")),
                budget_fraction=gauge(
                    "budget_sampled_fraction", "Budget mode: keys sampled / candidate keys of a sparse layer at "
                    "its choice for a target cost, since the worker started (or magicpig_reset_stats).",
                    ("layer", "target")),
            )
            REGISTRY.register(_Forwarder(m))
            _metrics = m
        return _metrics


class Exporter:
    """Turns worker snapshots into metric values. Counters take the increase since the previous
    snapshot of the same worker, so they stay monotonic when a worker's counters are reset."""

    def __init__(self, model_name: str, m: _Metrics | None = None) -> None:
        self.model_name = model_name
        self.m = m if m is not None else metrics()
        self._last: dict[tuple, float] = {}
        self._last_steps: dict[tuple, int] = {}

    def update(self, per_engine: dict[int, list[dict[str, Any]]]) -> None:
        for engine, snaps in per_engine.items():
            for rank, snap in enumerate(snaps or ()):
                if isinstance(snap, dict):
                    self._update_worker((self.model_name, str(engine), str(rank)), snap)

    def _update_worker(self, labels: tuple[str, ...], snap: dict[str, Any]) -> None:
        m = self.m
        steps = int(snap.get("steps") or 0)
        reset = steps < self._last_steps.get(labels, 0)
        self._last_steps[labels] = steps

        def count(metric: Counter, raw: Any, *extra: str, restarts_on_reset: bool = True) -> None:
            """``restarts_on_reset``: the worker's value restarts with magicpig_reset_stats (its
            stats' counters); False for a count that runs for the worker's life."""
            raw = float(raw or 0)
            key = (id(metric), labels, extra)
            last = self._last.get(key, 0.0)
            self._last[key] = raw
            delta = raw if (reset and restarts_on_reset) or raw < last else raw - last
            child = metric.labels(*labels, *extra)  # creates the series at 0
            if delta > 0:
                child.inc(delta)

        exact = snap.get("decode_exact") or {}
        for reason in sorted(set(EXACT_REASONS) | set(exact)):
            count(m.decodes, exact.get(reason), "exact", reason)
        by_method = snap.get("decode_by_method") or {}
        for method in sorted({SPARSE_METHOD} | set(by_method)):
            count(m.decodes, by_method.get(method), "sparse", method)
        if "sampled_keys" in snap and "candidate_keys" in snap:  # raw sample sizes, where Stats reports them
            count(m.sampled_keys, snap["sampled_keys"])
            count(m.candidate_keys, snap["candidate_keys"])
        index = snap.get("index") or {}
        for event in SEGMENT_EVENTS:
            count(m.segments, index.get(f"segments_{event}"), event)
        for event in CENTRE_EVENTS:
            count(m.centres, index.get(f"centres_{event}"), event)
        count(m.tokens_indexed, index.get("tokens_indexed"))
        count(m.build_seconds, snap.get("build_seconds"))
        count(m.sparse_seconds, snap.get("sparse_seconds"))
        # the cost model's count runs for the worker's life: magicpig_reset_stats does not restart it
        cost = snap.get("cost_model") or {}
        count(m.built_on_outlook, cost.get("built_on_outlook"), restarts_on_reset=False)
        if "sampling_pays_from_keys" in cost:  # once the model predicts (None: no context pays)
            start = cost["sampling_pays_from_keys"]
            m.sampling_pays_from.labels(*labels).set(math.inf if start is None else start)

        m.index_bytes.labels(*labels).set(snap.get("index_bytes") or 0)
        m.mirror_bytes.labels(*labels).set(snap.get("mirror_bytes") or 0)
        m.pooled_bytes.labels(*labels).set(snap.get("pooled_bytes") or 0)
        m.held_bytes_peak.labels(*labels).set(snap.get("held_bytes_peak") or 0)
        m.index_cap_bytes.labels(*labels).set(snap.get("index_cap_bytes") or 0)
        m.segments_live.labels(*labels).set(index.get("segments_live") or 0)
        if snap.get("sampled_fraction") is not None:  # no series before the first sparse decode
            m.sampled_fraction.labels(*labels).set(snap["sampled_fraction"])
        budget_layers = (snap.get("budget") or {}).get("layers") or {}
        for layer, entry in budget_layers.items():  # a series per (layer, target) once chosen
            for target, c in entry.items():
                if isinstance(c, dict):
                    m.budget_K.labels(*labels, layer, target).set(c["K"])
                    m.budget_L.labels(*labels, layer, target).set(c["L"])
                    m.budget_L_built.labels(*labels, layer, target).set(c.get("L_built", c["L"]))
                    if c.get("sampled_fraction") is not None:
                        m.budget_fraction.labels(*labels, layer, target).set(c["sampled_fraction"])


def _calling_engine_client(max_depth: int = 12):
    """The ``AsyncLLM`` whose ``__init__`` is creating this stat logger (a stat logger is given
    only the config; the engine client is the caller's ``self``), or None."""
    from vllm.engine.protocol import EngineClient

    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, EngineClient) and getattr(obj, "engine_core", None) is not None:
            return obj
        frame = frame.f_back
    return None


class MagicPigStatLogger(AggregateStatLoggerBase):
    """Stat logger plugin: exports the workers' MAGICPIG counters to Prometheus."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None, client: Any = None) -> None:
        self.engine_indexes = list(engine_indexes or [0])
        self.interval = float(envs.VLLM_LOG_STATS_INTERVAL)
        self.exporter: Exporter | None = None
        self._client: weakref.ref | None = None
        self._task: asyncio.Task | None = None
        self._dirty = True  # engine activity since the last fetch started
        self._last_fetch = float("-inf")
        self._warned = False
        if not serves_magicpig(vllm_config):
            return
        client = client if client is not None else _calling_engine_client()
        if client is None:
            logger.warning("MAGICPIG metrics: no engine client found; /metrics will not carry MAGICPIG counters.")
            return
        if getattr(getattr(client, "engine_core", None), "client_index", 0) != 0:
            return  # several API servers: the first one exports (see the module docstring)
        self._client = weakref.ref(client)
        self.exporter = Exporter(str(vllm_config.model_config.served_model_name))

    # StatLoggerBase: all three run in the API server's event loop.
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        self._dirty = True
        self._schedule()

    def log(self) -> None:
        self._schedule()

    def log_engine_initialized(self) -> None:
        self._schedule()

    def _schedule(self) -> None:
        """Start a fetch, delayed to keep one interval after the previous one, unless one is pending."""
        if self.exporter is None or not self._dirty or self._task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        delay = max(0.0, self._last_fetch + self.interval - time.monotonic())
        self._task = loop.create_task(self._fetch_later(delay))

    async def _fetch_later(self, delay: float) -> None:
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            client = self._client() if self._client is not None else None
            if client is None:
                self.exporter = None
                return
            self._dirty = False
            self._last_fetch = time.monotonic()
            self.exporter.update(await self.fetch(client))
        except Exception as e:  # the engine is shutting down or failed: vLLM reports that itself
            (logger.debug if self._warned else logger.warning)("MAGICPIG metrics: fetching %s failed: %r", RPC, e)
            self._warned = True
        finally:
            self._task = None
        self._schedule()  # activity during the fetch: one more, an interval later

    async def fetch(self, client) -> dict[int, list[dict[str, Any]]]:
        """Every worker's snapshot, per engine index: {engine: [rank 0's, rank 1's, ...]}."""
        core = getattr(client, "engine_core", None)
        if len(self.engine_indexes) > 1 and hasattr(core, "call_utility_all_async"):  # data parallel
            replies = await core.call_utility_all_async("collective_rpc", RPC, None, (), None)
            ranks = list(getattr(core, "engine_ranks_managed", self.engine_indexes))
            return dict(zip(ranks, replies))
        return {self.engine_indexes[0]: await client.collective_rpc(RPC)}
