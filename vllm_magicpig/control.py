"""Evaluation-only run-time switches of the decode path.

The accuracy harness shares one prefill across methods: it keeps prefix caching on and
changes how decode attention is computed between ``generate`` calls, through
``llm.collective_rpc("magicpig_set_eval", kwargs={...})``. Production serving never
calls this; everything then comes from the config. Changing K, L or the centring
clears the index, whose segments were hashed with the old settings.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_magicpig import centring
from vllm_magicpig.config import CENTERINGS, DECODE_METHODS, MagicPigConfig


@dataclass(frozen=True)
class StepSettings:
    """What one engine step's decode uses (the config, unless the harness overrides it)."""

    method: str
    K: int
    L: int
    centering: str
    budget_fraction: float
    quest_page_size: int
    measure_error: bool = False
    calibrate: bool = False  # add decode requests' keys to the centring calibration


_override: dict = {}


def set_eval(**kw) -> dict:
    """Override decode settings (method, K, L, centering, budget_fraction, quest_page_size,
    measure_error, calibrate); pass nothing to go back to the config. Centering may also be
    one of the evaluation-only centrings of :mod:`vllm_magicpig.centring`."""
    allowed = {f.name for f in dataclasses.fields(StepSettings)}
    unknown = set(kw) - allowed
    if unknown:
        raise ValueError(f"unknown evaluation setting(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "method" in kw and kw["method"] not in DECODE_METHODS:
        raise ValueError(f"decode method {kw['method']!r} is not one of {', '.join(DECODE_METHODS)}")
    if "centering" in kw:
        allowed = CENTERINGS + centring.EVAL_CENTERINGS
        if kw["centering"] not in allowed:
            raise ValueError(f"centering {kw['centering']!r} is not one of {', '.join(allowed)}")
        centring.check_available(kw["centering"])
    if "K" in kw and not 1 <= int(kw["K"]) <= 16:
        raise ValueError("K must be in 1..16")
    if "L" in kw and not 2 <= int(kw["L"]) <= 1024:
        raise ValueError("L must be in 2..1024")
    if "budget_fraction" in kw and not 0 < float(kw["budget_fraction"]) <= 1:
        raise ValueError("budget_fraction must be in (0, 1]")
    changes_index = any(k in kw or k in _override for k in ("K", "L", "centering"))
    _override.clear()
    _override.update(kw)
    if changes_index:
        from vllm_magicpig import per_token_centres
        from vllm_magicpig.index import STORE

        STORE.clear()
        per_token_centres.clear()
    return dict(_override)


def set_decode_method(method: str | None) -> dict:
    return set_eval(**({} if method is None else {"method": method}))


def settings(cfg: MagicPigConfig) -> StepSettings:
    base = StepSettings(cfg.decode_method, cfg.K, cfg.L, cfg.centering, cfg.budget_fraction,
                        cfg.quest_page_size)
    return dataclasses.replace(base, **_override) if _override else base
