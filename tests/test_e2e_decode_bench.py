"""The end-to-end decode benchmark's arithmetic (benchmarks/e2e_decode.py), without an engine:
decode steps are timed by the requests' timestamps (and, as a cross-check, as a difference that
cancels the per-request prefill), and the table and plot read the rows it writes."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e_decode  # noqa: E402


class _Clock:
    """A fake perf_counter that the fake engines advance (one clock for both, as in a run)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeLLM:
    """generate() advances the clock by a fixed per-request cost plus a per-token cost: what a
    prefix-cache hit does (recompute the last block, then decode), and returns outputs with vLLM's
    request timestamps: the first token after the recompute and ``first_step_s``, then one a token.
    A run's ``recompute_noise`` (one value per run, in order) adds to its recompute only, before the
    first token. No real time is measured."""

    def __init__(self, clock: _Clock, fixed_s: float, per_token_s: float, first_step_s: float = 0.0,
                 recompute_noise=()):
        self.clock, self.fixed_s, self.per_token_s = clock, fixed_s, per_token_s
        self.first_step_s = first_step_s
        self.recompute_noise = list(recompute_noise)

    def generate(self, prompts, sp, use_tqdm=False):
        noise = self.recompute_noise.pop(0) if self.recompute_noise else 0.0
        first = self.clock.now + noise + self.fixed_s
        last = first + (self.first_step_s - self.per_token_s if sp.max_tokens > 1 else 0.0)
        last += (sp.max_tokens - 1) * self.per_token_s
        self.clock.now = last
        metrics = SimpleNamespace(first_token_ts=first, last_token_ts=last)
        return [SimpleNamespace(metrics=metrics) for _ in prompts]


def _patch_clock(monkeypatch) -> _Clock:
    pytest.importorskip("vllm")
    clock = _Clock()
    monkeypatch.setattr(e2e_decode.time, "perf_counter", clock)
    monkeypatch.setattr(e2e_decode.time, "sleep", lambda s: None)
    return clock


def test_decode_step_leaves_out_the_recompute_and_the_first_step_for_each_engine(monkeypatch):
    clock = _patch_clock(monkeypatch)
    llms = {"CPU_ATTN": _FakeLLM(clock, 0.2, 0.004, first_step_s=0.5),
            "MAGICPIG": _FakeLLM(clock, 0.5, 0.002, first_step_s=0.5)}
    timed = e2e_decode.decode_seconds(llms, ["p"], decode_tokens=25, reps=2)
    assert timed["CPU_ATTN"].step_s == pytest.approx(0.004)  # the 0.2 s recompute and the 0.5 s step are gone
    assert timed["MAGICPIG"].step_s == pytest.approx(0.002)  # and the other engine's 0.5 s
    assert timed["CPU_ATTN"].wall_difference_s == pytest.approx(0.004)  # the wall times agree where nothing is noisy
    # the whole long run: recompute, the first step, then the other 8 + 25 - 2 steps
    assert timed["CPU_ATTN"].request_s == pytest.approx(0.2 + 0.5 + (e2e_decode.SHORT_TOKENS + 25 - 2) * 0.004)


def test_timestamps_leave_out_a_slow_recompute_that_moves_the_wall_difference(monkeypatch):
    clock = _patch_clock(monkeypatch)
    # both short runs' recomputes 0.03 s slow, neither long one's: the wall difference loses 0.03 s of decode
    llm = _FakeLLM(clock, 0.2, 0.004, recompute_noise=[0.03, 0.03, 0.0, 0.0])
    timed = e2e_decode.decode_seconds({"CPU_ATTN": llm}, ["p", "q"], decode_tokens=25, reps=2)["CPU_ATTN"]
    assert timed.wall_difference_s == pytest.approx(0.004 - 0.03 / 25)
    assert timed.step_s == pytest.approx(0.004)


def test_decode_span_is_first_to_last_token_averaged_over_the_batch():
    out = [SimpleNamespace(metrics=SimpleNamespace(first_token_ts=10.0, last_token_ts=10.9)),
           SimpleNamespace(metrics=SimpleNamespace(first_token_ts=10.0, last_token_ts=11.1))]
    assert e2e_decode.decode_span_seconds(out) == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="disable_log_stats"):
        e2e_decode.decode_span_seconds([SimpleNamespace(metrics=None)])


def test_engines_take_turns_abba_with_a_pause_at_each_handover(monkeypatch):
    calls, pauses = [], []
    monkeypatch.setattr(e2e_decode.time, "sleep", lambda s: pauses.append((len(calls), s)))
    def call(name):
        calls.append(name)
        return len(calls)

    out = e2e_decode.in_turn({"A": lambda: call("A"), "B": lambda: call("B")}, reps=4, pause_s=1.5)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert out == {"A": [1, 4, 5, 8], "B": [2, 3, 6, 7]}
    # a pause before each call that follows the other engine's, none between one engine's calls
    assert pauses == [(1, 1.5), (3, 1.5), (5, 1.5), (7, 1.5)]


def _rows():
    rows = []
    for backend, tps in (("CPU_ATTN", 10.0), ("MAGICPIG", 15.0)):
        for ctx in (4096, 16384):
            for b in (1, 4):
                r = dict(backend=backend, threads="default", context=ctx, batch=b, prefill_s=40.0,
                         tok_per_s=tps * b * (4096 / ctx), ms_per_step=100.0, kv_bytes_per_token=23040)
                if backend == "MAGICPIG":
                    r.update(sampled_fraction=0.025, bytes_per_token=30000, index_build_s=1.0)
                rows.append(r)
    return rows


def test_table_gives_ratio_fraction_bytes_and_build_share():
    lines = e2e_decode.table_lines(_rows(), decode_tokens=32, cold_tokens=0)
    row = next(line for line in lines if line.startswith("| default | 16384 | 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[5] == "1.50x" and cells[6] == "2.50%"
    assert cells[9] == "30000 / 23040"
    # 4 prompts prefilled in 40 s: 10 s each; the batch of 4 waited 1 s for its index: 2.5%
    assert cells[11] == "2.5%"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speed.png"
    e2e_decode.plot(_rows(), path, "test shape")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_first_decode_delay_is_magicpigs_first_step_over_cpu_attns_against_one_prompts_prefill():
    rows = _rows()
    for r in rows:
        if r["batch"] == 4:
            r["first_decode_ms"] = 150.0 if r["backend"] == "MAGICPIG" else 100.0
    lines = e2e_decode.table_lines(rows, decode_tokens=32, cold_tokens=0)
    row = next(line for line in lines if line.startswith("| default | 4096 | 100.0 | 150.0 |"))
    # 0.05 s more than exact, against one prompt's 10 s prefill (4 prompts in 40 s)
    assert row.endswith("| 0.05 s | 10.0 | 0.5% |")


def test_breakdown_splits_the_step_and_bounds_the_speed_up_by_the_floor_and_dense_layers():
    rows = _rows()
    for r in rows:
        r["floor_ms_per_step"] = 20.0
        if r["backend"] == "CPU_ATTN":
            r.update(ms_per_step=60.0, tok_per_s=r["batch"] / 0.060)  # 40 ms of attention over 4 layers: 10 a layer
        else:
            r.update(ms_per_step=40.0, tok_per_s=r["batch"] / 0.040, sparse_ms_per_step=6.0, dense_layers=1.0,
                     layers=4)
    lines = e2e_decode.table_lines(rows, decode_tokens=32, cold_tokens=0)
    row = next(line for line in lines if line.startswith("| default | 16384 | 4 | 20.0 / 20.0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # CPU_ATTN: 60 ms step, 40 of attention; MAGICPIG: 40 = 20 floor + 6 sparse + 14 rest
    assert cells[4:9] == ["60.0", "40.0", "40.0", "6.0", "14.0"]
    assert cells[9] == "1 of 4"
    # free sparse layers leave the floor and the dense layer's 10 ms: 60 / 30
    assert cells[10] == "1.50x" and cells[11] == "2.00x"


def test_breakdown_flags_a_row_whose_timings_disagree_with_themselves():
    # The 12-06 head_dim-128 run 1: floors 20.62 / 16.62 ms, MAGICPIG's step 28.62 by timestamps, 33.66 by wall.
    rows = _rows()
    for r in rows:
        quiet = r["context"] == 4096
        if r["backend"] == "CPU_ATTN":
            r.update(floor_ms_per_step=20.62 if not quiet else 16.0, ms_per_step=37.97, ms_per_step_wall=37.35)
        else:
            r.update(floor_ms_per_step=16.62 if not quiet else 16.5, ms_per_step=28.62,
                     ms_per_step_wall=33.66 if not quiet else 29.0, sparse_ms_per_step=2.48, dense_layers=1.0,
                     layers=4)
    lines = e2e_decode.table_lines(rows, decode_tokens=32, cold_tokens=0)
    flagged = [line for line in lines if line.startswith("- default, ")]
    assert flagged == [
        "- default, 16384, batch 1: floors 20.62 / 16.62 ms (CPU_ATTN / MAGICPIG)",
        "- default, 16384, batch 1: MAGICPIG's step 28.62 ms by timestamps, 33.66 by wall time",
        "- default, 16384, batch 4: floors 20.62 / 16.62 ms (CPU_ATTN / MAGICPIG)",
        "- default, 16384, batch 4: MAGICPIG's step 28.62 ms by timestamps, 33.66 by wall time"]


def test_sparse_time_and_dense_layers_per_step_come_from_the_counters():
    st = {"decode_sparse": 3 * 2 * 10, "decode_exact": {"dense_layer": 1 * 2 * 10}, "sparse_seconds": 0.12}
    # 10 steps of batch 2 over 4 layers (3 sparse, 1 dense): 12 ms of sparse layers a step
    assert e2e_decode.sparse_ms_per_step(st, batch=2, layers=4) == 12.0
    assert e2e_decode.dense_layers_per_step(st, batch=2, layers=4) == 1.0


def test_warm_up_waits_while_the_index_is_building_or_deferred():
    def st(deferred=0, jobs=0, installed=0):
        return {"decode_exact": {"index_deferred": deferred} if deferred else {},
                "index": {"background_jobs": jobs, "background_installed": installed}}

    assert e2e_decode._waiting(st(), st(deferred=30))  # the run's decodes were deferred
    assert e2e_decode._waiting(st(deferred=30), st(deferred=30, jobs=1))  # paid: now building
    assert not e2e_decode._waiting(st(deferred=30, jobs=1), st(deferred=30, jobs=1, installed=1))  # sampled
    assert not e2e_decode._waiting(st(), st())


class DeferringEngine:
    """A fake MAGICPIG engine: its prompts' index is deferred for ``defer_steps`` decode steps (the
    cost model's ski-rental), then built on the background thread over ``build_steps`` steps and
    installed at the start of the next run."""

    def __init__(self, defer_steps: int, build_steps: int) -> None:
        self.defer_steps, self.build_steps = defer_steps, build_steps
        self.steps = self.deferred = self.jobs = self.installed = 0
        self.built_at = None  # the step the build finishes
        self.tokens = []

    def run(self, tokens: int) -> None:
        self.tokens.append(tokens)
        if self.built_at is not None and self.steps >= self.built_at:
            self.installed = 1
        for _ in range(tokens - 1):  # the first token is the prompt's recompute
            self.steps += 1
            if self.jobs == 0 and self.steps <= self.defer_steps:
                self.deferred += 1
            elif self.jobs == 0:
                self.jobs, self.built_at = 1, self.steps + self.build_steps

    def stats(self) -> dict:
        return {"decode_exact": {"index_deferred": self.deferred} if self.deferred else {},
                "index": {"background_jobs": self.jobs, "background_installed": self.installed},
                "build_seconds": 0.0}


@pytest.mark.parametrize("defer_steps", [0, 420, 5000])
def test_warm_up_runs_until_the_deferred_index_is_built_and_installed(monkeypatch, defer_steps):
    """A build the cost model defers for 420 steps, then ~13 s (~65 steps) long (8K batch 4 on an AMX
    machine, where a 448-step warm-up left it inside the timed runs) is installed within the
    warm-up; one deferred past ``MAX_WARM_STEPS`` stops the warm-up at the cap (that row is then
    served exactly)."""
    engine = DeferringEngine(defer_steps, build_steps=65)
    monkeypatch.setattr(e2e_decode, "_stats", lambda llm: engine.stats())
    monkeypatch.setattr(e2e_decode, "_timed_generate", lambda llm, prompts, tokens: engine.run(tokens) or 1.0)
    llm = SimpleNamespace(collective_rpc=lambda name: None)
    _, runs, _ = e2e_decode.warm_up(llm, ["p"])
    assert runs == len(engine.tokens)
    if defer_steps < e2e_decode.MAX_WARM_STEPS:
        assert engine.installed == 1  # the index was in place before the timed runs
        before = engine.stats()
        engine.run(e2e_decode.SHORT_TOKENS)
        assert not e2e_decode._waiting(before, engine.stats())
    else:
        assert engine.installed == 0 and engine.steps >= e2e_decode.MAX_WARM_STEPS
        assert engine.steps < e2e_decode.MAX_WARM_STEPS + e2e_decode.WARM_TOKENS


def test_schedulers_are_pinned_off_the_workers_cores(monkeypatch):
    psutil = pytest.importorskip("psutil")

    class Proc:
        def __init__(self, name, pid, tids, children=()):
            self._name, self.pid, self._tids, self._children = name, pid, tids, list(children)

        def name(self):
            return self._name

        def threads(self):
            return [SimpleNamespace(id=t) for t in self._tids]

        def children(self, recursive=False):
            return self._children

    workers = [Proc("VLLM::Worker", 20, [20, 21]), Proc("VLLM::Worker", 30, [30])]
    engine_cores = [Proc("VLLM::EngineCore", 10, [10, 11])]
    me = Proc("python", 1, [1, 2], engine_cores + workers)
    affinity = {20: {0}, 30: {0}}
    pinned = {}
    monkeypatch.setattr(e2e_decode, "ALLOWED_CPUS", frozenset({0, 1, 2}))
    monkeypatch.setattr(psutil, "Process", lambda: me)
    monkeypatch.setattr(e2e_decode.os, "sched_getaffinity", lambda pid: affinity[pid])
    monkeypatch.setattr(e2e_decode.os, "sched_setaffinity", lambda tid, cpus: pinned.__setitem__(tid, list(cpus)))
    assert e2e_decode.keep_off_worker_cores() == [1, 2]
    # every thread of this process and of the engine cores; none of the workers'
    assert pinned == {1: [1, 2], 2: [1, 2], 10: [1, 2], 11: [1, 2]}
    # workers on every core: nothing to pin to, nothing pinned
    affinity[20], pinned = {0, 1, 2}, {}
    monkeypatch.setattr(e2e_decode.os, "sched_setaffinity", lambda tid, cpus: pinned.__setitem__(tid, list(cpus)))
    assert e2e_decode.keep_off_worker_cores() == [] and pinned == {}


def test_cold_requests_take_turns_on_the_same_prompts_and_the_fastest_counts(monkeypatch):
    calls = []

    times = {"CPU_ATTN": [1000.0, 900.0], "MAGICPIG": [950.0, 1100.0]}  # ms per token, in the order run

    def fake_cold(llm, backend, tok, ctx, cold_tokens, seed):
        calls.append((backend, seed))
        ms = times[backend][sum(c[0] == backend for c in calls) - 1]
        return dict(backend=backend, context=ctx, batch="cold", cold_ms_per_token=ms)

    monkeypatch.setattr(e2e_decode, "_cold", fake_cold)
    monkeypatch.setattr(e2e_decode.time, "sleep", lambda s: None)
    rows = e2e_decode.cold_rows({"CPU_ATTN": None, "MAGICPIG": None}, None, 4096, 64, repeats=2, first="MAGICPIG")
    first, second = 777_000 + 4096, 777_000 + 4096 + 1000
    assert calls == [("MAGICPIG", first), ("CPU_ATTN", first), ("CPU_ATTN", second), ("MAGICPIG", second)]
    by = {r["backend"]: r for r in rows}
    assert by["CPU_ATTN"]["cold_ms_per_token"] == 900.0 and by["CPU_ATTN"]["cold_runs"] == [1000.0, 900.0]
    assert by["MAGICPIG"]["cold_ms_per_token"] == 950.0 and by["MAGICPIG"]["cold_runs"] == [950.0, 1100.0]


def test_benchmark_prompts_share_no_leading_block(tmp_path):
    """Pass-key prompts share their text up to the needle; the benchmark's must not, or a "new"
    prompt is half a prefix-cache hit (vLLM hashes blocks of 16 tokens from the start)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from vllm_magicpig.models import prepare_smollm2

    tok = AutoTokenizer.from_pretrained(str(prepare_smollm2()))
    a, b = (tok.encode(e2e_decode.distinct_prompt(tok, 2048, seed)) for seed in (777_000, 778_000))
    assert a[:16] != b[:16]
    assert abs(len(a) - 2048) < 64 and abs(len(b) - 2048) < 64


def test_first_decode_is_the_one_step_of_a_two_token_run_after_the_index_is_cleared(monkeypatch):
    clock = _patch_clock(monkeypatch)
    rpcs = []
    magicpig = _FakeLLM(clock, 0.5, 0.01, first_step_s=0.03)
    magicpig.collective_rpc = lambda name: rpcs.append(name)
    cpu_attn = _FakeLLM(clock, 0.2, 0.01, first_step_s=0.02)
    first = e2e_decode.first_decode_ms({"CPU_ATTN": cpu_attn, "MAGICPIG": magicpig}, "p", reps=2)
    assert first == {"CPU_ATTN": 20.0, "MAGICPIG": 30.0}  # the recompute before the first token left out
    assert rpcs == ["magicpig_clear_index"] * 2  # before each of MAGICPIG's runs


class _PhaseLLM:
    """A fake engine whose worker RPCs answer like ``magicpig_phase_timers`` and ``magicpig_stats``: a run
    of the row adds ``phase_s`` to the timers (while on) and its decodes to the counters."""

    def __init__(self, phase_s: dict, sparse_s: float, decodes: int):
        self.phase_s, self.sparse_s, self.decodes = phase_s, sparse_s, decodes
        self.on, self.timers, self.stats, self.calls = False, {}, None, []
        self.reset()

    def reset(self):
        self.stats = {"decode_sparse": 0, "decode_exact": {}, "sparse_seconds": 0.0}

    def generate(self, prompts, sp, use_tqdm=False):
        self.calls.append(("generate", self.on))
        if self.on:
            self.timers = {k: self.timers.get(k, 0.0) + v for k, v in self.phase_s.items()}
        self.stats["decode_sparse"] += self.decodes
        self.stats["sparse_seconds"] += self.sparse_s
        return [SimpleNamespace(metrics=SimpleNamespace(first_token_ts=0.0, last_token_ts=1.0)) for _ in prompts]

    def collective_rpc(self, name, args=()):
        self.calls.append((name, args))
        if name == "magicpig_reset_stats":
            self.reset()
            return [None]
        if name == "magicpig_stats":
            return [dict(self.stats)]
        assert name == "magicpig_phase_timers"
        if args[0]:
            self.on, self.timers = True, {}
            return [{}]
        self.on = False
        return [dict(self.timers)]


def test_engine_phases_split_the_sparse_call_per_step_and_leave_the_rest_as_set_up():
    pytest.importorskip("vllm")
    phase_s = {"queries": 0.010, "lookup": 0.030, "gather_logits": 0.030, "softmax_v": 0.020, "dense": 0.008,
               "merge": 0.002}
    # 10 steps of batch 2 over 3 sparse layers: 60 sparse decodes, 0.12 s in the ops call
    llm = _PhaseLLM(phase_s, sparse_s=0.12, decodes=60)
    ms = e2e_decode.engine_phases(llm, ["p", "q"], decode_tokens=10, batch=2, layers=3)
    assert ms["lookup"] == 3.0 and ms["queries"] == 1.0 and ms["merge"] == 0.2
    assert ms["call"] == 12.0 and ms["set_up"] == pytest.approx(12.0 - 10.0)
    # the run is timed with the timers on, and the stats it leaves are reset for the next row
    assert ("generate", True) in llm.calls and llm.stats["decode_sparse"] == 0
    assert llm.calls[-1] == ("magicpig_reset_stats", ())


def test_phase_table_gives_each_phase_and_the_call_per_sparse_layer():
    rows = _rows()
    for r in rows:
        r["floor_ms_per_step"] = 20.0
        if r["backend"] == "MAGICPIG":
            r.update(sparse_ms_per_step=6.0, dense_layers=1.0, layers=4,
                     sparse_phases_ms_per_step=dict(queries=0.5, lookup=2.0, gather_logits=1.5, softmax_v=1.0,
                                                    dense=0.4, merge=0.1, call=6.0, set_up=0.5))
    lines = e2e_decode.table_lines(rows, decode_tokens=32, cold_tokens=0)
    head = next(i for i, line in enumerate(lines) if line.startswith("| threads | context | batch | queries"))
    row = next(line for line in lines[head:] if line.startswith("| default | 16384 | 4 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:10] == ["0.50", "2.00", "1.50", "1.00", "0.40", "0.10", "0.50"]
    assert cells[10] == "6.00" and cells[11] == "2.000"  # 6 ms over the 3 sparse layers
