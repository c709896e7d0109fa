"""One sparse layer's execution of the step plan, and the accounting of every decode, once.

``SparseLayer.begin`` binds the layer's settings (in budget mode, its own calibrated K and L),
reads the layer's KV views and tells the extensions' layer observers; then either the platform
kernel serves the batch (nothing sampled this step) and :meth:`SparseLayer.account_exact` counts
it, or :meth:`SparseLayer.forward` runs the step's decode method (``decode_methods.py``) and counts
what it reports. A budget-mode layer that is still calibrating serves its decodes exactly through
the same method and records the query/key angles (``budget.py``).
"""
from __future__ import annotations

import dataclasses

import torch

from vllm_magicpig import decode_methods, magicpig_decode  # noqa: F401  (registers the production method)
from vllm_magicpig.budget import angle_histogram
from vllm_magicpig.decode_methods import DecodeResult, LayerContext
from vllm_magicpig.kv_layout import KVViews, gather, request_blocks
from vllm_magicpig.planner import DecodePlan, StepSettings
from vllm_magicpig.stats import EXACT_CALIBRATING


def budget_applies(st: StepSettings) -> bool:
    return st.target_cost is not None and st.method == decode_methods.MAGICPIG


class SparseLayer:
    def __init__(self, ctx: LayerContext) -> None:
        self.ctx = ctx

    def layer_settings(self, st: StepSettings) -> StepSettings:
        """The step's settings as this layer runs them: in budget mode, with the layer's own (K, L)
        (the config's while the layer calibrates: nothing is hashed then)."""
        if budget_applies(st):
            choice = self.ctx.runtime.budget.choice(self.ctx.name, st.target_cost)
            if choice is not None and (choice.K, choice.L) != (st.K, st.L):
                return dataclasses.replace(st, K=choice.K, L=choice.L)
        return st

    def begin(self, kv_cache: torch.Tensor, plan: DecodePlan) -> KVViews:
        """Bind the step's settings and the layer's cache views; run the observers' before_decode."""
        ctx = self.ctx
        st = ctx.settings = self.layer_settings(plan.settings)
        ctx.projection = ctx.runtime.projection(ctx.head_size, st.K, st.L)
        kv = ctx.runtime.layout.views(kv_cache)
        for observer in ctx.runtime.observers:
            observer.before_decode(ctx, kv, plan)
        return kv

    def forward(self, query: torch.Tensor, kv: KVViews, plan: DecodePlan, output: torch.Tensor) -> None:
        """Decode attention for every decode request of the plan, by the step's method."""
        ctx = self.ctx
        R, H, D = plan.num_decodes, ctx.num_heads, ctx.head_size
        q, out = query.view(R, H, D), output.view(R, H, D)
        method = ctx.runtime.decode_method(plan.settings.method)
        if budget_applies(plan.settings) and ctx.runtime.budget.calibrating(ctx.name):
            self._observe_angles(q, kv, plan)
            plan = calibration_plan(plan)
        result = method.forward(ctx, q, kv, plan, out)
        self._account(plan, result, label=result.label or method.name)
        for observer in ctx.runtime.observers:
            observer.after_decode(ctx, q, kv, plan, out, result)

    def _observe_angles(self, q: torch.Tensor, kv: KVViews, plan: DecodePlan) -> None:
        """Budget-mode calibration: the angles between each planned-sparse request's query heads and
        its candidate keys (the tokens the index would sample), centred as the index centres them."""
        ctx = self.ctx
        centring = decode_methods.get_centring(ctx.settings.centering)
        hist = None
        for r in plan.sparse:
            lo, hi = plan.covered_range(r)
            keys = gather(kv.key, request_blocks(plan.block_table, r, hi, kv.block_size), lo, hi)
            centre = centring(ctx, plan.centres[r], kv).to(device=keys.device, dtype=torch.float32)
            h = angle_histogram(q[r], keys.to(torch.float32) - centre)
            hist = h if hist is None else hist + h
        if hist is not None:
            ctx.runtime.budget.observe(ctx.name, hist, len(plan.sparse))

    def account_exact(self, plan: DecodePlan) -> None:
        """The platform kernel served every decode request of the plan (none was planned sparse)."""
        self._account(plan, DecodeResult(served=[]), label=None)

    def _account(self, plan: DecodePlan, result: DecodeResult, label: str | None) -> None:
        stats = self.ctx.runtime.stats
        for reason in plan.exact_reason.values():
            stats.decode_exact[reason] += 1
        for reason in result.exact.values():
            stats.decode_exact[reason] += 1
        if result.served:
            stats.decode_sparse += len(result.served)
            stats.decode_by_method[label] += len(result.served)
            candidates = sum(plan.covered[r] for r in result.served) * self.ctx.num_heads
            stats.add_sampled(self.ctx.name, result.sampled, candidates)
            if budget_applies(plan.settings):
                self.ctx.runtime.budget.add_sampled(plan.settings.target_cost, self.ctx.name, result.sampled,
                                                    candidates, len(result.served))


def calibration_plan(plan: DecodePlan) -> DecodePlan:
    """``plan`` with its sparse requests served exactly (whole context), counted as ``calibrating``."""
    dense = plan.dense_ranges.clone()
    reasons = dict(plan.exact_reason)
    for r in plan.sparse:
        s = plan.seq_lens[r]
        dense[r, 0, 0], dense[r, 0, 1], dense[r, 1, 0], dense[r, 1, 1] = 0, s, s, s
        reasons[r] = EXACT_CALIBRATING
    return dataclasses.replace(plan, dense_ranges=dense, sparse=[], centres={}, segments={}, covered={},
                               exact_reason=reasons)
