"""What MAGICPIG costs when it serves a decode step exactly, against CPU_ATTN.

    python benchmarks/exact_service.py [--contexts 4096] [--batches 1,4] [--tree DIR]   (contexts <= 8191)

MAGICPIG serves a decode exactly whenever sampling would not pay: a context too short, the cost
model predicting sampling slower, a prompt whose index is deferred or still being built. Then
vLLM's own CPU kernel attends, and what MAGICPIG adds is its Python: the per-step plan in the
metadata builder and the per-layer dispatch and accounting. "Never slower than exact" needs that
to be small against a step. End to end, the two engines run one after the other and this
machine's speed drifts by more than the difference, so this benchmark times it at the vLLM
seam instead: both backends' metadata builders and impls (``MagicPigMetadataBuilder`` /
``MagicPigImpl`` and vLLM's ``CPUAttentionMetadataBuilder`` / ``CPUAttentionBackendImpl``) over
the same paged cache and queries, SmolLM2's shape (30 layers, MAGICPIG's default dense ones), one
engine step each, alternating step by step in one process on one thread. vLLM's kernel op is
timed inside both, so the table splits each step into the kernel and everything around it.

``--reason short_context`` (the default) plans requests exact as contexts under
``min_sparse_context`` are: the same path as the other reasons from the planner on, and one that
an older checkout (``--tree``) takes too. ``--reason index_deferred`` takes the path a new prompt
takes while its index has not paid for its build (the cost model's ski-rental, ``cost_model.py``):
the planner finds the prompt's centre and asks the cost model every step. For that, the cost model
is primed, before the timed steps, with timings that say sampling pays at this context (exact
1 ms, sampled 1 us per request and layer) and a build that never pays back (1000 s); the timed
steps' own exact timings then join its fit, as in an engine.

``--tree DIR`` times another built checkout's vllm_magicpig (a git worktree of an earlier commit);
run it and the default in turn to compare commits through the drift.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timed_tree import use_tree_from_argv  # noqa: E402

TREE = use_tree_from_argv()

D, HKV, G, BS = 64, 3, 3, 128  # SmolLM2-135M's attention; vLLM's CPU block size
H = HKV * G
LAYERS = 30


class _Layer:
    """The attributes of vLLM's Attention layer that the CPU impls read."""

    def __init__(self, name: str) -> None:
        self.layer_name = name
        self.isa = "vec"
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0


class _KernelTimer:
    """Wraps vLLM's CPU attention op: the seconds spent inside it, over both backends' calls."""

    def __init__(self) -> None:
        self.inner = torch.ops._C.cpu_attention_with_kv_cache
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        return out


def vllm_config(model: str, magicpig: dict):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=model, dtype=torch.bfloat16, max_model_len=8192,
                                               enforce_eager=True),
                      cache_config=CacheConfig(block_size=BS), additional_config={"magicpig": magicpig})


def prime_deferral(cost, ctx: int) -> None:
    """Cost-model timings under which every prompt of ``ctx`` keys waits for its build (module docs)."""
    for _ in range(cost.min_steps):
        cost.observe_exact(1, ctx, 1e-3)
        cost.observe_sparse(1, ctx, 1e-6)
    cost.observe_build(1, 1e3)


def decode_batch(lens: list[int], gen: torch.Generator) -> tuple:
    """One decode step's inputs at the seam for requests of ``lens`` keys (one new token each):
    a random paged cache (SmolLM2's shape, blocks in random order), vLLM's common metadata, the
    queries, the new K/V rows and the output buffer."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    batch, blocks = len(lens), -(-max(lens) // BS)
    cache = (torch.randn(batch * blocks + 1, HKV, BS, 2 * D, generator=gen) * 0.5).bfloat16()
    block_table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    last = seq.long() - 1
    slots = block_table.long().gather(1, (last // BS).view(-1, 1)).view(-1) * BS + last % BS
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=batch, num_actual_tokens=batch,
        max_query_len=1, max_seq_len=max(lens), block_table_tensor=block_table, slot_mapping=slots,
        seq_lens_cpu_upper_bound=seq, is_prefilling=torch.zeros(batch, dtype=torch.bool))
    q = torch.randn(batch, H, D, generator=gen).bfloat16()
    kv_new = torch.randn(batch, HKV, D, generator=gen).bfloat16()
    return cache, cam, q, kv_new, torch.empty(batch, H, D, dtype=torch.bfloat16)


def seam_backends(cfg, cache: torch.Tensor, cam, q: torch.Tensor, kv_new: torch.Tensor, out: torch.Tensor):
    """Both backends' metadata builders at SmolLM2's shape (30 layers), and ``step(name)``: one engine
    step of that backend over the batch (``decode_batch``'s inputs). Call inside
    ``set_current_vllm_config(cfg)``."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_magicpig.backend import MagicPigImpl, MagicPigMetadataBuilder
    from vllm_magicpig.kv_layout import amx_granted

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
    layers = [_Layer(n) for n in names]
    builders = {"MAGICPIG": MagicPigMetadataBuilder(spec, names, cfg, torch.device("cpu")),
                "CPU_ATTN": CPUAttentionMetadataBuilder(spec, names, cfg, torch.device("cpu"))}
    # One cache serves both, in the layout MAGICPIG's builder chose: on an AMX CPU, vLLM's would
    # pick "amx" and read that cache as AMX tiles (SIGILL in a process without AMX state).
    builders["CPU_ATTN"].isa = builders["MAGICPIG"].isa
    for layer in layers:  # the KV write's layout, as vLLM sets it on its layers
        layer.isa = builders["MAGICPIG"].isa
    if builders["MAGICPIG"].isa == "amx":
        amx_granted()  # vLLM's AMX kernel runs here with no matmul before it to ask for the state
    args = (H, D, D**-0.5, HKV, None, None, "auto")
    impls = {"MAGICPIG": [MagicPigImpl(*args) for _ in names],
             "CPU_ATTN": [CPUAttentionBackendImpl(*args)] * LAYERS}

    def step(name: str) -> None:
        meta = builders[name].build(0, cam)
        for layer, impl in zip(layers, impls[name]):
            impl.forward(layer, q, kv_new, kv_new, cache, meta, out)

    return builders, step


WARM_TURNS = 3  # turns of both backends before the timed ones


def time_in_turn(step, steps: int, timer: _KernelTimer | None = None) -> dict[str, list[tuple[float, float]]]:
    """Each backend's ``steps`` steps after ``WARM_TURNS`` warm-up turns, the two alternating (each turn reverses the
    order): (seconds, of them inside vLLM's kernel op with a ``timer``, else 0)."""
    times: dict[str, list[tuple[float, float]]] = {"MAGICPIG": [], "CPU_ATTN": []}
    for i in range(steps + WARM_TURNS):
        for name in (("MAGICPIG", "CPU_ATTN") if i % 2 else ("CPU_ATTN", "MAGICPIG")):
            if timer is not None:
                timer.seconds = 0.0
            t0 = time.perf_counter()
            step(name)
            if i >= WARM_TURNS:
                times[name].append((time.perf_counter() - t0, 0.0 if timer is None else timer.seconds))
    return times


def run(model: str, ctx: int, batch: int, steps: int, timer: _KernelTimer, reason: str = "short_context") -> dict:
    from vllm.config import set_current_vllm_config

    magicpig = {"background_index": False, "log_stats_interval": 0, "cost_calibration": False}  # primed by hand
    if reason == "short_context":
        magicpig["min_sparse_context"] = ctx + 1
    cfg = vllm_config(model, magicpig)
    inputs = decode_batch([ctx] * batch, torch.Generator().manual_seed(ctx + batch))
    with set_current_vllm_config(cfg):
        builders, step = seam_backends(cfg, *inputs)
        if reason == "index_deferred":
            prime_deferral(builders["MAGICPIG"].runtime.cost, ctx)
        times = time_in_turn(step, steps, timer)
        st = builders["MAGICPIG"].runtime.stats.snapshot()
    assert st["decode_sparse"] == 0 and set(st["decode_exact"]) == {reason, "dense_layer"}, st
    row = {"context": ctx, "batch": batch, "steps": steps, "reason": reason}
    for name, ts in times.items():
        row[f"{name}_step_ms"] = round(1e3 * statistics.median(t for t, _ in ts), 3)
        row[f"{name}_kernel_ms"] = round(1e3 * statistics.median(k for _, k in ts), 3)
        row[f"{name}_around_ms"] = round(1e3 * statistics.median(t - k for t, k in ts), 3)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each backend per row")
    ap.add_argument("--tree", default=None, help="another built checkout to time (see the module docs)")
    ap.add_argument("--reason", choices=("short_context", "index_deferred"), default="short_context",
                    help="why the planner serves the decodes exactly (see the module docs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # vLLM's default binding gives the worker one core here

    import vllm_magicpig
    from vllm_magicpig.models import prepare_smollm2

    vllm_magicpig.register()
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU ops)

    timer = _KernelTimer()
    torch.ops._C.cpu_attention_with_kv_cache = timer
    try:
        table(str(prepare_smollm2()), args, timer)
    finally:
        torch.ops._C.cpu_attention_with_kv_cache = timer.inner
    return 0


def table(model: str, args, timer: _KernelTimer) -> None:
    print(f"timing {TREE}: one engine step (30 layers), both backends alternating, medians of {args.steps}; "
          f"MAGICPIG's decodes exact as {args.reason}")
    print("| context | batch | CPU_ATTN step ms | MAGICPIG step ms | ratio | vLLM kernel ms (CPU_ATTN / MAGICPIG) "
          "| around the kernel ms (CPU_ATTN / MAGICPIG) | MAGICPIG's extra ms |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            r = run(model, ctx, batch, args.steps, timer, args.reason)
            extra = r["MAGICPIG_around_ms"] - r["CPU_ATTN_around_ms"]
            print(f"| {ctx} | {batch} | {r['CPU_ATTN_step_ms']} | {r['MAGICPIG_step_ms']} | "
                  f"{r['CPU_ATTN_step_ms'] / r['MAGICPIG_step_ms']:.3f}x | {r['CPU_ATTN_kernel_ms']} / "
                  f"{r['MAGICPIG_kernel_ms']} | {r['CPU_ATTN_around_ms']} / {r['MAGICPIG_around_ms']} | "
                  f"{extra:.3f} |", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
