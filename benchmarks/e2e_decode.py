"""vLLM decode speed: MAGICPIG against CPU_ATTN, side by side in one run.

    python benchmarks/e2e_decode.py                     # SmolLM2: 4K, 8K, 16K x batch 1, 4
    python benchmarks/e2e_decode.py --contexts 4096 --batches 1 --decode-tokens 16   # quick
    python benchmarks/e2e_decode.py --model llama-d128 --contexts 32768,65536 --batches 1   # the paper's regime
    python benchmarks/e2e_decode.py --threads default,all     # vLLM's thread binding, then all cores

Method (identical for both backends, each in its own engine, with the same threads):
1. prefill the batch's distinct prompts once (max_tokens=1); prefill time is recorded;
2. decode ``--decode-tokens`` tokens from the prefix cache (the first MAGICPIG run
   builds its LSH index here: reported as index build time);
3. decode again, timed: steady-state decode tokens/s;
4. the cold path a user meets: one new prompt of the same length (no prefix-cache hit),
   prefill plus ``--cold-tokens`` tokens, the index build included; reported as ms per
   generated token (``--cold-tokens 0`` skips it).
Contexts above the model's trained length use linear RoPE scaling (``hf_overrides``) for BOTH
backends. The measured sampled fraction is printed next to every MAGICPIG time.

Models: ``smollm2`` (SmolLM2-135M-Instruct, head_dim 64, 3 KV heads) and ``llama-d128``, a
random-weight Llama written by this script (``load_format="dummy"``): head_dim 128, 8 query /
2 KV heads, 4 layers of which layer 0 stays dense, SmolLM2's tokenizer; its outputs are
meaningless, its shapes are the paper's. Threads: ``default`` is vLLM's binding (the worker on
all cores but the one reserved for the front end: 1 of 2 here); ``all`` binds the worker to every
core (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).
Results go to benchmarks/results/e2e_decode.{md,json} (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


LLAMA_D128 = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
              "num_hidden_layers": 4, "intermediate_size": 2816, "max_position_embeddings": 131072}


def write_llama_d128(folder: Path, tokenizer_dir: Path) -> Path:
    """A random-weight Llama config (weights come from ``load_format="dummy"``) with SmolLM2's tokenizer."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg["vocab_size"],
                  hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="bfloat16",
                  bos_token_id=cfg.get("bos_token_id", 1), eos_token_id=cfg.get("eos_token_id", 2),
                  rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, **LLAMA_D128)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _engine(model: str, backend: str, max_len: int, magicpig: dict, trained_len: int, dummy: bool):
    from vllm import LLM

    overrides = {}
    if max_len > trained_len:
        factor = max_len / trained_len
        overrides = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "linear", "factor": factor},
                     "max_position_embeddings": max_len}
    kw = dict(model=model, attention_backend=backend, enforce_eager=True, max_model_len=max_len,
              hf_overrides=overrides or None, seed=0, max_num_seqs=8)
    if dummy:
        kw["load_format"] = "dummy"
    if backend == "MAGICPIG":
        kw["additional_config"] = {"magicpig": magicpig}
    return LLM(**kw)


def _stats(llm):
    from vllm_magicpig.stats import merge_snapshots

    return merge_snapshots(llm.collective_rpc("magicpig_stats"))


def run_backend(backend, model, contexts, batches, decode_tokens, magicpig, cold_tokens=0, trained_len=8192,
                dummy=False):
    from vllm import SamplingParams

    from vllm_magicpig import passkey

    max_len = max(contexts) + max(decode_tokens, cold_tokens) + 64
    llm = _engine(model, backend, max_len, magicpig, trained_len, dummy)
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
        if cold_tokens:
            rows.append(_cold(llm, backend, tok, ctx, cold_tokens))
    del llm
    return rows


def _cold(llm, backend, tok, ctx, cold_tokens):
    """One new prompt (no prefix-cache hit): prefill, index build and ``cold_tokens`` tokens, as a user meets it."""
    from vllm import SamplingParams

    from vllm_magicpig import passkey

    prompt = passkey.build(tok, ctx, seed=777_000 + ctx, depth=0.5).text
    if backend == "MAGICPIG":
        llm.collective_rpc("magicpig_reset_stats")
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=cold_tokens, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t0
    row = dict(backend=backend, context=ctx, batch="cold", cold_s=round(total, 2), cold_tokens=cold_tokens,
               cold_ms_per_token=round(1000 * total / cold_tokens, 1))
    if backend == "MAGICPIG":
        st = _stats(llm)
        row.update(sampled_fraction=st["sampled_fraction"], index_build_s=round(st["build_seconds"], 2),
                   decode_sparse=st["decode_sparse"])
    print(json.dumps(row), flush=True)
    return row


def bind_threads(mode: str) -> None:
    """Set vLLM's CPU thread binding for the next engine: ``default`` (vLLM's own) or ``all`` cores."""
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        os.environ.pop(var, None)
    if mode == "all":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif mode != "default":
        raise ValueError(f"--threads takes default and/or all, not {mode!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "llama-d128"), default="smollm2")
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--cold-tokens", type=int, default=128)
    ap.add_argument("--threads", default="default", help="default and/or all, comma-separated")
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
    trained_len, dummy, shape = 8192, False, "SmolLM2-135M bf16 (head_dim 64, 9 query / 3 KV heads, 30 layers)"
    if args.model == "llama-d128":
        import tempfile

        model = str(write_llama_d128(Path(tempfile.mkdtemp(prefix="llama_d128_")), Path(model)))
        trained_len, dummy = LLAMA_D128["max_position_embeddings"], True
        magicpig["dense_layers"] = [0]
        shape = ("random-weight Llama (head_dim 128, 8 query / 2 KV heads, 4 layers, layer 0 dense), "
                 "load_format=dummy")
    rows = []
    for mode in args.threads.split(","):
        bind_threads(mode)
        for backend in ("CPU_ATTN", "MAGICPIG"):
            part = run_backend(backend, model, contexts, batches, args.decode_tokens,
                               magicpig if backend == "MAGICPIG" else {}, args.cold_tokens, trained_len, dummy)
            rows += [dict(r, threads=mode) for r in part]
    bind_threads("default")

    base = {(r["threads"], r["context"], r["batch"]): r for r in rows if r["backend"] == "CPU_ATTN"}
    lines = [
        f"Command: `python benchmarks/e2e_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"K={args.K}, L={args.L}, {args.decode_tokens} decode tokens per request, {shape}, enforce_eager, "
        f"{os.cpu_count()} cores; threads `default` = vLLM's binding (1 core for the worker here), `all` = every "
        f"core. Index MiB = all the worker holds at that point (earlier rows' prompts included).",
        "",
        "| threads | context | batch | CPU_ATTN tok/s | MAGICPIG tok/s | speed-up | sampled fraction | "
        "index MiB (tables / K,V mirror) | index build s | prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["backend"] != "MAGICPIG" or r["batch"] == "cold":
            continue
        b = base[(r["threads"], r["context"], r["batch"])]
        frac = r["sampled_fraction"]
        lines.append(
            f"| {r['threads']} | {r['context']} | {r['batch']} | {b['tok_per_s']:.1f} | {r['tok_per_s']:.1f} | "
            f"{r['tok_per_s'] / b['tok_per_s']:.2f}x | {'n/a' if frac is None else f'{frac:.2%}'} | "
            f"{r['index_MiB']} / {r['mirror_MiB']} | {r['index_build_s']} | {b['prefill_s']} |"
        )
    cold = [r for r in rows if r["backend"] == "MAGICPIG" and r["batch"] == "cold"]
    if cold:
        lines += ["", f"Cold single request (new prompt: prefill + {args.cold_tokens} tokens, index build included), "
                  "ms per generated token:", "",
                  "| threads | context | CPU_ATTN ms/token | MAGICPIG ms/token | speed-up | sampled fraction | "
                  "index build s |", "|---|---|---|---|---|---|---|"]
        for r in cold:
            b = base[(r["threads"], r["context"], "cold")]
            frac = r["sampled_fraction"]
            lines.append(f"| {r['threads']} | {r['context']} | {b['cold_ms_per_token']} | {r['cold_ms_per_token']} | "
                         f"{b['cold_ms_per_token'] / r['cold_ms_per_token']:.2f}x | "
                         f"{'n/a' if frac is None else f'{frac:.2%}'} | {r['index_build_s']} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
