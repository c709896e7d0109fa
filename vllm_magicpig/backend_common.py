"""What every platform's MAGICPIG backend shares: its declarations, its per-step metadata, and
the decode/prefill dispatch of builder and impl. A platform backend (``backend.py`` for
vLLM's CPU attention, ``backend_cuda.py`` for FLASH_ATTN) is these mixins placed before the
platform's own classes, plus what only that platform knows (its KV layout and runtime).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata

import vllm_magicpig
from vllm_magicpig.config import MagicPigConfigError
from vllm_magicpig.decode_methods import LayerContext
from vllm_magicpig.exact_tally import ExactTally
from vllm_magicpig.layer import SparseLayer, sub_plan
from vllm_magicpig.limits import SUPPORTED_HEAD_SIZES
from vllm_magicpig.planner import DecodePlan, StepPlanner
from vllm_magicpig.runtime import MagicPigRuntime

logger = init_logger("vllm.magicpig")  # under vLLM's logger tree, so its handler prints it


class MagicPigDeclarations:
    """What MAGICPIG can serve, declared the way vLLM's backends declare it: vLLM's selector and
    our start-up checks both read these (``AttentionBackend.validate_configuration``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    # fp8 caches pack K/V differently; the sparse kernel reads plain 16-bit rows.
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return vllm_magicpig.BACKEND_NAME  # the registered enum name

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # FLASH_ATTN answers this by its own rule (any multiple of 8 up to 256): ours is the kernel's.
        return head_size in SUPPORTED_HEAD_SIZES

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_rswa(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    # The index is keyed by whole-context block tables: context-parallel shards break that.
    @classmethod
    def supports_dcp(cls) -> bool:
        return False

    @classmethod
    def supports_pcp(cls) -> bool:
        return False


class BatchRows:
    """Some of a step's decode tokens, by their rows in the batch: as views when the rows are
    contiguous (no copies; in a batch of two they always are), else gathered and scattered."""

    __slots__ = ("index", "span")

    def __init__(self, rows: list[int], device) -> None:
        self.index = torch.tensor(rows, dtype=torch.long, device=device)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.span = slice(rows[0], rows[0] + len(rows)) if contiguous else None

    def __len__(self) -> int:
        return self.index.numel()

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.span] if self.span is not None else t.index_select(0, self.index)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Where these rows' output is written: ``out``'s rows, or a buffer for :meth:`put`."""
        return out[self.span] if self.span is not None else out.new_empty((len(self), *out.shape[1:]))

    def put(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """``part`` (from :meth:`output`) into ``out``'s rows."""
        if self.span is None:
            out.index_copy_(0, self.index, part)


@dataclass
class DecodeSplit:
    """A step that samples some decode requests and serves the others exactly: each part goes to
    the kernel that serves it fastest. The platform's kernel attends a whole context faster than
    MAGICPIG's kernel attends it as an exact range: with the exact requests in MAGICPIG's call, a
    step that sampled one request and attended 20 exactly ran at 0.96x CPU_ATTN
    (``benchmarks/mixed_step.py``), and under load most steps are such steps."""

    exact_rows: BatchRows  # the exact requests' decode tokens
    exact: Any  # the platform's metadata for those requests alone
    tally: ExactTally  # their reasons and the platform kernel's time, one add per sparse layer
    sampled_rows: BatchRows  # the sampled requests' decode tokens
    sampled_plan: DecodePlan  # the step's plan restricted to them, renumbered 0..m-1


@dataclass
class MagicPigMetadata:
    """Per-step metadata, shared by every layer (per-layer state lives on the impl)."""

    full: Any  # the platform's metadata for the whole batch, for exact layers
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    # the prefill requests alone, in a step that mixes them with decodes some of which are sampled:
    # the sparse layers hand this part to the platform kernel (None in any other step)
    prefill: Any
    runtime: MagicPigRuntime
    sparse_plan: DecodePlan | None = None
    # the layers whose decodes the platform kernel attends (exact_tally.py); None without decodes
    exact_tally: ExactTally | None = None
    # a step that samples some decodes and not others: how the sparse layers split them (or None)
    split: DecodeSplit | None = None

    @property
    def platform_serves_decodes(self) -> bool:
        """No decode request is sampled this step: every layer hands the whole batch to the
        platform kernel, as the platform's own backend would."""
        return self.sparse_plan is not None and not self.sparse_plan.sparse

    # vLLM reads these names on metadata objects in a few generic places.
    @property
    def num_actual_tokens(self) -> int:
        return self.full.num_actual_tokens

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.full.slot_mapping


class MagicPigBuilderMixin:
    """Builds the platform's metadata for the whole batch and for its decode and prefill parts,
    and plans the step's sparse decode once for every layer."""

    # Decodes first, so the decode/prefill split is a prefix of the batch.
    reorder_batch_threshold: int = 1
    # In a step that samples some decodes, hand the others to the platform kernel (DecodeSplit).
    # A platform whose decode method attends every request's exact part in its own kernel already
    # (CUDA's split decode) turns this off.
    splits_exact_decodes: bool = True

    def _init_magicpig(self, vllm_config, make_runtime=None) -> None:
        from vllm_magicpig import runtime as runtimes

        if vllm_config.speculative_config is not None:
            raise MagicPigConfigError("MAGICPIG does not support speculative decoding; drop --speculative-config")
        self.runtime = runtimes.attach(vllm_config, make_runtime)
        rt = self.runtime
        self.planner = StepPlanner(rt.cfg, self.block_size, rt.index, rt.mirror, rt.cost, rt.indexer, rt.cap_bytes)

    def host_view(self, cam, num_reqs: int):
        """The CPU tensors the planner reads (the platform's metadata may live on a device)."""
        return cam

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> MagicPigMetadata:
        cam = common_attn_metadata
        full = super().build(common_prefix_len, cam, fast_build)
        num_decodes, num_prefills, num_decode_tokens = decodes_and_prefills(cam)
        rt = self.runtime
        rt.fold_tallies()  # the previous step's, before the cost model plans this one
        stats = rt.stats
        stats.steps += 1
        if num_prefills:
            stats.prefill_chunks += num_prefills
            stats.prefill_tokens += cam.num_actual_tokens - num_decode_tokens
        host = self.host_view(cam, cam.num_reqs)
        self.planner.observe_step(host, num_decodes)
        bounds, rt.answer_bounds = rt.answer_bounds, None  # this step's, published by the runner (answer_bounds.py)
        if bounds is not None and len(bounds) < num_decodes:
            bounds = None
        plan = self.planner.plan(host, num_decodes, rt.step_settings(), bounds) if num_decodes else None
        if rt.cfg.log_stats_interval and stats.steps % rt.cfg.log_stats_interval == 0:
            logger.info(stats.summary_line())
        tally = split = None
        if plan is not None:
            reasons = [] if plan.sparse else list(plan.exact_reason.values())
            tally = ExactTally(num_decodes, reasons, plan.context_keys, plan.timed and not num_prefills)
            if plan.sparse and plan.exact_reason and self.splits_exact_decodes:
                split = self._decode_split(cam, plan, fast_build)
            rt.start_exact_tallies(tally, *([split.tally] if split is not None else []))
        # The prefill part's own metadata, only where sparse layers serve the decodes themselves:
        # one more build of the platform's, every such step of a batch that mixes a prefill chunk
        # with decodes (the common step under load).
        prefill = None
        if num_prefills and plan is not None and plan.sparse:
            (p_cam,) = split_attn_metadata(
                [UBatchSlice(slice(num_decodes, cam.num_reqs), slice(num_decode_tokens, cam.num_actual_tokens))], cam
            )
            prefill = super().build(0, p_cam, fast_build)
        return MagicPigMetadata(
            full=full,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            prefill=prefill,
            runtime=rt,
            sparse_plan=plan,
            exact_tally=tally,
            split=split,
        )

    def _decode_split(self, cam, plan: DecodePlan, fast_build: bool) -> DecodeSplit:
        """The platform's metadata for the step's exact decode requests alone, and the plan of its
        sampled ones: one more build of the platform's metadata, once a step, for every layer."""
        exact = sorted(plan.exact_reason)
        device = cam.query_start_loc.device
        lens = [plan.seq_lens[r] for r in exact]
        # timed even beside a prefill chunk: the sparse layers attend that apart, before the decodes
        tally = ExactTally(len(exact), [plan.exact_reason[r] for r in exact], sum(lens), plan.timed)
        return DecodeSplit(
            exact_rows=BatchRows(exact, device),
            exact=super().build(0, decode_rows_metadata(cam, torch.tensor(exact), max(lens)), fast_build),
            tally=tally,
            sampled_rows=BatchRows(plan.sparse, device),
            sampled_plan=sub_plan(plan, plan.sparse),
        )


def decode_rows_metadata(cam, rows: torch.Tensor, max_seq_len: int):
    """vLLM's ``CommonAttentionMetadata`` for decode requests ``rows`` of a batch alone (host int64
    indices, ascending; a decode request's one token is its row, decodes coming first). vLLM's
    ``split_attn_metadata`` takes contiguous runs; the exact requests of a step are any subset.
    Fields MAGICPIG's declarations rule out (encoder, context-parallel, multimodal, R-SWA, ...) and
    vLLM's caches are left unset."""
    n = rows.numel()
    device = cam.query_start_loc.device
    on_device = rows.to(device)

    def pick(t):
        return None if t is None else t.index_select(0, rows.to(t.device))

    qsl_cpu = torch.arange(n + 1, dtype=cam.query_start_loc_cpu.dtype)
    return dataclasses.replace(
        cam,
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=cam.seq_lens.index_select(0, on_device),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max_seq_len,
        block_table_tensor=cam.block_table_tensor.index_select(0, on_device),
        slot_mapping=cam.slot_mapping.index_select(0, on_device),
        logits_indices_padded=None,
        num_logits_indices=None,
        max_logits_per_req=None,
        encoder_seq_lens=None,
        encoder_seq_lens_cpu=None,
        dcp_local_seq_lens=None,
        dcp_local_seq_lens_cpu_upper_bound=None,
        positions=pick(cam.positions),
        is_prefilling=pick(cam.is_prefilling),
        seq_lens_cpu_upper_bound=pick(cam.seq_lens_cpu_upper_bound),
        req_idx=None if cam.req_idx is None else cam.req_idx[rows.numpy()],
        mm_req_doc_ranges=None,
        rswa_prefix_lens=None,
        replayssm_decode_base_cpu=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


def decodes_and_prefills(cam) -> tuple[int, int, int]:
    """(decode requests, prefill requests, decode tokens) of a batch whose decodes come first. A
    1-token chunk that is still prefilling has an incomplete prompt: it counts as a prefill, kept
    exact. A batch of 1-token queries none of which is prefilling is all decodes, known without
    vLLM's general split (which costs ~40 us of torch calls a step)."""
    if cam.max_query_len <= 1 and cam.num_actual_tokens == cam.num_reqs and (
            cam.is_prefilling is None or not bool(cam.is_prefilling[: cam.num_reqs].any())):
        return cam.num_reqs, 0, cam.num_actual_tokens
    num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
        cam, decode_threshold=1, treat_short_extends_as_decodes=False
    )
    return num_decodes, num_prefills, num_decode_tokens


def check_layer_features(alibi_slopes, sliding_window, sinks, logits_soft_cap) -> None:
    """Backstops for what the start-up checks already reject; they name the layer feature."""
    if alibi_slopes is not None:
        raise MagicPigConfigError("MAGICPIG does not support ALiBi; run this model without MAGICPIG")
    if sliding_window is not None:
        raise MagicPigConfigError("MAGICPIG does not support sliding-window attention")
    if sinks is not None:
        raise MagicPigConfigError("MAGICPIG does not support learned attention sinks")
    if logits_soft_cap:
        raise MagicPigConfigError("MAGICPIG does not support logit soft-capping")


class MagicPigImplMixin:
    """Exact parts go to the platform's own kernel (``super().forward``) unchanged; decode rows of
    sparse layers go to the layer's SparseLayer."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **kwargs) -> None:
        check_layer_features(alibi_slopes, sliding_window, sinks, logits_soft_cap)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks)
        # Which layer this is, and whether it is dense, is known at the first forward (from the
        # layer's name and the runtime on the metadata).
        self.layer_index: int | None = None
        self.sparse_layer: SparseLayer | None = None
        self._registered_cache: torch.Tensor | None = None

    def _resolve_layer(self, layer, rt: MagicPigRuntime) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_index = extract_layer_index(layer.layer_name)
        if self.layer_index not in rt.dense_layers:
            self.sparse_layer = SparseLayer(LayerContext(layer.layer_name, self.layer_index, self.num_heads,
                                                         self.num_kv_heads, self.head_size, self.scale, rt))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("MAGICPIG does not support fused output quantization")
        if attn_metadata is None:  # profiling / warm-up: the platform's own behaviour
            return super().forward(layer, query, key, value, kv_cache, None, output)
        meta: MagicPigMetadata = attn_metadata
        if self.layer_index is None:
            self._resolve_layer(layer, meta.runtime)
        meta.runtime.stats.count_layer(layer.layer_name)
        if self.sparse_layer is not None and kv_cache is not self._registered_cache:
            # the background indexer reads this layer's cache (the tensor is the worker's for life)
            meta.runtime.indexer.register_layer(self.sparse_layer.ctx, meta.runtime.layout.views(kv_cache))
            self._registered_cache = kv_cache
        if self.sparse_layer is not None and meta.runtime.mirror is not None:
            # The step's KV is written (vLLM's KV update runs before attention): mirror what completed.
            meta.runtime.mirror.copy_layer(layer.layer_name, meta.runtime.layout.views(kv_cache))
        if not meta.num_decodes:
            return super().forward(layer, query, key, value, kv_cache, meta.full, output)
        if self.sparse_layer is None or meta.platform_serves_decodes:
            # The platform kernel attends the whole batch, as under the platform's own backend; the
            # layer adds its decodes and its time to the step's tally (exact_tally.py: per-layer
            # accounting here cost more than a cheap layer's attention).
            if self.sparse_layer is not None and meta.runtime.observers:  # they see every sparse decode
                self.sparse_layer.begin(kv_cache, meta.sparse_plan)
            t0 = time.perf_counter()
            super().forward(layer, query, key, value, kv_cache, meta.full, output)
            meta.exact_tally.add(self.sparse_layer is None, time.perf_counter() - t0)
            return output
        nd = meta.num_decode_tokens
        if meta.num_prefills:
            t = meta.full.num_actual_tokens
            super().forward(layer, query[nd:t], key[nd:t], value[nd:t], kv_cache, meta.prefill, output[nd:t])
            query, key, value, output = query[:nd], key[:nd], value[:nd], output[:nd]
        # else a pure decode step: the tensors as vLLM passed them (the platform kernel reads the
        # metadata's tokens; slicing four views costs more than a cheap layer's Python)
        self.forward_decode(layer, query, key, value, kv_cache, meta, output)
        return output

    def forward_decode(self, layer, query, key, value, kv_cache, meta: MagicPigMetadata, output) -> None:
        """Decode attention for the batch's decode requests in a sparse layer of a step that samples
        some (their tokens first in ``query`` and ``output``; rows past them, if any, are not
        decode tokens)."""
        plan = meta.sparse_plan
        kv = self.sparse_layer.begin(kv_cache, plan)  # its observers see every decode request
        rt = meta.runtime
        nd = meta.num_decode_tokens
        if query.shape[0] != nd:
            query, output = query[:nd], output[:nd]
        split = meta.split
        if split is not None:
            self._forward_exact_decodes(layer, query, key, value, kv_cache, split, output)
            whole_output, plan = output, split.sampled_plan
            query, output = split.sampled_rows.take(query), split.sampled_rows.output(output)
        t0, built0 = time.perf_counter(), rt.stats.build_seconds
        all_served = self.sparse_layer.forward(query, kv, plan, output)
        # Sampling's cost, less builds; not where the layer attended a request exactly after all (its
        # segments refused under the cap): a whole context in MAGICPIG's call is no sampled request's
        # cost, and under a long-answer load such layers made sampling look slower than exact.
        if rt.cost is not None and not plan.exact_reason and plan.timed and all_served:
            seconds = time.perf_counter() - t0 - (rt.stats.build_seconds - built0)
            rt.sparse_tally.timed(len(plan.sparse), plan.context_keys, seconds)
        if split is not None:
            split.sampled_rows.put(whole_output, output)

    def _forward_exact_decodes(self, layer, query, key, value, kv_cache, split: DecodeSplit, output) -> None:
        """The platform kernel attends the step's exact decode requests over their own metadata.
        ``key`` and ``value`` pass through unused: a decoder layer's attention reads K/V from the
        cache, which vLLM's KV update wrote before it."""
        rows = split.exact_rows
        out = rows.output(output)
        t0 = time.perf_counter()
        super().forward(layer, rows.take(query), key, value, kv_cache, split.exact, out)
        split.tally.add(False, time.perf_counter() - t0)
        rows.put(output, out)

