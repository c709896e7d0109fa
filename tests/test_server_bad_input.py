"""The OpenAI server with MAGICPIG survives bad input, and rejects bad MAGICPIG configs at start-up.

Two halves:

* A malformed ``--additional-config`` (``K`` out of range, an unknown key) must make
  ``python -m vllm.entrypoints.openai.api_server`` exit non-zero before it loads weights, without
  ever answering ``/health``, with a message naming the key. These run first (no server yet).
* ONE server for the rest of the module (``--max-model-len 4096``, ``min_sparse_context`` 512,
  ``log_stats_interval`` 1, ``VLLM_LOG_STATS_INTERVAL=1``): bad requests (prompt over the model
  length, bad sampling parameters, malformed JSON, missing fields, a wrong model name, an
  out-of-vocabulary token id) get a 4xx with a JSON error message and do not hurt the engine; a
  streaming client that disconnects after the first chunk is aborted; afterwards normal requests
  still succeed, and a ~2K-token pass-key prompt is decoded sparsely (``/metrics`` and the
  worker's ``MAGICPIG stats:`` lines), with no decode served exactly for lack of index room.
"""
from __future__ import annotations

import json
import time

import pytest
import requests

from vllm_magicpig.eval.openai_server import Server, healthy, launch, metric_value, scrape, stop, wait_healthy

pytestmark = pytest.mark.server

BAD_CONFIG_TIMEOUT_S = 90
MAX_MODEL_LEN = 4096
# background_index off: a few-token request must be sampled from its first decode, not wait for its index
SERVER_CFG = {"K": 10, "L": 150, "min_sparse_context": 512, "log_stats_interval": 1, "cost_model": False,
              "background_index": False}
# VLLM_LOG_STATS_INTERVAL paces vLLM's stat loggers, and with them MAGICPIG's /metrics fetches.
STATS_ENV = {"VLLM_LOG_STATS_INTERVAL": "1"}


def _error_message(r: requests.Response) -> str:
    """The message of vLLM's JSON error body ``{"error": {"message": ..., "code": ...}}``."""
    assert r.headers.get("content-type", "").startswith("application/json"), (r.headers, r.text[:500])
    body = r.json()
    err = body.get("error", body) if isinstance(body, dict) else None
    msg = err.get("message") if isinstance(err, dict) else None
    assert isinstance(msg, str) and msg.strip(), f"no error message in {body}"
    return msg


# --------------------------------------------------------------------------- bad --additional-config


@pytest.mark.parametrize("magicpig, expected", [
    ({"K": 0}, ["'K'=0", "allowed: 1..16"]),
    ({"num_tables": 150}, ["unknown key(s) 'num_tables'"]),
], ids=["K0", "unknown_key"])
def test_bad_additional_config_exits_at_startup(model_path, tmp_path, magicpig, expected):
    t0 = time.monotonic()
    srv = launch(model_path, tmp_path / "server.log", magicpig, max_model_len=MAX_MODEL_LEN, **STATS_ENV)
    proc = srv.proc
    became_healthy = False
    try:
        while proc.poll() is None and time.monotonic() - t0 < BAD_CONFIG_TIMEOUT_S:
            became_healthy |= healthy(srv.url)
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        rc = proc.poll()
    finally:
        stop(proc)
    out = srv.log()
    assert rc is not None, f"still running after {BAD_CONFIG_TIMEOUT_S}s; log tail:\n{srv.tail()}"
    assert rc != 0, f"exited with rc=0; log tail:\n{srv.tail()}"
    assert not became_healthy, "the server answered /health with a bad MAGICPIG config"
    for part in expected:
        assert part in out, f"{part!r} not in the output; log tail:\n{srv.tail()}"
    assert "Loading weights" not in out and "Starting to load model" not in out, srv.tail()
    msg = next(line for line in out.splitlines() if expected[0] in line)
    print(f"\n{magicpig}: rc={rc} after {elapsed:.1f}s: {msg.strip()[:300]}")


# --------------------------------------------------------------------------- one server for the rest


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    srv = launch(model_path, tmp_path_factory.mktemp("server_bad_input") / "server.log", SERVER_CFG,
                 max_model_len=MAX_MODEL_LEN, **STATS_ENV)
    try:
        print(f"\nserver healthy after {wait_healthy(srv):.1f}s")
        yield srv
    finally:
        stop(srv.proc)


@pytest.fixture(scope="module")
def passkey_prompt(model_path):
    from transformers import AutoTokenizer

    from vllm_magicpig import passkey

    return passkey.build(AutoTokenizer.from_pretrained(model_path), 2048, seed=5, depth=0.3)


def _complete(server: Server, prompt: str, max_tokens: int, **extra) -> dict:
    t0 = time.monotonic()
    r = requests.post(f"{server.url}/v1/completions", timeout=300, json={
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:1000]}\nlog tail:\n{server.tail()}"
    out = r.json()
    assert out["choices"][0]["text"], out
    print(f"\n200 in {time.monotonic() - t0:.1f}s, usage {out['usage']}: {out['choices'][0]['text']!r}")
    return out


LONG_PROMPT = "hello " * 5000  # ~5000 tokens, over --max-model-len 4096

# (id, request kwargs builder(model) -> dict for requests.post, expected status (None: any 4xx), path)
BAD_REQUESTS = [
    ("prompt_over_max_len", lambda m: {"json": {"model": m, "prompt": LONG_PROMPT, "max_tokens": 4}}, 400),
    ("max_tokens_over_max_len", lambda m: {"json": {"model": m, "prompt": "Hi", "max_tokens": 5000}}, 400),
    ("temperature_-1", lambda m: {"json": {"model": m, "prompt": "Hi", "max_tokens": 4, "temperature": -1}}, 400),
    ("top_p_2", lambda m: {"json": {"model": m, "prompt": "Hi", "max_tokens": 4, "top_p": 2}}, 400),
    ("max_tokens_-5", lambda m: {"json": {"model": m, "prompt": "Hi", "max_tokens": -5}}, 400),
    ("n_0", lambda m: {"json": {"model": m, "prompt": "Hi", "max_tokens": 4, "n": 0}}, 400),
    ("malformed_json", lambda m: {"data": '{"model": "' + m + '", "prompt": "Hi", "max_tokens": ',
                                  "headers": {"Content-Type": "application/json"}}, 400),
    ("missing_prompt", lambda m: {"json": {"model": m, "max_tokens": 4}}, 400),
    ("wrong_model", lambda m: {"json": {"model": "no-such-model", "prompt": "Hi", "max_tokens": 4}}, 404),
    ("token_id_out_of_vocab", lambda m: {"json": {"model": m, "prompt": [1, 2, 10**9], "max_tokens": 4}}, 400),
    ("chat_missing_messages", lambda m: {"json": {"model": m, "max_tokens": 4}}, 400),
]


@pytest.mark.parametrize("case, build, status", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_4xx(server, case, build, status):
    path = "/v1/chat/completions" if case.startswith("chat_") else "/v1/completions"
    t0 = time.monotonic()
    r = requests.post(f"{server.url}{path}", timeout=120, **build(server.model))
    elapsed = time.monotonic() - t0
    assert 400 <= r.status_code < 500, f"{case}: HTTP {r.status_code}: {r.text[:500]}\nlog tail:\n{server.tail()}"
    msg = _error_message(r)
    print(f"\n{case}: HTTP {r.status_code} in {elapsed:.2f}s: {msg[:300]!r}")
    assert r.status_code == status, f"{case}: HTTP {r.status_code} (expected {status}): {msg}"
    assert server.proc.poll() is None, f"server died on {case}; log tail:\n{server.tail()}"


def test_missing_model_serves_the_default_model(server):
    """vLLM's protocol makes ``model`` optional (``model: str | None = None``): a request without
    it is served by the only served model. Documented here, so a change of that rule shows."""
    r = requests.post(f"{server.url}/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 4})
    print(f"\nmissing model: HTTP {r.status_code}: {r.text[:300]!r}")
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text[:500]
    if r.status_code == 200:
        assert r.json()["model"] == server.model, r.json()
    else:
        _error_message(r)


def test_still_serving_after_bad_requests(server):
    out = _complete(server, "The capital of France is", 8)
    assert out["usage"]["completion_tokens"] > 0, out
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
    log = server.log()
    assert "EngineDeadError" not in log and "EngineCore encountered a fatal error" not in log, server.tail()


def test_stream_client_disconnect_is_aborted(server, passkey_prompt):
    """A streaming client that hangs up after the first chunk: the request is aborted (not decoded
    to its 2000 tokens), and the engine serves the next request."""
    gen_before = metric_value(scrape(server.url), "vllm:generation_tokens_total") or 0
    t0 = time.monotonic()
    r = requests.post(f"{server.url}/v1/completions", stream=True, timeout=300, json={
        "model": server.model, "prompt": passkey_prompt.text, "max_tokens": 2000, "ignore_eos": True,
        "temperature": 0, "stream": True})
    assert r.status_code == 200, r.text[:500]
    first = next(line for line in r.iter_lines() if line)
    r.close()
    t_first = time.monotonic() - t0
    assert first.startswith(b"data: {"), first[:200]
    assert json.loads(first[len(b"data: "):])["choices"][0]["text"] is not None

    # vLLM aborts the request when the client is gone: generation stops long before 2000 tokens
    # (the counter, updated every engine step, stands still while nothing runs).
    t1 = time.monotonic()
    last = None
    while True:
        s = scrape(server.url)
        gen = metric_value(s, "vllm:generation_tokens_total") or 0
        if gen == last:
            break
        assert time.monotonic() - t1 < 60, f"still generating ({gen} tokens); log tail:\n{server.tail()}"
        last = gen
        time.sleep(2)
    generated = gen - gen_before
    running = metric_value(s, "vllm:num_requests_running")
    aborted = metric_value(s, "vllm:request_success_total", finished_reason="abort")
    print(f"\nfirst chunk after {t_first:.1f}s; generation stopped within {time.monotonic() - t1:.1f}s of the "
          f"disconnect after {generated:.0f} tokens; running={running}, finished_reason=abort: {aborted}")
    assert generated < 1000, f"the disconnected request was not aborted: {generated} tokens generated"
    assert server.proc.poll() is None, server.tail()

    # the same document again (its prefix blocks and MAGICPIG segments cached), then an unrelated prompt
    out = _complete(server, passkey_prompt.text, 8)
    print(f"pass key {passkey_prompt.pass_key} in the answer: {passkey_prompt.pass_key in out['choices'][0]['text']}")
    _complete(server, "The capital of France is", 8)


def test_magicpig_decoded_sparsely(server, passkey_prompt):
    """The good requests ran MAGICPIG: sparse decodes counted, none served exactly for lack of room."""
    out = _complete(server, passkey_prompt.text, 6)
    assert out["usage"]["prompt_tokens"] >= 1800, out["usage"]

    # The stat logger fetches the workers' counters at most once a second, and once after idling.
    deadline = time.monotonic() + 30
    while True:
        s = scrape(server.url)
        sparse = metric_value(s, "vllm:magicpig_decodes_total", served="sparse") or 0
        if sparse > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    log = server.log()
    mp = {f"{n}{dict(lab)}": v for (n, lab), v in s.items() if n.startswith("vllm:magicpig_decodes_total")}
    print(f"\n/metrics: {mp}")
    assert "Cannot use MAGICPIG backend on CPU" not in log, "vLLM silently fell back to CPU_ATTN"
    assert sparse > 0, f"no sparse decode in /metrics: {mp}"
    assert metric_value(s, "vllm:magicpig_decodes_total", served="exact", reason="evicted") == 0, mp
    stats = [line for line in log.splitlines() if "MAGICPIG stats:" in line]
    assert stats, f"no 'MAGICPIG stats:' line; log tail:\n{server.tail()}"
    print(f"last stats line: {stats[-1].strip()[:400]}")
    assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
    assert "EngineDeadError" not in log and "Traceback" not in log, server.tail()
