"""The seam through which code outside the production path (the accuracy harness's baselines,
centrings and calibration: ``vllm_magicpig.eval.decode``) plugs into the decode path.

Extensions are found through the entry-point group ``vllm_magicpig.extensions``: each entry
point is a function called once per process, which registers what it adds:

* decode methods and centrings (:mod:`vllm_magicpig.decode_methods`);
* config keys of ``additional_config["magicpig"]`` (:func:`register_config_key`), validated
  at start-up like ours and carried in ``MagicPigConfig.extra``;
* step-settings hooks and layer observers, attached to one runtime while they are needed
  (``MagicPigRuntime.settings_hooks``, ``MagicPigRuntime.observers``), so production decode pays
  nothing for them otherwise;
* worker RPC methods for ``LLM.collective_rpc`` (:func:`register_worker_rpc`);
* per-runtime state and counters (:func:`register_runtime_init`).

Production modules never import an extension; they only call what was registered here.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable

ENTRY_POINT_GROUP = "vllm_magicpig.extensions"
# VLLM_MAGICPIG_EXTENSIONS=0 serves with production code only (and proves it needs nothing else).
DISABLE_ENV = "VLLM_MAGICPIG_EXTENSIONS"

_lock = threading.RLock()
_loaded = False


@dataclass(frozen=True)
class ConfigKey:
    """A config key added by an extension: ``parse(value)`` returns the value or raises
    ``MagicPigConfigError`` naming the key and the allowed range."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str = ""


CONFIG_KEYS: dict[str, ConfigKey] = {}
WORKER_RPCS: dict[str, Callable] = {}  # name -> fn(runtime, *args, **kwargs)
RUNTIME_INITS: list[Callable] = []  # fn(runtime): set up the extension's per-runtime state


def load() -> None:
    """Run every installed extension's registration function (once per process)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        if os.environ.get(DISABLE_ENV, "1") == "0":
            return
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            ep.load()()


def register_config_key(key: ConfigKey) -> None:
    CONFIG_KEYS[key.name] = key


def register_worker_rpc(name: str, fn: Callable) -> None:
    WORKER_RPCS[name] = fn


def register_runtime_init(fn: Callable) -> None:
    if fn not in RUNTIME_INITS:
        RUNTIME_INITS.append(fn)
