"""What a decode step costs when it samples some requests and attends the others exactly, against CPU_ATTN.

    python benchmarks/mixed_step.py [--batches 2,8,21] [--sampled-context 4608] [--exact-context 4096]

Under load most steps mix requests that MAGICPIG samples with requests it serves exactly (their
index deferred, evicted at the cap, or sampling slower for them). Such a step's sparse layers hand
the exact requests to vLLM's kernel over metadata of their own and the sampled ones to MAGICPIG's
one native call (``backend_common.DecodeSplit``; before it, MAGICPIG's call attended the exact ones
over their whole context too: results/mixed_step_avx512_1206.md). This times that step at the vLLM
seam, as ``exact_service.py`` does (both backends' metadata builders
and impls, SmolLM2's shape, one engine step of 30 layers, alternating in one process on one
thread): one request of ``--sampled-context`` keys is sampled (cost model off), the batch's other
requests, of ``--exact-context`` keys, are served exactly as ``short_context``; the counters check
that. Run it with the worker's one core (``taskset -c 1``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exact_service as seam  # noqa: E402  (the harness at the vLLM seam)


def run(model: str, sampled_ctx: int, exact_ctx: int, batch: int, steps: int) -> dict:
    from vllm.config import set_current_vllm_config

    if exact_ctx >= sampled_ctx:
        raise SystemExit("--exact-context must be below --sampled-context (it is what keeps them exact)")
    cfg = seam.vllm_config(model, {"background_index": False, "log_stats_interval": 0, "cost_calibration": False,
                                   "cost_model": False, "min_sparse_context": exact_ctx + 1})
    lens = [sampled_ctx] + [exact_ctx] * (batch - 1)
    inputs = seam.decode_batch(lens, torch.Generator().manual_seed(batch))
    with set_current_vllm_config(cfg):
        builders, step = seam.seam_backends(cfg, *inputs)
        times = seam.time_in_turn(step, steps)  # the warm-up turns build the sampled request's index
        st = builders["MAGICPIG"].runtime.stats.snapshot()
    sparse_layers = seam.LAYERS - len(builders["MAGICPIG"].runtime.dense_layers)
    calls = (steps + seam.WARM_TURNS) * sparse_layers
    want = {"short_context": calls * (batch - 1)} if batch > 1 else {}
    got = {k: v for k, v in st["decode_exact"].items() if k != "dense_layer"}
    assert st["decode_sparse"] == calls and got == want, st  # one sampled request per sparse layer, the rest exact
    row = {"batch": batch, "sampled_context": sampled_ctx, "exact_context": exact_ctx, "steps": steps}
    for name, ts in times.items():
        row[f"{name}_step_ms"] = round(1e3 * statistics.median(t for t, _ in ts), 2)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2,8,21", help="requests a step: one sampled, the rest exact")
    ap.add_argument("--sampled-context", type=int, default=4608)
    ap.add_argument("--exact-context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12, help="timed steps of each backend per row")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # vLLM's default binding gives the worker one core here

    import vllm_magicpig
    from vllm_magicpig.models import prepare_smollm2

    vllm_magicpig.register()
    import vllm._custom_ops  # noqa: F401  (loads vLLM's CPU ops)

    model = str(prepare_smollm2())
    print(f"one engine step (30 layers), both backends alternating, medians of {args.steps}: one request of "
          f"{args.sampled_context} keys sampled, the others of {args.exact_context} keys exact")
    print("| batch | CPU_ATTN step ms | MAGICPIG step ms | MAGICPIG speed-up |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        r = run(model, args.sampled_context, args.exact_context, batch, args.steps)
        print(f"| {batch} | {r['CPU_ATTN_step_ms']} | {r['MAGICPIG_step_ms']} | "
              f"{r['CPU_ATTN_step_ms'] / r['MAGICPIG_step_ms']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
