"""vLLM decode speed on SmolLM2: MAGICPIG against CPU_ATTN, side by side in one run.

    python benchmarks/e2e_decode.py                     # 4K, 8K, 16K x batch 1, 4
    python benchmarks/e2e_decode.py --contexts 4096 --batches 1 --decode-tokens 16   # quick

Method (identical for both backends, each in its own engine):
1. prefill the batch's distinct prompts once (max_tokens=1); prefill time is recorded;
2. decode ``--decode-tokens`` tokens from the prefix cache (the first MAGICPIG run
   builds its LSH index here: reported as index build time);
3. decode again, timed: steady-state decode tokens/s.
Contexts above the model's 8K use linear RoPE scaling (``hf_overrides``) for BOTH
backends. The measured sampled fraction is printed next to every MAGICPIG time.
Results go to benchmarks/results/e2e_decode.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _engine(model: str, backend: str, max_len: int, magicpig: dict):
    from vllm import LLM

    overrides = {}
    if max_len > 8192:
        factor = max_len / 8192
        overrides = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "linear", "factor": factor},
                     "max_position_embeddings": max_len}
    kw = dict(model=model, attention_backend=backend, enforce_eager=True, max_model_len=max_len,
              hf_overrides=overrides or None, seed=0, max_num_seqs=8)
    if backend == "MAGICPIG":
        kw["additional_config"] = {"magicpig": magicpig}
    return LLM(**kw)


def _stats(llm):
    from vllm_magicpig.stats import merge_snapshots

    return merge_snapshots(llm.collective_rpc("magicpig_stats"))


def run_backend(backend, model, contexts, batches, decode_tokens, magicpig):
    from vllm import SamplingParams

    from vllm_magicpig import passkey

    max_len = max(contexts) + decode_tokens + 64
    llm = _engine(model, backend, max_len, magicpig)
    tok = llm.get_tokenizer()
    rows = []
    for ctx in contexts:
        prompts = [passkey.build(tok, ctx, seed=1000 + ctx + i, depth=0.5).text for i in range(max(batches))]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        prefill_s = time.perf_counter() - t0
        for b in batches:
            sp = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
            if backend == "MAGICPIG":
                llm.collective_rpc("magicpig_reset_stats")
            t0 = time.perf_counter()
            llm.generate(prompts[:b], sp, use_tqdm=False)  # warm: builds the index
            first_s = time.perf_counter() - t0
            build_s = _stats(llm)["build_seconds"] if backend == "MAGICPIG" else 0.0
            if backend == "MAGICPIG":
                llm.collective_rpc("magicpig_reset_stats")
            t0 = time.perf_counter()
            llm.generate(prompts[:b], sp, use_tqdm=False)
            steady_s = time.perf_counter() - t0
            row = dict(backend=backend, context=ctx, batch=b, prefill_s=round(prefill_s, 2),
                       first_run_s=round(first_s, 3), decode_s=round(steady_s, 3),
                       tok_per_s=round(b * decode_tokens / steady_s, 2),
                       ms_per_step=round(1000 * steady_s / decode_tokens, 2))
            if backend == "MAGICPIG":
                st = _stats(llm)
                row.update(sampled_fraction=st["sampled_fraction"], decode_sparse=st["decode_sparse"],
                           decode_exact=st["decode_exact"], index_MiB=round(st["index_bytes"] / 2**20, 1),
                           mirror_MiB=round(st["mirror_bytes"] / 2**20, 1), index_build_s=round(build_s, 2),
                           sparse_kernel_s=st["sparse_seconds"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    del llm
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--out", default=str(RESULTS / "e2e_decode"))
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    magicpig = {"K": args.K, "L": args.L, "index_memory_mb": 8192, "log_stats_interval": 0}
    rows = run_backend("CPU_ATTN", model, contexts, batches, args.decode_tokens, {})
    rows += run_backend("MAGICPIG", model, contexts, batches, args.decode_tokens, magicpig)

    base = {(r["context"], r["batch"]): r for r in rows if r["backend"] == "CPU_ATTN"}
    lines = [
        f"K={args.K}, L={args.L}, {args.decode_tokens} decode tokens per request, SmolLM2-135M bf16, "
        f"enforce_eager, {os.cpu_count()} cores (vLLM binds the worker to all but the cores it reserves "
        f"for its front end: 1 core here). Index MiB = all the worker holds at that point (earlier rows' "
        f"prompts included).",
        "",
        "| context | batch | CPU_ATTN tok/s | MAGICPIG tok/s | speed-up | sampled fraction | "
        "index MiB (tables / K,V mirror) | index build s | prefill s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["backend"] != "MAGICPIG":
            continue
        b = base[(r["context"], r["batch"])]
        frac = r["sampled_fraction"]
        lines.append(
            f"| {r['context']} | {r['batch']} | {b['tok_per_s']:.1f} | {r['tok_per_s']:.1f} | "
            f"{r['tok_per_s'] / b['tok_per_s']:.2f}x | {'n/a' if frac is None else f'{frac:.2%}'} | "
            f"{r['index_MiB']} / {r['mirror_MiB']} | {r['index_build_s']} | {b['prefill_s']} |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
