"""Python face of the MagicPIG CPU kernel (``vllm_magicpig._C``).

Everything is validated here, so the C++ side only ever sees well-formed pointers and sizes; a bad
argument raises ``ValueError``/``TypeError`` instead of crashing the process.  This module must not
import vLLM.

Threads: every entry point with an OpenMP region takes ``num_threads``.  ``None`` runs on
:func:`max_threads` threads, i.e. whatever torch/OpenMP says: the extension shares torch's OpenMP
runtime, so ``torch.set_num_threads`` changes it, and a vLLM CUDA worker sets it to 1.  An int >= 1
asks for that many threads whatever the current default is.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

import torch

from . import _C, limits

__all__ = [
    "Segment", "build_segment", "build_segment_from_codes", "merge_segments", "hash_codes",
    "DecodeStep", "sparse_decode_attention", "magicpig_decode_attention", "active_isa", "cpu_isa", "ISA_NAMES",
    "max_threads", "profiling", "MAX_SEGMENT_TOKENS", "key_hash",
]

MAX_SEGMENT_TOKENS = limits.MAX_SEGMENT_TOKENS
if _C.MAX_SEGMENT_TOKENS != MAX_SEGMENT_TOKENS:
    raise ImportError(f"vllm_magicpig._C was built with MAX_SEGMENT_TOKENS={_C.MAX_SEGMENT_TOKENS}, but "
                      f"vllm_magicpig.limits says {MAX_SEGMENT_TOKENS}: rebuild the extension "
                      "(python setup.py build_ext --inplace)")
# The kernel's paths, slowest to fastest. MAGICPIG_ISA caps the path process-wide (to run the kernel
# as it runs on an older CPU); the C++ side reads it once, so a typo is refused here, not ignored.
ISA_NAMES = tuple(_C.isa_names())  # ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
if os.environ.get("MAGICPIG_ISA", ISA_NAMES[-1]) not in ISA_NAMES:
    raise ImportError(f"MAGICPIG_ISA={os.environ['MAGICPIG_ISA']!r} is not one of {', '.join(ISA_NAMES)}: "
                      "set one of those, or unset it to run the fastest path this CPU has")
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
# The dtypes sparse_decode reads queries in and writes outputs in directly (an fp16 output goes
# through an fp32 temporary).
_Q_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_CODE = {torch.bfloat16: 0, torch.float32: 2}


def active_isa() -> str:
    """The path the kernel runs: the fastest this CPU has ("amx", "avx512_bf16", "avx512", "avx2" or
    "scalar"), capped by ``MAGICPIG_ISA``. "amx" is "avx512_bf16" with the keys hashed on AMX tiles
    (the OS granting them); attention runs the same there."""
    return _C.active_isa()


def key_hash(keys_dtype: torch.dtype, projection: torch.Tensor, K: int, L: int) -> str:
    """How :func:`build_segment` hashes keys of ``keys_dtype`` with ``projection [D, K*L]`` on this
    CPU (as capped by ``MAGICPIG_ISA``): ``"bf16_pairs"`` (bf16 keys, a projection of bf16 values,
    an AVX-512 BF16 CPU: the pair dot product on the keys as the cache holds them), ``"amx_tiles"``
    (the same products as a tile matrix product, on the "amx" path with ``D`` a multiple of 32) or
    ``"centred_fp32"`` (float32 ``k - c``, any dtype and projection). Both give the codes of
    ``sign((k - c) . w)``, up to float32 ties."""
    if keys_dtype not in _DTYPE_CODE:
        raise TypeError(f"keys_dtype must be in {[str(d) for d in _DTYPE_CODE]}, got {keys_dtype}")
    _check_kl(K, L)
    projection = _check_projection(projection, projection.shape[0] if projection.dim() else 0, K, L)
    return _C.key_hash(_DTYPE_CODE[keys_dtype], projection.data_ptr(), projection.shape[0], K, L)


def cpu_isa() -> str:
    """The fastest path this CPU has, whatever ``MAGICPIG_ISA`` says."""
    return _C.cpu_isa()


def max_threads() -> int:
    """The thread count of a call made with ``num_threads=None``: OpenMP's ``omp_get_max_threads()``
    in the runtime torch shares (so 1 after ``torch.set_num_threads(1)``)."""
    return _C.max_threads()


def huge_pool_stats() -> dict[str, int]:
    """The process-wide pool behind segments' big arrays (2 MiB-aligned huge-page regions, kept
    for reuse when a segment is freed; ``cpp/huge_pool.h``): ``live_bytes`` handed out,
    ``pooled_bytes`` kept, ``limit_bytes`` on both together, and counts of ``fresh_maps``,
    ``reuses`` and ``unmapped`` regions."""
    return dict(_C.huge_pool_stats())


def set_huge_pool_limit(limit_bytes: int) -> None:
    """Freed segment memory is kept for reuse only while live + pooled bytes stay within
    ``limit_bytes`` (process-wide; 1 GiB until set); pooled regions above it are unmapped now."""
    if limit_bytes < 0:
        raise ValueError(f"set_huge_pool_limit: limit_bytes must be >= 0, got {limit_bytes}")
    _C.set_huge_pool_limit(int(limit_bytes))


@contextlib.contextmanager
def profiling() -> Iterator[dict[str, float]]:
    """Time the kernel's phases for the calls made inside the block.

    Yields a dict that is filled on exit with seconds per phase, summed over threads: "queries"
    (hashing the queries, q . c), then per segment "lookup", "gather_logits" (the sampled rows' q.k
    and logits) and "softmax_v", "dense" (the exactly attended tokens, whole), and "merge".  The
    timers are process-wide: calls made by other threads meanwhile are counted too, and blocks must
    not nest.
    """
    times: dict[str, float] = {}
    start_phase_timers()
    try:
        yield times
    finally:
        times.update(stop_phase_timers())


def start_phase_timers() -> None:
    """Zero the kernel's phase timers and turn them on (:func:`profiling`, split in two for callers
    that start and stop them in separate calls, such as a worker RPC)."""
    _C.set_profiling(True)


def stop_phase_timers() -> dict[str, float]:
    """Turn the phase timers off and return their seconds per phase since :func:`start_phase_timers`."""
    times = dict(_C.profile())
    _C.set_profiling(False)
    return times


class Segment:
    """An immutable LSH index over a contiguous run of tokens, with its own row-major K/V copy.

    Thread-safe to read from any number of kernel calls at once; it owns all its memory, so the
    tensors it was built from may be freed right after :func:`build_segment` returns.
    """

    __slots__ = ("_c",)

    def __init__(self, c):
        self._c = c

    num_tokens = property(lambda self: self._c.num_tokens)
    num_kv_heads = property(lambda self: self._c.num_kv_heads)
    head_dim = property(lambda self: self._c.head_dim)
    K = property(lambda self: self._c.K)
    L = property(lambda self: self._c.L)
    index_bytes = property(lambda self: self._c.index_bytes, doc="CSR ids + bucket directory")
    mirror_bytes = property(lambda self: self._c.mirror_bytes, doc="K/V copy + centred key norms")
    mirror = property(lambda self: _MIRROR_NAME[self._c.mirror],
                      doc='"cache": K/V rows in the cache dtype; "int8": 8-bit rows with a scale per row')
    dtype = property(lambda self: _CODE_DTYPE[self._c.dtype_code])

    def codes(self) -> torch.Tensor:
        """int32 [Hkv, L, n] codes recovered from the buckets (for tests)."""
        c = self._c
        out = torch.empty(c.num_kv_heads, c.L, c.num_tokens, dtype=torch.int32)
        c.codes_into(out.data_ptr())
        return out

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 K and V [n, Hkv, D] as decode reads them from the mirror (for tests)."""
        c = self._c
        k = torch.empty(c.num_tokens, c.num_kv_heads, c.head_dim)
        v = torch.empty_like(k)
        c.rows_into(k.data_ptr(), v.data_ptr())
        return k, v

    def __repr__(self):
        return (f"Segment(n={self.num_tokens}, Hkv={self.num_kv_heads}, D={self.head_dim}, K={self.K}, "
                f"L={self.L}, dtype={self.dtype}, mirror={self.mirror}, index_bytes={self.index_bytes}, "
                f"mirror_bytes={self.mirror_bytes})")


# ----------------------------------------------------------------------------- validation helpers
def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    return t


def _shape(name, t, shape):
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")


def _dtype(name, t, dtypes):
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_optional_out(name, t, dtype, shape):
    """An optional per-head output: None, or a contiguous tensor of this dtype and shape."""
    if t is None:
        return
    _tensor(name, t)
    _dtype(name, t, (dtype,))
    _shape(name, t, shape)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_kl(K, L):
    (k_lo, k_hi), (l_lo, l_hi) = limits.K_RANGE, limits.L_RANGE
    if isinstance(K, bool) or not isinstance(K, int) or not limits.in_range(K, limits.K_RANGE):
        raise ValueError(f"K must be an int in {k_lo}..{k_hi}, got {K!r}")
    if isinstance(L, bool) or not isinstance(L, int) or not limits.in_range(L, limits.L_RANGE):
        raise ValueError(f"L must be an int in {l_lo}..{l_hi} (a key is sampled on >= 2 collisions), got {L!r}")


def _check_projection(projection, D, K, L):
    _tensor("projection", projection)
    _dtype("projection", projection, (torch.float32,))
    _shape("projection", projection, (D, K * L))
    return projection.contiguous()


def _check_head_dim(D):
    if D <= 0 or D % 16:
        raise ValueError(f"head_dim must be a positive multiple of 16, got {D}")


# A bound on num_threads, far above any CPU's hardware threads: OpenMP aborts the process when it
# cannot create the threads a region asks for, so a typo such as 10**6 must not reach it.
_MAX_THREADS = 4096


def _threads(num_threads) -> int:
    """The C++ thread argument: 0 (the OpenMP default) for None, else a validated int >= 1."""
    if num_threads is None:
        return 0
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be None or an int >= 1, got {type(num_threads).__name__} "
                        f"{num_threads!r}")
    if not 1 <= num_threads <= _MAX_THREADS:
        raise ValueError(f"num_threads must be None or an int in 1..{_MAX_THREADS}, got {num_threads}")
    return num_threads


def _check_kv(keys, values, centre):
    """keys/values [n, Hkv, D] bf16/fp16 and centre fp32 [Hkv, D], as a segment build takes them;
    returns (n, Hkv, D)."""
    _tensor("keys", keys)
    _tensor("values", values)
    _dtype("keys", keys, tuple(_DTYPE_CODE))
    if values.dtype != keys.dtype:
        raise TypeError(f"values dtype {values.dtype} must match keys dtype {keys.dtype}")
    if keys.dim() != 3:
        raise ValueError(f"keys must have shape [n, Hkv, D], got {list(keys.shape)}")
    n, hkv, D = keys.shape
    _shape("values", values, (n, hkv, D))
    if not 1 <= n <= MAX_SEGMENT_TOKENS:
        raise ValueError(f"a segment holds 1..{MAX_SEGMENT_TOKENS} tokens, got {n}")
    _check_head_dim(D)
    _tensor("centre", centre)
    _dtype("centre", centre, (torch.float32,))
    _shape("centre", centre, (hkv, D))
    return n, hkv, D


# ----------------------------------------------------------------------------- segments and hashing
# The mirror forms a segment may keep its K/V rows in (cpp/common.h's MirrorKind).
MIRRORS = ("cache", "int8")
_MIRROR_NAME = dict(enumerate(MIRRORS))


def _mirror_code(mirror: str) -> int:
    if mirror not in MIRRORS:
        raise ValueError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
    return MIRRORS.index(mirror)


def build_segment(keys, values, centre, projection, K: int, L: int, *, force_scalar: bool = False,
                  num_threads: int | None = None, mirror: str = "cache") -> Segment:
    """Index keys/values [n, Hkv, D] (bf16/fp16): centre, hash (k - c) and bucket-sort per table.

    ``mirror="int8"`` keeps the sampled rows as 8-bit values with a scale per row (see
    ``eval.reference.int8_rows``): half the bytes per key to hold and to read; the codes, and so
    the sampled keys, are the same as with the cache's dtype.
    ``force_scalar`` hashes with the portable path even where a SIMD path is available (for tests)."""
    _check_kl(K, L)
    n, hkv, D = _check_kv(keys, values, centre)
    projection = _check_projection(projection, D, K, L)
    nt = _threads(num_threads)
    code = _mirror_code(mirror)
    keys, values, centre = keys.contiguous(), values.contiguous(), centre.contiguous()
    c = _C.build_segment(keys.data_ptr(), values.data_ptr(), n, hkv, D, _DTYPE_CODE[keys.dtype],
                         centre.data_ptr(), projection.data_ptr(), K, L, bool(force_scalar), nt, code)
    return Segment(c)


# Code dtypes build_segment_from_codes takes, by element size; int16 holds uint16 bit patterns.
_CODE_BYTES = {torch.int32: 4, torch.int16: 2}


def build_segment_from_codes(keys, values, centre, codes, K: int, L: int, *,
                             num_threads: int | None = None, mirror: str = "cache") -> Segment:
    """:func:`build_segment` with the codes of (k - c) given instead of a projection (they were
    hashed elsewhere, e.g. on the GPU next to the cache): the same mirror, centred-key norms and
    bucket sort, no hashing.

    ``codes`` is ``[Hkv, L, n]``, the layout :meth:`Segment.codes` returns: int32 in
    ``[0, 2^K)``, or int16 holding the uint16 bit patterns (so ``K = 16`` codes >= 2^15 are
    negative int16).  Given ``seg.codes()`` of a segment built from the same keys, values and
    centre, the result equals ``seg`` (codes, index, mirror, norms)."""
    _check_kl(K, L)
    n, hkv, D = _check_kv(keys, values, centre)
    _tensor("codes", codes)
    _dtype("codes", codes, tuple(_CODE_BYTES))
    _shape("codes", codes, (hkv, L, n))
    nt = _threads(num_threads)
    mcode = _mirror_code(mirror)
    if not (codes.dtype == torch.int16 and K == 16):  # else every int16 bit pattern is a code
        lo, hi = (int(v) for v in torch.aminmax(codes))
        if lo < 0 or hi >= (1 << K):
            raise ValueError(f"codes must lie in [0, 2^K={1 << K}) (int16 codes read as uint16 bit patterns), "
                             f"got min {lo}, max {hi}")
    keys, values, centre, codes = keys.contiguous(), values.contiguous(), centre.contiguous(), codes.contiguous()
    c = _C.build_segment_from_codes(keys.data_ptr(), values.data_ptr(), n, hkv, D, _DTYPE_CODE[keys.dtype],
                                    centre.data_ptr(), codes.data_ptr(), _CODE_BYTES[codes.dtype], K, L, nt,
                                    mcode)
    return Segment(c)


def merge_segments(segments: Sequence[Segment], num_threads: int | None = None) -> Segment:
    """Concatenate segments in order without re-hashing (bucket b = concat of the children's b)."""
    nt = _threads(num_threads)
    segments = list(segments)
    if not segments:
        raise ValueError("merge_segments needs at least one segment")
    for s in segments:
        if not isinstance(s, Segment):
            raise TypeError(f"merge_segments takes Segment objects, got {type(s).__name__}")
    a = segments[0]
    for s in segments[1:]:
        for f in ("num_kv_heads", "head_dim", "K", "L", "dtype", "mirror"):
            if getattr(s, f) != getattr(a, f):
                raise ValueError(f"cannot merge segments with different {f}: {getattr(a, f)} vs {getattr(s, f)}")
    total = sum(s.num_tokens for s in segments)
    if total > MAX_SEGMENT_TOKENS:
        raise ValueError(f"merged segment would hold {total} tokens, more than {MAX_SEGMENT_TOKENS}")
    return Segment(_C.merge_segments([s._c for s in segments], nt))


def hash_codes(x, projection, K: int, L: int, *, force_scalar: bool = False,
               num_threads: int | None = None) -> torch.Tensor:
    """int32 [N, L] SimHash codes of rows x [N, D], with the arithmetic of a build's float32 k - c
    hash (``key_hash`` "centred_fp32", given the same ``force_scalar``); a "bf16_pairs" build's codes
    agree with them up to float32 ties."""
    _check_kl(K, L)
    _tensor("x", x)
    _dtype("x", x, (torch.float32, torch.bfloat16, torch.float16))
    if x.dim() != 2:
        raise ValueError(f"x must have shape [N, D], got {list(x.shape)}")
    N, D = x.shape
    projection = _check_projection(projection, D, K, L)
    nt = _threads(num_threads)
    x = x.to(torch.float32).contiguous()
    out = torch.empty(N, L, dtype=torch.int32)
    if N:
        _C.hash_codes(x.data_ptr(), N, D, projection.data_ptr(), K, L, out.data_ptr(), bool(force_scalar), nt)
    return out


# ----------------------------------------------------------------------------- decode attention
class DecodeStep:
    """The checks of a decode call that every sparse layer of an engine step shares, made once.

    A step fixes the batch's geometry from its first layer's tensors (``query``, the caches and
    ``out``) and takes what the layers share: the block table, the dense ranges, (K, L, L_read),
    and the projection the queries are hashed with. Each layer then calls :meth:`attend` (or
    :meth:`attend_codes` with the query codes given), which checks only that layer's own tensors
    against the step and makes the native call. The results are bit for bit those of
    :func:`magicpig_decode_attention` and :func:`sparse_decode_attention`, which are a step made
    and run once.

    The step holds the block table, dense ranges and projection it reads (the caller's own
    tensors, or contiguous copies where those were not contiguous) and reads their contents at
    every call, so they must not be changed in shape; ``check_values`` checks the ranges' values against the block table
    once, here. An engine's layers save the shared checks (~30-50 us a layer on one core, cold).
    """

    def __init__(self, *, query, key_cache, value_cache, out, block_table, dense_ranges, K: int, L: int,
                 projection=None, L_read: int | None = None, check_values: bool = True, force_scalar: bool = False,
                 num_threads: int | None = None) -> None:
        _check_kl(K, L)
        nt = _threads(num_threads)
        if L_read is None:
            L_read = L
        if isinstance(L_read, bool) or not isinstance(L_read, int) or not 2 <= L_read <= L:
            raise ValueError(f"L_read must be an int in 2..L={L} (the tables read), got {L_read!r}")
        for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                        ("block_table", block_table), ("dense_ranges", dense_ranges), ("out", out)):
            _tensor(name, t)
        _dtype("query", query, (torch.bfloat16, torch.float16, torch.float32))
        if query.dim() != 3:
            raise ValueError(f"query must have shape [R, H, D], got {list(query.shape)}")
        R, H, D = query.shape
        _check_head_dim(D)
        (num_blocks, block_size, hkv, Dk), k_strides = _cache_axes("key_cache", key_cache)
        if Dk != D:
            raise ValueError(f"key_cache head_dim {Dk} != query head_dim {D}")
        v_shape, v_strides = _cache_axes("value_cache", value_cache)
        if v_shape != (num_blocks, block_size, hkv, Dk):
            raise ValueError(f"value_cache is {list(v_shape)} as [num_blocks, block_size, Hkv, D], key_cache "
                             f"{[num_blocks, block_size, hkv, Dk]}")
        if len(k_strides) != len(v_strides):
            raise ValueError("key_cache and value_cache must both be 4-D or both 6-D views")
        _dtype("key_cache", key_cache, tuple(_DTYPE_CODE))
        if value_cache.dtype != key_cache.dtype:
            raise TypeError(f"value_cache dtype {value_cache.dtype} must match key_cache dtype {key_cache.dtype}")
        if hkv <= 0 or H % hkv:
            raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({hkv})")
        _dtype("block_table", block_table, (torch.int32,))
        if block_table.dim() != 2 or block_table.shape[0] != R:
            raise ValueError(f"block_table must have shape [R={R}, max_blocks], got {list(block_table.shape)}")
        max_blocks = block_table.shape[1]
        _dtype("dense_ranges", dense_ranges, (torch.int32,))
        _shape("dense_ranges", dense_ranges, (R, 2, 2))
        _shape("out", out, (R, H, D))
        if out.dtype != query.dtype:
            raise TypeError(f"out dtype {out.dtype} must match query dtype {query.dtype}")
        if projection is not None:
            projection = _check_projection(projection, D, K, L)
        # The O(n) value scan of the ranges; the backend's hot path skips it (check_values=False)
        # because it built the ranges and block table itself.
        if check_values and R:
            # Dense ranges must be ordered, inside the block table, and map to existing blocks.
            _check_dense_ranges(dense_ranges, block_table, max_blocks, block_size, num_blocks)
        self.R, self.H, self.D, self.hkv, self.K, self.L, self.L_read = R, H, D, hkv, K, L, L_read
        # What the native step reads, alive as long as the step: it holds their pointers.
        self.block_table, self.dense_ranges = block_table.contiguous(), dense_ranges.contiguous()
        self.projection = projection
        self._qshape, self._qdtype = query.shape, query.dtype
        # each view's own shape and strides (a tiled cache's K and V views tile differently)
        self._caches = ((key_cache.shape, key_cache.stride()), (value_cache.shape, value_cache.stride()))
        self._cache_dtype = key_cache.dtype
        # An output the kernel writes directly: bf16 / fp32 in place, anything else through fp32.
        self._odtype = out.dtype if out.dtype in _OUT_CODE else torch.float32
        self._c = _C.DecodeStep(R, H, hkv, D, K, L, L_read, _DTYPE_CODE[key_cache.dtype], _Q_CODE[query.dtype],
                                0 if projection is None else projection.data_ptr(), k_strides, v_strides,
                                self.block_table.data_ptr(), max_blocks, block_size, self.dense_ranges.data_ptr(),
                                _OUT_CODE[self._odtype], bool(force_scalar), nt)

    def serves(self, query, key_cache, value_cache, out, block_table, dense_ranges, projection, K: int, L: int,
               L_read: int | None = None) -> bool:
        """Whether a layer with these inputs can run on this step: the same block table, dense
        ranges and projection objects the step reads (so never one it could only read through a copy
        it made), the same (K, L, L_read), and a query, output and caches of the step's geometry
        (each checked as :meth:`attend` checks it, so a caller that asked may pass ``served=True``
        there). Identity, not equality, for what the step holds: an engine's next step brings new
        tensors, and the step holds these, so their ids cannot be reused while it lives."""
        if not (block_table is self.block_table and dense_ranges is self.dense_ranges
                and projection is self.projection and K == self.K and L == self.L
                and (L if L_read is None else L_read) == self.L_read):
            return False
        return self._layer_fits(query, key_cache, value_cache, out)

    def _layer_fits(self, query, key_cache, value_cache, out) -> bool:
        """Whether a layer's query, output and caches have the step's geometry (one comparison each)."""
        shape, dtype = self._qshape, self._qdtype
        if not (isinstance(query, torch.Tensor) and query.shape == shape and query.dtype is dtype and query.is_cpu
                and isinstance(out, torch.Tensor) and out.shape == shape and out.dtype is dtype and out.is_cpu):
            return False
        dtype = self._cache_dtype
        for t, (shape, stride) in zip((key_cache, value_cache), self._caches):
            if not (isinstance(t, torch.Tensor) and t.shape == shape and t.stride() == stride and t.dtype is dtype
                    and t.is_cpu):
                return False
        return True

    def attend(self, query, centres, segments, key_cache, value_cache, out, *, scale: float, lse=None,
               sampled_counts=None, served: bool = False) -> int:
        """One layer's decode, hashing its queries with the step's projection: ``centres`` holds
        each request's float32 centre ``[Hkv, D]``, or None for a request with no segments (served
        exactly). Writes ``out`` (and ``lse``, ``sampled_counts``); returns the sampled keys summed
        over requests and heads. ``served``: :meth:`serves` said yes to these very ``query``,
        caches and ``out`` (or the step was just made from them), so their checks are not made
        twice (the engine's path: a sparse layer's Python costs in the engine, cold between layers)."""
        if self.projection is None:
            raise ValueError("this DecodeStep was made without a projection: call attend_codes with the query codes")
        if not isinstance(centres, (list, tuple)):
            raise TypeError(f"centres must be a list of R float32 [Hkv, D] tensors or None, got "
                            f"{type(centres).__name__}")
        if len(centres) != self.R:
            raise ValueError(f"centres must have R={self.R} entries, got {len(centres)}")
        shape = (self.hkv, self.D)
        ptrs = []
        for r, c in enumerate(centres):
            if c is None:
                ptrs.append(0)
                continue
            if not (isinstance(c, torch.Tensor) and c.dtype is torch.float32 and c.shape == shape and c.is_cpu
                    and c.is_contiguous()):
                _tensor(f"centres[{r}]", c)
                _dtype(f"centres[{r}]", c, (torch.float32,))
                _shape(f"centres[{r}]", c, shape)
                raise ValueError(f"centres[{r}] must be contiguous")
            ptrs.append(c.data_ptr())
        return self._run(query, 0, 0, ptrs, segments, key_cache, value_cache, out, scale, lse, sampled_counts,
                         served)

    def attend_codes(self, query, query_codes, query_dot_centre, segments, key_cache, value_cache, out, *,
                     scale: float, lse=None, sampled_counts=None, check_values: bool = True) -> int:
        """One layer's decode with the query codes ``[R, H, L]`` int32 and q . c ``[R, H]`` float32
        given (hashed elsewhere); otherwise as :meth:`attend`."""
        _tensor("query_codes", query_codes)
        _tensor("query_dot_centre", query_dot_centre)
        _dtype("query_codes", query_codes, (torch.int32,))
        _dtype("query_dot_centre", query_dot_centre, (torch.float32,))
        _shape("query_codes", query_codes, (self.R, self.H, self.L))
        _shape("query_dot_centre", query_dot_centre, (self.R, self.H))
        if check_values and query_codes.numel() and (int(query_codes.min()) < 0
                                                    or int(query_codes.max()) >= (1 << self.K)):
            raise ValueError(f"query_codes must lie in [0, 2^K={1 << self.K})")
        qc, qdc = query_codes.contiguous(), query_dot_centre.contiguous()
        return self._run(query, qc.data_ptr(), qdc.data_ptr(), [], segments, key_cache, value_cache, out, scale, lse,
                         sampled_counts)

    def _run(self, query, qc_ptr, qdc_ptr, centre_ptrs, segments, key_cache, value_cache, out, scale, lse,
             sampled_counts, served: bool = False) -> int:
        if not served:
            self._check_layer_tensors(query, key_cache, value_cache, out)
        _check_optional_out("lse", lse, torch.float32, (self.R, self.H))
        _check_optional_out("sampled_counts", sampled_counts, torch.int64, (self.R, self.H))
        if not isinstance(segments, (list, tuple)) or len(segments) != self.R:
            raise ValueError(f"segments must be a list of R={self.R} lists of Segment")
        try:  # the native call checks each segment's (Hkv, D, K, L, dtype)
            seg_c = [[s._c for s in segs] for segs in segments]
        except (AttributeError, TypeError):
            _check_segment_lists(segments)
            raise
        if not self.R:
            return 0
        # The query goes in, and a bf16 / fp32 output comes out, in its own dtype: no conversion pass.
        q = query.contiguous()
        direct = out.dtype is self._odtype and out.is_contiguous()
        o = out if direct else torch.empty(self._qshape, dtype=self._odtype)
        sampled = self._c.run(float(scale), q.data_ptr(), qc_ptr, qdc_ptr, centre_ptrs, seg_c, key_cache.data_ptr(),
                              value_cache.data_ptr(), o.data_ptr(), 0 if lse is None else lse.data_ptr(),
                              0 if sampled_counts is None else sampled_counts.data_ptr())
        if not direct:
            out.copy_(o)
        return sampled

    def _check_layer_tensors(self, query, key_cache, value_cache, out) -> None:
        """A layer's own tensors, against the step (``_layer_fits``); the precise message only when
        they do not fit: the first tensor that does not, and why."""
        if self._layer_fits(query, key_cache, value_cache, out):
            return
        for name, t in (("query", query), ("out", out)):
            _tensor(name, t)
            _dtype(name, t, (self._qdtype,))
            if t.shape != self._qshape:
                raise ValueError(f"{name} must have the step's shape {list(self._qshape)}, got {list(t.shape)}")
        dtype = self._cache_dtype
        for name, t, (shape, stride) in zip(("key_cache", "value_cache"), (key_cache, value_cache), self._caches):
            _tensor(name, t)
            if t.shape != shape or t.stride() != stride or t.dtype is not dtype:
                raise ValueError(f"{name} must match the step's cache: shape {list(shape)}, strides {stride}, "
                                 f"dtype {dtype}; got {list(t.shape)}, {t.stride()}, {t.dtype}")


def _check_segment_lists(segments) -> None:
    """Why ``segments`` is not R lists of Segment: the message for the fast path's failure."""
    for r, segs in enumerate(segments):
        if not isinstance(segs, (list, tuple)):
            raise TypeError(f"segments[{r}] must be a list of Segment, got {type(segs).__name__}")
        for s in segs:
            if not isinstance(s, Segment):
                raise TypeError(f"segments[{r}] holds a {type(s).__name__}, not a Segment")


def sparse_decode_attention(query, query_codes, query_dot_centre, segments, key_cache, value_cache, *,
                            block_table, dense_ranges, scale: float, K: int, L: int, out, lse=None,
                            sampled_counts=None, force_scalar: bool = False, check_values: bool = True,
                            num_threads: int | None = None, L_read: int | None = None) -> int:
    """MagicPIG decode attention for R requests (one query token each), with the query codes
    ``[R, H, L]`` int32 and q . c ``[R, H]`` float32 given; writes ``out`` (and ``lse``,
    ``sampled_counts``) and returns the sampled keys summed over requests and heads.  See the
    module docs of the package README for the estimator.

    Everything after ``value_cache`` is keyword-only, so each call names its tensors, scalars and
    outputs rather than relying on the order of a dozen similar arguments.  The result does not
    depend on ``num_threads`` (bit for bit).

    ``L_read`` (2..L, None: L) reads only the segments' first ``L_read`` tables: keys colliding in
    >= 2 of them are sampled, weighted for (K, L_read). That equals segments built with L_read
    tables from the projection's first K * L_read columns (budget mode steers its fraction so).

    A :class:`DecodeStep` made and run once."""
    step = DecodeStep(query=query, key_cache=key_cache, value_cache=value_cache, out=out, block_table=block_table,
                      dense_ranges=dense_ranges, K=K, L=L, L_read=L_read, check_values=check_values,
                      force_scalar=force_scalar, num_threads=num_threads)
    return step.attend_codes(query, query_codes, query_dot_centre, segments, key_cache, value_cache, out, scale=scale,
                             lse=lse, sampled_counts=sampled_counts, check_values=check_values)


def magicpig_decode_attention(query, projection, centres, segments, key_cache, value_cache, *, block_table,
                              dense_ranges, scale: float, K: int, L: int, out, lse=None, sampled_counts=None,
                              force_scalar: bool = False, check_values: bool = True,
                              num_threads: int | None = None, L_read: int | None = None) -> int:
    """As :func:`sparse_decode_attention`, in one native call that also hashes the queries (with
    ``projection [D, K*L]``, the arithmetic of the segment build) and computes q . c: ``centres`` is a
    list of R entries, each request's float32 centre ``[Hkv, D]``, or None for a request with no
    segments (served exactly). Returns the sampled keys summed over requests and heads. ``L_read``:
    as there. A :class:`DecodeStep` made and run once."""
    _tensor("projection", projection)  # required here (a DecodeStep may be made without one)
    step = DecodeStep(query=query, key_cache=key_cache, value_cache=value_cache, out=out, block_table=block_table,
                      dense_ranges=dense_ranges, K=K, L=L, projection=projection, L_read=L_read,
                      check_values=check_values, force_scalar=force_scalar, num_threads=num_threads)
    return step.attend(query, centres, segments, key_cache, value_cache, out, scale=scale, lse=lse,
                       sampled_counts=sampled_counts)


def _cache_axes(name, view) -> tuple[tuple[int, int, int, int], list[int]]:
    """A cache view's logical shape ``(num_blocks, block_size, Hkv, D)`` and the strides the native
    call reads: a 4-D view's own, or for a 6-D one (``[blocks, slots / a, a, Hkv, D / b, b]``, a
    tiled layout such as vLLM's AMX cache) the inner strides, then the tiles (a, the stride of a
    slot tile, b, the stride of an element tile)."""
    if view.dim() == 4:
        return tuple(view.shape), list(view.stride())
    if view.dim() == 6:
        nb, t1, t2, hkv, d1, d2 = view.shape
        sb, st1, st2, sh, sd1, sd2 = view.stride()
        return (nb, t1 * t2, hkv, d1 * d2), [sb, st2, sh, sd2, t2, st1, d2, sd1]
    raise ValueError(f"{name} must be a 4-D view [num_blocks, block_size, Hkv, D] or a 6-D tiled one "
                     f"[num_blocks, block_size / a, a, Hkv, D / b, b], got {list(view.shape)}")


def _check_dense_ranges(dense_ranges, block_table, max_blocks, block_size, num_blocks) -> None:
    rng = dense_ranges.to(torch.int64)
    lo, hi = rng[..., 0], rng[..., 1]
    if bool((lo < 0).any()) or bool((hi < lo).any()):
        raise ValueError("dense_ranges must be half-open ranges [a, b) with 0 <= a <= b")
    if bool((hi > max_blocks * block_size).any()):
        raise ValueError(f"dense_ranges reach past the block table ({max_blocks} blocks x {block_size} tokens)")
    nonempty = hi > lo
    if bool(nonempty.any()):
        idx = torch.arange(max_blocks).view(1, 1, -1)
        used = (nonempty.unsqueeze(-1) & (idx >= (lo // block_size).unsqueeze(-1))
                & (idx <= ((hi - 1).clamp(min=0) // block_size).unsqueeze(-1))).any(dim=1)
        ids = block_table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise ValueError(f"block_table holds block ids outside [0, {num_blocks}) for dense tokens")

