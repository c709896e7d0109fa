"""MAGICPIG's counters on vLLM's Prometheus /metrics endpoint (vllm_magicpig/metrics.py).

The unit tests drive the stat logger plugin with fake workers (no engine); the server test
(marked ``server``) starts the OpenAI server with MAGICPIG, sends one pass-key prompt long
enough to be sampled, and reads the counters back from /metrics.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from prometheus_client import REGISTRY, generate_latest

from vllm_magicpig.eval.openai_server import launch, stop, wait_healthy
from vllm_magicpig.eval.openai_server import metric_samples as samples
from vllm_magicpig.eval.openai_server import metric_value as value
from vllm_magicpig.metrics import Exporter, MagicPigStatLogger

# --- helpers ----------------------------------------------------------------------------------


def scrape_registry() -> dict:
    return samples(generate_latest(REGISTRY).decode())  # the API server's own registry


def snapshot(steps=10, sparse=0, exact=None, index=None, frac=None, index_bytes=0, build=0.0, **extra) -> dict:
    snap = {"steps": steps, "decode_sparse": sparse, "decode_exact": dict(exact or {}),
            "decode_by_method": {"magicpig": sparse} if sparse else {}, "sampled_fraction": frac,
            "index": dict(index or {}), "index_bytes": index_bytes, "mirror_bytes": 2 * index_bytes,
            "build_seconds": build, "sparse_seconds": 0.0}
    snap.update(extra)
    return snap


def fake_config(backend: str = "MAGICPIG", model: str = "m"):
    return SimpleNamespace(attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
                           model_config=SimpleNamespace(served_model_name=model))


class FakeClient:
    """An engine client whose workers report ``snaps`` (one per rank); counts and times the RPCs."""

    def __init__(self, snaps, delay: float = 0.0, client_index: int = 0):
        self.snaps, self.delay = snaps, delay
        self.engine_core = SimpleNamespace(client_index=client_index)
        self.calls: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert method == "magicpig_stats"
        self.calls.append(time.monotonic())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            return [dict(s) for s in self.snaps]
        finally:
            self.in_flight -= 1


# --- unit tests (no engine) -------------------------------------------------------------------


def test_entry_point_is_registered():
    """vLLM's AsyncLLM loads the logger from the ``vllm.stat_logger_plugins`` group (./setup.sh
    reinstalls the package so the entry point exists)."""
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.stat_logger_plugins")}
    assert eps.get("magicpig") == "vllm_magicpig.metrics:MagicPigStatLogger", eps
    assert MagicPigStatLogger in load_stat_logger_plugin_factories()


def test_exporter_per_rank_monotonic_across_reset():
    model = "unit-exporter"
    ex = Exporter(model)
    ex.update({0: [snapshot(steps=5), snapshot(steps=5)]})
    s = scrape_registry()
    # every series exists from the first snapshot, at zero; no sampled fraction before a sparse decode
    for reason in ("short_context", "dense_layer", "evicted", "decode_method_exact"):
        assert value(s, "vllm:magicpig_decodes_total", model_name=model, rank="1", served="exact", reason=reason) == 0
    assert value(s, "vllm:magicpig_decodes_total", model_name=model, served="sparse", reason="magicpig") == 0
    assert value(s, "vllm:magicpig_segments_total", model_name=model, event="built") == 0
    assert value(s, "vllm:magicpig_sampled_fraction", model_name=model) is None

    idx = {"segments_built": 3, "segments_merged": 1, "centres_computed": 2, "segments_live": 3, "tokens_indexed": 900}
    ex.update({0: [
        snapshot(steps=20, sparse=40, exact={"dense_layer": 8}, index=idx, frac=0.05, index_bytes=1000, build=0.5,
                 pooled_bytes=4 << 20, index_cap_bytes=3 << 30),
        snapshot(steps=20, sparse=30, exact={"dense_layer": 8, "evicted": 2}, index=idx, frac=0.07, index_bytes=900),
    ]})
    s = scrape_registry()
    sparse = dict(model_name=model, engine="0", served="sparse", reason="magicpig")
    assert value(s, "vllm:magicpig_decodes_total", rank="0", **sparse) == 40
    assert value(s, "vllm:magicpig_decodes_total", rank="1", **sparse) == 30
    assert value(s, "vllm:magicpig_decodes_total", model_name=model, rank="1", reason="evicted") == 2
    assert value(s, "vllm:magicpig_sampled_fraction", model_name=model, rank="0") == pytest.approx(0.05)
    assert value(s, "vllm:magicpig_sampled_fraction", model_name=model, rank="1") == pytest.approx(0.07)
    assert value(s, "vllm:magicpig_index_bytes", model_name=model) == 1900  # summed over ranks
    assert value(s, "vllm:magicpig_mirror_bytes", model_name=model, rank="0") == 2000
    assert value(s, "vllm:magicpig_pooled_bytes", model_name=model, rank="0") == 4 << 20
    assert value(s, "vllm:magicpig_index_cap_bytes", model_name=model, rank="0") == 3 << 30
    assert value(s, "vllm:magicpig_segments_live", model_name=model, rank="0") == 3
    assert value(s, "vllm:magicpig_segments_total", model_name=model, rank="0", event="built") == 3
    assert value(s, "vllm:magicpig_segments_total", model_name=model, rank="0", event="merged") == 1
    assert value(s, "vllm:magicpig_centres_total", model_name=model, rank="0", event="computed") == 2
    assert value(s, "vllm:magicpig_tokens_indexed_total", model_name=model, rank="0") == 900
    assert value(s, "vllm:magicpig_build_seconds_total", model_name=model, rank="0") == pytest.approx(0.5)

    # magicpig_reset_stats on rank 0 (its steps restart): the counters keep climbing by the new values
    ex.update({0: [snapshot(steps=3, sparse=4, frac=0.02, index=idx, index_bytes=1000),
                   snapshot(steps=25, sparse=35, exact={"dense_layer": 8, "evicted": 2}, index=idx, frac=0.07)]})
    s = scrape_registry()
    assert value(s, "vllm:magicpig_decodes_total", rank="0", **sparse) == 44
    assert value(s, "vllm:magicpig_decodes_total", rank="1", **sparse) == 35
    assert value(s, "vllm:magicpig_segments_total", model_name=model, rank="0", event="built") == 6
    assert value(s, "vllm:magicpig_decodes_total", model_name=model, rank="0", reason="dense_layer") == 8
    assert value(s, "vllm:magicpig_sampled_fraction", model_name=model, rank="0") == pytest.approx(0.02)


def test_prompts_built_on_outlook_count_the_workers_life():
    """The cost model's count of prompts built on an answer outlook is not restarted by
    magicpig_reset_stats (the stats' steps are): the counter follows it, not the reset."""
    model = "unit-outlook"
    ex = Exporter(model)
    series = dict(model_name=model, rank="0")
    ex.update({0: [snapshot(steps=5)]})  # no cost model: the series exists, at zero
    assert value(scrape_registry(), "vllm:magicpig_prompts_built_on_outlook_total", **series) == 0
    ex.update({0: [snapshot(steps=20, cost_model={"built_on_outlook": 3})]})
    assert value(scrape_registry(), "vllm:magicpig_prompts_built_on_outlook_total", **series) == 3
    ex.update({0: [snapshot(steps=2, cost_model={"built_on_outlook": 4})]})  # stats reset; one more build
    assert value(scrape_registry(), "vllm:magicpig_prompts_built_on_outlook_total", **series) == 4


def test_the_cost_models_line_is_a_gauge_once_it_predicts():
    """``sampling_pays_from_keys``: no series before the cost model predicts, its context after, and
    +Inf where sampling pays at no context (the stats' null)."""
    model = "unit-line"
    ex = Exporter(model)
    series = dict(model_name=model, rank="0")
    ex.update({0: [snapshot(steps=5, cost_model={"built_on_outlook": 0})]})
    assert value(scrape_registry(), "vllm:magicpig_sampling_pays_from_keys", **series) is None
    ex.update({0: [snapshot(steps=6, cost_model={"built_on_outlook": 0, "sampling_pays_from_keys": 3251})]})
    assert value(scrape_registry(), "vllm:magicpig_sampling_pays_from_keys", **series) == 3251
    ex.update({0: [snapshot(steps=7, cost_model={"built_on_outlook": 0, "sampling_pays_from_keys": None})]})
    assert value(scrape_registry(), "vllm:magicpig_sampling_pays_from_keys", **series) == math.inf


def test_raw_sample_counters_when_stats_report_them():
    model = "unit-raw"
    ex = Exporter(model)
    ex.update({0: [snapshot(sparse=1, frac=0.25, sampled_keys=25, candidate_keys=100)]})
    ex.update({0: [snapshot(sparse=2, frac=0.2, sampled_keys=40, candidate_keys=200)]})
    s = scrape_registry()
    assert value(s, "vllm:magicpig_sampled_keys_total", model_name=model) == 40
    assert value(s, "vllm:magicpig_candidate_keys_total", model_name=model) == 200


def test_budget_mode_gauges_per_layer_and_target():
    model = "unit-budget"
    ex = Exporter(model)
    budget = {"layers": {"model.layers.3.self_attn.attn": {
        "0.02": {"K": 11, "L": 120, "L_built": 150, "model_fraction": 0.02, "K_range": [10, 11], "L_range": [90, 120],
                 "choices": 3, "refined": 1, "sampled_fraction": 0.021},
        "0.04": {"K": 10, "L": 140, "model_fraction": 0.04, "K_range": [10, 10], "L_range": [140, 140],
                 "choices": 1, "refined": 0, "sampled_fraction": None}}}}
    ex.update({0: [snapshot(sparse=3, frac=0.02, budget=budget)]})
    s = scrape_registry()
    at = dict(model_name=model, rank="0", layer="model.layers.3.self_attn.attn")
    assert value(s, "vllm:magicpig_budget_K", target="0.02", **at) == 11
    assert value(s, "vllm:magicpig_budget_L", target="0.04", **at) == 140
    assert value(s, "vllm:magicpig_budget_L_built", target="0.02", **at) == 150
    assert value(s, "vllm:magicpig_budget_sampled_fraction", target="0.02", **at) == pytest.approx(0.021)
    assert value(s, "vllm:magicpig_budget_sampled_fraction", target="0.04", **at) is None  # not sampled yet


def test_metrics_survive_vllm_unregister():
    """vLLM's PrometheusStatLogger, created after the plugin loggers, unregisters every ``vllm:``
    collector; the MAGICPIG metrics are exported through a nameless forwarder and stay."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    Exporter("unit-unregister").update({0: [snapshot(sparse=3, frac=0.1)]})
    unregister_vllm_metrics()
    s = scrape_registry()
    assert value(s, "vllm:magicpig_decodes_total", model_name="unit-unregister", served="sparse") == 3


def test_logger_finds_the_creating_engine_client():
    from vllm.engine.protocol import EngineClient

    Client = type("Client", (EngineClient,), dict.fromkeys(EngineClient.__abstractmethods__, None))
    client = Client()
    client.engine_core = SimpleNamespace(client_index=0)

    def init(self):  # stands for AsyncLLM.__init__ -> StatLoggerManager -> the plugin's factory
        return MagicPigStatLogger(vllm_config=fake_config(), engine_indexes=[0])

    lg = init(client)
    assert lg.exporter is not None and lg._client() is client
    # not serving MAGICPIG, or not the first of several API servers: nothing is exported
    assert MagicPigStatLogger(fake_config("CPU_ATTN"), [0], client=client).exporter is None
    assert MagicPigStatLogger(fake_config(), [0], client=FakeClient([], client_index=1)).exporter is None


def test_logger_polls_at_most_once_per_interval_and_never_blocks():
    model = "unit-poll"
    client = FakeClient([snapshot(sparse=7, frac=0.1, index_bytes=64)], delay=0.1)
    lg = MagicPigStatLogger(fake_config(model=model), [0], client=client)
    lg.interval = 0.5

    async def scenario():
        lg.log_engine_initialized()  # first fetch at once: the series exist from start-up
        await asyncio.sleep(0.2)
        assert len(client.calls) == 1
        # 2 s of engine steps: record() returns at once; fetches follow at the interval
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            lg.record(None, None, engine_idx=0)
            assert time.perf_counter() - t0 < 0.01
            await asyncio.sleep(0.01)
        lg.record(None, None)  # the last step: no await between it and the count below
        n_active = len(client.calls)
        await asyncio.sleep(1.5)  # idle: one trailing fetch, then none
        lg.log()
        await asyncio.sleep(1.0)
        return n_active

    n_active = asyncio.run(scenario())
    gaps = [b - a for a, b in zip(client.calls, client.calls[1:])]
    assert all(g >= lg.interval - 0.02 for g in gaps), gaps
    assert 3 <= n_active <= 6, client.calls
    assert len(client.calls) == n_active + 1, "exactly one trailing fetch after activity"
    assert client.max_in_flight == 1
    s = scrape_registry()
    assert value(s, "vllm:magicpig_decodes_total", model_name=model, served="sparse") == 7
    assert value(s, "vllm:magicpig_index_bytes", model_name=model) == 64


def test_logger_survives_a_failing_rpc():
    class Broken(FakeClient):
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.calls.append(time.monotonic())
            raise RuntimeError("engine dead")

    client = Broken([])
    lg = MagicPigStatLogger(fake_config(model="unit-broken"), [0], client=client)
    lg.interval = 0.1

    async def scenario():
        lg.log_engine_initialized()
        await asyncio.sleep(0.05)
        lg.record(None, None)
        await asyncio.sleep(0.3)

    asyncio.run(scenario())
    assert len(client.calls) == 2 and lg._task is None


# --- the OpenAI server ------------------------------------------------------------------------

PROMPT_TOKENS = 2048
# background_index off: a few-token request must be sampled from its first decode, not wait for its index
SERVER_CFG = {"K": 10, "L": 150, "min_sparse_context": 512, "log_stats_interval": 1, "cost_model": False,
              "background_index": False}


@pytest.mark.server
def test_metrics_endpoint_carries_magicpig_counters(model_path, tmp_path):
    # VLLM_LOG_STATS_INTERVAL: vLLM's stat logging interval, which also paces the MAGICPIG fetches
    srv = launch(model_path, tmp_path / "server.log", SERVER_CFG, VLLM_LOG_STATS_INTERVAL="1")
    url, tail = srv.url, srv.tail
    try:
        from transformers import AutoTokenizer

        from vllm_magicpig import passkey

        # built while the server starts
        prompt = passkey.build(AutoTokenizer.from_pretrained(model_path), PROMPT_TOKENS, seed=3, depth=0.4)
        wait_healthy(srv)

        r = requests.post(f"{url}/v1/completions", timeout=300, json={
            "model": model_path, "prompt": prompt.text, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:500]}\n{tail()}"
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] >= 1800, usage
        # every layer of every decode step (the first token comes from the prefill) is one decode
        layers = json.loads((Path(model_path) / "config.json").read_text())["num_hidden_layers"]
        expected = layers * (usage["completion_tokens"] - 1)
        assert expected > 0, usage

        # The logger fetches the workers' counters at most once a second here (some during the
        # request), and once more after the engine goes idle: wait for that one.
        sparse = dict(model_name=model_path, engine="0", rank="0", served="sparse", reason="magicpig")
        deadline = time.monotonic() + 30
        while True:
            text = requests.get(f"{url}/metrics", timeout=10).text
            s = samples(text)
            if (value(s, "vllm:magicpig_decodes_total") or 0) >= expected:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        log_text = srv.log()
    finally:
        stop(srv.proc)

    assert "Cannot use MAGICPIG backend on CPU" not in log_text, "vLLM silently fell back to CPU_ATTN"
    assert "MAGICPIG stats:" in log_text, "the worker's stats log line is gone"
    mp_lines = "\n".join(line for line in text.splitlines() if "vllm:magicpig_" in line.split("{")[0])
    assert value(s, "vllm:num_requests_running") is not None, "vLLM's own metrics are missing"
    assert (value(s, "vllm:magicpig_decodes_total") or 0) >= expected, f"not all {expected} decodes:\n{mp_lines}"
    assert (value(s, "vllm:magicpig_decodes_total", **sparse) or 0) > 0, f"no sparse decode:\n{mp_lines}"
    assert value(s, "vllm:magicpig_decodes_total", served="exact", reason="dense_layer") > 0, mp_lines
    assert value(s, "vllm:magicpig_decodes_total", served="exact", reason="evicted") == 0, mp_lines
    frac = value(s, "vllm:magicpig_sampled_fraction", model_name=model_path, rank="0")
    assert frac is not None and 0 < frac < 1, mp_lines
    assert value(s, "vllm:magicpig_index_bytes", rank="0") > 0, mp_lines
    assert value(s, "vllm:magicpig_mirror_bytes", rank="0") > 0, mp_lines
    assert value(s, "vllm:magicpig_index_cap_bytes", rank="0") == 4096 << 20, mp_lines  # the default cap, room for it
    assert value(s, "vllm:magicpig_segments_live", rank="0") > 0, mp_lines
    assert value(s, "vllm:magicpig_segments_total", event="built") > 0, mp_lines
    assert value(s, "vllm:magicpig_centres_total", event="computed") > 0, mp_lines
    assert value(s, "vllm:magicpig_build_seconds_total") > 0, mp_lines
    sampled, candidates = value(s, "vllm:magicpig_sampled_keys_total"), value(s, "vllm:magicpig_candidate_keys_total")
    assert 0 < sampled < candidates, mp_lines  # the raw sums behind the fraction
    print("\n" + mp_lines)
