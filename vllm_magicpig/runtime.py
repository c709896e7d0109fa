"""One MAGICPIG runtime per worker: the parsed config, the index, the counters, the SimHash
projections, the ops and the KV layout, in one object instead of module singletons.

The metadata builder attaches it (:func:`attach`, once per ``VllmConfig``: every builder of a
worker shares it) and hands it to the layers on the step's metadata; the worker RPCs find it
with :func:`current`. Tests create a fresh one per case.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from vllm_magicpig import decode_methods, extensions
from vllm_magicpig.answer_lengths import AnswerLengths
from vllm_magicpig.background_index import BackgroundIndexer
from vllm_magicpig.budget import Budget
from vllm_magicpig.config import MagicPigConfig, parse_config
from vllm_magicpig.cost_model import DecodeCostModel
from vllm_magicpig.exact_tally import ExactTally
from vllm_magicpig.host_mirror import HostMirror
from vllm_magicpig.index import IndexStore
from vllm_magicpig.kv_layout import CpuVecLayout, KVLayout
from vllm_magicpig.magicpig_decode import build_segment_from_cache
from vllm_magicpig.node_memory import worker_guard
from vllm_magicpig.ops import CpuKernelOps, SparseDecodeOps
from vllm_magicpig.planner import StepSettings
from vllm_magicpig.sparse_tally import SparseTally
from vllm_magicpig.stats import Stats


def simhash_projection(head_dim: int, K: int, L: int, seed: int) -> torch.Tensor:
    """A seeded Gaussian SimHash projection [D, K*L] (float32 holding bf16 values).

    Rounded to bf16 so that a bf16 key's products with it are exact in float32: a build then hashes
    the keys as the cache holds them with the AVX-512 BF16 pair dot product, half the instructions
    of float32 FMAs (``kernel.key_hash``). Rounding moves each entry by at most 2^-9 of itself, so
    each hyperplane's normal turns by ~1e-3 radians: the collision probability (1 - theta / pi)^K,
    exact for Gaussian normals, moves by about as much. Queries, keys, the GPU's hash and the
    float64 references all use these values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, K * L, generator=g, dtype=torch.float32).bfloat16().float()


class MagicPigRuntime:
    def __init__(self, cfg: MagicPigConfig, *, num_layers: int, hf_config: Any = None,
                 ops: SparseDecodeOps | None = None, layout: KVLayout | None = None,
                 methods: dict[str, Any] | None = None, dense_attention: Any = None,
                 mirror_engine: Any = None) -> None:
        """``methods``: this platform's implementation of a decode method where it differs from the
        registered one (the split decode on CUDA); ``dense_attention``: the platform's paged exact
        attention with LSE, for methods that split a request into an exact and a sampled part;
        ``mirror_engine``: where the KV cache is not in host memory, the copy engine of its host
        mirror (``host_mirror.py``; staging bounded by half the index cap)."""
        self.cfg = cfg
        self.num_layers = num_layers
        self.dense_layers = cfg.resolved_dense_layers(num_layers)
        self.hf_config = hf_config  # the model's config (extensions read RoPE from it)
        self.stats = Stats()
        self.index = IndexStore(self.stats, cfg.segment_tokens)
        self.ops: SparseDecodeOps = ops if ops is not None else CpuKernelOps()
        self.layout: KVLayout = layout if layout is not None else CpuVecLayout()
        self.cap_bytes = cfg.index_memory_mb * 2**20
        self.stats.index_cap_bytes = self.cap_bytes
        self.ops.set_memory_cap(self.cap_bytes)
        # and it grows only while its memory node keeps node_reserve_mb free, whatever else shares it
        self.index.node_guard = worker_guard(cfg.node_reserve_mb, self.ops)
        self.ops.set_mirror_dtype(cfg.mirror_dtype)
        self.stats.add_section("memory_pool", self.ops.memory_pool_stats)
        # Which of vLLM's cache layouts this worker reads ("cpu_vec", "cpu_amx", "flash"): the
        # benchmarks record it beside their times, since vLLM's own kernel speed depends on it.
        self.stats.add_section("kv_layout", lambda: {"kv_layout": self.layout.name})
        self.cost = DecodeCostModel() if cfg.cost_model else None
        if self.cost is not None:
            self.stats.add_section("cost_model", lambda: {"cost_model": self.cost.snapshot()},
                                   summary=self.cost.summary)
            self.index.on_build = self.cost.observe_build
        self.mirror = HostMirror(mirror_engine, self.stats, self.cap_bytes // 2) if mirror_engine is not None else None
        self.methods = dict(methods or {})
        self.dense_attention = dense_attention
        self.extension_state: dict[str, Any] = {}
        # Budget mode's (K, L) per layer and request (used when a step's settings carry a target)
        self.budget = Budget(cfg.max_L, cfg.calibration_decodes)
        self.stats.add_section("budget", self.budget.snapshot, self.budget.reset_counters, self.budget.summary)
        # Layer observers: ``before_decode(ctx, kv, plan)`` runs before every sparse layer's decode
        # (also when the platform kernel serves it), ``after_decode(ctx, query, kv, plan, out,
        # result)`` after a decode through a registered method. Empty unless an extension needs them.
        self.observers: list[Any] = []
        # Step-settings hooks ``hook(runtime, settings) -> settings``, applied in order by
        # step_settings. Empty unless an extension attaches one while it changes the settings (the
        # evaluation harness's override), so a production step pays nothing for them.
        self.settings_hooks: list[Callable] = []
        # what each request of the step being built may still decode (answer_bounds.py: the runner
        # publishes it, the metadata builder takes it); None when no runner published one
        self.answer_bounds: Sequence[int | None] | None = None
        # how long this worker's answers ran, of their max_tokens (answer_lengths.py; recorded by the
        # runner patch as requests finish): a request's outlook for the cost model
        self.answer_lengths = AnswerLengths()
        self.stats.add_section("answer_lengths", self.answer_lengths.snapshot)
        # A new prompt's index built on a background thread (its first decodes served exactly)
        self.indexer = BackgroundIndexer(
            self.index, self.ops, self.stats, self.cap_bytes, build_segment_from_cache, self.projection,
            enabled=cfg.background_index and decode_methods.MAGICPIG not in self.methods)  # a platform's own
        # MAGICPIG method (the split decode on CUDA) builds its own way, at the first decode
        self._projections: dict[tuple[int, int, int], torch.Tensor] = {}
        # the latest step's layers served by the platform kernel, and the sparse layers' records,
        # folded when read or at the next step's plan (exact_tally.py, sparse_tally.py)
        self._exact_tallies: tuple[ExactTally, ...] = ()
        self.sparse_tally = SparseTally()
        self.stats.add_flush(self.fold_tallies)
        extensions.load()
        self._config_settings = StepSettings.from_config(cfg)  # the config is immutable: once
        for init in extensions.RUNTIME_INITS:
            init(self)

    def projection(self, head_dim: int, K: int, L: int) -> torch.Tensor:
        """The shared, seeded Gaussian SimHash projection [D, K*L]: same seed, same codes."""
        key = (head_dim, K, L)
        if key not in self._projections:
            self._projections[key] = simhash_projection(head_dim, K, L, self.cfg.seed)
        return self._projections[key]

    def decode_method(self, name: str):
        """The implementation of decode method ``name`` on this runtime's platform."""
        return self.methods.get(name) or decode_methods.get_method(name)

    def start_exact_tallies(self, *tallies: ExactTally) -> None:
        """The new step's tallies (the builder folded the previous ones before planning): the whole
        batch's, and in a step that samples some decodes, its exact decodes' apart."""
        self._exact_tallies = tallies

    def fold_tallies(self) -> None:
        """Count what the platform kernel and the sparse layers served so far (every stats read and
        step plan calls this)."""
        for tally in self._exact_tallies:
            tally.fold(self.stats, self.cost)
        self.sparse_tally.fold(self.stats, self.cost)

    def step_settings(self) -> StepSettings:
        """The config's settings, after the settings hooks attached to this runtime."""
        settings = self._config_settings
        for hook in self.settings_hooks:
            settings = hook(self, settings)
        return settings

    def clear_index(self) -> None:
        self.index.clear()
        self.budget.forget()  # its choices belong to centres that no longer exist
        self.indexer.forget()
        if self.cost is not None:
            self.cost.forget_prompts()  # so are the deferred prompts' accounts


_lock = threading.Lock()
_current: MagicPigRuntime | None = None
_current_source: Any = None


def attach(vllm_config, make: Any = None) -> MagicPigRuntime:
    """The worker's runtime for ``vllm_config``, created (and the config parsed) on first use.
    ``make(cfg, num_layers=..., hf_config=...)`` builds it (default: the CPU platform's)."""
    global _current, _current_source
    with _lock:
        if _current is None or _current_source is not vllm_config:
            from vllm_magicpig.startup_checks import total_layers

            cfg = parse_config(vllm_config.additional_config)
            model = vllm_config.model_config
            _current = (make or MagicPigRuntime)(cfg, num_layers=total_layers(model, vllm_config.parallel_config),
                                                 hf_config=model.hf_config)
            _current_source = vllm_config
        return _current


def current() -> MagicPigRuntime | None:
    """This worker's runtime, or None when no MAGICPIG layer was built here."""
    return _current


def install(rt: MagicPigRuntime | None, source: Any = None) -> None:
    """Make ``rt`` this process's runtime (tests; ``source`` is the VllmConfig it belongs to)."""
    global _current, _current_source
    with _lock:
        _current, _current_source = rt, source
