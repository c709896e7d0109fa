"""Load test of vLLM's OpenAI server: MAGICPIG against CPU_ATTN, the same requests, one run.

    python benchmarks/serve_load.py                       # the full run: 200 concurrent requests
    python benchmarks/serve_load.py --requests 24 --doc-tokens 1024,3072 --out /tmp/serve_load  # CI-sized
    python benchmarks/serve_load.py --requests 60 --doc-tokens 2048,7168 --answer-tokens 512 \
        --out benchmarks/results/serve_load_long_answers        # long answers over long documents

Runs (``--backends``): ``MAGICPIG``, the plugin as a user gets it (the cost model on: a decode that
sampling would not speed up is served exactly, and a prompt is indexed only once its decodes would
pay for the build); ``MAGICPIG-sampled``, the same with ``cost_model: false``, so every decode it can
sample is sampled: the sampled path, its index memory cap and eviction under load; ``CPU_ATTN``, the
baseline.

For each run in turn, the server is started on 127.0.0.1 (``python -m
vllm.entrypoints.openai.api_server``, eager mode), and every request of one seeded workload is
sent at once (all concurrent; vLLM queues what does not fit). The workload mixes:

* retrievals: 1K-7K-token documents with a pass key hidden at a random depth (completions,
  greedy, streaming and not, some with a stop string), answered correctly or not. With
  ``--answer-tokens N`` each retrieval instead streams an answer of exactly N tokens (greedy,
  ``ignore_eos``, no stop string: the key, then the model's continuation), the load in which
  sampling can pay for a prompt's index: a short answer ends before its decodes have saved what
  building the index costs, so the cost model rightly serves it exactly;
* short chats (chat completions, greedy or sampled, streaming and not);
* ``n > 1`` sampling; stop strings; clients that disconnect after a few streamed chunks;
* bad requests (over the model length, bad sampling parameters, malformed JSON), which must get a 4xx.

Every response is checked: no 5xx, no transport error, a 4xx for each bad request and for nothing
else, ``n`` choices where ``n`` was asked, no stop string in the text. Retrieval is compared as a rate
(batch make-up changes bf16 logits, so the same request can answer differently on either backend).
During the run the server's ``/metrics`` and the resident memory of its processes are sampled; after
it, the server must still answer. MAGICPIG's own counters (from ``/metrics``) show what it served
sparse and what exactly, and why, and the most index memory it held against ``index_memory_mb``.

The report goes to ``--out`` (``.md`` and ``.json``); the checks' failures are listed there and make
the exit status 1. ``tests/test_serve_load.py`` runs the CI-sized version through :func:`run`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import requests as http

from vllm_magicpig.config import parse_config
from vllm_magicpig.eval import openai_server as srv

RESULTS = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 8192

CHATS = [
    "Say hello in one word.",
    "Name three colours.",
    "What is two plus two?",
    "Give me a synonym for happy.",
    "Write one short sentence about the sea.",
    "What day comes after Monday?",
]
COUNTING = "Count from one to ten: one, two, three,"


@dataclass
class Job:
    """One request of the workload and what its response must show."""

    idx: int
    kind: str  # retrieval | chat | n_sampling | stop | disconnect | bad_*
    path: str
    body: dict | None  # None: ``raw`` is sent as the body (malformed JSON)
    stream: bool = False
    raw: str | None = None
    pass_key: str | None = None  # retrievals: the answer
    stop: str | None = None  # must not appear in the returned text
    n: int = 1
    disconnect_after: int = 0  # streamed chunks read before the client hangs up (0: read all)
    expect_4xx: bool = False
    doc_tokens: int = 0
    long_answer: bool = False  # a retrieval of --answer-tokens tokens (its decode rate is reported)


@dataclass
class Outcome:
    idx: int
    kind: str
    status: int = 0  # HTTP status (0: transport error)
    latency_s: float = 0.0
    ttft_s: float | None = None  # streaming: first content chunk
    completion_tokens: int = 0
    correct: bool | None = None  # retrievals
    failure: str | None = None  # a broken check, in words
    text: str = ""


def make_workload(tokenizer, model: str, num: int, doc_tokens: tuple[int, int], seed: int,
                  answer_tokens: int | None = None) -> list[Job]:
    """``num`` requests in a seeded mix (the same for every backend); ``answer_tokens``: each retrieval
    streams an answer of exactly that many tokens instead of a short one."""
    from vllm_magicpig import passkey

    rng = random.Random(seed)
    # kinds in proportion; at least one of each, bad requests and disconnects a few
    weights = {"retrieval": 0.35, "chat": 0.30, "n_sampling": 0.10, "stop": 0.10, "disconnect": 0.07,
               "bad_too_long": 0.03, "bad_sampling": 0.03, "bad_json": 0.02}
    kinds = [k for k, w in weights.items() if k != "retrieval" for _ in range(max(1, round(w * num)))]
    kinds += ["retrieval"] * max(1, num - len(kinds))  # retrievals take the rest
    rng.shuffle(kinds)
    jobs = []
    for i, kind in enumerate(kinds):
        stream = rng.random() < 0.5
        if kind == "retrieval":
            n_tok = rng.randint(*doc_tokens)
            p = passkey.build(tokenizer, n_tok, seed=seed * 1000 + i, depth=rng.uniform(0.1, 0.9))
            body = {"model": model, "prompt": p.text, "max_tokens": 12, "temperature": 0}
            stop = None
            cut = rng.random() < 0.3  # drawn either way, so both mixes keep the rest of the seed's draws
            if answer_tokens:
                # streamed, so its decode rate can be timed from its first token on
                body.update(max_tokens=answer_tokens, ignore_eos=True)
                stream = True
            elif cut:  # the answer is "<key>." or "<key>,": a stop string cuts it
                stop = "."
                body["stop"] = [stop]
            jobs.append(Job(i, kind, "/v1/completions", body, stream, pass_key=p.pass_key, stop=stop,
                            doc_tokens=p.num_tokens, long_answer=bool(answer_tokens)))
        elif kind == "chat":
            body = {"model": model, "messages": [{"role": "user", "content": rng.choice(CHATS)}],
                    "max_tokens": 32, "temperature": rng.choice([0, 0.7])}
            jobs.append(Job(i, kind, "/v1/chat/completions", body, stream))
        elif kind == "n_sampling":
            n = rng.choice([2, 3])
            body = {"model": model, "prompt": rng.choice(CHATS), "max_tokens": 16, "temperature": 0.8, "n": n,
                    "seed": i}
            jobs.append(Job(i, kind, "/v1/completions", body, stream, n=n))
        elif kind == "stop":
            body = {"model": model, "prompt": COUNTING, "max_tokens": 24, "temperature": 0, "stop": [" six"]}
            jobs.append(Job(i, kind, "/v1/completions", body, stream, stop=" six"))
        elif kind == "disconnect":
            # a long prompt (served sparse once decoding starts), dropped after two streamed chunks
            p = passkey.build(tokenizer, doc_tokens[0], seed=seed * 1000 + i, depth=0.5)
            body = {"model": model, "prompt": p.text, "max_tokens": 64, "temperature": 0,
                    "ignore_eos": True}
            jobs.append(Job(i, kind, "/v1/completions", body, True, disconnect_after=2, doc_tokens=p.num_tokens))
        elif kind == "bad_too_long":
            body = {"model": model, "prompt": "hello " * (MAX_MODEL_LEN + 100), "max_tokens": 4}
            jobs.append(Job(i, kind, "/v1/completions", body, expect_4xx=True))
        elif kind == "bad_sampling":
            body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": -1.0}
            jobs.append(Job(i, kind, "/v1/completions", body, expect_4xx=True))
        else:  # bad_json
            jobs.append(Job(i, kind, "/v1/completions", None, raw='{"model": "x", "prompt": ', expect_4xx=True))
    return jobs


def _texts(payload: dict) -> tuple[list[str], list[str | None]]:
    """(text, finish_reason) of each choice of a non-streamed response."""
    choices = payload.get("choices", [])
    return ([c.get("text") or (c.get("message") or {}).get("content") or "" for c in choices],
            [c.get("finish_reason") for c in choices])


async def send(session: aiohttp.ClientSession, url: str, job: Job) -> Outcome:
    out = Outcome(job.idx, job.kind)
    t0 = time.perf_counter()
    body = dict(job.body) if job.body is not None else None
    if body is not None and job.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body) if body is not None else job.raw
    try:
        async with session.post(url + job.path, data=data, headers={"Content-Type": "application/json"}) as resp:
            out.status = resp.status
            if resp.status != 200 or not job.stream:
                payload = await resp.read()
                out.latency_s = time.perf_counter() - t0
                if resp.status == 200:
                    doc = json.loads(payload)
                    texts, finish = _texts(doc)
                    out.completion_tokens = (doc.get("usage") or {}).get("completion_tokens", 0)
                else:
                    texts, finish = [payload.decode(errors="replace")[:300]], []
            else:
                pieces: dict[int, list[str]] = {}
                reasons: dict[int, str | None] = {}
                chunks = 0
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    line = line[5:].strip()
                    if line == "[DONE]":
                        break
                    doc = json.loads(line)
                    if doc.get("usage"):
                        out.completion_tokens = doc["usage"].get("completion_tokens", 0)
                    for c in doc.get("choices", []):
                        piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                        if piece and out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - t0
                        pieces.setdefault(c.get("index", 0), []).append(piece)
                        if c.get("finish_reason"):
                            reasons[c.get("index", 0)] = c["finish_reason"]
                    chunks += 1
                    if job.disconnect_after and chunks >= job.disconnect_after:
                        resp.close()  # hang up mid-stream: the connection is dropped, not drained
                        break
                out.latency_s = time.perf_counter() - t0
                texts = ["".join(pieces[k]) for k in sorted(pieces)]
                finish = [reasons.get(k) for k in sorted(pieces)]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.latency_s = time.perf_counter() - t0
        out.failure = f"transport: {type(e).__name__}: {e}"
        return out
    out.text = texts[0] if texts else ""
    out.failure = check(job, out, texts, finish)
    return out


def check(job: Job, out: Outcome, texts: list[str], finish: list[str | None]) -> str | None:
    """What is wrong with this response (None: nothing)."""
    if out.status >= 500:
        return f"HTTP {out.status}: {out.text[:200]}"
    if job.expect_4xx:
        return None if 400 <= out.status < 500 else f"bad request answered HTTP {out.status}"
    if out.status != 200:
        return f"HTTP {out.status}: {texts[0][:200] if texts else ''}"
    if job.disconnect_after:
        return None
    if len(texts) != job.n:
        return f"{len(texts)} choices, asked for {job.n}"
    if not all(f in ("stop", "length") for f in finish):  # sampled text may be empty (an early EOS)
        return f"finish reasons {finish}"
    if job.stop and any(job.stop in t for t in texts):
        return f"stop string {job.stop!r} in the text"
    if job.long_answer and out.completion_tokens != job.body["max_tokens"]:
        return f"{out.completion_tokens} tokens answered, asked for exactly {job.body['max_tokens']} (ignore_eos)"
    if job.pass_key is not None:
        out.correct = job.pass_key in texts[0]
    return None


async def sample_while(stop: asyncio.Event, server: srv.Server, every_s: float, rss: list, scrapes: list) -> None:
    """Resident memory of the server's processes and MAGICPIG's index gauges, until ``stop``."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        rss.append(await loop.run_in_executor(None, srv.group_rss_bytes, server.proc))
        try:
            s = await loop.run_in_executor(None, srv.scrape, server.url)
            scrapes.append({"index_bytes": srv.metric_value(s, "vllm:magicpig_index_bytes"),
                            "mirror_bytes": srv.metric_value(s, "vllm:magicpig_mirror_bytes")})
        except Exception:  # noqa: BLE001  (a slow scrape under load is not a failure of the run)
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


async def drive(server: srv.Server, jobs: list[Job], timeout_s: float) -> tuple[list[Outcome], float, list, list]:
    rss: list[int] = []
    scrapes: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_while(stop, server, 2.0, rss, scrapes))
    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap: every request is in flight at once
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(send(session, server.url, j) for j in jobs))
        wall = time.perf_counter() - t0
    stop.set()
    await sampler
    return list(outcomes), wall, rss, scrapes


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def decode_ms_per_token(out: Outcome) -> float | None:
    """A streamed answer's time from its first token to its last, per token after the first: its
    decode rate as its client saw it (None without a first token or a second)."""
    if out.ttft_s is None or out.completion_tokens < 2 or out.failure:
        return None
    return 1e3 * (out.latency_s - out.ttft_s) / (out.completion_tokens - 1)


def summarize(jobs: list[Job], outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    served = [o for o, j in zip(outcomes, jobs) if not j.expect_4xx and not j.disconnect_after and o.status == 200]
    rates = [r for o, j in zip(outcomes, jobs) if j.long_answer and (r := decode_ms_per_token(o)) is not None]
    lat = [o.latency_s for o in served]
    ttft = [o.ttft_s for o in served if o.ttft_s is not None]
    retr = [o for o in outcomes if o.kind == "retrieval" and o.correct is not None]
    retr_lat = [o.latency_s for o in retr]
    tokens = sum(o.completion_tokens for o in served)
    return {
        "requests": len(jobs), "wall_s": round(wall, 1),
        "completed": len(served), "req_per_s": round(len(served) / wall, 3),
        "output_tok_per_s": round(tokens / wall, 2), "output_tokens": tokens,
        "latency_s": {f"p{q}": round(pct(lat, q), 2) for q in (50, 90, 99)} if lat else {},
        "retrieval_latency_s": {f"p{q}": round(pct(retr_lat, q), 2) for q in (50, 90, 99)} if retr_lat else {},
        "ttft_s": {f"p{q}": round(pct(ttft, q), 2) for q in (50, 90, 99)} if ttft else {},
        # the long answers' decode, ms a token from first token to last (prefill and queueing left out)
        "long_answers": len(rates),
        "long_answer_ms_per_token": ({f"p{q}": round(pct(rates, q), 1) for q in (50, 90)}
                                     | {"mean": round(statistics.mean(rates), 1)}) if rates else {},
        "retrievals": len(retr), "retrieval_correct": sum(o.correct for o in retr),
        "status_counts": {str(s): sum(o.status == s for o in outcomes) for s in sorted({o.status for o in outcomes})},
        "failures": [f"#{o.idx} {o.kind}: {o.failure}" for o in outcomes if o.failure],
    }


def magicpig_counters(scraped: dict) -> dict[str, Any]:
    v = lambda name, **lab: srv.metric_value(scraped, f"vllm:magicpig_{name}", **lab)
    exact = {}
    for (name, labels), val in scraped.items():
        lab = dict(labels)
        if name == "vllm:magicpig_decodes_total" and lab.get("served") == "exact" and val:
            exact[lab["reason"]] = exact.get(lab["reason"], 0) + int(val)
    return {
        "decodes_sparse": int(v("decodes_total", served="sparse") or 0),
        "decodes_exact": exact,
        "sampled_fraction": v("sampled_fraction"),
        "held_bytes_peak": int(v("held_bytes_peak") or 0),
        "segments": {e: int(v("segments_total", event=e) or 0)
                     for e in ("built", "merged", "evicted", "invalidated", "refused")},
        "built_on_outlook": int(v("prompts_built_on_outlook_total") or 0),
    }


# The runs --backends names: label -> (vLLM backend, what the run sets in MAGICPIG's config).
RUNS = {"MAGICPIG": ("MAGICPIG", {}), "MAGICPIG-sampled": ("MAGICPIG", {"cost_model": False}),
        "CPU_ATTN": ("CPU_ATTN", None)}


def magicpig_config(index_mb: int, extra: dict) -> dict:
    """MAGICPIG's config for this load: K=10, L=150, the cap, and ``--magicpig``'s keys, checked by the
    plugin's own parser now rather than by the server minutes into a run."""
    cfg = {"K": 10, "L": 150, "index_memory_mb": index_mb} | extra
    try:
        parse_config({"magicpig": cfg})
    except ValueError as e:
        raise SystemExit(f"--magicpig: {e}") from None
    return cfg


def run_config(label: str, magicpig: dict) -> tuple[str, dict | None]:
    """The vLLM backend of run ``label`` and its MAGICPIG config (None for an exact backend)."""
    if label not in RUNS:
        raise SystemExit(f"unknown run {label!r}: choose from {', '.join(RUNS)}")
    backend, override = RUNS[label]
    return backend, None if override is None else magicpig | override


def samples_every_decode(cfg: dict) -> bool:
    """Whether a MAGICPIG config samples every decode it can (no cost model deciding against it), so
    a run of it that served no decode sparse fell back to exact attention without a reason."""
    return not parse_config({"magicpig": cfg}).cost_model  # the plugin's own defaults decide


def run_backend(label: str, model: str, jobs: list[Job], log_dir: Path, magicpig: dict, kv_cache_gb: int,
                timeout_s: float) -> dict[str, Any]:
    backend, cfg = run_config(label, magicpig)
    server = srv.launch(model, log_dir / f"server_{label}.log", cfg,
                        max_model_len=MAX_MODEL_LEN, backend=backend, kv_cache_gb=kv_cache_gb,
                        VLLM_LOG_STATS_INTERVAL="1")
    try:
        startup_s = srv.wait_healthy(server)
        time.sleep(2)  # let the start-up settle before the idle memory is read
        rss_ready = srv.group_rss_bytes(server.proc)
        outcomes, wall, rss, scrapes = asyncio.run(drive(server, jobs, timeout_s))
        report = summarize(jobs, outcomes, wall)
        report.update(backend=backend, label=label, startup_s=round(startup_s, 1),
                      rss_ready_gb=round(rss_ready / 2**30, 2), rss_peak_gb=round(max(rss + [rss_ready]) / 2**30, 2))
        # afterwards: still serving, and (MAGICPIG) its counters, once the plugin's trailing fetch ran
        time.sleep(3)
        after = http.post(f"{server.url}/v1/completions", json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=60)
        report["healthy_after"] = srv.healthy(server.url) and after.status_code == 200
        if cfg is not None:
            report["magicpig"] = magicpig_counters(srv.scrape(server.url))
            report["magicpig"]["config"] = cfg
            report["magicpig"]["index_memory_mb"] = cfg["index_memory_mb"]
            report["magicpig"]["scraped_held_max"] = max(
                ((s["index_bytes"] or 0) + (s["mirror_bytes"] or 0) for s in scrapes), default=0)
        report["outcomes"] = [asdict(o) | {"text": o.text[:80]} for o in outcomes]
        return report
    finally:
        srv.stop(server.proc)


def verdict(reports: dict[str, dict], jobs: list[Job], kv_cache_gb: int, slack_gb: float) -> list[str]:
    """The run's failed checks (empty: it passed)."""
    bad: list[str] = []
    for name, r in reports.items():
        bad += [f"{name}: {f}" for f in r["failures"]]
        if not r["healthy_after"]:
            bad.append(f"{name}: not serving after the load")
        # memory: what the KV cache, the index cap and slack allow above the idle server
        allowed = kv_cache_gb + slack_gb + (r.get("magicpig", {}).get("index_memory_mb", 0) / 1024)
        if r["rss_peak_gb"] - r["rss_ready_gb"] > allowed:
            bad.append(f"{name}: RSS grew {r['rss_peak_gb'] - r['rss_ready_gb']:.2f} GB > {allowed:.2f} GB allowed")
    ex = reports.get("CPU_ATTN")
    for name, mp in reports.items():
        c = mp.get("magicpig")
        if c is None:
            continue
        # With the cost model on, a run may rightly serve every decode exactly (the counters give the
        # reasons); with it off, a run with no sparse decode fell back without one.
        if c["decodes_sparse"] == 0 and samples_every_decode(c["config"]):
            bad.append(f"{name}: no decode was served sparse (a silent fallback to exact attention?)")
        if c["held_bytes_peak"] > c["index_memory_mb"] * 2**20:
            bad.append(f"{name}: held {c['held_bytes_peak']} bytes > index_memory_mb={c['index_memory_mb']}")
        if ex and ex["retrievals"]:
            # bf16 logits depend on the batch make-up, so single answers may flip either way: compare
            # rates, allowing one answer in twenty (at least one).
            tol = max(1, round(0.05 * ex["retrievals"]))
            if mp["retrieval_correct"] < ex["retrieval_correct"] - tol:
                bad.append(f"retrieval: {name} {mp['retrieval_correct']}/{mp['retrievals']} < CPU_ATTN "
                           f"{ex['retrieval_correct']}/{ex['retrievals']} - {tol}")
    return bad


def render(args, jobs: list[Job], reports: dict[str, dict], problems: list[str], command: str) -> str:
    lines = [f"Command: `{command}` ({time.strftime('%Y-%m-%d')})", "",
             f"# OpenAI server under load: {len(jobs)} concurrent requests, SmolLM2-135M-Instruct", ""]
    kinds: dict[str, int] = {}
    for j in jobs:
        kinds[j.kind] = kinds.get(j.kind, 0) + 1
    docs = [j.doc_tokens for j in jobs if j.doc_tokens]
    lines += [f"Mix: {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; documents {min(docs)}-{max(docs)} "
              f"tokens (mean {statistics.mean(docs):.0f}); {sum(j.stream for j in jobs)} streamed. "
              f"Server: eager, max-model-len {MAX_MODEL_LEN}, KV cache {args.kv_cache_gb} GB, "
              f"MAGICPIG {json.dumps(args.magicpig)} (MAGICPIG-sampled: and "
              f"{json.dumps(RUNS['MAGICPIG-sampled'][1])}).", ""]
    lines += ["| backend | wall s | req/s | out tok/s | latency p50/p90/p99 s | retrieval latency p50/p90/p99 s | "
              "TTFT p50/p90/p99 s | retrieval correct | HTTP statuses | RSS idle / peak GB | healthy after |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    def trio(d):
        return " / ".join(f"{d[k]:.2f}" for k in ("p50", "p90", "p99")) if d else "-"
    for name, r in reports.items():
        lines.append(f"| {name} | {r['wall_s']} | {r['req_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
                     f"{trio(r['latency_s'])} | {trio(r['retrieval_latency_s'])} | {trio(r['ttft_s'])} | "
                     f"{r['retrieval_correct']}/{r['retrievals']} | "
                     f"{', '.join(f'{k}: {v}' for k, v in r['status_counts'].items())} | "
                     f"{r['rss_ready_gb']} / {r['rss_peak_gb']} | {r['healthy_after']} |")
    if any(j.long_answer for j in jobs):
        lines += ["", f"Long answers: each retrieval streamed {args.answer_tokens} tokens (`--answer-tokens`); "
                  "its decode rate is its time from first token to last per token after the first, as its "
                  "client saw it (queueing and prefill, its own and the other requests', left out of it, but "
                  "not the steps it shared with other requests' prefill chunks).", "",
                  "| backend | long answers timed | ms a token p50 / p90 / mean |", "|---|---|---|"]
        for name, r in reports.items():
            m = r["long_answer_ms_per_token"]
            lines.append(f"| {name} | {r['long_answers']} | "
                         + (f"{m['p50']} / {m['p90']} / {m['mean']}" if m else "-") + " |")
    ex = reports.get("CPU_ATTN")
    for name, r in reports.items():
        if "magicpig" in r and ex:
            lines += ["", f"{name} / CPU_ATTN: throughput {r['req_per_s'] / ex['req_per_s']:.2f}x (requests/s), "
                      f"wall time {r['wall_s'] / ex['wall_s']:.2f}x."]
            mine, theirs = r["long_answer_ms_per_token"], ex["long_answer_ms_per_token"]
            if mine and theirs:
                lines[-1] += (f" Long answers' decode: {theirs['mean'] / mine['mean']:.2f}x CPU_ATTN's rate "
                              f"(mean ms a token {mine['mean']} / {theirs['mean']}).")
    for name, r in reports.items():
        if "magicpig" not in r:
            continue
        c = r["magicpig"]
        frac = c["sampled_fraction"]
        lines += ["", f"{name}'s counters after the run (from `/metrics`; a decode is one request x layer; config "
                  f"{json.dumps(c['config'])}):", "",
                  f"- decodes served sparse: {c['decodes_sparse']}; exact, by reason: {c['decodes_exact']}",
                  f"- sampled fraction: {'n/a' if frac is None else f'{frac:.2%}'}",
                  f"- segments: {c['segments']}; prompts built at their first decode on the answer outlook: "
                  f"{c.get('built_on_outlook', 0)}",
                  f"- index + mirror bytes held at most: {c['held_bytes_peak'] / 2**20:.0f} MiB "
                  f"(cap `index_memory_mb` = {c['index_memory_mb']} MiB; largest value scraped during the run: "
                  f"{c['scraped_held_max'] / 2**20:.0f} MiB)"]
    lines += ["", "Checks: " + ("all passed." if not problems else f"{len(problems)} FAILED:"), ""]
    lines += [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def run(requests: int, doc_tokens: tuple[int, int], backends: list[str], out: Path, magicpig: dict,
        kv_cache_gb: int = 4, seed: int = 0, timeout_s: float = 3600, rss_slack_gb: float = 1.5,
        command: str = "", answer_tokens: int | None = None) -> tuple[dict, list[str]]:
    """Run the load for each run of ``backends`` (labels of RUNS); write ``out``.md/.json; return
    (reports by label, failed checks). ``answer_tokens``: the retrievals' answer length (None: short)."""
    from transformers import AutoTokenizer

    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    for label in backends:  # an unknown run fails before any server starts
        run_config(label, magicpig)
    if answer_tokens and doc_tokens[1] + answer_tokens > MAX_MODEL_LEN:
        raise SystemExit(f"documents of up to {doc_tokens[1]} tokens and answers of {answer_tokens} exceed the "
                         f"server's max-model-len {MAX_MODEL_LEN}: shorten one")
    jobs = make_workload(tokenizer, model, requests, doc_tokens, seed, answer_tokens)
    out.parent.mkdir(parents=True, exist_ok=True)
    reports = {b: run_backend(b, model, jobs, out.parent, magicpig, kv_cache_gb, timeout_s) for b in backends}
    problems = verdict(reports, jobs, kv_cache_gb, rss_slack_gb)
    args = argparse.Namespace(kv_cache_gb=kv_cache_gb, magicpig=magicpig, answer_tokens=answer_tokens)
    out.with_suffix(".md").write_text(render(args, jobs, reports, problems, command))
    out.with_suffix(".json").write_text(json.dumps({"reports": reports, "problems": problems}, indent=1))
    return reports, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--doc-tokens", default="1024,7168", help="min,max tokens of the retrieval documents")
    ap.add_argument("--backends", default="MAGICPIG,MAGICPIG-sampled,CPU_ATTN",
                    help=f"comma-separated runs, in order: {', '.join(RUNS)}")
    ap.add_argument("--index-mb", type=int, default=2048, help="MAGICPIG's index_memory_mb")
    ap.add_argument("--magicpig", type=json.loads, default={},
                    help="more keys of MAGICPIG's config for its runs, as JSON (e.g. '{\"segment_tokens\": 128}')")
    ap.add_argument("--answer-tokens", type=int, default=None,
                    help="each retrieval streams an answer of exactly this many tokens (default: short answers)")
    ap.add_argument("--kv-cache-gb", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "serve_load")
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.doc_tokens.split(","))
    magicpig = magicpig_config(a.index_mb, a.magicpig)
    reports, problems = run(a.requests, (lo, hi), a.backends.split(","), a.out, magicpig, a.kv_cache_gb, a.seed,
                            command="python benchmarks/serve_load.py " + " ".join(sys.argv[1:]),
                            answer_tokens=a.answer_tokens)
    print(a.out.with_suffix(".md").read_text())
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
