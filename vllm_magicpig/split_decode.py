"""MAGICPIG with the KV cache on an accelerator: the exact part next to the cache, the sampled
part on the host kernel, merged by LSE (the CUDA platform's ``magicpig`` method).

Per sparse layer and step:

1. Centres and segments come from the index, as on the CPU; a segment is built from the
   device cache: its keys are gathered, centred and hashed on the device, and the keys,
   values and codes are copied to host memory for ``build_segment_from_codes``.
2. Queries are hashed and ``q . c`` computed on the device, then copied to the host.
3. The exact part (sinks, whole blocks, and the tail) runs on the device through the runtime's
   ``dense_attention`` (FLASH_ATTN on CUDA) with its LSE.
4. The host kernel attends the sampled segments only, with its LSE.
5. The two are merged on the device (vLLM's ``merge_attn_states``).

Requests not sampled (short, evicted) have no segments: the host part is empty (LSE -inf) and
the merge returns the exact part. Everything here is device-agnostic torch; on the CPU (the
tests) the "device" is the CPU and copies are no-ops.
"""
from __future__ import annotations

import math
import time

import torch

from vllm_magicpig import decode_methods, device_ops
from vllm_magicpig.decode_methods import DecodeResult, LayerContext
from vllm_magicpig.index import SegmentRef
from vllm_magicpig.kv_layout import KVViews, gather
from vllm_magicpig.magicpig_decode import index_sparse_requests
from vllm_magicpig.planner import DecodePlan


class HostBuffers:
    """Host buffers the step's transfers reuse, layer after layer: pinned when the device is a GPU,
    so copies to and from them are asynchronous. Reuse is safe because every layer waits for its
    own device-to-host copies, which the stream orders after the previous layer's host-to-device ones."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(name, dtype)] = torch.empty(max(n, 1), dtype=dtype, pin_memory=pinned)
        return buf[:n].view(shape)

    def to_host(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t  # already on the host (the CPU stand-in in tests)
        buf = self.get(name, tuple(t.shape), t.dtype, pinned=True)
        buf.copy_(t, non_blocking=True)
        return buf


class SplitMagicPigDecode:
    name = decode_methods.MAGICPIG

    def __init__(self) -> None:
        self._projections: dict[tuple, torch.Tensor] = {}
        self.buffers = HostBuffers()

    def _projection(self, ctx: LayerContext, device: torch.device) -> torch.Tensor:
        """The runtime's projection, resident on the device (queries and keys hash with the same W)."""
        key = (ctx.head_size, ctx.settings.K, ctx.settings.L, device)
        if key not in self._projections:
            self._projections[key] = ctx.projection.to(device)
        return self._projections[key]

    def forward(self, ctx: LayerContext, query: torch.Tensor, kv: KVViews, plan: DecodePlan,
                out: torch.Tensor) -> DecodeResult:
        rt, st = ctx.runtime, ctx.settings
        R, H, D = query.shape
        hkv, device = ctx.num_kv_heads, query.device
        ops = rt.ops
        centring = decode_methods.get_centring(st.centering)
        proj = self._projection(ctx, device)

        def both_copies(spec):  # the centre on the device (q . c, key codes) and on the host (norms)
            c = centring(ctx, spec, kv).to(torch.float32)
            return c, c.cpu()

        def make_build(centre_pair):
            centre, centre_host = centre_pair

            def build(ref: SegmentRef):
                _, start, size, blocks = ref.key
                lo, hi = ref.first_token - start, size
                keys = gather(kv.key, blocks, lo, hi)  # hashed on the device
                codes = device_ops.centred_key_codes(keys, centre, proj, st.K, st.L).cpu()
                staged = rt.mirror.rows(ctx.name, blocks, lo, hi) if rt.mirror is not None else None
                if staged is None:  # not staged (or staging was full): copy from the device now
                    staged = keys.cpu(), gather(kv.value, blocks, lo, hi).cpu()
                seg = ops.build_segment_from_codes(staged[0], staged[1], centre_host, codes, st.K, st.L)
                if rt.mirror is not None:
                    rt.mirror.release(ctx.name, blocks)  # the segment holds its own copy now
                return seg
            return build

        segments, served_centres, dense, result = index_sparse_requests(ctx, plan, both_copies, make_build)
        centres = torch.zeros(R, hkv, 1, D, dtype=torch.float32, device=device)
        for r, (centre, _) in served_centres.items():
            centres[r, :, 0] = centre

        t0 = time.perf_counter()
        q32 = query.to(torch.float32)
        qdc = (q32.view(R, hkv, ctx.group, D) * centres).sum(-1).view(R, H)
        codes = device_ops.hash_codes(query.reshape(R * H, D), proj, st.K, st.L).view(R, H, st.L)
        # What the host kernel needs goes to pinned buffers, asynchronously; the exact part is queued
        # behind those copies, so it runs on the device while the host kernel samples. One wait
        # per sparse layer: for the copies, not for the exact part.
        bufs, on_device = self.buffers, query.is_cuda
        q_host, codes_host, qdc_host = (bufs.to_host("q", query), bufs.to_host("codes", codes),
                                        bufs.to_host("qdc", qdc))
        copied = None
        if on_device:
            copied = torch.cuda.Event()
            copied.record()
        table, lens = device_ops.dense_block_tables(plan.block_table, plan.seq_lens, dense, kv.block_size)
        dense_out, dense_lse = rt.dense_attention(query, kv, table.to(device, non_blocking=True),
                                                  lens.to(device, non_blocking=True), ctx.scale, int(lens.max()))
        if copied is not None:
            copied.synchronize()

        host_out = bufs.get("out", (R, H, D), query.dtype, on_device)  # the kernel writes the query dtype
        host_lse = bufs.get("lse", (R, H), torch.float32, on_device)
        counts = torch.zeros(R, H, dtype=torch.int64)
        no_cache = torch.zeros(1, kv.block_size, hkv, D, dtype=kv.key.dtype)  # nothing dense on the host
        ops.attend(q_host, codes_host, qdc_host, segments, KVViews(no_cache, no_cache),
                   torch.zeros(R, 1, dtype=torch.int32), torch.zeros(R, 2, 2, dtype=torch.int32), ctx.scale,
                   st.K, st.L, host_out, counts, lse=host_lse, L_read=st.L_read)
        device_ops.merge_states(out, dense_out.to(out.dtype), dense_lse,
                                host_out.to(device=device, non_blocking=True).to(out.dtype),
                                host_lse.t().to(device, non_blocking=True))
        rt.stats.sparse_seconds += time.perf_counter() - t0
        result.count_by_request(counts)
        result.sampled = sum(result.sampled_by_request.values())
        return result
