"""Evaluation-only decode pieces, plugged into the production decode path through its seam
(:mod:`vllm_magicpig.extensions`, :mod:`vllm_magicpig.decode_methods`):

* decode methods ``topk`` and ``quest`` (:mod:`.baselines`) and ``magicpig_per_key``
  (:mod:`.per_key`, for the per-key centrings ``segment`` and ``pre_rope``);
* the centring ``global`` and the calibration behind it (:mod:`.centring`);
* the config keys ``budget_fraction`` and ``quest_page_size``;
* the run-time override and the worker RPCs ``magicpig_set_eval``,
  ``magicpig_set_decode_method``, ``magicpig_calibration`` and ``magicpig_clear_calibration``
  (:mod:`.settings`);
* the worker RPC ``magicpig_phase_timers``: the kernel's phase timers in the engine's worker, for
  the end-to-end benchmark's split of the sparse layers' time (``benchmarks/e2e_decode.py``);
* the counter ``relative_error_per_layer`` (``measure_error=True``).

:func:`install` is this package's ``vllm_magicpig.extensions`` entry point.
"""
from __future__ import annotations

import torch

from vllm_magicpig import decode_methods, extensions

_installed = False


class ErrorObserver:
    """With ``measure_error=True``: each served request's relative error against exact attention."""

    def before_decode(self, ctx, kv, plan) -> None:
        pass

    def after_decode(self, ctx, query, kv, plan, out, result) -> None:
        from vllm_magicpig.eval.decode.settings import state

        ev = state(ctx.runtime)
        if not ev.override.measure_error or not result.served:
            return
        exact = exact_output(ctx, query, kv, plan)
        for r in result.served:
            e = exact[r].float()
            ev.add_error(ctx.name, float((out[r].float() - e).norm() / e.norm().clamp_min(1e-12)))


def exact_output(ctx, query, kv, plan) -> torch.Tensor:
    """Exact attention for every decode request (the kernel with the whole context dense)."""
    R, H, D = query.shape
    st = ctx.settings
    full = torch.zeros(R, 2, 2, dtype=torch.int32)
    full[:, 0, 1] = torch.tensor(plan.seq_lens, dtype=torch.int32)
    full[:, 1, 0] = full[:, 0, 1]
    full[:, 1, 1] = full[:, 0, 1]
    out = torch.empty(R, H, D, dtype=query.dtype)
    codes = torch.zeros(R, H, st.L, dtype=torch.int32)
    ctx.runtime.ops.attend(query, codes, torch.zeros(R, H), [[] for _ in range(R)], kv, plan.block_table, full,
                           ctx.scale, st.K, st.L, out, None)
    return out


def _calibration(rt, clear: bool = False) -> dict:
    from vllm_magicpig.eval.decode import centring
    from vllm_magicpig.eval.decode.settings import state

    if rt is None:  # no MAGICPIG layer in this worker: nothing calibrated
        return {"layers": 0, "requests": 0, "positions": 0}
    ev = state(rt)
    if clear:
        ev.calibration.clear()
    return centring.calibration_summary(ev)


def _phase_timers(rt, on: bool) -> dict:
    """``on=True``: zero the worker's kernel phase timers and start them; ``on=False``: stop them and
    return seconds per phase since (process-wide, so with or without a MAGICPIG runtime)."""
    from vllm_magicpig import kernel

    if on:
        kernel.start_phase_timers()
        return {}
    return kernel.stop_phase_timers()


def _set_eval(rt, **kw):
    from vllm_magicpig.eval.decode.settings import set_eval

    return set_eval(rt, **kw)


def _set_decode_method(rt, method=None):
    from vllm_magicpig.eval.decode.settings import set_decode_method

    return set_decode_method(rt, method)


def _clear_calibration(rt):
    return _calibration(rt, clear=True)


def install() -> None:
    """Register the evaluation pieces (idempotent; called once per process by extensions.load)."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm_magicpig.eval.decode import centring, settings
    from vllm_magicpig.eval.decode.baselines import BaselineDecode
    from vllm_magicpig.eval.decode.per_key import PerKeyDecode

    for name in settings.BASELINES:
        decode_methods.register_method(BaselineDecode(name))
    decode_methods.register_method(PerKeyDecode(), configurable=False)
    decode_methods.register_centring("global", centring.global_centre, configurable=False)
    extensions.register_config_key(extensions.ConfigKey(
        "budget_fraction", 0.04, settings.parse_budget_fraction,
        "evaluation only: key budget of the 'topk' / 'quest' baselines"))
    extensions.register_config_key(extensions.ConfigKey(
        "quest_page_size", 16, settings.parse_quest_page_size, "evaluation only: page size of the 'quest' baseline"))
    extensions.register_runtime_init(settings.init_runtime)
    extensions.register_worker_rpc("magicpig_set_eval", _set_eval)
    extensions.register_worker_rpc("magicpig_set_decode_method", _set_decode_method)
    extensions.register_worker_rpc("magicpig_calibration", _calibration)
    extensions.register_worker_rpc("magicpig_clear_calibration", _clear_calibration)
    extensions.register_worker_rpc("magicpig_phase_timers", _phase_timers)
