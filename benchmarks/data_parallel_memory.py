"""Two data-parallel engines on one memory node, whose index caps fit one engine but not both: does
the node keep MAGICPIG's reserve (``node_reserve_mb``) free, and is every request still answered?

vLLM starts each engine of a dense model's ``--data-parallel-size`` as if it were alone on the node
(a parallel world of one), so each plans its KV cache and index cap alone at start-up and counts
the other's cap as free memory (``vllm_magicpig/node_memory.py``). This script starts such a server,
sends ``--requests`` distinct pass-key prompts at once, samples the node's free memory every 0.5 s
while they run, and reports the lowest free memory against the reserve, each engine's index bytes
and decodes by reason (``node_memory_low``: served exactly for the node's memory), and the answers.

The index is made heavy on purpose (L=1024 tables; K=1 so that builds are quick: ~195 KB a token
over SmolLM2's 28 sparse layers), so two engines fill a 24 GB machine within minutes. K=1 samples
nearly every key through 1,024 tables, so decoding is slow: keep ``--max-tokens`` small.

    python benchmarks/data_parallel_memory.py --out benchmarks/results/data_parallel_memory   # ~8 min
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GIB, MIB = 2**30, 2**20
RESULTS = Path(__file__).resolve().parent / "results"
METRICS_SETTLE_S = 25  # vLLM's stats interval (10 s) and MAGICPIG's trailing fetch after activity


def summarize(samples: list[tuple[float, int]], reserve_bytes: int) -> dict:
    """The lowest free memory sampled, when (s from the first sample), and how far below the reserve."""
    if not samples:
        return {"samples": 0}
    t0 = samples[0][0]
    t_low, low = min(samples, key=lambda s: s[1])
    return {"samples": len(samples), "min_free_gib": round(low / GIB, 3), "at_s": round(t_low - t0, 1),
            "below_reserve_mib": round(max(0, reserve_bytes - low) / MIB, 1),
            "last_free_gib": round(samples[-1][1] / GIB, 3)}


def engine_metrics(text: str) -> dict[str, dict]:
    """Per engine, from the server's /metrics: index and mirror bytes, decodes by reason."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        m = re.match(r'vllm:magicpig_(index_bytes|mirror_bytes|decodes_total)\{(.*)\} ([0-9.e+]+)$', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        engine = out.setdefault(labels.get("engine", "0"), {"decodes": {}})
        value = float(m.group(3))
        if m.group(1) == "decodes_total":
            if value:
                engine["decodes"][labels.get("reason", "?")] = int(value)
        else:
            engine[m.group(1)] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=7000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cap-mb", type=int, default=10000, help="index_memory_mb of each engine")
    ap.add_argument("--kv-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE of each engine")
    ap.add_argument("--reserve-mb", type=int, default=512, help="node_reserve_mb")
    ap.add_argument("--out", default=str(RESULTS / "data_parallel_memory"))
    args = ap.parse_args()

    import requests
    from transformers import AutoTokenizer

    from vllm_magicpig import passkey
    from vllm_magicpig.eval.openai_server import launch, stop, wait_healthy
    from vllm_magicpig.host_memory import node_available_bytes
    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    cfg = {"K": 1, "L": 1024, "cost_model": False, "index_memory_mb": args.cap_mb, "node_reserve_mb": args.reserve_mb}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    free_before = node_available_bytes()
    srv = launch(model, out.with_suffix(".server.log"), cfg, max_model_len=8192, kv_cache_gb=args.kv_gb,
                 extra_args=("--data-parallel-size", "2"))
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.monotonic(), node_available_bytes()))
            time.sleep(0.5)

    try:
        started_s = wait_healthy(srv, 900)
        free_started = node_available_bytes()
        threading.Thread(target=sample, daemon=True).start()
        prompts = [passkey.build(tok, args.prompt_tokens, seed=100 + i, depth=0.5) for i in range(args.requests)]

        def ask(p):
            r = requests.post(f"{srv.url}/v1/completions", timeout=3600,
                              json={"model": model, "prompt": p.text, "max_tokens": args.max_tokens, "temperature": 0})
            return r.status_code, (r.json()["choices"][0]["text"] if r.ok else r.text[:200]), p.pass_key

        t0 = time.monotonic()
        with ThreadPoolExecutor(args.requests) as ex:
            answers = list(ex.map(ask, prompts))
        wall = time.monotonic() - t0
        # /metrics is refreshed from the workers an interval after activity (metrics.py): the last one
        time.sleep(METRICS_SETTLE_S)
        engines = engine_metrics(requests.get(f"{srv.url}/metrics", timeout=30).text)
    finally:
        done.set()
        stop(srv.proc)
    log = out.with_suffix(".server.log").read_text(errors="replace")
    result = {
        "command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "config": cfg,
        "kv_cache_gib_each": args.kv_gb, "free_before_gib": round(free_before / GIB, 2),
        "free_after_start_gib": round(free_started / GIB, 2), "startup_s": round(started_s),
        "caps_sum_gib": round(2 * args.cap_mb * MIB / GIB, 2), "wall_s": round(wall),
        "answered": sum(1 for s, _, _ in answers if s == 200), "requests": args.requests,
        "pass_key_found": sum(1 for s, text, key in answers if s == 200 and key in text),
        "free_memory": summarize(samples, args.reserve_mb * MIB), "engines": engines,
        "startup_checks": [line.split("] ", 1)[-1] for line in log.splitlines() if "KV cache as sized" in line],
        "node_warnings": sum(1 for line in log.splitlines() if "memory node has" in line),
        "oom_or_died": any(w in log for w in ("Killed", "OOM", "died unexpectedly")),
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    fm = result["free_memory"]
    lines = [f"Command: `{result['command']}` ({result['date']})", "",
             f"Two engines (`--data-parallel-size 2`), each a {args.kv_gb} GiB KV cache and an index cap of "
             f"{args.cap_mb} MiB (K=1, L=1024), node_reserve_mb {args.reserve_mb}; free memory "
             f"{result['free_before_gib']} GiB before start-up, {result['free_after_start_gib']} GiB after. Each "
             "engine's start-up check saw the node alone:", ""]
    lines += [f"- {line}" for line in result["startup_checks"]]
    lines += ["", f"{args.requests} prompts of ~{args.prompt_tokens} tokens sent at once, {args.max_tokens} tokens "
              f"each: {result['answered']} answered, {result['pass_key_found']} with the pass key, "
              f"{result['wall_s']} s. "
              f"Lowest free memory sampled (every 0.5 s): **{fm.get('min_free_gib')} GiB** at {fm.get('at_s')} s "
              f"({fm.get('below_reserve_mib')} MiB below the reserve); {result['node_warnings']} node warnings "
              f"in the log; OOM or a dead engine: {result['oom_or_died']}.", "",
              "| engine | index + mirror GiB | decodes sampled | exact: node_memory_low | exact: other |",
              "|---|---|---|---|---|"]
    for name, e in sorted(engines.items()):
        d = dict(e["decodes"])
        sampled, low = d.pop("magicpig", 0), d.pop("node_memory_low", 0)
        held = (e.get("index_bytes", 0) + e.get("mirror_bytes", 0)) / GIB
        other = ", ".join(f"{k} {v}" for k, v in sorted(d.items()))
        lines.append(f"| {name} | {held:.2f} | {sampled} | {low} | {other} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
