"""One sparse layer's execution of the step plan, and the accounting of every decode, once.

``SparseLayer.begin`` reads the layer's KV views and tells the extensions' layer observers;
then either the platform kernel serves the batch (nothing sampled this step) and
:meth:`SparseLayer.account_exact` counts it, or :meth:`SparseLayer.forward` runs the step's
decode method (``decode_methods.py``) and counts what it reports.
"""
from __future__ import annotations

import torch

from vllm_magicpig import magicpig_decode  # noqa: F401  (registers the production method)
from vllm_magicpig.decode_methods import DecodeResult, LayerContext
from vllm_magicpig.kv_layout import KVViews
from vllm_magicpig.planner import DecodePlan


class SparseLayer:
    def __init__(self, ctx: LayerContext) -> None:
        self.ctx = ctx

    def begin(self, kv_cache: torch.Tensor, plan: DecodePlan) -> KVViews:
        """Bind the step's settings and the layer's cache views; run the observers' before_decode."""
        ctx, st = self.ctx, plan.settings
        ctx.settings = st
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
        result = method.forward(ctx, q, kv, plan, out)
        self._account(plan, result, label=result.label or method.name)
        for observer in ctx.runtime.observers:
            observer.after_decode(ctx, q, kv, plan, out, result)

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
