"""The ops seam between the device-agnostic decode path and a platform's kernels.

The planner, the index and the decode methods call only these operations, so a new
platform (the CUDA path's host-side kernel over mirrored pages) is a new implementation of
:class:`SparseDecodeOps` beside :class:`CpuKernelOps`, not a rewrite of the layers above.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch

from vllm_magicpig.kv_layout import KVViews


class SparseDecodeOps(Protocol):
    def build_segment(self, keys: torch.Tensor, values: torch.Tensor, centre: torch.Tensor,
                      projection: torch.Tensor, K: int, L: int) -> Any:
        """Index keys/values ``[n, Hkv, D]`` centred by ``centre [Hkv, D]``."""

    def merge_segments(self, segments: Sequence[Any]) -> Any:
        """Concatenate segments in token order without re-hashing."""

    def hash_codes(self, x: torch.Tensor, projection: torch.Tensor, K: int, L: int) -> torch.Tensor:
        """int32 ``[N, L]`` SimHash codes of rows ``x [N, D]``: a segment build's, up to float32 ties."""

    def build_segment_from_codes(self, keys: torch.Tensor, values: torch.Tensor, centre: torch.Tensor,
                                 codes: torch.Tensor, K: int, L: int) -> Any:
        """The same segment, from codes ``[Hkv, L, n]`` hashed elsewhere (on the accelerator)."""

    def attend(self, query: torch.Tensor, query_codes: torch.Tensor, query_dot_centre: torch.Tensor,
               segments: list[list[Any]], kv: KVViews, block_table: torch.Tensor, dense_ranges: torch.Tensor,
               scale: float, K: int, L: int, out: torch.Tensor, sampled_counts: torch.Tensor | None,
               lse: torch.Tensor | None = None, L_read: int | None = None) -> None:
        """One decode attention call for every request: sampled segments plus exact dense ranges
        (``lse``: the natural-log LSE per request and head, for merging with another part;
        ``L_read``: the segments' first tables read, None: all L)."""

    def attend_queries(self, query: torch.Tensor, projection: torch.Tensor, centres: list[torch.Tensor | None],
                       segments: list[list[Any]], kv: KVViews, block_table: torch.Tensor, dense_ranges: torch.Tensor,
                       scale: float, K: int, L: int, out: torch.Tensor, sampled_counts: torch.Tensor | None = None,
                       L_read: int | None = None) -> int:
        """As :meth:`attend`, with the query codes and q . c computed in the same call from
        ``projection`` and each request's centre (None: no segments); returns the sampled keys
        summed over requests and heads. The CPU path's one native call per sparse layer."""

    def end_calls(self) -> None:
        """Drop what the calls so far keep for the next one (a step's checked tensors), so tensors
        attended only once (the start-up calibration's synthetic cache) are freed."""

    def set_mirror_dtype(self, mirror_dtype: str) -> None:
        """How segments built from now on keep their K/V rows (the config's ``mirror_dtype``)."""

    def set_memory_cap(self, cap_bytes: int) -> None:
        """The index's memory cap (``index_memory_mb``): memory freed by dropped segments may be
        kept for reuse by later builds only while the index's memory, in use or kept, stays within it."""

    def memory_pool_stats(self) -> dict[str, int]:
        """``{"pooled_bytes": ...}``: freed segment memory kept for reuse (not in ``index_bytes``)."""

    def release_pooled(self) -> None:
        """Give the freed segment memory kept for reuse back to the OS now (the memory node is short:
        ``node_memory.py``); later frees are kept again, within the cap."""


class CpuKernelOps:
    """The C++ kernel (``vllm_magicpig.kernel``) over host memory.

    ``num_threads``: the kernel's OpenMP threads; None uses the process default, which is right
    on vLLM's CPU platform (it binds the worker's threads) and wrong in a CUDA worker (vLLM sets
    torch, and so the shared OpenMP runtime, to one thread there).
    """

    def __init__(self, num_threads: int | None = None) -> None:
        from vllm_magicpig import kernel  # the extension loads once a runtime exists

        self._kernel = kernel
        self.num_threads = num_threads
        self.mirror = "cache"  # the kernel's name for mirror_dtype "auto"
        self._step = None  # the kernel.DecodeStep of the step being decoded

    def end_calls(self):
        self._step = None

    def set_mirror_dtype(self, mirror_dtype):
        self.mirror = "cache" if mirror_dtype == "auto" else mirror_dtype

    def build_segment(self, keys, values, centre, projection, K, L):
        return self._kernel.build_segment(keys, values, centre, projection, K, L, num_threads=self.num_threads,
                                          mirror=self.mirror)

    def build_segment_from_codes(self, keys, values, centre, codes, K, L):
        return self._kernel.build_segment_from_codes(keys, values, centre, codes, K, L, num_threads=self.num_threads,
                                                     mirror=self.mirror)

    def merge_segments(self, segments):
        return self._kernel.merge_segments(segments, num_threads=self.num_threads)

    def set_memory_cap(self, cap_bytes):
        # The pool is process-wide: one worker process serves one model, so one runtime sets it.
        self._kernel.set_huge_pool_limit(cap_bytes)

    def release_pooled(self):
        # a limit of 0 unmaps every pooled region (live ones stay); then frees are kept again
        limit = self._kernel.huge_pool_stats()["limit_bytes"]
        self._kernel.set_huge_pool_limit(0)
        self._kernel.set_huge_pool_limit(limit)

    def memory_pool_stats(self):
        return {"pooled_bytes": self._kernel.huge_pool_stats()["pooled_bytes"]}

    def hash_codes(self, x, projection, K, L):
        return self._kernel.hash_codes(x, projection, K, L, num_threads=self.num_threads)

    def attend(self, query, query_codes, query_dot_centre, segments, kv, block_table, dense_ranges, scale, K, L,
               out, sampled_counts, lse=None, L_read=None):
        # The backend built the codes, ranges and block table itself: skip the O(n) value scans.
        self._kernel.sparse_decode_attention(
            query, query_codes, query_dot_centre, segments, kv.key, kv.value, block_table=block_table,
            dense_ranges=dense_ranges, scale=scale, K=K, L=L, out=out, lse=lse, sampled_counts=sampled_counts,
            check_values=False, num_threads=self.num_threads, L_read=L_read)

    def attend_queries(self, query, projection, centres, segments, kv, block_table, dense_ranges, scale, K, L, out,
                       sampled_counts=None, L_read=None):
        # The sparse layers of a step pass the plan's block table, dense ranges and the shared
        # projection: the checks of those are made once, by the step's first layer (kernel.DecodeStep).
        # serves() checks this layer's query, caches and output, or the new step was made from them:
        # either way attend need not check them again.
        step = self._step
        if step is None or not step.serves(query, kv.key, kv.value, out, block_table, dense_ranges, projection, K, L,
                                           L_read):
            step = self._step = self._kernel.DecodeStep(
                query=query, key_cache=kv.key, value_cache=kv.value, out=out, block_table=block_table,
                dense_ranges=dense_ranges, K=K, L=L, projection=projection, L_read=L_read, check_values=False,
                num_threads=self.num_threads)
        return step.attend(query, centres, segments, kv.key, kv.value, out, scale=scale, sampled_counts=sampled_counts,
                           served=True)
