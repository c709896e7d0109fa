"""vLLM decode speed: MAGICPIG against CPU_ATTN, side by side in one run.

    python benchmarks/e2e_decode.py                     # SmolLM2: 4K, 8K, 16K x batch 1, 4
    python benchmarks/e2e_decode.py --contexts 4096 --batches 1 --decode-tokens 16   # quick
    python benchmarks/e2e_decode.py --model llama-d128 --contexts 32768,65536 --batches 1   # the paper's regime
    python benchmarks/e2e_decode.py --threads default,all     # vLLM's thread binding, then all cores

Method (identical for both backends, each in its own engine, with the same threads). Both engines
are alive at once and every timing is taken in turn, CPU_ATTN then MAGICPIG then MAGICPIG then
CPU_ATTN (``in_turn``): these 2-core machines drift by ~20% within minutes, more than the
differences "never slower" is about, and one engine's whole run after the other's put that drift
between the two figures of a row. The idle engine's worker sleeps while the other runs. The
engines' schedulers are pinned off their workers' cores (``keep_off_worker_cores``).
1. prefill the batch's distinct prompts once (max_tokens=1); prefill time is recorded;
2. decode a few tokens from the prefix cache (MAGICPIG builds the row's LSH index here, from an
   empty index, on its background thread: decoding repeats until it is installed; reported as
   index build time, and as a share of the prompts' prefill);
3. decode timed by vLLM's request timestamps (``decode_seconds``): runs of 8 and 8 + ``--decode-tokens``
   tokens from the prefix cache, each timed from its first token to its last, so the recompute
   of the prompt's last block that every prefix-cache hit pays (before the first token) is left
   out; the difference of the two spans leaves out the first decode steps too. The difference
   of the runs' wall times, which cancels the recompute but carries its noise, is kept beside it;
4. the cold path a user meets: one new prompt of the same length (no prefix-cache hit),
   prefill plus ``--cold-tokens`` tokens, the index build included; reported as ms per
   generated token (``--cold-tokens 0`` skips it);
5. the step's floor, beside each row: the same decode timing over prompts of ~64 tokens, where attention costs
   next to nothing: the model's other work and the engine's loop. With it, each row's step is
   split into the floor, the sparse layers (MAGICPIG's own timer) and the rest (the dense layers),
   and the speed-up a free sparse layer would give is bounded (Amdahl).
Contexts above the model's trained length use linear RoPE scaling (``hf_overrides``) for BOTH
backends. The measured sampled fraction is printed next to every MAGICPIG time.

Models: ``smollm2`` (SmolLM2-135M-Instruct, head_dim 64, 3 KV heads) and ``llama-d128``, a
random-weight Llama written by this script (``load_format="dummy"``): head_dim 128, 8 query /
2 KV heads, 4 layers of which layer 0 stays dense, SmolLM2's tokenizer; its outputs are
meaningless, its shapes are the paper's. Threads: ``default`` is vLLM's binding (the worker on
all cores but the one reserved for the front end: 1 of 2 here); ``all`` binds the worker to every
core (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``).
Results go to benchmarks/results/e2e_decode.{md,json,png} (``--out``); the PNG plots decode speed
against context for both backends.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
SHORT_TOKENS = 8  # the short run of the decode difference (see decode_seconds)
REPEATS = 2  # runs of each length; the fastest counts
# Warm-up: runs of WARM_TOKENS while the index is deferred or building, MAX_WARM_STEPS decode steps
# at most (a prompt it never pays for is served exactly: then the row measures that, and its
# sampled fraction says so). At 8K batch 4 on an AMX machine the cost model deferred the build
# for ~420 steps, then it took ~13 s beside the decodes: a cap of 64 runs of 8 tokens (448 steps)
# left that build inside the timed runs (0.54x, results/e2e_decode_amx_block_cover.md).
WARM_TOKENS = 32
MAX_WARM_STEPS = 1536
BACKENDS = ("CPU_ATTN", "MAGICPIG")  # the baseline first in every turn of in_turn
HANDOVER_S = 1.5  # between two engines' calls: the idle worker's 1 s of polling ends first (in_turn)
ALLOWED_CPUS = frozenset(os.sched_getaffinity(0))  # before any pinning (keep_off_worker_cores)
FLOOR_WORDS = 48  # words of a floor prompt (~64 tokens): attention over it is next to free


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
              hf_overrides=overrides or None, seed=0, max_num_seqs=8,
              disable_log_stats=False)  # request timestamps (the cold row's prefill / decode split)
    if dummy:
        kw["load_format"] = "dummy"
    if backend == "MAGICPIG":
        kw["additional_config"] = {"magicpig": magicpig}
    return LLM(**kw)


def _stats(llm):
    from vllm_magicpig.stats import merge_snapshots

    return merge_snapshots(llm.collective_rpc("magicpig_stats"))


def _timed_generate(llm, prompts, tokens: int) -> float:
    return _generate(llm, prompts, tokens)[0]


def _generate(llm, prompts, tokens: int) -> tuple[float, float]:
    """-> (wall seconds of a ``generate`` of ``tokens`` tokens, seconds from its first token to its
    last by vLLM's request timestamps: ``decode_span_seconds``)."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True),
                           use_tqdm=False)
    return time.perf_counter() - t0, decode_span_seconds(outputs)


def decode_span_seconds(outputs) -> float:
    """Seconds from the first token to the last of a run, by vLLM's per-request timestamps (the
    engine core's clock at each request's first and last token), averaged over the batch's
    requests, which decode in the same steps. The first token comes from the prefill (for a
    prefix-cache hit, the recompute of the prompt's last block), so only decode steps lie between."""
    spans = []
    for out in outputs:
        m = out.metrics
        if m is None or not m.last_token_ts:
            raise RuntimeError("vLLM gave no request timestamps: the engine needs disable_log_stats=False")
        spans.append(m.last_token_ts - m.first_token_ts)
    return sum(spans) / len(spans)


def in_turn(fns: dict, reps: int, pause_s: float = HANDOVER_S) -> dict:
    """Call each of ``fns`` (backend -> function) ``reps`` times, the backends taking turns in
    ABBA order, so the machine's drift (this project's 2-core machines change speed by ~20%
    within minutes) falls on both alike; -> backend -> list of results. Before a call that follows
    the other engine's, wait ``pause_s``: vLLM's worker polls its input queue with ``sched_yield``
    for 1 s after its last step before it sleeps, and on a shared core that would tax the next call."""
    names = list(fns)
    out = {n: [] for n in names}
    last = None
    for rep in range(reps):
        for n in (names if rep % 2 == 0 else names[::-1]):
            if last is not None and last != n:
                time.sleep(pause_s)
            out[n].append(fns[n]())
            last = n
    return out


def generate_in_turn(llms: dict, prompts, tokens: int, reps: int) -> dict:
    """backend -> seconds of each of ``reps`` timed ``generate`` runs of ``prompts``, the engines in turn."""
    return in_turn({n: (lambda llm=llm: _timed_generate(llm, prompts, tokens)) for n, llm in llms.items()}, reps)


class DecodeTiming(NamedTuple):
    step_s: float  # seconds per decode step: the difference of two runs' decode spans (request timestamps)
    wall_difference_s: float  # the same from the two runs' wall times, the recompute cancelling
    request_s: float  # the fastest long run, whole (recompute of the last block included)


def decode_seconds(llms: dict, prompts, decode_tokens: int, reps: int = REPEATS) -> dict:
    """backend -> ``DecodeTiming`` of the batch's decode steps from the prefix cache.

    Each ``generate`` from the prefix cache first recomputes the prompt's last block (vLLM keeps
    at least one prompt token to compute): a prefill of up to a block at the full context, the
    same for both backends, that would dilute a decode ratio. Runs of ``SHORT_TOKENS`` and
    ``SHORT_TOKENS + decode_tokens`` tokens are timed by vLLM's request timestamps from the first
    token to the last (``decode_span_seconds``), which leaves the recompute out, and the step is
    the difference of the two spans over ``decode_tokens``, which leaves out the first decode
    steps too: the step after the first token took ~0.5 s for either backend at 4K tokens, batch 4
    (6x a later step), and would have added ~11 ms to every step of a 40-token span. The same
    difference of the runs' wall times, which cancels the recompute but carries its noise (at 16K
    tokens, batch 4, ~7 s of recompute around ~3 s of decode), is kept beside it as a cross-check.
    The engines take turns (``in_turn``), and the minimum of ``reps`` runs of each is taken (noise
    on these machines only ever adds time)."""
    def run(llm, tokens):
        return lambda: _generate(llm, prompts, tokens)

    short = in_turn({n: run(llm, SHORT_TOKENS) for n, llm in llms.items()}, reps)
    long = in_turn({n: run(llm, SHORT_TOKENS + decode_tokens) for n, llm in llms.items()}, reps)
    def fastest(runs, k):  # k: 0 the wall time, 1 the decode span (_generate)
        return min(r[k] for r in runs)

    out = {}
    for n in llms:
        step = max(fastest(long[n], 1) - fastest(short[n], 1), 1e-9) / decode_tokens
        wall = max(fastest(long[n], 0) - fastest(short[n], 0), 1e-9) / decode_tokens
        out[n] = DecodeTiming(step, wall, fastest(long[n], 0))
    return out


def first_decode_ms(llms: dict, prompt: str, reps: int = REPEATS) -> dict:
    """backend -> milliseconds of a prompt's first decode step, index included: MAGICPIG's index is
    cleared first, so that step meets an unindexed prompt as a new one does (from the prefix
    cache, so no full prefill: the span of a 2-token run by vLLM's request timestamps,
    ``decode_span_seconds``); the fastest of ``reps``. The step after the first token is slower
    than later ones for either backend (see ``decode_seconds``), so the delay indexing adds is
    MAGICPIG's step less CPU_ATTN's."""
    def run(backend: str) -> float:
        if backend == "MAGICPIG":
            llms[backend].collective_rpc("magicpig_clear_index")
        return _generate(llms[backend], [prompt], 2)[1]

    steps = in_turn({n: (lambda n=n: run(n)) for n in llms}, reps)
    return {n: round(1000 * min(steps[n]), 1) for n in llms}


def _waiting(before: dict, after: dict) -> bool:
    """The prompts' index was not in place during the run between two stats: a background build
    is still running, or the cost model deferred it (``index_deferred``: until the exact decodes
    would have paid for it, cost_model.py; ``index_cannot_pay``: the prompt's first request, whose
    few tokens could not pay it back: the warm-up's next runs over the prompt may)."""
    deferred = [sum(st["decode_exact"].get(k, 0) for k in ("index_deferred", "index_cannot_pay"))
                for st in (before, after)]
    return bool(_indexing(after)) or deferred[1] > deferred[0]


def _indexing(st: dict) -> int:
    """Background index jobs not installed yet (installed at the start of a step after they finish)."""
    ix = st["index"]
    return ix.get("background_jobs", 0) - sum(ix.get(k, 0) for k in ("background_installed", "background_dropped",
                                                                      "background_failed"))


def bytes_per_token(st: dict, tokens: int) -> int:
    """MAGICPIG's host bytes (LSH tables + K/V mirror, every layer) per context token."""
    return round((st["index_bytes"] + st["mirror_bytes"]) / max(tokens, 1))


def model_config(model: str) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def kv_bytes_per_token(model: str) -> int:
    """vLLM's own KV cache bytes per token (bf16 K and V, every layer)."""
    cfg = model_config(model)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * 2 * 2


def num_layers(model: str) -> int:
    return model_config(model)["num_hidden_layers"]


def floor_ms_per_step(llms: dict, batch: int, decode_tokens: int) -> dict:
    """backend -> ms per decode step of ``batch`` prompts of ~64 tokens: the step without (much) attention."""
    from vllm import SamplingParams

    words = " ".join(["the river runs past the old mill"] * (FLOOR_WORDS // 7))
    prompts = [f"Note {i}: {words}" for i in range(batch)]
    for llm in llms.values():
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return {n: round(1000 * t.step_s, 2) for n, t in decode_seconds(llms, prompts, decode_tokens).items()}


def _decodes(st: dict) -> int:
    """(request, layer) decodes of the stats window, sparse and exact."""
    return st["decode_sparse"] + sum(st["decode_exact"].values())


def decode_steps(st: dict, batch: int, layers: int) -> float:
    """Decode steps of the stats window, from its (request, layer) decodes (never 0: a divisor)."""
    return max(_decodes(st) / (batch * layers), 1e-9)


def sparse_ms_per_step(st: dict, batch: int, layers: int) -> float:
    """MAGICPIG's sparse-layer time (its own timer, index builds excluded) per decode step of the window."""
    return round(1000 * st["sparse_seconds"] / decode_steps(st, batch, layers), 2)


def dense_layers_per_step(st: dict, batch: int, layers: int) -> float:
    """Layers per step served exactly because they are dense (config), from the decode counters."""
    return layers * st["decode_exact"].get("dense_layer", 0) / max(_decodes(st), 1)


def warm_up(llm, prompts) -> tuple[float, int, float]:
    """MAGICPIG: decode the row's prompts from an empty index until it is in place (built on the
    background thread, or deferred by the cost model until it pays: at most ``MAX_WARM_STEPS``
    decode steps) -> (first run's seconds, runs, seconds spent indexing). Its stats are reset after."""
    llm.collective_rpc("magicpig_clear_index")
    llm.collective_rpc("magicpig_reset_stats")
    before = _stats(llm)
    first_s = _timed_generate(llm, prompts, SHORT_TOKENS)
    runs, steps = 1, SHORT_TOKENS - 1  # a run's first token is the prompt's (prefix-cache) recompute
    while steps < MAX_WARM_STEPS and _waiting(before, after := _stats(llm)):
        before = after
        _timed_generate(llm, prompts, WARM_TOKENS)
        runs, steps = runs + 1, steps + WARM_TOKENS - 1
    build_s = _stats(llm)["build_seconds"]
    llm.collective_rpc("magicpig_reset_stats")
    return first_s, runs, build_s


def engine_phases(llm, prompts, decode_tokens: int, batch: int, layers: int) -> dict:
    """The sparse layers' time in the engine split by the kernel's phase timers, from one more run of the
    row's decodes after its timed ones (so the timers' own cost stays out of the timed figures) -> ms per
    decode step: each phase, ``call`` (MAGICPIG's own timer around the ops call) and ``set_up`` (the call
    less its phases: the Python around the native call, its checks and its preparation). The timers are
    the worker's (the eval extension's RPC ``magicpig_phase_timers``), on the real keys of the row."""
    llm.collective_rpc("magicpig_reset_stats")
    llm.collective_rpc("magicpig_phase_timers", args=(True,))
    try:
        _generate(llm, prompts, decode_tokens)
    finally:
        per_rank = llm.collective_rpc("magicpig_phase_timers", args=(False,))
    st = _stats(llm)
    llm.collective_rpc("magicpig_reset_stats")
    steps = decode_steps(st, batch, layers)
    ms = {k: round(1000 * sum(p[k] for p in per_rank) / steps, 3) for k in per_rank[0]}
    ms["call"] = round(1000 * st["sparse_seconds"] / steps, 3)
    ms["set_up"] = round(ms["call"] - sum(v for k, v in ms.items() if k != "call"), 3)
    return ms


def magicpig_fields(st: dict, batch: int, ctx: int, layers: int, build_s: float) -> dict:
    """What MAGICPIG's stats say of a row's timed decodes."""
    return dict(sampled_fraction=st["sampled_fraction"], decode_sparse=st["decode_sparse"],
                decode_exact=st["decode_exact"], index_MiB=round(st["index_bytes"] / 2**20, 1),
                mirror_MiB=round(st["mirror_bytes"] / 2**20, 1), index_build_s=round(build_s, 2),
                bytes_per_token=bytes_per_token(st, batch * ctx), sparse_kernel_s=st["sparse_seconds"],
                sparse_ms_per_step=sparse_ms_per_step(st, batch, layers),
                dense_layers=dense_layers_per_step(st, batch, layers), layers=layers,
                cost_model=st.get("cost_model"),  # its per-layer timings in the engine (cost_model.py)
                kv_layout=st.get("kv_layout"))  # vLLM's cache layout: "cpu_amx" runs vLLM's AMX kernel


def kv_space_gib(contexts, batches, extra_tokens: int, kv_bpt: int) -> int:
    """A KV cache for the largest row's prompts, the cold prompt and the floor's, with room to spare:
    both engines are alive at once, so neither takes vLLM's default share of memory."""
    tokens = (max(contexts) + extra_tokens) * (max(batches) + 1) + 64 * max(batches)
    return max(2, math.ceil(1.5 * tokens * kv_bpt / 2**30) + 1)


def _engine_processes():
    """(this process, vLLM's worker processes, the engines' other processes) under this one."""
    import psutil

    me = psutil.Process()
    procs = me.children(recursive=True)
    workers = [p for p in procs if p.name().startswith("VLLM::Worker")]
    return me, workers, [p for p in procs if p not in workers]


def pin_schedulers(cores) -> None:
    """Bind every thread of this process and of the engines' non-worker processes (the engine
    core's scheduler, which polls its worker with ``sched_yield`` while a step runs) to ``cores``."""
    me, _, others = _engine_processes()
    for proc in [me] + others:
        for thread in proc.threads():
            try:
                os.sched_setaffinity(thread.id, cores)
            except OSError:  # a thread that ended meanwhile
                pass


def worker_cores() -> set[int]:
    """The cores vLLM's workers under this process are bound to (empty before any engine starts)."""
    _, workers, _ = _engine_processes()
    return set().union(*(os.sched_getaffinity(w.pid) for w in workers))


def keep_off_worker_cores() -> list[int]:
    """Pin this process and the engines' schedulers to the cores no vLLM worker is bound to ->
    those cores ([] when the workers hold every core, as with ``--threads all``: nothing pinned).
    vLLM keeps a core from its workers for the scheduler but leaves the scheduler free to run
    anywhere, and Linux sometimes runs it on its worker's core, which it polls with
    ``sched_yield`` while a step runs. In the first side-by-side run one engine was 40% slower
    than the other at the same work (floors 84 and 61 ms a step) and its scheduler was seen on
    its worker's core for seconds at a time; pinned, the floors agreed within 3%. A direct test
    in one engine (``scheduler_pinning.py``) found no difference, so that cause is not
    established; the pinning stays, as vLLM means the reserved core to be used."""
    busy = worker_cores()
    free = sorted(ALLOWED_CPUS - busy)
    if not busy or not free:
        return []
    pin_schedulers(free)
    return free


def run_side_by_side(model, contexts, batches, decode_tokens, magicpig, cold_tokens=0, trained_len=8192,
                     dummy=False, cold_repeats=1, warm=True) -> list[dict]:
    """Both backends' engines alive at once, with the same threads, measured in turn (``in_turn``):
    each row's two figures come from the same minutes of this machine."""
    extra = SHORT_TOKENS + max(decode_tokens, cold_tokens) + 64
    kv_bpt, layers = kv_bytes_per_token(model), num_layers(model)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib(contexts, batches, extra, kv_bpt)))
    pin_schedulers(ALLOWED_CPUS)  # the engines start unpinned (a previous --threads mode pinned this process)
    llms = {b: _engine(model, b, max(contexts) + extra, magicpig if b == "MAGICPIG" else {}, trained_len, dummy)
            for b in BACKENDS}
    tok = llms["MAGICPIG"].get_tokenizer()
    scheduler_cores = keep_off_worker_cores()
    print(f"this process and the engine cores pinned to cores {scheduler_cores or 'shared with the workers'}",
          flush=True)
    rows = []
    for ci, ctx in enumerate(contexts):
        if warm:
            rows += warm_rows(llms, tok, ctx, batches, decode_tokens, kv_bpt, layers, scheduler_cores)
        if cold_tokens:
            rows += cold_rows(llms, tok, ctx, cold_tokens, cold_repeats, first=BACKENDS[ci % 2])
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    return rows


def distinct_prompt(tok, ctx: int, seed: int) -> str:
    """A pass-key prompt of ``ctx`` tokens that shares no prefix-cache block with another seed's.
    Pass-key prompts share their text up to the needle (the task and the filler): half of a
    "new" prompt was a prefix-cache hit, which halved the cold rows' prefill and let a batch's
    prompts inherit one another's index centre."""
    from vllm_magicpig import passkey

    return f"Document {seed}.\n" + passkey.build(tok, ctx - 8, seed=seed, depth=0.5).text


def warm_rows(llms, tok, ctx, batches, decode_tokens, kv_bpt, layers, scheduler_cores) -> list[dict]:
    """Decode speed from the prefix cache, MAGICPIG's index built, for each batch size."""
    rows = []
    prompts = [distinct_prompt(tok, ctx, seed=1000 + ctx + i) for i in range(max(batches))]
    prefill_s = generate_in_turn(llms, prompts, 1, 1)
    for b in batches:
        first_s, warm_runs, build_s = warm_up(llms["MAGICPIG"], prompts[:b])
        timed = decode_seconds(llms, prompts[:b], decode_tokens)
        st = _stats(llms["MAGICPIG"])  # before the floor's decodes add to it
        phases = engine_phases(llms["MAGICPIG"], prompts[:b], decode_tokens, b, layers)
        floor = floor_ms_per_step(llms, b, decode_tokens)  # beside the row it splits: the machine drifts
        for n in BACKENDS:
            t = timed[n]
            row = dict(backend=n, context=ctx, batch=b, prefill_s=round(prefill_s[n][0], 2),
                       decode_s=round(t.step_s * decode_tokens, 3), tok_per_s=round(b / t.step_s, 2),
                       ms_per_step=round(1000 * t.step_s, 2), ms_per_step_wall=round(1000 * t.wall_difference_s, 2),
                       request_s=round(t.request_s, 3),
                       kv_bytes_per_token=kv_bpt, floor_ms_per_step=floor[n], scheduler_cores=scheduler_cores)
            if n == "MAGICPIG":
                row.update(first_run_s=round(first_s, 3), warm_runs=warm_runs,
                           **magicpig_fields(st, b, ctx, layers, build_s))
                # indexing inside the timed runs (a segment's growth by merging, synchronous): it lands
                # in the step time whole, where a long answer spreads it over a unit of tokens
                row["timed_build_s"] = round(st["build_seconds"], 3)
                row["sparse_phases_ms_per_step"] = phases
            print(json.dumps(row), flush=True)
            rows.append(row)
    first = first_decode_ms(llms, prompts[0])
    for r in rows[-len(BACKENDS):]:
        r["first_decode_ms"] = first[r["backend"]]
    return rows


def cold_rows(llms, tok, ctx, cold_tokens, repeats, first) -> list[dict]:
    """The cold path, ``repeats`` new prompts per backend, the backends taking turns (ABBA, starting
    with ``first``) on the same prompts: a cold request is minutes long here, and one such request
    per backend moved by 20-35% between runs. A backend's row is its fastest request (noise only
    adds time), with every request's ms per generated token in ``cold_runs``."""
    names = [first] + [n for n in BACKENDS if n != first]
    done = {n: 0 for n in names}

    def run(n):
        done[n] += 1
        return _cold(llms[n], n, tok, ctx, cold_tokens, seed=777_000 + ctx + 1000 * (done[n] - 1))

    runs = in_turn({n: (lambda n=n: run(n)) for n in names}, repeats)
    rows = []
    for n in BACKENDS:
        row = dict(min(runs[n], key=lambda r: r["cold_ms_per_token"]))
        row["cold_runs"] = [r["cold_ms_per_token"] for r in runs[n]]
        rows.append(row)
    return rows


def _cold(llm, backend, tok, ctx, cold_tokens, seed):
    """One new prompt (no prefix-cache hit): prefill, index build and ``cold_tokens`` tokens, as a
    user meets it. vLLM's request timestamps split it into prefill (to the first token) and decode."""
    from vllm import SamplingParams

    prompt = distinct_prompt(tok, ctx, seed)
    if backend == "MAGICPIG":
        llm.collective_rpc("magicpig_reset_stats")
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=cold_tokens, ignore_eos=True),
                          use_tqdm=False)
    total = time.perf_counter() - t0
    m = out.metrics
    prefill = m.first_token_ts - m.scheduled_ts
    decode = m.last_token_ts - m.first_token_ts
    row = dict(backend=backend, context=ctx, batch="cold", cold_s=round(total, 2), cold_tokens=cold_tokens,
               cold_ms_per_token=round(1000 * total / cold_tokens, 1), cold_prefill_s=round(prefill, 2),
               cold_decode_ms_per_step=round(1000 * decode / max(cold_tokens - 1, 1), 1))
    if backend == "MAGICPIG":
        st = _stats(llm)
        row.update(sampled_fraction=st["sampled_fraction"], index_build_s=round(st["build_seconds"], 2),
                   decode_sparse=st["decode_sparse"], decode_exact=st["decode_exact"],
                   cost_model=st.get("cost_model"),  # what decided whether to defer this prompt's index
                   kv_layout=st.get("kv_layout"))
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


def prefill_per_prompt(rows: list[dict], row: dict) -> float:
    """Seconds one prompt of ``row``'s context took to prefill: its ``prefill_s`` covers the context's
    largest batch of prompts, prefilled together."""
    return row["prefill_s"] / max(x["batch"] for x in rows if x["context"] == row["context"] and x["batch"] != "cold")


def table_lines(rows: list[dict], decode_tokens: int, cold_tokens: int) -> list[str]:
    """The results table: decode speed side by side, the sampled fraction, time per step, bytes per token,
    and the index build against the prompts' prefill."""
    base = {(r["threads"], r["context"], r["batch"]): r for r in rows if r["backend"] == "CPU_ATTN"}
    lines = [
        f"Decode: ms per step from vLLM's request timestamps: runs of {SHORT_TOKENS} and "
        f"{SHORT_TOKENS}+{decode_tokens} tokens from the prefix cache (fastest of {REPEATS} each), each timed from its "
        "first token to its last (so the recompute of the prompt's last block, before the first token, is left out), "
        "the difference of the two spans over the extra steps (so the first decode steps are left out too). Beside "
        "it, the same difference of the runs' wall times, a cross-check that carries both runs' noise. Bytes per "
        "token: MAGICPIG's host memory (LSH tables + K/V mirror, all layers) per context token of the row's prompts, "
        "beside vLLM's own KV cache per token. Index build: the seconds spent indexing the row's prompts (on the "
        "background thread, unless disabled), and that as a share of their prefill; the cold table below gives what "
        "indexing cost a request.",
        "",
        "| threads | context | batch | CPU_ATTN tok/s | MAGICPIG tok/s | speed-up | sampled fraction | "
        "ms per step (CPU_ATTN / MAGICPIG) | by wall times | bytes per token (MAGICPIG / KV cache) | "
        "index build s | build / prefill |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["backend"] != "MAGICPIG" or r["batch"] == "cold":
            continue
        b = base[(r["threads"], r["context"], r["batch"])]
        frac = r["sampled_fraction"]
        prefill_each = prefill_per_prompt(rows, b)
        lines.append(
            f"| {r['threads']} | {r['context']} | {r['batch']} | {b['tok_per_s']:.1f} | {r['tok_per_s']:.1f} | "
            f"{r['tok_per_s'] / b['tok_per_s']:.2f}x | {'n/a' if frac is None else f'{frac:.2%}'} | "
            f"{b['ms_per_step']} / {r['ms_per_step']} | "
            f"{b.get('ms_per_step_wall', '-')} / {r.get('ms_per_step_wall', '-')} | "
            f"{r['bytes_per_token']} / {r['kv_bytes_per_token']} | "
            f"{r['index_build_s']} | {r['index_build_s'] / (prefill_each * r['batch']):.1%} |"
        )
    lines += breakdown_lines(rows, base)
    first = [r for r in rows if r["backend"] == "MAGICPIG" and "first_decode_ms" in r]
    if first:
        lines += ["", "First decode step of a prompt whose index is not built yet (MAGICPIG's index cleared before "
                  "it; from the prefix cache: the one step of a 2-token run, by vLLM's request timestamps): the delay "
                  "indexing adds to the first decode token (MAGICPIG's step less CPU_ATTN's: the step after the first "
                  "token is slower than later ones for either backend), against that prompt's prefill.", "",
                  "| threads | context | CPU_ATTN ms | MAGICPIG ms | delay from indexing | prefill s | "
                  "delay / prefill |",
                  "|---|---|---|---|---|---|---|"]
        for r in first:
            b = next(x for x in rows if x["backend"] == "CPU_ATTN" and x["threads"] == r["threads"]
                     and x["context"] == r["context"] and "first_decode_ms" in x)
            prefill_each = prefill_per_prompt(rows, b)
            delay = max(r["first_decode_ms"] - b["first_decode_ms"], 0.0) / 1000
            lines.append(f"| {r['threads']} | {r['context']} | {b['first_decode_ms']} | {r['first_decode_ms']} | "
                         f"{delay:.2f} s | {prefill_each:.1f} | {delay / prefill_each:.1%} |")
    cold = [r for r in rows if r["backend"] == "MAGICPIG" and r["batch"] == "cold"]
    if cold:
        lines += ["", f"Cold single request (new prompt: prefill + {cold_tokens} tokens, index build included), "
                  "ms per generated token; vLLM's request timestamps split it into prefill and decode. The cost of "
                  "indexing to this request: MAGICPIG's decode time over CPU_ATTN's, as a share of the prefill.", "",
                  "| threads | context | CPU_ATTN ms/token | MAGICPIG ms/token | speed-up | sampled fraction | "
                  "prefill s | decode ms/step (CPU_ATTN / MAGICPIG) | index build s | indexing cost / prefill |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in cold:
            b = base[(r["threads"], r["context"], "cold")]
            frac = r["sampled_fraction"]
            extra = (r["cold_decode_ms_per_step"] - b["cold_decode_ms_per_step"]) * (cold_tokens - 1) / 1000
            lines.append(f"| {r['threads']} | {r['context']} | {b['cold_ms_per_token']} | {r['cold_ms_per_token']} | "
                         f"{b['cold_ms_per_token'] / r['cold_ms_per_token']:.2f}x | "
                         f"{'n/a' if frac is None else f'{frac:.2%}'} | {b['cold_prefill_s']} | "
                         f"{b['cold_decode_ms_per_step']} / {r['cold_decode_ms_per_step']} | {r['index_build_s']} | "
                         f"{max(extra, 0.0) / b['cold_prefill_s']:.1%} |")
        repeated = [r for r in cold if len(r.get("cold_runs", [])) > 1]
        if repeated:
            lines += ["", "Each backend's fastest of its cold requests above; every request's ms per generated "
                      "token, in the order run (the backends taking turns, ABBA, on the same prompts):", ""]
            for r in repeated:
                b = base[(r["threads"], r["context"], "cold")]
                lines.append(f"- {r['threads']}, {r['context']}: CPU_ATTN {b.get('cold_runs')}, "
                             f"MAGICPIG {r['cold_runs']}")
    return lines


def breakdown_lines(rows: list[dict], base: dict) -> list[str]:
    """Where each row's step goes, and the speed-up that would remain if the sparse layers cost nothing."""
    parts = [r for r in rows if r["backend"] == "MAGICPIG" and r["batch"] != "cold" and "sparse_ms_per_step" in r
             and "floor_ms_per_step" in base[(r["threads"], r["context"], r["batch"])]]
    if not parts:
        return []
    lines = ["", "Step breakdown, ms per decode step. Floor: the same timing over ~64-token prompts (the model's other "
             "work and the engine's loop; attention next to free). CPU_ATTN attention: its step less its floor. "
             "MAGICPIG sparse layers: its own timer around them (index builds excluded); the rest is mostly the "
             "dense layers, attended exactly. Bound: CPU_ATTN's step over MAGICPIG's floor plus its dense layers' "
             "share of CPU_ATTN's attention, the speed-up if the sparse layers cost nothing.", "",
             "| threads | context | batch | floor (CPU_ATTN / MAGICPIG) | CPU_ATTN step | CPU_ATTN attention | "
             "MAGICPIG step | sparse layers | rest | dense layers | speed-up | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in parts:
        b = base[(r["threads"], r["context"], r["batch"])]
        attention = b["ms_per_step"] - b["floor_ms_per_step"]
        rest = r["ms_per_step"] - r["floor_ms_per_step"] - r["sparse_ms_per_step"]
        dense = attention * r["dense_layers"] / r["layers"]
        bound = b["ms_per_step"] / (r["floor_ms_per_step"] + dense)
        lines.append(f"| {r['threads']} | {r['context']} | {r['batch']} | {b['floor_ms_per_step']} / "
                     f"{r['floor_ms_per_step']} | {b['ms_per_step']} | {attention:.1f} | {r['ms_per_step']} | "
                     f"{r['sparse_ms_per_step']} | {rest:.1f} | {r['dense_layers']:.0f} of {r['layers']} | "
                     f"{r['tok_per_s'] / b['tok_per_s']:.2f}x | {bound:.2f}x |")
    lines += ["", "A bound below a speed-up target puts that target out of reach of this model on this machine, "
              "whatever the sparse layers cost: the floor and the dense layers alone take longer."]
    noisy = noisy_rows(parts, base)
    if noisy:
        lines += ["", f"Noisy rows (two figures that measure the same thing differ by more than {NOISE:.0%}; rerun "
                  "them before quoting):", ""] + [f"- {n}" for n in noisy]
    return lines + phase_lines(parts)


NOISE = 0.10  # how far two timings of the same thing may differ before a row is flagged noisy


def noisy_rows(parts: list[dict], base: dict) -> list[str]:
    """Rows whose timings disagree with themselves: the two backends' floors (the same model's work over
    ~64-token prompts, which should match), or a backend's step by request timestamps and by wall time."""
    out = []
    for r in parts:
        b = base[(r["threads"], r["context"], r["batch"])]
        where = f"{r['threads']}, {r['context']}, batch {r['batch']}"
        lo, hi = sorted((b["floor_ms_per_step"], r["floor_ms_per_step"]))
        if hi > lo * (1 + NOISE):
            out.append(f"{where}: floors {b['floor_ms_per_step']} / {r['floor_ms_per_step']} ms (CPU_ATTN / MAGICPIG)")
        for x in (b, r):
            wall = x.get("ms_per_step_wall")
            if wall and abs(wall - x["ms_per_step"]) > NOISE * x["ms_per_step"]:
                out.append(f"{where}: {x['backend']}'s step {x['ms_per_step']} ms by timestamps, {wall} by wall time")
    return out


PHASES = ("queries", "lookup", "gather_logits", "softmax_v", "dense", "merge", "set_up")


def phase_lines(parts: list[dict]) -> list[str]:
    """The sparse layers' time split by the kernel's phase timers in the engine (``engine_phases``)."""
    parts = [r for r in parts if r.get("sparse_phases_ms_per_step")]
    if not parts:
        return []
    lines = ["", "Sparse layers split by the kernel's phase timers in the engine's worker, ms per decode step, from "
             "one more run of the row's decodes after the timed ones (timers on): queries (hashing, q.c), lookup "
             "(collision counting over the buckets), gather_logits (sampled rows' q.k), softmax_v (the weighted V "
             "sum), dense (sink and recent tokens, exactly), merge; set-up: the ops call less its phases (Python, "
             "checks, the native call's preparation). Per sparse layer: the call over the sparse layers a step.", "",
             "| threads | context | batch | " + " | ".join(PHASES) + " | call | per sparse layer |",
             "|---|---|---|" + "---|" * (len(PHASES) + 2)]
    for r in parts:
        ph = r["sparse_phases_ms_per_step"]
        sparse_layers = max(r["layers"] - r["dense_layers"], 1)
        lines.append(f"| {r['threads']} | {r['context']} | {r['batch']} | "
                     + " | ".join(f"{ph.get(k, 0):.2f}" for k in PHASES)
                     + f" | {ph['call']:.2f} | {ph['call'] / sparse_layers:.3f} |")
    return lines


def plot(rows: list[dict], path: Path, shape: str) -> None:
    """Decode tokens/s against context, both backends side by side (one panel per thread mode and
    batch), the sampled fraction written by each MAGICPIG point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[eval]): no plot")
        return
    panels = sorted({(r["threads"], r["batch"]) for r in rows if r["batch"] != "cold"}, key=str)
    if not panels:  # --cold-only: no decode speeds to plot
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (threads, batch) in zip(axes[0], panels):
        for backend, style in (("CPU_ATTN", "s-"), ("MAGICPIG", "o-")):
            pts = sorted((r["context"], r["tok_per_s"], r.get("sampled_fraction")) for r in rows
                         if r["backend"] == backend and r["threads"] == threads and r["batch"] == batch)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=backend)
            if backend == "MAGICPIG":
                for x, y, f in pts:
                    if f is not None:
                        ax.annotate(f"{f:.1%}", (x, y), textcoords="offset points", xytext=(0, 6), fontsize=8,
                                    ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"batch {batch}, threads {threads}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(shape, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "llama-d128"), default="smollm2")
    ap.add_argument("--contexts", default="4096,8192,16384")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--cold-tokens", type=int, default=128)
    ap.add_argument("--cold-repeats", type=int, default=1, help="new prompts per backend on the cold path (ABBA)")
    ap.add_argument("--cold-only", action="store_true", help="only the cold path (no warm rows)")
    ap.add_argument("--threads", default="default", help="default and/or all, comma-separated")
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--mirror-dtype", default="auto", choices=("auto", "int8"),
                    help="MAGICPIG's mirror_dtype (how its segments keep the sampled K/V rows)")
    ap.add_argument("--out", default=str(RESULTS / "e2e_decode"))
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    from vllm_magicpig.kernel import active_isa
    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    magicpig = {"K": args.K, "L": args.L, "index_memory_mb": 8192, "log_stats_interval": 0,
                "mirror_dtype": args.mirror_dtype}
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
        part = run_side_by_side(model, contexts, batches, args.decode_tokens, magicpig, args.cold_tokens,
                                trained_len, dummy, args.cold_repeats, warm=not args.cold_only)
        rows += [dict(r, threads=mode) for r in part]
    bind_threads("default")

    layouts = sorted({r["kv_layout"] for r in rows if r.get("kv_layout")})
    lines = [
        f"Command: `python benchmarks/e2e_decode.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.strftime('%Y-%m-%d')})",
        "",
        f"K={args.K}, L={args.L}, mirror_dtype {args.mirror_dtype}, {shape}, enforce_eager, {os.cpu_count()} cores, "
        f"kernel path {active_isa()}, vLLM's KV cache layout {layouts} "
        "(vLLM's CPU attention, MAGICPIG's prefill and exact decodes run the kernel of that layout's ISA); "
        "threads `default` = vLLM's binding (1 core for the worker here), `all` = every core. Both engines alive "
        "at once, timed in turn (ABBA); the engines' schedulers pinned to the cores their workers are not bound to: "
        f"{sorted({str(r.get('scheduler_cores')) for r in rows if 'scheduler_cores' in r})}.",
        "",
    ] + table_lines(rows, args.decode_tokens, args.cold_tokens)
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"), shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
