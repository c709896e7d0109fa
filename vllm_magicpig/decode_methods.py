"""The decode-method seam: how one sparse layer computes decode attention for a plan.

A :class:`DecodeMethod` gets the layer's :class:`LayerContext`, the batch's decode queries, the
layer's KV views and the step's :class:`~vllm_magicpig.planner.DecodePlan`, and writes
attention outputs for *every* decode request of the plan (the ones planned exact included).
It returns which requests it served sparse and how many keys it sampled; the layer does all
accounting from that, once (``layer.py``).

Production registers ``magicpig`` (``magicpig_decode.py``); ``exact`` needs no method (the
planner marks every request exact and the platform kernel serves them). Extensions register
more (see :mod:`vllm_magicpig.extensions`). Centrings are registered the same way: a centring
computes a request's centre for one layer from the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from vllm_magicpig.kv_layout import KVViews
    from vllm_magicpig.planner import DecodePlan, StepSettings
    from vllm_magicpig.runtime import MagicPigRuntime


@dataclass
class LayerContext:
    """One sparse layer, as decode methods see it."""

    name: str
    index: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    runtime: "MagicPigRuntime"
    settings: "StepSettings | None" = None  # the current step's
    projection: torch.Tensor | None = None  # the SimHash projection of the current settings

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class DecodeResult:
    served: list[int]  # requests served sparse
    sampled: int = 0  # keys sampled for them, summed over query heads
    # per served request (row of the plan), when the method counts them (budget mode steers by them)
    sampled_by_request: dict[int, int] | None = None
    exact: dict[int, str] = field(default_factory=dict)  # planned sparse, served exactly: reason
    label: str | None = None  # counter label (default: the method's name)

    def count_by_request(self, counts: torch.Tensor) -> None:
        """``sampled_by_request`` of the served requests from the kernel's ``[R, H]`` counts."""
        per_request = counts.sum(dim=1).tolist()
        self.sampled_by_request = {r: per_request[r] for r in self.served}


class DecodeMethod(Protocol):
    name: str

    def forward(self, ctx: LayerContext, query: torch.Tensor, kv: "KVViews", plan: "DecodePlan",
                out: torch.Tensor) -> DecodeResult: ...


Centring = Callable[[LayerContext, Any, "KVViews"], torch.Tensor]  # (ctx, CentreSpec, kv) -> [Hkv, D]

# Production's names, known before their implementations are imported (the config parser
# runs in the front end, which never imports the decode path).
MAGICPIG = "magicpig"
EXACT = "exact"  # no method object: the planner marks every request exact
BUILTIN_METHODS = (MAGICPIG, EXACT)
BUILTIN_CENTRINGS = ("request", "none")

_METHODS: dict[str, DecodeMethod] = {}
_CONFIGURABLE: list[str] = list(BUILTIN_METHODS)
_CENTRINGS: dict[str, Centring] = {}
_CONFIG_CENTRINGS: list[str] = list(BUILTIN_CENTRINGS)


def register_method(method: DecodeMethod, *, configurable: bool = True) -> None:
    """``configurable``: selectable with the config key ``decode_method`` (else only by a
    settings hook)."""
    _METHODS[method.name] = method
    if configurable and method.name not in _CONFIGURABLE:
        _CONFIGURABLE.append(method.name)


def get_method(name: str) -> DecodeMethod:
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"decode method {name!r} is not registered; known: {', '.join(_METHODS)}") from None


def configurable_methods() -> tuple[str, ...]:
    return tuple(_CONFIGURABLE)


def register_centring(name: str, centring: Centring, *, configurable: bool = True) -> None:
    _CENTRINGS[name] = centring
    if configurable and name not in _CONFIG_CENTRINGS:
        _CONFIG_CENTRINGS.append(name)


def get_centring(name: str) -> Centring:
    try:
        return _CENTRINGS[name]
    except KeyError:
        raise ValueError(f"centring {name!r} is not registered; known: {', '.join(_CENTRINGS)}") from None


def configurable_centrings() -> tuple[str, ...]:
    return tuple(_CONFIG_CENTRINGS)


def centring_names() -> tuple[str, ...]:
    return tuple(_CENTRINGS)
