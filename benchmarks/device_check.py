"""Device check for the split MAGICPIG decode (``../shared/docs/gpu-path.md`` section 3, "Device script").

Run it on a machine with a GPU, torch and the built extension but no vLLM (it cannot be installed there):

    python benchmarks/device_check.py --out benchmarks/results/            # CUDA (H200: estimated 1-3 min)
    python benchmarks/device_check.py --device cpu --small --out /tmp/x    # CPU smoke, ~10-20 s on 2 cores

It imports only torch and the vLLM-free modules of the plugin (``kernel``, ``device_ops``' pure torch functions,
``kv_layout``). Two pieces of the real CUDA path live in vLLM and are replaced here by torch STAND-INS, named as
such wherever they are used:

* ``paged_attention_with_lse_standin``: FLASH_ATTN's paged decode with ``return_softmax_lse=True`` (the exact
  part: sinks, the tail, or the whole context). Its timings are those of plain torch ops, not of FA.
* ``merge_attn_states_standin``: vLLM's ``merge_attn_states`` (the same math as its torch fallback).

Sections: env (versions, the OpenMP runtime, threads), mirror (cache blocks -> pinned host memory on a side
stream), host_mirror (the plugin's own HostMirror and copy engine), hash (device codes vs the C++ kernel's),
merge (LSE merge == exact), decode (one layer of the split decode vs the single-call CPU kernel). Every gate
prints PASS/FAIL; the exit status is 1 if any gate failed. It writes ``device_check_<device>.md`` and ``.json``
to ``--out``. Every figure in them was measured in this run on the device named in their header; on
``--device cpu`` the "device" is the CPU and no GPU figure exists.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_magicpig import device_ops, kernel  # noqa: E402
from vllm_magicpig.kv_layout import CpuVecLayout, FlashLayout, KVViews, gather  # noqa: E402

# The plugin's defaults (config.py): paper LSH budget, sinks, local window; the largest segment. No
# indexing step (segment_tokens): the check plans first decodes only, covered to the prompt's last full block.
K_BITS, L_TABLES, SINK_TOKENS, LOCAL_WINDOW = 10, 150, 4, 64
MAX_SEG = kernel.MAX_SEGMENT_TOKENS
BLOCK = 16  # vLLM's default CUDA block size (FLASH_ATTN takes multiples of 16)
SEED = 0
# A differing code bit is a float tie when its float64 projection is within this fraction of sum_d |x_d w_d|:
# each side's float32 dot product of D=128 terms is within D * 2^-24 of that sum of the exact value (whatever
# the summation order), so the two can disagree in sign only inside twice that.
TIE_TOL = 2 * 128 * 2.0**-24

# ============================================================================ config


def make_config(small: bool) -> dict:
    if small:  # CPU smoke: the same code paths on shapes a 2-core machine runs in seconds
        # Segments of at most 1024 tokens, so a 2048-token request has two, as a 96K one has three of 32K.
        return dict(mirror_tokens=[512, 4096], mirror_hkv=2, hash_rows=16384, merge_keys=1024,
                    decode_n=[2048], H=8, Hkv=2, R=[1, 4], reps=2, env_rows=4096, max_segment=1024)
    return dict(mirror_tokens=[512, 32768, 98304], mirror_hkv=8, hash_rows=786432, merge_keys=8192,
                decode_n=[32768, 98304], H=32, Hkv=8, R=[1, 4], reps=5, env_rows=32768, max_segment=MAX_SEG)


# ============================================================================ helpers


class Run:
    """Collects the results, the gates and the report lines of one run."""

    def __init__(self, device: torch.device, small: bool) -> None:
        self.device, self.small = device, small
        self.results: dict = {"device": device.type, "small": small}
        self.gates: list[dict] = []
        self.md: list[str] = []

    def gate(self, name: str, passed: bool, detail: str) -> bool:
        passed = bool(passed)
        self.gates.append({"name": name, "passed": passed, "detail": detail})
        print(f"{'PASS' if passed else 'FAIL'} {name}: {detail}", flush=True)
        self.md.append(f"- **{'PASS' if passed else 'FAIL'}** `{name}`: {detail}")
        return passed

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.md.append(text)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of fn() with the device drained before and after each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the host."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def host_buffer(shape, dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for device copies: pinned on CUDA (async DMA), plain memory on the CPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def host_threads() -> int:
    """Cores this process may run on (os.cpu_count() counts CPUs outside the affinity mask too)."""
    return len(os.sched_getaffinity(0))


def last_team_size() -> int | None:
    """The team size of the last sparse_decode call, if the extension records it."""
    fn = getattr(kernel, "last_team_size", None) or getattr(kernel._C, "last_team_size", None)
    return int(fn()) if fn is not None else None


def simhash_projection(head_dim: int, K: int, L: int, seed: int) -> torch.Tensor:
    """A seeded Gaussian projection [D, K*L], made as ``runtime.simhash_projection`` makes it (a copy: the
    runtime module pulls in the config, index and decode layers, which this script keeps out of its imports so
    that nothing can bring vLLM in). Any fixed projection serves the checks; device and CPU share this one."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(head_dim, K * L, generator=g, dtype=torch.float32).bfloat16().float()


# ============================================================================ stand-ins for vLLM


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Exact attention of one token's heads q [H, D] over k, v [n, Hkv, D] (GQA), in float32 on their device.
    Returns (out [H, D] float32, natural-log lse [H] float32); zeros and -inf when n == 0."""
    H, D = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if n == 0:
        return (torch.zeros(H, D, dtype=torch.float32, device=q.device),
                torch.full((H,), float("-inf"), device=q.device))
    qf = q.float().view(hkv, H // hkv, D)
    logits = torch.matmul(qf, k.float().permute(1, 2, 0)) * scale  # [Hkv, g, n]
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse.unsqueeze(-1))
    out = torch.matmul(p, v.float().permute(1, 0, 2))  # [Hkv, g, D]
    return out.reshape(H, D), lse.reshape(H)


def paged_attention_with_lse_standin(query: torch.Tensor, kv: KVViews, block_table: torch.Tensor,
                                     lens: list[int], scale: float):
    """STAND-IN for FLASH_ATTN's paged decode (``flash_attn_varlen_func(..., block_table=, seqused_k=,
    return_softmax_lse=True)``): request r's query attends the first ``lens[r]`` tokens of its block-table
    row, in float32 torch on the cache's device. Returns (out [R, H, D] in the query dtype as FA returns it,
    lse [H, R] float32, natural log)."""
    R, H, D = query.shape
    bs = kv.block_size
    out = torch.empty(R, H, D, dtype=query.dtype, device=query.device)
    lse = torch.empty(H, R, dtype=torch.float32, device=query.device)
    for r in range(R):
        n = int(lens[r])
        blocks = block_table[r, : -(-n // bs)].long()
        k = kv.key.index_select(0, blocks).reshape(-1, kv.key.shape[2], D)[:n]
        v = kv.value.index_select(0, blocks).reshape(-1, kv.value.shape[2], D)[:n]
        o, s = attention_with_lse(query[r], k, v, scale)
        out[r], lse[:, r] = o.to(query.dtype), s
    return out, lse


def merge_attn_states_standin(output: torch.Tensor, a_out: torch.Tensor, a_lse: torch.Tensor,
                              b_out: torch.Tensor, b_lse: torch.Tensor, output_lse: torch.Tensor | None = None):
    """STAND-IN for vLLM's ``merge_attn_states`` (v1/attention/ops/merge_attn_states.py; a CUDA kernel there):
    the math of its torch fallback ``_merge_attn_states_torch``. out [R, H, D], lse [H, R] natural log; +inf
    reads as -inf, an empty side (-inf) contributes nothing, both empty gives zeros."""
    def clean(x):
        return torch.where(torch.isinf(x) & (x > 0), torch.full_like(x, float("-inf")), x).float()

    a_lse, b_lse = clean(a_lse), clean(b_lse)
    m = torch.maximum(a_lse, b_lse)
    both_empty = m == float("-inf")
    m_safe = torch.where(both_empty, torch.zeros_like(m), m)  # exp(-inf - -inf) would be NaN
    a_se, b_se = torch.exp(a_lse - m_safe), torch.exp(b_lse - m_safe)
    total = a_se + b_se
    denom = torch.where(both_empty, torch.ones_like(total), total)
    a_w = (a_se / denom).t().unsqueeze(-1)
    b_w = (b_se / denom).t().unsqueeze(-1)
    merged = a_out.float() * a_w + b_out.float() * b_w
    merged.masked_fill_(both_empty.t().unsqueeze(-1), 0.0)
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.where(both_empty, m, torch.log(denom) + m_safe))


# ============================================================================ env


def section_env(run: Run, cfg: dict) -> None:
    dev = run.device
    run.line("\n## env\n")
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (no GPU used)",
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "affinity": host_threads(),
        "isa": kernel.active_isa(),
        "torch_threads": torch.get_num_threads(),
    }
    # Which OpenMP runtime(s) the process maps: one libgomp means the extension shares torch's, so
    # torch.set_num_threads(1) (what vLLM's CUDA worker does) shrinks the kernel's default team too.
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1] and "/" in line})
    env["omp_libraries"] = libs
    env["gomp_libraries"] = [p for p in libs if "gomp" in p]
    threads = host_threads()
    torch_threads = torch.get_num_threads()
    env["max_threads_before"] = kernel.max_threads()
    torch.set_num_threads(1)
    env["max_threads_after_set_num_threads_1"] = kernel.max_threads()
    try:
        gen = torch.Generator().manual_seed(SEED)
        x = torch.randn(cfg["env_rows"], 128, generator=gen)
        w = simhash_projection(128, K_BITS, L_TABLES, SEED)
        t_default = timed(lambda: kernel.hash_codes(x, w, K_BITS, L_TABLES), torch.device("cpu"), 2)
        t_threads = timed(lambda: kernel.hash_codes(x, w, K_BITS, L_TABLES, num_threads=threads),
                          torch.device("cpu"), 2)
        # The team-size probe: a tiny sparse_decode with dense tokens only (units exist, nothing sampled).
        q = torch.randn(1, 4, 128, generator=gen).to(torch.bfloat16)
        cache = torch.randn(*CpuVecLayout.cache_shape(2, BLOCK, 1, 128), generator=gen).to(torch.bfloat16)
        views = CpuVecLayout().views(cache)
        args = dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32),
                    dense_ranges=torch.tensor([[[0, 2 * BLOCK], [2 * BLOCK, 2 * BLOCK]]], dtype=torch.int32),
                    scale=128 ** -0.5, K=K_BITS, L=L_TABLES, out=torch.empty(1, 4, 128, dtype=torch.bfloat16))
        codes, qdc = torch.zeros(1, 4, L_TABLES, dtype=torch.int32), torch.zeros(1, 4)
        kernel.sparse_decode_attention(q, codes, qdc, [[]], views.key, views.value, **args)
        team_default = last_team_size()
        kernel.sparse_decode_attention(q, codes, qdc, [[]], views.key, views.value, num_threads=threads, **args)
        team_threads = last_team_size()
    finally:
        torch.set_num_threads(torch_threads)
    env.update(hash_rows=cfg["env_rows"], hash_s_num_threads_none=t_default, hash_s_num_threads_all=t_threads,
               speedup_num_threads=t_default / t_threads, team_num_threads_none=team_default,
               team_num_threads_all=team_threads, threads_requested=threads)
    run.results["env"] = env
    for k, v in env.items():
        run.line(f"- {k}: {v}")
    run.line(f"- after torch.set_num_threads(1): hash_codes of {cfg['env_rows']} rows takes {ms(t_default)} with "
             f"num_threads=None and {ms(t_threads)} with num_threads={threads} ({t_default / t_threads:.2f}x)")
    if team_threads is None:
        run.line("- the extension does not record team sizes (no last_team_size): team check skipped")
    else:
        run.gate("env.num_threads_team", team_threads == threads,
                 f"after torch.set_num_threads(1), sparse_decode with num_threads={threads} ran a team of "
                 f"{team_threads} (num_threads=None: {team_default})")


# ============================================================================ mirror


def mirror_case(run: Run, cfg: dict, cache: torch.Tensor, kv: KVViews, idx: torch.Tensor, a: torch.Tensor) -> dict:
    """Gather the blocks ``idx`` head-major, copy them to pageable (and on CUDA pinned, side-stream) host memory,
    time it, time it against a main-stream matmul, and check the bytes."""
    dev, cuda = run.device, run.device.type == "cuda"
    hkv, D = cache.shape[1], cache.shape[3] // 2
    n = idx.numel() * BLOCK
    nbytes = n * hkv * 2 * D * 2

    def gather_head_major():
        # [Hkv, nb, bs, 2D] in one kernel: index_select on the block dim of the head-major view.
        return torch.index_select(cache.transpose(0, 1), 1, idx).reshape(hkv, n, 2 * D)

    src = gather_head_major()
    row = {"tokens": n, "bytes": nbytes, "gather_s": timed(gather_head_major, dev, cfg["reps"])}
    pageable = torch.empty(hkv, n, 2 * D, dtype=torch.bfloat16)
    row["pageable_GBps"] = nbytes / timed(lambda: pageable.copy_(src), dev, cfg["reps"]) / 1e9
    # The reference rows, by another route: the runtime's gather (advanced indexing) of K and V.
    blocks = tuple(int(b) for b in idx.tolist())
    ref_k = gather(kv.key, blocks, 0, n).cpu().permute(1, 0, 2)
    ref_v = gather(kv.value, blocks, 0, n).cpu().permute(1, 0, 2)

    def same(host):
        return (torch.equal(host[..., :D].view(torch.int16), ref_k.view(torch.int16))
                and torch.equal(host[..., D:].view(torch.int16), ref_v.view(torch.int16)))

    ok = same(pageable)
    if cuda:
        pinned = host_buffer((hkv, n, 2 * D), torch.bfloat16, dev)
        side, main = torch.cuda.Stream(dev), torch.cuda.current_stream(dev)
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("t0", "c0", "c1", "m1")}

        def copy_on_side():
            side.wait_stream(main)  # the gather (main stream) must finish before the copy reads it
            with torch.cuda.stream(side):
                ev["c0"].record(side)
                pinned.copy_(src, non_blocking=True)
                ev["c1"].record(side)
            src.record_stream(side)  # src is read on the side stream: keep the allocator off it

        t_pin = timed(copy_on_side, dev, cfg["reps"])
        ok = ok and same(pinned)
        # Overlap: the matmul alone, the copy alone, then both, with events for the timeline.
        reps_mm = max(1, round(t_pin / timed(lambda: a @ a, dev, cfg["reps"])))

        def matmuls():
            for _ in range(reps_mm):
                a @ a

        def both():
            ev["t0"].record(main)
            copy_on_side()  # issued first: a pinned copy returns at once, so the matmuls queue behind it
            matmuls()
            ev["m1"].record(main)

        t_mm = timed(matmuls, dev, cfg["reps"])
        t_both = timed(both, dev, cfg["reps"])
        overlap = (t_mm + t_pin - t_both) / min(t_mm, t_pin)  # 1: fully hidden, 0: serial
        row.update(pinned_GBps=nbytes / t_pin / 1e9, pinned_copy_s=t_pin, matmul_s=t_mm, matmul_reps=reps_mm,
                   both_s=t_both, overlap_fraction=overlap, overlapped=overlap > 0.5,
                   timeline_ms={"copy_start": ev["t0"].elapsed_time(ev["c0"]),
                                "copy_end": ev["t0"].elapsed_time(ev["c1"]),
                                "matmul_end": ev["t0"].elapsed_time(ev["m1"])})
    run.gate(f"mirror.bytes_equal[{n}]", ok,
             f"{n} tokens ({nbytes / 2**20:.1f} MiB) copied to host equal the cache rows (K and V)")
    return row


def section_mirror(run: Run, cfg: dict) -> None:
    """A segment's blocks, gathered head-major from a FLASH_ATTN cache on the device, copied to host memory
    on a side stream while the main stream computes (the mirror of gpu-path.md, "Mirror and index")."""
    dev, cuda = run.device, run.device.type == "cuda"
    run.line("\n## mirror\n")
    hkv, D = cfg["mirror_hkv"], 128
    n_max = max(cfg["mirror_tokens"])
    num_blocks = 2 * n_max // BLOCK
    gen = torch.Generator(device=dev).manual_seed(SEED)
    # LBNHC, the layout MAGICPIG declares: physically [num_blocks, block_size, Hkv, 2D] (a block is one
    # contiguous run); FLASH_ATTN sees the logical [num_blocks, Hkv, block_size, 2D] permutation of it.
    phys = torch.randn(num_blocks, BLOCK, hkv, 2 * D, generator=gen, device=dev).to(torch.bfloat16)
    cache = phys.permute(0, 2, 1, 3)
    kv = FlashLayout().views(cache)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    # The main-stream work to overlap with: a bf16 matmul, repeated to last about as long as each copy.
    a = torch.randn(4096, 4096, generator=gen, device=dev).to(torch.bfloat16)
    rows = [mirror_case(run, cfg, cache, kv, perm[: n // BLOCK], a) for n in cfg["mirror_tokens"]]
    run.results["mirror"] = rows
    if cuda:
        run.line("")
        run.line("| tokens | MiB | gather | pageable GB/s | pinned GB/s (side stream) | matmul alone | copy alone | "
                 "both | overlap | timeline (copy start/end, matmul end) |")
        run.line("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            tl = r["timeline_ms"]
            run.line(f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {ms(r['gather_s'])} | {r['pageable_GBps']:.1f} | "
                     f"{r['pinned_GBps']:.1f} | {ms(r['matmul_s'])} | {ms(r['pinned_copy_s'])} | {ms(r['both_s'])} "
                     f"| {r['overlap_fraction']:.2f} ({'yes' if r['overlapped'] else 'no'}) | "
                     f"{tl['copy_start']:.2f}/{tl['copy_end']:.2f}/{tl['matmul_end']:.2f} ms |")
    else:
        run.line("Device is the CPU: the \"copy\" is a host memcpy (no pinned memory, no streams, no overlap).")
        run.line("")
        run.line("| tokens | MiB | gather | memcpy GB/s |")
        run.line("|---|---|---|---|")
        for r in rows:
            run.line(f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {ms(r['gather_s'])} | {r['pageable_GBps']:.2f} |")


def section_host_mirror(run: Run, cfg: dict) -> None:
    """The production host mirror (``vllm_magicpig/host_mirror.py``) with this device's copy engine: a prompt's
    completed blocks are enqueued for copy in one layer's forward, the call returns before the copy ends (CUDA),
    and the staged rows equal the cache's."""
    from vllm_magicpig.host_mirror import CudaCopyEngine, HostMirror, SyncCopyEngine
    from vllm_magicpig.stats import Stats

    dev, cuda = run.device, run.device.type == "cuda"
    run.line("\n## host_mirror\n")
    hkv, D = cfg["mirror_hkv"], 128
    n = max(cfg["mirror_tokens"])
    num_blocks = 2 * n // BLOCK
    gen = torch.Generator(device=dev).manual_seed(SEED + 1)
    cache = torch.randn(num_blocks, BLOCK, hkv, 2 * D, generator=gen, device=dev).to(torch.bfloat16).permute(0, 2, 1, 3)
    kv = FlashLayout().views(cache)
    blocks = torch.randperm(num_blocks, generator=gen, device=dev)[: n // BLOCK].tolist()
    engine = CudaCopyEngine(dev) if cuda else SyncCopyEngine()
    mirror = HostMirror(engine, Stats(), max_bytes=4 * n * hkv * D * 2 * 2)
    layer = "model.layers.1.self_attn.attn"
    nbytes = 2 * n * hkv * D * 2
    timings = []
    # Twice: the first copy allocates its pinned buffers (torch's caching host allocator pins fresh memory);
    # the second, after the first's rows are released, can reuse them. The difference is the allocation.
    for attempt in ("cold", "warm"):
        sync(dev)
        mirror.begin_step(blocks, blocks)  # a prefill step that completes every block
        t0 = time.perf_counter()
        mirror.copy_layer(layer, kv)
        t_enqueue = time.perf_counter() - t0
        event = mirror._pending[blocks[-1]]
        while not event.query():
            pass
        t_done = time.perf_counter() - t0
        mirror.begin_step([], [])
        timings.append({"attempt": attempt, "enqueue_s": t_enqueue, "done_s": t_done})
        if attempt == "cold":
            got = mirror.rows(layer, tuple(blocks), 0, n)
            ok = got is not None and torch.equal(got[0], gather(kv.key, tuple(blocks), 0, n).cpu()) and torch.equal(
                got[1], gather(kv.value, tuple(blocks), 0, n).cpu())
            run.gate("host_mirror.rows_equal", ok,
                     f"{n} tokens x {hkv} KV heads staged by copy_layer equal the cache rows")
            run.gate("host_mirror.ready", mirror.ready_blocks(blocks) == len(blocks),
                     "every copied block counts as mirrored")
            del got
            mirror.release(layer, tuple(blocks))  # the segment build's release: the pinned rows are freed
    run.results["host_mirror"] = {"tokens": n, "bytes": nbytes, "enqueue_s": timings[0]["enqueue_s"],
                                  "done_s": timings[0]["done_s"], "attempts": timings}
    if cuda:
        for t in timings:
            run.line(f"- {t['attempt']}: copy_layer returned after {ms(t['enqueue_s'])}; the copy completed after "
                     f"{ms(t['done_s'])} ({nbytes / t['done_s'] / 1e9:.1f} GB/s including the gather)")
    else:
        run.line(f"Device is the CPU: copy_layer copies synchronously ({ms(timings[0]['done_s'])} cold, "
                 f"{ms(timings[1]['done_s'])} warm, for {nbytes / 2**20:.1f} MiB).")


# ============================================================================ hash


def tie_explained(x: torch.Tensor, w: torch.Tensor, codes_a: torch.Tensor, codes_b: torch.Tensor,
                  K: int) -> tuple[int, int]:
    """(mismatched codes, of which not explained by a float tie). x [N, D] float32 host rows, codes [N, L].
    A mismatch is a tie when every differing bit's float64 projection is within TIE_TOL of sum |x_d w_d|."""
    bad = (codes_a != codes_b).nonzero()
    if bad.numel() == 0:
        return 0, 0
    unexplained = 0
    xs, ls = bad[:, 0], bad[:, 1]
    wt = w.double().t()  # [K*L, D]
    for i0 in range(0, len(xs), 4096):
        xi, li = xs[i0:i0 + 4096], ls[i0:i0 + 4096]
        cols = li.unsqueeze(1) * K + torch.arange(K)  # [m, K] projection columns of each code's table
        wx = wt[cols]  # [m, K, D]
        xd = x[xi].double().unsqueeze(1)  # [m, 1, D]
        proj = (wx * xd).sum(-1)
        bound = (wx.abs() * xd.abs()).sum(-1)
        diff_bits = ((codes_a[xi, li] ^ codes_b[xi, li]).unsqueeze(1) >> torch.arange(K)) & 1
        tie = (proj.abs() <= TIE_TOL * bound) | (diff_bits == 0)
        unexplained += int((~tie.all(dim=1)).sum())
    return len(xs), unexplained


def section_hash(run: Run, cfg: dict) -> None:
    dev = run.device
    run.line("\n## hash\n")
    N, D = cfg["hash_rows"], 128
    gen = torch.Generator(device=dev).manual_seed(SEED + 1)
    # Centred-key-like rows: bf16 keys with a common offset, minus their mean, in float32 (as both sides hash).
    keys = (torch.randn(N, D, generator=gen, device=dev) + 2.0 * torch.randn(1, D, generator=gen, device=dev))
    keys = keys.to(torch.bfloat16).float()
    x_dev = keys - keys.mean(0, keepdim=True)
    x = x_dev.cpu()
    w = simhash_projection(D, K_BITS, L_TABLES, SEED)
    w_dev = w.to(dev)
    threads = host_threads()
    t0 = time.perf_counter()
    cpu_codes = kernel.hash_codes(x, w, K_BITS, L_TABLES, num_threads=threads)
    t_cpu = time.perf_counter() - t0  # one call: at 786K rows it is seconds, no need to repeat
    res = {"rows": N, "cpu_kernel_s": t_cpu, "threads": threads}
    for tf32 in (False, True):
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
        elif tf32:
            continue  # no TF32 on the CPU
        t_dev = timed(lambda: device_ops.hash_codes(x_dev, w_dev, K_BITS, L_TABLES), dev, cfg["reps"])
        dev_codes = device_ops.hash_codes(x_dev, w_dev, K_BITS, L_TABLES).cpu()
        if tf32:  # informational: TF32 rounding is far beyond float32 ties, so only count the mismatches
            mism, unexplained = int((dev_codes != cpu_codes).sum()), None
        else:
            mism, unexplained = tie_explained(x, w, dev_codes, cpu_codes, K_BITS)
        frac = mism / cpu_codes.numel()
        tag = "tf32_on" if tf32 else "tf32_off"
        res[tag] = {"device_s": t_dev, "mismatched_codes": mism, "mismatch_fraction": frac,
                    "not_float_ties": unexplained}
        ties = "" if unexplained is None else f", {unexplained} of them beyond float ties"
        run.line(f"- {tag}: device hash of {N} rows {ms(t_dev)}; {mism} of {cpu_codes.numel()} codes differ from "
                 f"the CPU kernel ({frac:.2e}){ties}")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the rest of the run compares against float32 math
    run.line(f"- CPU kernel hash_codes ({threads} threads): {ms(t_cpu)}")
    run.results["hash"] = res
    off = res["tf32_off"]
    run.gate("hash.mismatch_tf32_off", off["mismatch_fraction"] < 1e-3,
             f"device codes vs kernel.hash_codes differ in {off['mismatch_fraction']:.2e} of codes (< 1e-3)")


# ============================================================================ merge


def section_merge(run: Run, cfg: dict) -> None:
    """Attention over two disjoint key sets, merged by LSE, equals attention over all keys (float32)."""
    dev = run.device
    run.line("\n## merge\n")
    R, H, hkv, D, n = 4, cfg["H"], cfg["Hkv"], 128, cfg["merge_keys"]
    gen = torch.Generator(device=dev).manual_seed(SEED + 2)
    scale = D ** -0.5
    q = torch.randn(R, H, D, generator=gen, device=dev) * 2
    k = torch.randn(R, n, hkv, D, generator=gen, device=dev)
    v = torch.randn(R, n, hkv, D, generator=gen, device=dev)
    exact = torch.empty(R, H, D, device=dev)
    exact_lse = torch.empty(H, R, device=dev)
    a_out, b_out = torch.empty_like(exact), torch.empty_like(exact)
    a_lse, b_lse = torch.empty_like(exact_lse), torch.empty_like(exact_lse)
    for r in range(R):
        in_a = torch.rand(n, generator=gen, device=dev) < 0.3
        exact[r], exact_lse[:, r] = attention_with_lse(q[r], k[r], v[r], scale)
        a_out[r], a_lse[:, r] = attention_with_lse(q[r], k[r][in_a], v[r][in_a], scale)
        b_out[r], b_lse[:, r] = attention_with_lse(q[r], k[r][~in_a], v[r][~in_a], scale)
    merged, merged_lse = torch.empty_like(exact), torch.empty_like(exact_lse)
    t = timed(lambda: merge_attn_states_standin(merged, a_out, a_lse, b_out, b_lse, merged_lse), dev, cfg["reps"])
    rel = rel_err(merged, exact)
    dlse = float((merged_lse - exact_lse).abs().max())
    # The parts' logits come from matmuls of other shapes than the whole's, whose float32 sums may
    # run in other orders (blocking, thread count): at 1024 keys, lse ~10, that moved the lse by up
    # to 3e-5 (a CPU test run, 2026-12-07), where a wrong merge is off by O(1).
    run.gate("merge.disjoint_equals_exact", rel <= 1e-5 and dlse <= 1e-4,
             f"merged out rel {rel:.2e} (<= 1e-5), |lse diff| {dlse:.2e} (<= 1e-4), {n} keys, R={R}, H={H}")
    # An empty side (lse -inf; its output is garbage and must be ignored) is the identity.
    empty_lse = torch.full_like(b_lse, float("-inf"))
    ident, ident_lse = torch.empty_like(exact), torch.empty_like(exact_lse)
    merge_attn_states_standin(ident, a_out, a_lse, b_out, empty_lse, ident_lse)
    run.gate("merge.empty_side_identity", torch.equal(ident, a_out) and torch.equal(ident_lse, a_lse),
             "merging with an lse=-inf side returns the other side bit for bit (out and lse)")
    merge_attn_states_standin(ident, a_out, empty_lse, b_out, empty_lse, ident_lse)
    run.gate("merge.both_empty_zero", bool((ident == 0).all()) and bool((ident_lse == float("-inf")).all()),
             "two empty sides give zeros and lse -inf")
    run.results["merge"] = {"keys": n, "rel": rel, "lse_diff": dlse, "merge_s": t}
    run.line(f"- stand-in merge of R={R}, H={H}: {ms(t)}")


# ============================================================================ decode


def plan_request(n: int, max_segment: int) -> dict:
    """The planner's split of an n-token context, with the sinks rounded up to a whole block (gpu-path.md,
    "Dense part on the GPU"): exact [0, sink) and [covered_end, n); LSH segments over [sink, covered_end) of at
    most ``max_segment`` tokens (planner.segment_layout); the centre over [sink, centre_end) (planner._centre_for)."""
    sink = -(-SINK_TOKENS // BLOCK) * BLOCK
    # a first decode: the prompt covered to its last full block before the local window (planner.covered_end_for)
    covered_end = centre_end = ((n - LOCAL_WINDOW) // BLOCK) * BLOCK
    segs = [(max(s, sink), min(s + max_segment, covered_end)) for s in range(0, covered_end, max_segment)]
    return {"sink": sink, "covered_end": covered_end, "segments": segs, "centre_end": centre_end}


def make_decode_data(dev: torch.device, n: int, R: int, H: int, hkv: int, D: int, plan: dict, seed: int) -> dict:
    """R contexts of n tokens in one paged FLASH_ATTN cache (LBNHC, shuffled blocks), bf16. Keys: a common
    offset (which centring removes) plus noise, and 4 heavy "needle" keys per request inside the sampled range,
    which that request's queries point at (so the sampled part carries most of the attention mass)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    nb = n // BLOCK
    offset = 3.0 * torch.randn(hkv, D, generator=gen, device=dev)
    keys = offset + torch.randn(R, n, hkv, D, generator=gen, device=dev)
    values = torch.randn(R, n, hkv, D, generator=gen, device=dev)
    direction = torch.randn(R, hkv, D, generator=gen, device=dev)
    direction = direction / direction.norm(dim=-1, keepdim=True) * math.sqrt(D)
    lo, hi = plan["sink"], plan["covered_end"]
    needles = lo + torch.randperm(hi - lo, generator=gen, device=dev)[: 4 * R].view(R, 4)
    for r in range(R):
        keys[r, needles[r]] = offset + 1.2 * direction[r]
    g = H // hkv
    q = direction.repeat_interleave(g, dim=1) + 0.3 * torch.randn(R, H, D, generator=gen, device=dev)
    keys, values, q = keys.to(torch.bfloat16), values.to(torch.bfloat16), q.to(torch.bfloat16)
    num_blocks = R * nb + 8  # spare blocks hold junk that no table points at
    phys = torch.randn(num_blocks, BLOCK, hkv, 2 * D, generator=gen, device=dev).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen, device=dev)
    block_table = perm[: R * nb].view(R, nb).to(torch.int32)
    for r in range(R):
        phys[block_table[r].long()] = torch.cat([keys[r], values[r]], -1).view(nb, BLOCK, hkv, 2 * D)
    cache = phys.permute(0, 2, 1, 3)  # FLASH_ATTN's logical [num_blocks, Hkv, block_size, 2D]
    return {"keys": keys, "values": values, "q": q, "cache": cache, "kv": FlashLayout().views(cache),
            "block_table": block_table, "needles": needles}


def cpu_cache_copy(cache: torch.Tensor) -> KVViews:
    """The same cache in vLLM's CPU ("vec") layout on the host, for the single-call kernel reference. The
    relayout (K column-major per block) runs on the device, then one copy to the host."""
    nb, hkv, bs, two_d = cache.shape
    d = two_d // 2
    src = FlashLayout().views(cache)
    dst = torch.empty(CpuVecLayout.cache_shape(nb, bs, hkv, d), dtype=cache.dtype, device=cache.device)
    views = CpuVecLayout().views(dst)
    views.key.copy_(src.key)
    views.value.copy_(src.value)
    return CpuVecLayout().views(dst.cpu())


def build_segments(run: Run, data: dict, plan: dict, proj_dev: torch.Tensor, proj: torch.Tensor, R: int,
                   threads: int, n: int) -> tuple[list, torch.Tensor, dict]:
    """Segments of every request from device-hashed codes (device_ops.centred_key_codes -> D2H ->
    kernel.build_segment_from_codes); request 0's are checked against kernel.build_segment (CPU hashing)."""
    dev, kv = run.device, data["kv"]
    nb = n // BLOCK
    centres = torch.stack([data["keys"][r, plan["sink"]:plan["centre_end"]].float().mean(0) for r in range(R)])
    t = {"device_gather_hash_d2h_s": 0.0, "build_from_codes_s": 0.0, "build_segment_cpu_hash_s": 0.0}
    segments, mism, unexplained, total, from_codes_exact = [], 0, 0, 0, True
    for r in range(R):
        blocks = tuple(int(b) for b in data["block_table"][r, :nb].tolist())
        centre_h = centres[r].cpu()
        row = []
        for lo, hi in plan["segments"]:
            sync(dev)
            t0 = time.perf_counter()
            keys, values = gather(kv.key, blocks, lo, hi), gather(kv.value, blocks, lo, hi)
            codes = device_ops.centred_key_codes(keys, centres[r], proj_dev, K_BITS, L_TABLES)
            # int16 on the wire: codes < 2^K fit, half the bytes of int32 (build_segment_from_codes reads both).
            keys_h, values_h, codes_h = keys.cpu(), values.cpu(), codes.to(torch.int16).cpu()
            t1 = time.perf_counter()
            seg = kernel.build_segment_from_codes(keys_h, values_h, centre_h, codes_h, K_BITS, L_TABLES,
                                                  num_threads=threads)
            t2 = time.perf_counter()
            t["device_gather_hash_d2h_s"] += t1 - t0
            t["build_from_codes_s"] += t2 - t1
            row.append(seg)
            if r == 0:
                seg_codes = seg.codes()
                from_codes_exact = from_codes_exact and torch.equal(seg_codes, codes_h.to(torch.int32))
                t3 = time.perf_counter()
                ref = kernel.build_segment(keys_h, values_h, centre_h, proj, K_BITS, L_TABLES, num_threads=threads)
                t["build_segment_cpu_hash_s"] += time.perf_counter() - t3
                x = (keys_h.float() - centre_h).permute(1, 0, 2).reshape(-1, keys_h.shape[2])  # [Hkv*m, D]
                a = seg_codes.permute(0, 2, 1).reshape(-1, L_TABLES)  # [Hkv*m, L], rows in x's order
                b = ref.codes().permute(0, 2, 1).reshape(-1, L_TABLES)
                mi, un = tie_explained(x, proj, a, b, K_BITS)
                mism, unexplained, total = mism + mi, unexplained + un, total + a.numel()
        segments.append(row)
    run.gate(f"decode[n={n}].segment_codes_roundtrip", from_codes_exact,
             "Segment.codes() of build_segment_from_codes equals the device codes it was given")
    run.gate(f"decode[n={n}].segment_codes_vs_cpu_hash", unexplained == 0,
             f"device-hashed segment codes vs kernel.build_segment: {mism} of {total} differ "
             f"({mism / max(total, 1):.2e}), {unexplained} beyond float ties")
    t.update(mismatched_codes=mism, codes=total, not_float_ties=unexplained)
    return segments, centres, t


def section_decode(run: Run, cfg: dict) -> None:
    dev = run.device
    run.line("\n## decode\n")
    H, hkv, D = cfg["H"], cfg["Hkv"], 128
    scale = D ** -0.5
    threads = host_threads()
    proj = simhash_projection(D, K_BITS, L_TABLES, SEED)
    proj_dev = proj.to(dev)
    rows = []
    for n in cfg["decode_n"]:
        plan = plan_request(n, cfg["max_segment"])
        r_max = max(cfg["R"])
        data = make_decode_data(dev, n, r_max, H, hkv, D, plan, SEED + n)
        segments, centres, seg_t = build_segments(run, data, plan, proj_dev, proj, r_max, threads, n)
        cpu_kv = cpu_cache_copy(data["cache"])
        run.line(f"- n={n}: segments {plan['segments']} per request; per request (mean of {r_max}): device "
                 f"gather+centre+hash+D2H {ms(seg_t['device_gather_hash_d2h_s'] / r_max)}, "
                 f"kernel.build_segment_from_codes {ms(seg_t['build_from_codes_s'] / r_max)}; request 0 with CPU "
                 f"hashing (kernel.build_segment, for comparison) {ms(seg_t['build_segment_cpu_hash_s'])}")
        for R in cfg["R"]:
            rows.append(decode_case(run, cfg, data, plan, segments[:R], centres[:R], cpu_kv, proj_dev, n, R,
                                    scale, threads))
            rows[-1]["segment_build"] = seg_t
        del data, cpu_kv, segments
    run.results["decode"] = rows
    run.line("")
    run.line("Timings per layer (median of %d). \"dense\" is the torch STAND-IN for FLASH_ATTN's paged decode, "
             "\"merge\" the torch STAND-IN for vLLM's merge_attn_states: their times are plain torch ops', not the "
             "real kernels'; "
             "\"exact SDPA\" is torch SDPA over contiguous K/V, for scale." % cfg["reps"])
    run.line("")
    run.line("| n | R | hash+D2H wait | CPU kernel | dense (stand-in) | H2D+merge (stand-in) | serial sum | "
             "pipelined total | exact SDPA | pipelined step after set_num_threads(1): None / num_threads |")
    run.line("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tt = r["timings_s"]
        run.line(f"| {r['n']} | {r['R']} | {ms(tt['hash_d2h'])} | {ms(tt['cpu_kernel'])} | {ms(tt['dense'])} | "
                 f"{ms(tt['h2d_merge'])} | {ms(tt['serial_sum'])} | {ms(tt['pipelined_total'])} | "
                 f"{ms(tt['exact_sdpa'])} | {ms(tt['step_1thread_default'])} "
                 f"(team {r['team_default']}) / {ms(tt['step_1thread_num_threads'])} "
                 f"(team {r['team_num_threads']}) |")
    run.line("")
    run.line("| n | R | split vs single-call rel | lse diff | split vs exact rel | single-call vs exact rel | "
             "sampled fraction | all-dense vs exact rel |")
    run.line("|---|---|---|---|---|---|---|---|")
    for r in rows:
        run.line(f"| {r['n']} | {r['R']} | {r['split_vs_single_rel']:.2e} | {r['lse_diff']:.2e} | "
                 f"{r['split_vs_exact_rel']:.3e} | {r['single_vs_exact_rel']:.3e} | {r['sampled_fraction']:.4f} | "
                 f"{r['all_dense_vs_exact_rel']:.2e} |")


def time_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, dev: torch.device,
              reps: int) -> float:
    """Exact decode attention for scale: torch SDPA over contiguous K/V [R, Hkv, n, D] (not FA's paged kernel;
    the layout copy is not timed)."""
    k, v = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    qs = q.unsqueeze(2)  # [R, H, 1, D]
    return timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True),
                 dev, reps)


def decode_case(run: Run, cfg: dict, data: dict, plan: dict, segments: list, centres: torch.Tensor,
                cpu_kv: KVViews, proj_dev: torch.Tensor, n: int, R: int, scale: float, threads: int) -> dict:
    dev, cuda = run.device, run.device.type == "cuda"
    H, D = data["q"].shape[1], data["q"].shape[2]
    hkv = data["kv"].key.shape[2]
    q = data["q"][:R].contiguous()
    kv = data["kv"]
    bt_host = data["block_table"][:R].cpu()
    sink, covered_end = plan["sink"], plan["covered_end"]
    dense_ranges = torch.tensor([[[0, sink], [covered_end, n]]] * R, dtype=torch.int32)
    # The virtual block table of the exact part is made once per step (in the metadata builder), not per layer.
    table, lens = device_ops.dense_block_tables(bt_host, [n] * R, dense_ranges, BLOCK)
    table_dev, lens_l = table.to(dev), lens.tolist()
    q_pin = host_buffer((R, H, D), torch.bfloat16, dev)
    codes_pin = host_buffer((R, H, L_TABLES), torch.int32, dev)
    qdc_pin = host_buffer((R, H), torch.float32, dev)
    out_pin = host_buffer((R, H, D), torch.bfloat16, dev)
    lse_pin = host_buffer((R, H), torch.float32, dev)
    counts = torch.zeros(R, H, dtype=torch.int64)
    # Nothing dense on the host: a one-block dummy cache, empty ranges.
    dummy = torch.zeros(1, BLOCK, hkv, D, dtype=torch.bfloat16)
    host_args = dict(block_table=torch.zeros(R, 1, dtype=torch.int32),
                     dense_ranges=torch.zeros(R, 2, 2, dtype=torch.int32), scale=scale, K=K_BITS, L=L_TABLES,
                     out=out_pin, lse=lse_pin, sampled_counts=counts, check_values=False)
    output = torch.empty(R, H, D, dtype=torch.bfloat16, device=dev)
    output_lse = torch.empty(H, R, dtype=torch.float32, device=dev)
    cent = centres.view(R, hkv, 1, D)

    def device_hash():
        qdc = (q.float().view(R, hkv, H // hkv, D) * cent).sum(-1).view(R, H)
        codes = device_ops.hash_codes(q.reshape(R * H, D), proj_dev, K_BITS, L_TABLES).view(R, H, L_TABLES)
        q_pin.copy_(q, non_blocking=True)
        codes_pin.copy_(codes, non_blocking=True)
        qdc_pin.copy_(qdc, non_blocking=True)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            return ev
        return None

    def dense():
        return paged_attention_with_lse_standin(q, kv, table_dev, lens_l, scale)

    def cpu_kernel(segs=segments, num_threads=threads):
        kernel.sparse_decode_attention(q_pin, codes_pin, qdc_pin, segs, dummy, dummy, num_threads=num_threads,
                                       **host_args)

    def h2d_merge(dense_out, dense_lse):
        host_out = out_pin.to(dev, non_blocking=True)
        host_lse = lse_pin.to(dev, non_blocking=True).t().contiguous()
        merge_attn_states_standin(output, dense_out, dense_lse, host_out, host_lse, output_lse)

    def hash_wait():
        ev = device_hash()
        if ev is not None:
            ev.synchronize()

    def step(num_threads=threads):
        """One layer as gpu-path.md orders it: hash + async D2H, the dense part queued behind the copies, wait
        for the copies only, the CPU kernel while the device runs the dense part, H2D, merge."""
        ev = device_hash()
        dense_out, dense_lse = dense()
        if ev is not None:
            ev.synchronize()
        cpu_kernel(num_threads=num_threads)
        h2d_merge(dense_out, dense_lse)

    # ---- correctness: one pipelined step vs the single-call CPU kernel over the host copy of the cache
    step()
    sync(dev)
    split_out, split_lse = output.cpu(), output_lse.cpu().t()
    sampled = int(counts.sum())
    ref_out = torch.empty(R, H, D, dtype=torch.bfloat16)
    ref_lse = torch.empty(R, H, dtype=torch.float32)
    kernel.sparse_decode_attention(q_pin.clone(), codes_pin.clone(), qdc_pin.clone(), segments, cpu_kv.key,
                                   cpu_kv.value, block_table=bt_host, dense_ranges=dense_ranges, scale=scale,
                                   K=K_BITS, L=L_TABLES, out=ref_out, lse=ref_lse, num_threads=threads)
    exact = torch.empty(R, H, D, dtype=torch.float32)
    for r in range(R):
        exact[r] = attention_with_lse(q[r], data["keys"][r], data["values"][r], scale)[0].cpu()
    rel = rel_err(split_out, ref_out)
    dlse = float((split_lse - ref_lse).abs().max())
    tag = f"decode[n={n},R={R}]"
    run.gate(f"{tag}.split_vs_single_call", rel < 1e-2 and dlse < 1e-2,
             f"split (device dense stand-in + CPU segments, merged) vs single-call CPU kernel: rel {rel:.2e} "
             f"(< 1e-2), |lse diff| {dlse:.2e} (< 1e-2)")

    # ---- all dense: every request exact (real rows, no segments): the CPU side is empty, the merge is exact
    exact_ranges = torch.tensor([[[0, n], [n, n]]] * R, dtype=torch.int32)
    table_x, lens_x = device_ops.dense_block_tables(bt_host, [n] * R, exact_ranges, BLOCK)
    hash_wait()
    dense_x = paged_attention_with_lse_standin(q, kv, table_x.to(dev), lens_x.tolist(), scale)
    cpu_kernel([[] for _ in range(R)])
    host_empty = bool((lse_pin == float("-inf")).all())
    h2d_merge(*dense_x)
    sync(dev)
    rel_dense = rel_err(output.cpu(), exact)
    run.gate(f"{tag}.all_dense_equals_exact", host_empty and rel_dense < 1e-2,
             f"no segments: host lse all -inf = {host_empty}; merged vs exact float32 attention rel "
             f"{rel_dense:.2e} (< 1e-2, bf16 output)")

    # ---- timings
    reps = cfg["reps"]
    t = {"hash_d2h": timed(hash_wait, dev, reps),
         "cpu_kernel": timed(cpu_kernel, dev, reps)}
    dense_res = dense()
    t["dense"] = timed(dense, dev, reps)
    t["h2d_merge"] = timed(lambda: h2d_merge(*dense_res), dev, reps)
    t["serial_sum"] = t["hash_d2h"] + t["cpu_kernel"] + t["dense"] + t["h2d_merge"]
    t["pipelined_total"] = timed(step, dev, reps)
    t["exact_sdpa"] = time_sdpa(q, data["keys"][:R], data["values"][:R], scale, dev, reps)
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what vLLM's CUDA worker does
    try:
        t["step_1thread_default"] = timed(lambda: step(num_threads=None), dev, reps)
        team_default = last_team_size()
        t["step_1thread_num_threads"] = timed(lambda: step(num_threads=threads), dev, reps)
        team_threads = last_team_size()
    finally:
        torch.set_num_threads(torch_threads)
    sampled_fraction = sampled / (R * H * (covered_end - sink))
    return {"n": n, "R": R, "H": H, "Hkv": hkv, "D": D, "sink": sink, "covered_end": covered_end,
            "dense_len": int(lens[0]), "split_vs_single_rel": rel, "lse_diff": dlse,
            "split_vs_exact_rel": rel_err(split_out, exact), "single_vs_exact_rel": rel_err(ref_out, exact),
            "all_dense_vs_exact_rel": rel_dense, "sampled_fraction": sampled_fraction, "timings_s": t,
            "team_default": team_default, "team_num_threads": team_threads, "threads": threads}


# ============================================================================ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for device_check_<device>.md/.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (the CPU smoke mode)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda":
        # The hash and decode comparisons are against float32 math on the host: no TF32 (hash re-enables it
        # only for its informational line).
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = make_config(args.small)
    run = Run(dev, args.small)
    run.results["config"] = dict(cfg, K=K_BITS, L=L_TABLES, block_size=BLOCK, sink_tokens=SINK_TOKENS,
                                 local_window=LOCAL_WINDOW)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU, no GPU used"
    run.line(f"# Device check: device {dev.type} ({name})")
    run.line("")
    run.line(f"Ran `benchmarks/device_check.py --device {dev.type}{' --small' if args.small else ''}` on {name}. "
             "Every figure below was measured in this run on that device"
             + ("; this is the CPU smoke mode, so none of them is a GPU figure." if dev.type == "cpu" else "."))
    t0 = time.perf_counter()
    for section in (section_env, section_mirror, section_host_mirror, section_hash, section_merge, section_decode):
        ts = time.perf_counter()
        try:
            section(run, cfg)
        except Exception as e:  # a crashed section is a failed gate; the others still run and report
            run.gate(f"{section.__name__}.ran", False, f"raised {type(e).__name__}: {e}")
            import traceback

            traceback.print_exc()
        run.line(f"\n_{section.__name__[8:]}: {time.perf_counter() - ts:.1f} s_\n")
    # The script must run where vLLM is absent: importing it anywhere above would break that.
    run.gate("env.no_vllm_import", "vllm" not in sys.modules, "vllm is not among the imported modules")
    total = time.perf_counter() - t0
    failed = [g["name"] for g in run.gates if not g["passed"]]
    run.results.update(gates=run.gates, total_s=total, passed=not failed)
    run.line(f"\n**{len(run.gates) - len(failed)}/{len(run.gates)} gates passed** in {total:.1f} s"
             + (f"; failed: {', '.join(failed)}" if failed else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"device_check_{dev.type}"
    stem.with_suffix(".md").write_text("\n".join(run.md) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(run.results, indent=2, default=str) + "\n")
    print(f"wrote {stem}.md and {stem}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
