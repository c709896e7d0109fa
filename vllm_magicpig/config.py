"""The MAGICPIG configuration: parsed from ``additional_config["magicpig"]`` and validated.

Every error names the offending key, the value given and what is allowed, because
these messages are what a user sees when ``vllm serve`` refuses to start. Parsed once per
process that needs it (the front end's start-up check, the worker's runtime); the limits
come from :mod:`vllm_magicpig.limits`. Extensions may add keys (``extensions.py``); their
values are validated here too and carried in ``MagicPigConfig.extra``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_magicpig import decode_methods, extensions
from vllm_magicpig.budget import DEFAULT_CALIBRATION_DECODES, DEFAULT_MAX_L
from vllm_magicpig.limits import K_RANGE, L_RANGE, MAX_SEGMENT_TOKENS

CONFIG_KEY = "magicpig"
# Accepted spellings of a key: the British spelling the code uses, for the documented one.
ALIASES = {"centring": "centering"}


class MagicPigConfigError(ValueError):
    """A bad ``additional_config["magicpig"]`` entry, or a model MAGICPIG cannot serve."""


@dataclass(frozen=True)
class MagicPigConfig:
    # --- LSH budget (paper defaults: K=10, L=150) ---
    K: int = 10
    """SimHash bits per table (1..16). Larger K = sharper buckets, fewer samples."""
    L: int = 150
    """Number of hash tables (2..1024). Larger L = more samples, more memory."""
    # --- budget mode: K and L chosen per layer and request (``budget.py``) ---
    target_cost: float | None = None
    """Target sampled fraction of keys (e.g. 0.02): K and L are then chosen per sparse layer and
    request from the model's own query/key angles. Excludes ``K`` and ``L``."""
    max_L: int = DEFAULT_MAX_L
    """Budget mode: the largest L it may choose (index memory and lookups grow with L)."""
    calibration_decodes: int = DEFAULT_CALIBRATION_DECODES
    """Budget mode: a request's first decodes whose pooled query/key angles refine its (K, L) in each
    layer (all are sampled; the first chooses alone)."""
    # --- tokens always attended exactly ---
    sink_tokens: int = 4
    """Initial tokens attended exactly (attention sinks)."""
    local_window: int = 64
    """Most recent tokens attended exactly."""
    dense_layers: tuple[int, ...] | None = None
    """Layers that always use exact attention. None = the first and the middle layer
    (the paper keeps layers 0 and 16 of 32)."""
    min_sparse_context: int = 1024
    """Decode requests with a shorter context are served exactly."""
    # --- index ---
    segment_tokens: int = 512
    """Indexing step (a multiple of the KV block size): the last segment grows by this
    many tokens at a time, so the exactly attended tail stays below it."""
    max_segment_tokens: int = 32768
    """Largest segment (token ids inside a segment are 16-bit)."""
    index_memory_mb: int = 4096
    """Cap on the CPU-side index (hash tables + K/V mirror), per worker. Least
    recently used segments are evicted; their tokens are then attended exactly. On vLLM's CPU
    platform the cap comes out of the worker's memory budget (``host_memory.py``)."""
    node_reserve_mb: int = 512
    """Memory the index leaves free on its memory node, whatever its cap: a prompt whose index would
    take the node's free memory below it is served exactly (stats: ``node_memory_low``) until there
    is room (``node_memory.py``). Other engines (``--data-parallel-size``, which vLLM starts each as if
    alone) and processes share the node; a cap is a limit, not memory set aside."""
    mirror_dtype: str = "auto"
    """How segments keep the K/V rows that decode samples: 'auto', as the KV cache holds them (bf16 /
    fp16), or 'int8', 8-bit values with a scale per row: half the mirror's memory and the bytes each
    sampled key costs to read, output within ~1% of 'auto' (``benchmarks/kernel_bench.py``); the
    sampled keys are the same."""
    centering: str = "request"
    """Key centring: per request (the paper's; measured best) or none (ablation only).
    Also accepted as ``centring``."""
    inherit_centre: bool = True
    """A prompt that extends a prefix which already has a centre reuses that centre
    and its segments (multi-turn chat over a cached document is not re-indexed)."""
    seed: int = 0
    """Seed of the shared Gaussian projection; same seed, same tokens."""
    cost_model: bool = True
    """Serve a decode exactly when this worker's own timings predict that sampling its context
    would be slower than exact attention (stats: ``sampling_slower``; see ``cost_model.py``), and
    index a new prompt once its exact decodes would have saved what the build costs (stats:
    ``index_deferred``) and its request's ``max_tokens`` leaves room for the build to pay back
    (``index_cannot_pay``). false: index every prompt at its first decode and sample every request
    past ``min_sparse_context``."""
    cost_calibration: bool = True
    """With the cost model: time sampling, exact attention and an index build on synthetic inputs
    of the model's shape when the worker starts (``cost_calibration.py``; about a second for
    SmolLM2), so a fresh engine's first prompts are decided by measured costs instead of being
    indexed to measure them. false: learn from the requests served only."""
    background_index: bool = True
    """Index a new prompt on a background thread (``background_index.py``): its first decodes are
    served exactly (stats: ``indexing``) instead of waiting for the index. false: build at the
    first decode. Budget mode and accelerator platforms build at the first decode either way."""
    cpu_threads: int = 0
    """Threads of the host kernel when the KV cache is on a GPU (vLLM runs CUDA workers' torch on
    one thread); 0 = OMP_NUM_THREADS if set, else the worker's CPU affinity shared among the
    node's workers. On vLLM's CPU platform the worker's own thread binding is used."""
    # --- observability ---
    log_stats_interval: int = 200
    """Log the counters every N engine steps (0 = never)."""
    decode_method: str = "magicpig"
    """'magicpig', or 'exact' (every decode on the platform kernel); extensions add more
    (the accuracy harness's 'topk' and 'quest' baselines)."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Values given for the keys extensions registered, as (key, value) pairs."""
    given: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)
    """The keys the user set (a platform may size a default itself, e.g. the host index cap)."""

    def resolved_dense_layers(self, num_layers: int) -> frozenset[int]:
        if self.dense_layers is None:
            return frozenset({0, num_layers // 2})
        return frozenset(self.dense_layers)

    def option(self, key: str) -> Any:
        """The value of an extension's key (its default when not given)."""
        given = dict(self.extra)
        return given[key] if key in given else extensions.CONFIG_KEYS[key].default

    def options(self) -> dict[str, Any]:
        """Every extension key's value."""
        return {key: self.option(key) for key in sorted(extensions.CONFIG_KEYS)}

    def as_dict(self) -> dict[str, Any]:
        """The config as ``additional_config["magicpig"]`` would spell it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "given")}
        out.update(self.options())
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(MagicPigConfig) if f.name not in ("extra", "given")}

# (low, high) inclusive; None = unbounded.
_INT_RANGES: dict[str, tuple[int | None, int | None]] = {
    "K": K_RANGE,
    "L": L_RANGE,
    "sink_tokens": (0, None),
    "local_window": (0, None),
    "min_sparse_context": (0, None),
    "segment_tokens": (16, MAX_SEGMENT_TOKENS),
    "max_segment_tokens": (16, MAX_SEGMENT_TOKENS),
    "index_memory_mb": (1, None),
    "node_reserve_mb": (0, None),
    "seed": (0, 2**63 - 1),
    "log_stats_interval": (0, None),
    "cpu_threads": (0, 4096),
    "max_L": L_RANGE,
    "calibration_decodes": (1, 1_000_000),
}
# target_cost: below 0.1% a 16K context keeps ~16 keys per head; above 50% sampling is no cheaper
# than attending every key exactly.
TARGET_COST_RANGE = (0.001, 0.5)
MIRROR_DTYPES = ("auto", "int8")
BUDGET_ONLY_KEYS = ("max_L", "calibration_decodes")


def _range_text(lo: int | None, hi: int | None) -> str:
    if hi is None:
        return f">= {lo}"
    return f"{lo}..{hi}"


def check_int(key: str, value: Any, bounds: tuple[int | None, int | None] | None = None) -> int:
    """``value`` as an int in ``bounds`` (default: the key's own range), or an error naming both."""
    # bool is an int subclass; `"K": true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise MagicPigConfigError(
            f"magicpig config: {key!r} must be an integer, got {value!r} ({type(value).__name__})"
        )
    lo, hi = bounds if bounds is not None else _INT_RANGES[key]
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise MagicPigConfigError(
            f"magicpig config: {key!r}={value} is out of range; allowed: {_range_text(lo, hi)}"
        )
    return value


def check_target_cost(value: Any) -> float:
    lo, hi = TARGET_COST_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MagicPigConfigError(
            f"magicpig config: 'target_cost' must be a number such as 0.02, got {value!r} ({type(value).__name__})"
        )
    if not lo <= value <= hi:
        raise MagicPigConfigError(
            f"magicpig config: 'target_cost'={value!r} is out of range; allowed: a number in {lo:g}..{hi:g} "
            "(the fraction of keys sampled, e.g. 0.02)"
        )
    return float(value)


def check_choice(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise MagicPigConfigError(
            f"magicpig config: {key!r}={value!r} is not supported; allowed: {', '.join(allowed)}"
        )
    return value


def centerings() -> tuple[str, ...]:
    """The values the config key ``centering`` accepts."""
    extensions.load()
    return decode_methods.configurable_centrings()


def decode_method_names() -> tuple[str, ...]:
    """The values the config key ``decode_method`` accepts."""
    extensions.load()
    return decode_methods.configurable_methods()


def parse_config(additional_config: Mapping[str, Any] | None) -> MagicPigConfig:
    """Parse and validate ``additional_config`` (the whole dict vLLM hands over)."""
    extensions.load()
    raw: Any = (additional_config or {}).get(CONFIG_KEY, {})
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise MagicPigConfigError(
            f'additional_config["{CONFIG_KEY}"] must be a JSON object such as '
            f'{{"K": 10, "L": 150}}, got {raw!r}'
        )
    both = sorted(k for k in ALIASES if k in raw and ALIASES[k] in raw)
    if both:
        raise MagicPigConfigError(
            f"magicpig config: give {both[0]!r} or {ALIASES[both[0]]!r}, not both (they are one key)"
        )
    raw = {ALIASES.get(k, k): v for k, v in raw.items()}
    ext_keys = extensions.CONFIG_KEYS
    known = set(_FIELDS) | set(ext_keys)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise MagicPigConfigError(
            f"magicpig config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed keys: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ext_keys:
            extra[key] = ext_keys[key].parse(value)
        elif key in _INT_RANGES:
            values[key] = check_int(key, value)
        elif key == "dense_layers":
            if value is None:
                values[key] = None
                continue
            if not isinstance(value, (list, tuple)):
                raise MagicPigConfigError(
                    f"magicpig config: 'dense_layers' must be a list of layer indices, got {value!r}"
                )
            layers = []
            for v in value:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise MagicPigConfigError(
                        f"magicpig config: 'dense_layers' entries must be non-negative integers, got {v!r}"
                    )
                layers.append(v)
            values[key] = tuple(sorted(set(layers)))
        elif key in ("centering", "decode_method"):
            values[key] = check_choice(key, value, centerings() if key == "centering" else decode_method_names())
        elif key == "mirror_dtype":
            values[key] = check_choice(key, value, MIRROR_DTYPES)
        elif key == "target_cost":
            values[key] = None if value is None else check_target_cost(value)
        elif key in ("inherit_centre", "cost_model", "cost_calibration", "background_index"):
            if not isinstance(value, bool):
                raise MagicPigConfigError(f"magicpig config: {key!r} must be true or false, got {value!r}")
            values[key] = value
        else:  # pragma: no cover - every field is handled above
            raise AssertionError(key)
    cfg = MagicPigConfig(**values, extra=tuple(sorted(extra.items())), given=frozenset(raw))
    _check_budget(cfg)
    if cfg.max_segment_tokens < cfg.segment_tokens:
        raise MagicPigConfigError(
            f"magicpig config: 'max_segment_tokens'={cfg.max_segment_tokens} must be >= "
            f"'segment_tokens'={cfg.segment_tokens}"
        )
    return cfg


def _check_budget(cfg: MagicPigConfig) -> None:
    """Budget mode chooses K and L itself: explicit ones contradict it, and its own keys need it."""
    if cfg.target_cost is not None:
        explicit = [k for k in ("K", "L") if k in cfg.given]
        if explicit:
            keys = " and ".join(repr(k) for k in explicit)
            raise MagicPigConfigError(
                f"magicpig config: 'target_cost' chooses K and L per layer and request, so it cannot be combined "
                f"with {keys}; drop {keys} (or drop 'target_cost' to set K and L by hand)"
            )
        if cfg.decode_method != decode_methods.MAGICPIG:
            raise MagicPigConfigError(
                f"magicpig config: 'target_cost' applies to decode_method 'magicpig', not "
                f"{cfg.decode_method!r}; drop one of them"
            )
    else:
        orphans = [k for k in BUDGET_ONLY_KEYS if k in cfg.given]
        if orphans:
            verb = "applies" if len(orphans) == 1 else "apply"
            raise MagicPigConfigError(
                f"magicpig config: {', '.join(map(repr, orphans))} {verb} only in budget mode; "
                "add 'target_cost' (e.g. 0.02) or drop them"
            )


def validate_for_model(cfg: MagicPigConfig, *, num_layers: int, block_size: int | None) -> None:
    """Checks that need the model and cache shape (run at engine start-up)."""
    if cfg.dense_layers is not None:
        bad = [i for i in cfg.dense_layers if i >= num_layers]
        if bad:
            raise MagicPigConfigError(
                f"magicpig config: 'dense_layers' has {bad}, outside the model's layers; "
                f"allowed: 0..{num_layers - 1}"
            )
    if block_size is not None:
        for key in ("segment_tokens", "max_segment_tokens"):
            v = getattr(cfg, key)
            if v % block_size:
                raise MagicPigConfigError(
                    f"magicpig config: {key!r}={v} must be a multiple of the KV block size "
                    f"({block_size}); e.g. {max(block_size, v // block_size * block_size)}"
                )
