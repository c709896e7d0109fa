"""Where a sampled decode's time goes under a serving load: every sparse layer call of an engine
timed inside vLLM's worker, split by the kernel's phases, and grouped by batch size and by whether
an index build was running beside it.

    python benchmarks/load_split.py                     # 24 prompts of 2K-7K tokens, 512-token answers
    python benchmarks/load_split.py --prompts 4 --answer-tokens 32 --magicpig '{"cost_model": false}'

Why: under ``serve_load.py --answer-tokens 512`` the cost model's log put sampling at ~300 us a
request and layer, about twice what ``decode_profile.py --cold`` measures for a 4K request alone,
and that is what kept MAGICPIG only on a par with exact there. ``engine_split.py`` times a
steady batch of equal prompts; a load is not that: batches of many requests of different lengths,
each with its decoded tokens still in the exact tail, some steps beside a background build.

One engine (SmolLM2, MAGICPIG as a user gets it: the cost model on, unless ``--magicpig`` says
otherwise) with the OpenAI server's batching defaults (``max_num_seqs`` 128, ``max_num_batched_tokens``
2048) is handed every prompt at once, as ``serve_load.py``'s clients send them: distinct pass-key
documents of ``--doc-tokens`` lengths, each answered with exactly ``--answer-tokens`` tokens. Inside
the worker (``collective_rpc`` with a callable, so ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is set)
each sparse layer call that samples is recorded: its sampled requests, their keys, segments and
exactly attended tokens (sinks, window and the not yet indexed tail), its seconds less any index
building inside it, the native call's seconds and the kernel's phases (``kernel.start_phase_timers``),
and whether a background build was in flight. The report (``--out``, ``.md`` and ``.json``) gives,
per group, us a request and layer: the call, the native run, its phases one by one, and the Python
above it; beside them the cost model's own figures (its fit of exact and sampled attention).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
BATCH_GROUPS = (1, 4, 12, 32, 128)  # a call's sampled requests go to the first group at least as large
PHASES = ("queries", "lookup", "gather_logits", "softmax_v", "dense", "merge")


# ----------------------------------------------------------------------------- in the worker
def install(_worker=None):
    """Record every sparse layer call that samples, in the worker process (``read`` returns them)."""
    import builtins
    import time

    from vllm_magicpig import _C, kernel, layer

    records: list[dict] = []
    builtins._magicpig_load_split = records
    native = [0.0]  # the native runs' seconds inside the current call

    forward = layer.SparseLayer.forward

    def timed_forward(self, query, kv, plan, output):
        rt = self.ctx.runtime
        building = rt.indexer is not None and rt.indexer.building()
        built0, phases0 = rt.stats.build_seconds, dict(_C.profile())
        native[0] = 0.0
        t0 = time.perf_counter()
        served = forward(self, query, kv, plan, output)
        seconds = time.perf_counter() - t0
        if plan.sparse:
            phases1 = dict(_C.profile())
            ranges = plan.dense_ranges
            records.append({
                "requests": len(plan.sparse), "keys": sum(plan.seq_lens[r] for r in plan.sparse),
                "segments": sum(len(plan.segments[r]) for r in plan.sparse),
                "exact_tokens": int(sum(int(ranges[r, 0, 1] - ranges[r, 0, 0] + ranges[r, 1, 1] - ranges[r, 1, 0])
                                        for r in plan.sparse)),
                "seconds": seconds - (rt.stats.build_seconds - built0), "native": native[0],
                "phases": {k: v - phases0.get(k, 0.0) for k, v in phases1.items()},
                "building": building, "all_served": bool(served)})
        return served

    class NativeRun:  # the native step object, its runs timed
        def __init__(self, step):
            self.step = step

        def run(self, *args):
            t0 = time.perf_counter()
            try:
                return self.step.run(*args)
            finally:
                native[0] += time.perf_counter() - t0

    init = kernel.DecodeStep.__init__

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._c = NativeRun(self._c)

    kernel.DecodeStep.__init__ = wrapped_init
    layer.SparseLayer.forward = timed_forward
    kernel.start_phase_timers()
    return True


def read(_worker=None):
    import builtins

    return builtins._magicpig_load_split


# ----------------------------------------------------------------------------- arithmetic
def batch_group(requests: int) -> int:
    return next(b for b in BATCH_GROUPS if requests <= b) if requests <= BATCH_GROUPS[-1] else requests


def summarise(records: list[dict]) -> list[dict]:
    """One row per (build in flight, batch group): the calls, and per sampled request and layer the
    call's us, the native run's, its phases', the Python above it; keys, segments and exactly
    attended tokens a request; the exact part's ns a token."""
    groups: dict[tuple[bool, int], list[dict]] = defaultdict(list)
    for rec in records:
        if rec["requests"] and rec["all_served"]:
            groups[(rec["building"], batch_group(rec["requests"]))].append(rec)
    rows = []
    for (building, group), recs in sorted(groups.items()):
        n = sum(r["requests"] for r in recs)
        phases = {p: sum(r["phases"].get(p, 0.0) for r in recs) for p in PHASES}
        seconds, native = sum(r["seconds"] for r in recs), sum(r["native"] for r in recs)
        exact_tokens = sum(r["exact_tokens"] for r in recs)
        rows.append({
            "building": building, "batch": group, "calls": len(recs), "requests": n,
            "us": 1e6 * seconds / n, "native_us": 1e6 * native / n, "phases_us": 1e6 * sum(phases.values()) / n,
            "python_us": 1e6 * (seconds - native) / n,
            "phase_us": {p: 1e6 * s / n for p, s in phases.items()},
            "keys": sum(r["keys"] for r in recs) / n, "segments": sum(r["segments"] for r in recs) / n,
            "exact_tokens": exact_tokens / n,
            "dense_ns_per_token": 1e9 * phases["dense"] / exact_tokens if exact_tokens else 0.0})
    return rows


def table(rows: list[dict]) -> list[str]:
    head = ["build beside", "batch <=", "calls", "us a request", "native", "phases", "Python above"] + \
        list(PHASES) + ["keys", "segments", "exact tokens", "exact ns a token"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ["yes" if r["building"] else "no", str(r["batch"]), str(r["calls"])]
        cells += [f"{r[k]:.0f}" for k in ("us", "native_us", "phases_us", "python_us")]
        cells += [f"{r['phase_us'][p]:.1f}" for p in PHASES]
        cells += [f"{r['keys']:.0f}", f"{r['segments']:.2f}", f"{r['exact_tokens']:.0f}",
                  f"{r['dense_ns_per_token']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cost_model_lines(cost: dict | None) -> list[str]:
    if not cost:
        return ["The cost model was off."]
    cal = cost.get("calibration") or {}
    return [f"The cost model at the end: exact {cost.get('exact_us@4096')} / sampled {cost.get('sparse_us@4096')} us "
            f"a request and layer at 4K, exact {cost.get('exact_us@16384')} at 16K; builds "
            f"{cost.get('build_ms_per_1k_tokens')} ms per 1K tokens and layer; {cost.get('deferred_prompts')} prompts "
            f"deferred. Its start-up calibration: contexts {cal.get('contexts')}, exact us {cal.get('exact_us')}, "
            f"sampled us {cal.get('sparse_us')}, builds {cal.get('build_ms_per_1k_tokens')} ms per 1K tokens."]


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--doc-tokens", default="2048,7168", help="prompt lengths: lo,hi (uniform)")
    ap.add_argument("--answer-tokens", type=int, default=512)
    ap.add_argument("--magicpig", default="{}", help="more keys of MAGICPIG's config, as JSON")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "load_split")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.doc_tokens.split(","))
    from vllm_magicpig.config import parse_config

    magicpig = {"K": 10, "L": 150, **json.loads(args.magicpig)}
    parse_config(magicpig)  # a bad key fails here, before an engine starts
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with our callables
    import e2e_decode as e2e
    from vllm import LLM, SamplingParams

    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    e2e.bind_threads("default")
    kv_gib = e2e.kv_space_gib([hi + args.answer_tokens], [args.prompts], 0, e2e.kv_bytes_per_token(model))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    llm = LLM(model=model, attention_backend="MAGICPIG", enforce_eager=True, max_model_len=hi + args.answer_tokens,
              seed=0, max_num_seqs=128, max_num_batched_tokens=2048, additional_config={"magicpig": magicpig})
    e2e.pin_schedulers(e2e.keep_off_worker_cores())
    tok = llm.get_tokenizer()
    rng = random.Random(args.seed)
    prompts = [e2e.distinct_prompt(tok, rng.randint(lo, hi), seed=5000 + i) for i in range(args.prompts)]
    llm.collective_rpc(install)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True),
                 use_tqdm=False)
    wall = time.perf_counter() - t0
    records = llm.collective_rpc(read)[0]
    st = e2e._stats(llm)
    rows = summarise(records)
    lines = [f"Command: `python benchmarks/load_split.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"{args.prompts} prompts of {lo}-{hi} tokens at once, {args.answer_tokens}-token answers, MAGICPIG "
             f"{json.dumps(magicpig)}, vLLM's default thread binding; {wall:.1f} s. Decodes sampled "
             f"{st.get('decode_sparse')}, served exactly {st.get('decode_exact')}; sampled fraction "
             f"{st.get('sampled_fraction', 0):.2%}.", "",
             "Per sampled request and sparse layer, us: the call (less index building inside it), the native run, "
             "its phases (sum, then one by one), the Python above the native run; keys, segments and exactly "
             "attended tokens a request; the exact part's (`dense`) ns a token and request. Calls grouped by "
             "whether a background build was in flight and by their sampled requests.", ""]
    lines += table(rows) + [""] + cost_model_lines(st.get("cost_model"))
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"wall_s": wall, "rows": rows, "stats": st}, indent=1,
                                                         default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
