"""Evaluation-only run-time switches of the decode path, and their per-runtime state.

The accuracy harness shares one prefill across methods: it keeps prefix caching on and
changes how decode attention is computed between ``generate`` calls, through
``llm.collective_rpc("magicpig_set_eval", kwargs={...})``. Production serving never calls
this; everything then comes from the config. Changing K, L or the centring clears the
index, whose segments were hashed with the old settings.

Everything here lives on the worker's runtime (``runtime.extension_state["eval"]``) and
reaches the decode path only through the hooks of :mod:`vllm_magicpig.extensions`.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from vllm_magicpig import decode_methods
from vllm_magicpig.config import MagicPigConfigError, check_int, check_target_cost
from vllm_magicpig.limits import K_RANGE, L_RANGE

STATE_KEY = "eval"
# Centrings that give each key its own centre: the kernel's one q.c per request cannot
# express them, so a (request, layer) runs the torch method below instead (``per_key.py``).
PER_KEY_CENTRINGS = ("segment", "pre_rope")
PER_KEY_METHOD = "magicpig_per_key"
BASELINES = ("topk", "quest")


def parse_budget_fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise MagicPigConfigError(
            f"magicpig config: 'budget_fraction'={value!r} is out of range; allowed: a number in (0, 1]"
        )
    return float(value)


def parse_quest_page_size(value: Any) -> int:
    return check_int("quest_page_size", value, (1, 4096))


@dataclass(frozen=True)
class EvalOverride:
    """What ``magicpig_set_eval`` may change; None = the config's value."""

    method: str | None = None
    K: int | None = None
    L: int | None = None
    centering: str | None = None
    budget_fraction: float | None = None
    quest_page_size: int | None = None
    target_cost: float | None = None  # budget mode at this target (K, L chosen per layer; excludes K and L)
    max_L: int | None = None  # budget mode's largest L (with target_cost; None: the config's max_L)
    measure_error: bool = False  # record each served request's relative error vs exact attention
    calibrate: bool = False  # add decode requests' keys to the centring calibration


class EvalState:
    """One runtime's evaluation state: the override, calibration sums, per-key cache, errors."""

    def __init__(self, runtime) -> None:
        from vllm_magicpig.eval.decode.per_key import PerKeyCache

        self.runtime = runtime
        self.override = EvalOverride()
        self.calibration: dict = {}  # layer name -> centring.LayerCalibration
        self.per_key_cache = PerKeyCache()
        self.errors: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # layer -> [sum, count]

    @cached_property
    def rope(self):
        """The model's RoPE (None when its kind is not handled), read from the runtime's model config."""
        from vllm_magicpig.eval.decode.centring import Rope

        hf = self.runtime.hf_config
        if hf is None:
            return None
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return Rope.from_hf_config(hf, head)

    def add_error(self, layer_name: str, rel_err: float) -> None:
        e = self.errors[layer_name]
        e[0] += rel_err
        e[1] += 1

    def stats_section(self) -> dict:
        return {"relative_error_per_layer": {name: v[0] / v[1] for name, v in sorted(self.errors.items()) if v[1]}}

    def reset_stats(self) -> None:
        self.errors.clear()


def state(runtime) -> EvalState:
    return runtime.extension_state[STATE_KEY]


def init_runtime(runtime) -> None:
    st = runtime.extension_state[STATE_KEY] = EvalState(runtime)
    runtime.stats.add_section(STATE_KEY, st.stats_section, st.reset_stats)


def set_eval(runtime, **kw) -> dict:
    """Override decode settings (method, K, L, centering, budget_fraction, quest_page_size,
    target_cost and budget mode's max_L, measure_error, calibrate); pass nothing to go back to the
    config. Centering may also be one of the evaluation-only centrings of
    :mod:`vllm_magicpig.eval.decode.centring`."""
    if runtime is None:
        raise RuntimeError("magicpig_set_eval: this worker has no MAGICPIG layer (select --attention-backend MAGICPIG)")
    allowed = {f.name for f in dataclasses.fields(EvalOverride)}
    unknown = set(kw) - allowed
    if unknown:
        raise ValueError(f"unknown evaluation setting(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    for key, allowed in (("method", decode_methods.configurable_methods()),
                         ("centering", decode_methods.centring_names() + PER_KEY_CENTRINGS)):
        if key in kw and kw[key] not in allowed:
            raise ValueError(f"{key} {kw[key]!r} is not one of {', '.join(allowed)}")
    try:
        if "K" in kw:
            kw["K"] = check_int("K", kw["K"], K_RANGE)
        if "L" in kw:
            kw["L"] = check_int("L", kw["L"], L_RANGE)
        if "budget_fraction" in kw:
            kw["budget_fraction"] = parse_budget_fraction(kw["budget_fraction"])
        if "quest_page_size" in kw:
            kw["quest_page_size"] = parse_quest_page_size(kw["quest_page_size"])
        if kw.get("target_cost") is not None:
            kw["target_cost"] = check_target_cost(kw["target_cost"])
            if kw.get("K") is not None or kw.get("L") is not None:
                raise MagicPigConfigError("magicpig config: 'target_cost' chooses K and L per layer; give it or K/L")
        if kw.get("max_L") is not None:
            kw["max_L"] = check_int("max_L", kw["max_L"], L_RANGE)
            if kw.get("target_cost") is None:
                raise MagicPigConfigError("magicpig config: 'max_L' applies only in budget mode; add 'target_cost'")
    except MagicPigConfigError as e:  # the same checks as the config's, reported as a bad call
        raise ValueError(str(e).replace("magicpig config: ", "evaluation setting ")) from None
    if "centering" in kw:
        from vllm_magicpig.eval.decode.centring import check_available

        check_available(state(runtime), kw["centering"])
    ev = state(runtime)
    old = ev.override
    new = EvalOverride(**kw)
    changes_index = any(getattr(old, k) != getattr(new, k) for k in ("K", "L", "centering"))
    ev.override = new
    _attach_observers(runtime, new)
    _attach_settings_hook(runtime, new)
    # Budget mode's choices were made under the old largest L: forget them when it changes.
    max_L = new.max_L if new.max_L is not None else runtime.cfg.max_L
    if runtime.budget.max_L != max_L:
        runtime.budget.max_L = max_L
        runtime.budget.forget()
    if changes_index:
        runtime.clear_index()
        ev.per_key_cache.clear()
    return {k: v for k, v in dataclasses.asdict(new).items() if v not in (None, False)}


def _attach_observers(runtime, override: EvalOverride) -> None:
    """Calibration and error measurement watch every sparse layer's decode, so they are attached
    to the runtime only while switched on."""
    from vllm_magicpig.eval.decode import ErrorObserver
    from vllm_magicpig.eval.decode.centring import CalibrationObserver

    runtime.observers[:] = [o for o in runtime.observers if not isinstance(o, (CalibrationObserver, ErrorObserver))]
    if override.calibrate:
        runtime.observers.append(CalibrationObserver())
    if override.measure_error:
        runtime.observers.append(ErrorObserver())


def _attach_settings_hook(runtime, override: EvalOverride) -> None:
    """apply_override runs in every step of the runtime it is attached to: only while an override is set."""
    runtime.settings_hooks[:] = [h for h in runtime.settings_hooks if h is not apply_override]
    if override != _NO_OVERRIDE:
        runtime.settings_hooks.append(apply_override)


def set_decode_method(runtime, method: str | None) -> dict:
    return set_eval(runtime, **({} if method is None else {"method": method}))


_NO_OVERRIDE = EvalOverride()


def apply_override(runtime, settings):
    """The settings hook, attached to a runtime while its override is set (_attach_settings_hook):
    the step's settings with the override applied."""
    ov = state(runtime).override
    changes: dict[str, Any] = {
        k: getattr(ov, k) for k in ("method", "K", "L", "centering") if getattr(ov, k) is not None
    }
    options = dict(settings.options)
    for k in ("budget_fraction", "quest_page_size"):
        if getattr(ov, k) is not None:
            options[k] = getattr(ov, k)
    if ov.K is not None or ov.L is not None:
        changes["target_cost"] = None  # explicit K/L: one (K, L) for every layer, no budget mode
    if ov.target_cost is not None:
        changes["target_cost"] = ov.target_cost  # budget mode at this target (calibrated once per runtime)
    settings = dataclasses.replace(settings, **changes, options=options)
    if settings.method == decode_methods.MAGICPIG and settings.centering in PER_KEY_CENTRINGS:
        settings = dataclasses.replace(settings, method=PER_KEY_METHOD)
    return settings
