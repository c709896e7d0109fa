"""Evaluation-only run-time switch of the decode method.

The accuracy harness shares one prefill across methods: it keeps prefix caching on
and switches how decode attention is computed between requests with
``llm.collective_rpc("magicpig_set_decode_method", args=(method,))``. Production
serving never calls this; the method then comes from the config.
"""
from __future__ import annotations

from vllm_magicpig.config import DECODE_METHODS

_override: str | None = None


def set_decode_method(method: str | None) -> str | None:
    global _override
    if method is not None and method not in DECODE_METHODS:
        raise ValueError(f"decode method {method!r} is not one of {', '.join(DECODE_METHODS)}")
    _override = method
    return _override


def decode_method(configured: str) -> str:
    return _override or configured
