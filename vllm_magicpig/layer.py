"""One sparse layer's execution of the step plan, and the accounting of every decode, once.

``SparseLayer.begin`` binds the step's settings, reads the layer's KV views and tells the
extensions' layer observers; then :meth:`SparseLayer.forward` runs the step's decode method
(``decode_methods.py``) and counts what it reports. A step that samples no request never gets
to ``forward``: the platform kernel serves it (after ``begin`` when observers are attached),
counted in the step's ``ExactTally``.

Budget mode (``budget.py``): each request has its own (K, L) in each layer, chosen from its own
query/key angles and steered by what the kernel samples for it. The decode method runs once per
distinct (K, tables built, tables read) in the batch, on the requests that share it.
"""
from __future__ import annotations

import dataclasses

import torch

from vllm_magicpig import decode_methods, magicpig_decode  # noqa: F401  (registers the production method)
from vllm_magicpig.budget import Choice, angle_histogram
from vllm_magicpig.decode_methods import DecodeResult, LayerContext
from vllm_magicpig.kv_layout import KVViews, gather, request_blocks
from vllm_magicpig.planner import DecodePlan, StepSettings


def budget_applies(st: StepSettings) -> bool:
    return st.target_cost is not None and st.method == decode_methods.MAGICPIG


class SparseLayer:
    def __init__(self, ctx: LayerContext) -> None:
        self.ctx = ctx
        self._cache: torch.Tensor | None = None  # the cache tensor whose views are below
        self._views: KVViews | None = None

    def begin(self, kv_cache: torch.Tensor, plan: DecodePlan) -> KVViews:
        """Bind the step's settings and the layer's cache views; run the observers' before_decode."""
        self._bind(plan.settings)
        if kv_cache is not self._cache:  # a worker's layer keeps its cache tensor for life: views once
            self._cache, self._views = kv_cache, self.ctx.runtime.layout.views(kv_cache)
        kv = self._views
        for observer in self.ctx.runtime.observers:
            observer.before_decode(self.ctx, kv, plan)
        return kv

    def _bind(self, st: StepSettings) -> None:
        if st is self.ctx.settings:  # the runtime's settings object, the same step after step unless hooks change it
            return
        self.ctx.settings = st
        self.ctx.projection = self.ctx.runtime.projection(self.ctx.head_size, st.K, st.L)

    def forward(self, query: torch.Tensor, kv: KVViews, plan: DecodePlan, output: torch.Tensor) -> bool:
        """Decode attention for every decode request of the plan, by the step's method. Returns
        whether every request planned sparse was served sparse (False when the layer attended one
        exactly after all, its segments not kept under the cap: then the call's time is not
        sampling's alone)."""
        ctx = self.ctx
        R, H, D = plan.num_decodes, ctx.num_heads, ctx.head_size
        q, out = query.view(R, H, D), output.view(R, H, D)
        if budget_applies(plan.settings) and plan.sparse:
            return self._forward_budget(q, kv, plan, out)
        return self._run(q, kv, plan, out)

    def _run(self, q: torch.Tensor, kv: KVViews, plan: DecodePlan, out: torch.Tensor) -> bool:
        ctx = self.ctx
        method = ctx.runtime.decode_method(plan.settings.method)
        result = method.forward(ctx, q, kv, plan, out)
        self._account(plan, result, label=result.label or method.name)
        for observer in ctx.runtime.observers:
            observer.after_decode(ctx, q, kv, plan, out, result)
        return not result.exact

    # ------------------------------------------------------------------ budget mode
    def _forward_budget(self, q: torch.Tensor, kv: KVViews, plan: DecodePlan, out: torch.Tensor) -> bool:
        choices = {r: self._request_choice(q, kv, plan, r) for r in plan.sparse}
        groups: dict[tuple[int, int, int], list[int]] = {}
        for r in plan.sparse:
            groups.setdefault((choices[r].K, choices[r].L_built, choices[r].L), []).append(r)
        base = plan.settings
        if len(groups) == 1:
            ((K, L_built, L),) = groups
            self._bind(dataclasses.replace(base, K=K, L=L_built, L_read=L))
            return self._run(q, kv, plan, out)
        # One call per group; the requests planned exact ride with the first.
        exact_rows = [r for r in range(plan.num_decodes) if r not in choices]
        all_served = True
        for i, ((K, L_built, L), rows) in enumerate(groups.items()):
            rows = sorted(rows + (exact_rows if i == 0 else []))
            idx = torch.tensor(rows, dtype=torch.long, device=q.device)
            sub_out = torch.empty(len(rows), *out.shape[1:], dtype=out.dtype, device=out.device)
            self._bind(dataclasses.replace(base, K=K, L=L_built, L_read=L))
            all_served &= self._run(q.index_select(0, idx).contiguous(), kv, sub_plan(plan, rows), sub_out)
            out.index_copy_(0, idx, sub_out)
        return all_served

    def _request_choice(self, q: torch.Tensor, kv: KVViews, plan: DecodePlan, r: int) -> Choice:
        """Request r's (K, L) in this layer (``Budget.request_choice``); its angles, when needed, are
        between this decode's query heads and the request's indexed keys, centred as the index does."""
        ctx = self.ctx
        return ctx.runtime.budget.request_choice(ctx.name, plan.centres[r].cid, plan.settings.target_cost,
                                                 plan.covered[r], lambda: request_angles(ctx, q, kv, plan, r))

    # ------------------------------------------------------------------ accounting
    def _account(self, plan: DecodePlan, result: DecodeResult, label: str | None) -> None:
        stats = self.ctx.runtime.stats
        for reason in plan.exact_reason.values():
            stats.decode_exact[reason] += 1
        for reason in result.exact.values():
            stats.decode_exact[reason] += 1
        if result.served:
            candidates = sum(plan.covered[r] for r in result.served) * self.ctx.num_heads
            # one record, folded with the step's others (sparse_tally.py)
            self.ctx.runtime.sparse_tally.served(self.ctx.name, label, len(result.served), result.sampled, candidates)
            if budget_applies(plan.settings):
                budget, target, H = self.ctx.runtime.budget, plan.settings.target_cost, self.ctx.num_heads
                budget.add_sampled(target, self.ctx.name, result.sampled, candidates)
                for r, sampled in (result.sampled_by_request or {}).items():
                    budget.add_request_sampled(self.ctx.name, plan.centres[r].cid, target, sampled,
                                               plan.covered[r] * H)


def request_angles(ctx: LayerContext, q: torch.Tensor, kv: KVViews, plan: DecodePlan, r: int) -> torch.Tensor:
    """The angle histogram (``budget.angle_histogram``) between request r's query heads and its
    indexed keys, centred as the index centres them."""
    lo, hi = plan.covered_range(r)
    keys = gather(kv.key, request_blocks(plan.block_table, r, hi, kv.block_size), lo, hi)
    centring = decode_methods.get_centring(ctx.settings.centering)
    centre = ctx.runtime.index.centre(ctx.name, plan.centres[r], lambda s: centring(ctx, s, kv))
    return angle_histogram(q[r], keys.to(torch.float32) - centre.to(device=keys.device, dtype=torch.float32))


def sub_plan(plan: DecodePlan, rows: list[int]) -> DecodePlan:
    """The plan restricted to requests ``rows`` (renumbered 0..len-1 in that order)."""
    new = {r: i for i, r in enumerate(rows)}
    idx = torch.tensor(rows, dtype=torch.long)

    def keep(d: dict) -> dict:
        return {new[r]: v for r, v in d.items() if r in new}

    return DecodePlan(plan.settings, len(rows), plan.block_table.index_select(0, idx.to(plan.block_table.device)),
                      [plan.seq_lens[r] for r in rows],
                      plan.dense_ranges.index_select(0, idx.to(plan.dense_ranges.device)),
                      [new[r] for r in plan.sparse if r in new], keep(plan.centres), keep(plan.segments),
                      keep(plan.covered), keep(plan.exact_reason))
