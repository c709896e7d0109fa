"""Where a decode step goes inside vLLM's worker: a cProfile of the worker's thread over one
generation, for each backend, and the worker's context switches.

    python benchmarks/worker_profile.py --context 16384 --batch 1 --threads all
    python benchmarks/worker_profile.py --context 16384 --threads all --magicpig '{"background_index": false}'

e2e_decode.py times whole steps; this says which calls a step's time went to, so a gap between
backends can be traced to a call. Each backend runs alone (one engine at a time, the same
threads): its prompts are prefilled, MAGICPIG decodes until its index is installed (e2e_decode's
warm-up), then one generation of ``--tokens`` tokens from the prefix cache is profiled in the worker
(``collective_rpc`` turns cProfile on and off on the thread that runs the model). cProfile adds
~1 us to every Python call, so compare calls across backends rather than reading absolute Python
times; native calls (vLLM's ops, MAGICPIG's kernel) are timed as they run.

The table puts the calls whose time moved most between the backends side by side, per decode step.
A backend that makes the engine's own ops slower shows there: it found a background indexer whose
finished OpenMP pool made libgomp stop spin-waiting in every team of the worker (results/
worker_profile_16k_all_before.md, against worker_profile_16k_all.md after the fix).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_decode import (  # noqa: E402
    RESULTS,
    SHORT_TOKENS,
    _engine,
    _stats,
    bind_threads,
    distinct_prompt,
    kv_bytes_per_token,
    kv_space_gib,
    warm_up,
)

BACKENDS = ("CPU_ATTN", "MAGICPIG")


def start_profile(worker) -> None:
    """Runs in the worker (collective_rpc): profile its thread from now on."""
    import cProfile
    import resource

    worker._mp_profile = (cProfile.Profile(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter())
    worker._mp_profile[0].enable()


def stop_profile(worker) -> dict:
    """Runs in the worker: stop profiling -> {calls: {name: [calls, own seconds]}, rusage deltas}."""
    import pstats
    import resource

    prof, r0, t0 = worker._mp_profile
    prof.disable()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    calls = {}
    for (path, line, fn), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        name = f"{fn}" if path == "~" else f"{Path(path).name}:{line}({fn})"
        calls[name] = [ncalls, tottime]
    return dict(calls=calls, wall_s=time.perf_counter() - t0, user_s=r1.ru_utime - r0.ru_utime,
                sys_s=r1.ru_stime - r0.ru_stime, voluntary_switches=r1.ru_nvcsw - r0.ru_nvcsw,
                involuntary_switches=r1.ru_nivcsw - r0.ru_nivcsw)


def profile_backend(backend, model, context, batch, tokens, magicpig) -> dict:
    from vllm import SamplingParams

    llm = _engine(model, backend, context + tokens + 64, magicpig if backend == "MAGICPIG" else {}, 8192, False)
    try:
        tok = llm.get_tokenizer()
        prompts = [distinct_prompt(tok, context, seed) for seed in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=1)
        llm.generate(prompts, params, use_tqdm=False)  # prefill
        if backend == "MAGICPIG":
            warm_up(llm, prompts)
        else:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=SHORT_TOKENS, ignore_eos=True),
                         use_tqdm=False)
        llm.collective_rpc(start_profile)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        prof = llm.collective_rpc(stop_profile)[0]
        if backend == "MAGICPIG":
            st = _stats(llm)
            prof["sampled_decodes"] = st["decode_sparse"]
            prof["exact_decodes"] = dict(st["decode_exact"])
        return prof
    finally:
        llm.llm_engine.engine_core.shutdown()


def table(profiles: dict, steps: int, top: int) -> list[str]:
    a, b = (profiles[n]["calls"] for n in BACKENDS)
    moved = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, [0, 0])[1] - a.get(k, [0, 0])[1]))[:top]
    lines = ["| call | CPU_ATTN calls / step | CPU_ATTN ms / step | MAGICPIG calls / step | MAGICPIG ms / step |",
             "|---|---|---|---|---|"]
    for k in moved:
        ca, mp = a.get(k, [0, 0]), b.get(k, [0, 0])
        lines.append(f"| `{k}` | {ca[0] / steps:.1f} | {1e3 * ca[1] / steps:.3f} | {mp[0] / steps:.1f} | "
                     f"{1e3 * mp[1] / steps:.3f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=72, help="tokens of the profiled generation")
    ap.add_argument("--threads", default="default", choices=("default", "all"))
    ap.add_argument("--magicpig", default="{}", help="MAGICPIG's additional_config entries, as JSON")
    ap.add_argument("--top", type=int, default=25, help="calls in the table")
    ap.add_argument("--out", default=str(RESULTS / "worker_profile"))
    args = ap.parse_args(argv)
    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    magicpig = {"K": 10, "L": 150, "index_memory_mb": 8192, "log_stats_interval": 0, **json.loads(args.magicpig)}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE",
                          str(kv_space_gib([args.context], [args.batch], args.tokens + 64, kv_bytes_per_token(model))))
    # vLLM's multiprocessing pickles the profiling functions to the worker
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    bind_threads(args.threads)
    profiles = {b: profile_backend(b, model, args.context, args.batch, args.tokens, magicpig) for b in BACKENDS}
    steps = args.tokens - 1
    lines = [f"Command: `python benchmarks/worker_profile.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
             f"({time.strftime('%Y-%m-%d')})", "",
             f"SmolLM2-135M, {args.context} tokens x batch {args.batch}, threads `{args.threads}`, MAGICPIG config "
             f"{magicpig}; one generation of {args.tokens} tokens ({steps} decode steps) from the prefix cache, "
             "profiled in the worker (cProfile).", "",
             "| backend | wall s | ms / step | worker user s | worker sys s | voluntary context switches | "
             "involuntary | MAGICPIG decodes sampled / exact |", "|---|---|---|---|---|---|---|---|"]
    for n in BACKENDS:
        p = profiles[n]
        lines.append(f"| {n} | {p['wall_s']:.2f} | {1e3 * p['wall_s'] / steps:.1f} | {p['user_s']:.2f} | "
                     f"{p['sys_s']:.2f} | {p['voluntary_switches']} | {p['involuntary_switches']} | "
                     f"{p.get('sampled_decodes', '-')} / {p.get('exact_decodes', '-')} |")
    lines += ["", "The calls whose time moved most between the backends, per decode step:", ""]
    lines += table(profiles, steps, args.top)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps({n: {k: v for k, v in p.items() if k != "calls"}
                                                    for n, p in profiles.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
