"""The load test of the OpenAI server (benchmarks/serve_load.py), CI-sized: 24 concurrent requests
of the full run's mix (retrievals of 1K-3K-token documents, chats, n > 1, stop strings, clients
that hang up mid-stream, bad requests), through MAGICPIG and then CPU_ATTN.

The unit tests check that the run's verdict fails on what it must catch; the server test runs the
load and requires every check to pass.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve_load  # noqa: E402

GB = 2**30


def report(**over) -> dict:
    r = {"failures": [], "healthy_after": True, "rss_ready_gb": 6.0, "rss_peak_gb": 7.0, "retrievals": 10,
         "retrieval_correct": 9}
    r.update(over)
    return r


def magicpig_report(sparse=100, held=GB, cap_mb=2048, cost_model=False, **over) -> dict:
    return report(magicpig={"decodes_sparse": sparse, "held_bytes_peak": held, "index_memory_mb": cap_mb,
                            "config": {"index_memory_mb": cap_mb, "cost_model": cost_model}}, **over)


def test_verdict_passes_a_clean_run():
    assert serve_load.verdict({"MAGICPIG": magicpig_report(), "CPU_ATTN": report()}, [], 4, 1.5) == []


@pytest.mark.parametrize("mp, ex, expected", [
    (magicpig_report(sparse=0), report(), "no decode was served sparse"),
    (magicpig_report(held=2049 * 2**20), report(), "> index_memory_mb=2048"),
    (magicpig_report(retrieval_correct=7), report(), "retrieval: MAGICPIG 7/10 < CPU_ATTN 9/10 - 1"),
    (magicpig_report(failures=["#3 chat: HTTP 500"]), report(), "MAGICPIG: #3 chat: HTTP 500"),
    (magicpig_report(healthy_after=False), report(), "MAGICPIG: not serving after the load"),
    (magicpig_report(rss_peak_gb=14.0), report(), "MAGICPIG: RSS grew 8.00 GB"),
    (magicpig_report(), report(rss_peak_gb=12.0), "CPU_ATTN: RSS grew 6.00 GB > 5.50 GB allowed"),
], ids=["silent_fallback", "over_cap", "retrieval_rate", "5xx", "unhealthy", "rss_mp", "rss_exact"])
def test_verdict_catches(mp, ex, expected):
    problems = serve_load.verdict({"MAGICPIG": mp, "CPU_ATTN": ex}, [], 4, 1.5)
    assert any(expected in p for p in problems), problems


def test_a_run_with_the_cost_model_may_serve_every_decode_exactly():
    # The default config decides per decode; its counters give the reasons, so no sparse decode is
    # no failure there, while the run that samples every decode it can (cost model off) must sample.
    reports = {"MAGICPIG": magicpig_report(sparse=0, cost_model=True),
               "MAGICPIG-sampled": magicpig_report(sparse=0), "CPU_ATTN": report()}
    assert serve_load.verdict(reports, [], 4, 1.5) == [
        "MAGICPIG-sampled: no decode was served sparse (a silent fallback to exact attention?)"]


def test_each_magicpig_run_is_checked_against_cpu_attn():
    reports = {"MAGICPIG": magicpig_report(cost_model=True), "MAGICPIG-sampled": magicpig_report(retrieval_correct=7),
               "CPU_ATTN": report()}
    assert serve_load.verdict(reports, [], 4, 1.5) == ["retrieval: MAGICPIG-sampled 7/10 < CPU_ATTN 9/10 - 1"]


def test_magicpig_config_takes_more_keys_and_refuses_bad_ones_before_the_run():
    assert serve_load.magicpig_config(512, {}) == {"K": 10, "L": 150, "index_memory_mb": 512}
    assert serve_load.magicpig_config(512, {"segment_tokens": 128})["segment_tokens"] == 128
    with pytest.raises(SystemExit, match="--magicpig: .*segment_tokns"):
        serve_load.magicpig_config(512, {"segment_tokns": 128})


def test_runs_are_named_and_configured():
    cfg = {"K": 10, "L": 150, "index_memory_mb": 512}
    assert serve_load.run_config("MAGICPIG", cfg) == ("MAGICPIG", cfg)
    assert serve_load.run_config("MAGICPIG-sampled", cfg) == ("MAGICPIG", cfg | {"cost_model": False})
    assert serve_load.run_config("CPU_ATTN", cfg) == ("CPU_ATTN", None)
    with pytest.raises(SystemExit, match="unknown run 'FLASH'"):
        serve_load.run_config("FLASH", cfg)


def test_check_flags_a_wrong_response():
    job = serve_load.Job(0, "stop", "/v1/completions", {}, stop=" six", n=2)
    ok = serve_load.Outcome(0, "stop", status=200)
    assert serve_load.check(job, ok, ["one", "two"], ["stop", "length"]) is None
    assert "stop string" in serve_load.check(job, ok, ["five six", "two"], ["stop", "stop"])
    assert "1 choices" in serve_load.check(job, ok, ["one"], ["stop"])
    assert "finish reasons" in serve_load.check(job, ok, ["one", "two"], ["stop", None])
    bad = serve_load.Job(1, "bad_json", "/v1/completions", None, raw="{", expect_4xx=True)
    assert serve_load.check(bad, serve_load.Outcome(1, "bad_json", status=200), [], []) is not None
    assert serve_load.check(bad, serve_load.Outcome(1, "bad_json", status=400), [], []) is None
    retrieval = serve_load.Job(2, "retrieval", "/v1/completions", {}, pass_key="12345")
    out = serve_load.Outcome(2, "retrieval", status=200)
    serve_load.check(retrieval, out, [" 12345."], ["stop"])
    assert out.correct is True
    serve_load.check(retrieval, out, [" 54321."], ["stop"])
    assert out.correct is False


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_magicpig.models import prepare_smollm2

    return AutoTokenizer.from_pretrained(str(prepare_smollm2()))


def test_long_answers_change_only_the_retrievals(tokenizer):
    short = serve_load.make_workload(tokenizer, "m", 30, (1024, 2048), seed=3)
    long = serve_load.make_workload(tokenizer, "m", 30, (1024, 2048), seed=3, answer_tokens=256)
    assert [j.kind for j in long] == [j.kind for j in short]
    retrievals = [(s, j) for s, j in zip(short, long) if j.kind == "retrieval"]
    assert len(retrievals) >= 5 and any(s.stop for s, _ in retrievals)  # some short ones had a stop string
    for s, j in retrievals:
        assert j.long_answer and j.stream and j.stop is None and "stop" not in j.body
        assert j.body["max_tokens"] == 256 and j.body["ignore_eos"] is True
        assert j.body["prompt"] == s.body["prompt"] and j.pass_key == s.pass_key
    for s, j in zip(short, long):
        if j.kind != "retrieval":
            assert (j.body, j.stream, j.long_answer) == (s.body, s.stream, False)


def test_long_answers_are_checked_and_timed():
    job = serve_load.Job(0, "retrieval", "/v1/completions", {"max_tokens": 256}, True, pass_key="777",
                         long_answer=True)
    cut = serve_load.Outcome(0, "retrieval", status=200, completion_tokens=200, latency_s=3.0, ttft_s=1.0)
    assert "200 tokens answered, asked for exactly 256" in serve_load.check(job, cut, ["777 ..."], ["length"])
    full = serve_load.Outcome(0, "retrieval", status=200, completion_tokens=256, latency_s=3.55, ttft_s=1.0)
    assert serve_load.check(job, full, ["777 ..."], ["length"]) is None and full.correct
    assert serve_load.decode_ms_per_token(full) == pytest.approx(10.0)  # 2.55 s over 255 tokens after the first
    assert serve_load.decode_ms_per_token(serve_load.Outcome(1, "retrieval", completion_tokens=256)) is None
    summary = serve_load.summarize([job], [full], wall=4.0)
    assert summary["long_answers"] == 1 and summary["long_answer_ms_per_token"]["mean"] == pytest.approx(10.0)


@pytest.mark.server
def test_load_ci_sized(tmp_path):
    # 20 requests (6 retrievals over 1-2K-token documents, ~10K prompt tokens in all): the smallest mix
    # with every kind in it and at least 5 retrievals; each backend's run is mostly prefill, ~30 tokens/s
    # on an AVX2 CI machine.  A cap below what the run would hold (about 450 MiB): eviction of idle
    # segments, refusal beside those of requests still decoding, and new prompts planned exact while
    # their index would not fit must keep it, and those requests are served exactly, still answering
    # correctly.
    magicpig = {"K": 10, "L": 150, "index_memory_mb": 256, "cost_model": False}  # the sampled path under load
    reports, problems = serve_load.run(20, (1024, 2048), ["MAGICPIG", "CPU_ATTN"], tmp_path / "serve_load",
                                       magicpig, kv_cache_gb=4)
    print("\n" + (tmp_path / "serve_load.md").read_text())
    assert not problems, problems
    mp = reports["MAGICPIG"]
    segments = mp["magicpig"]["segments"]
    no_room = mp["magicpig"]["decodes_exact"].get("evicted", 0)
    assert mp["magicpig"]["decodes_sparse"] > 0
    assert segments["evicted"] + segments["refused"] + no_room > 0  # the cap bit
    four_xx = sum(v for k, v in mp["status_counts"].items() if k.startswith("4"))
    assert mp["retrievals"] >= 5 and four_xx >= 3  # the mix really ran
