"""What it costs when vLLM's CPU scheduler runs on its worker's core, in one engine, in turn.

    python benchmarks/scheduler_pinning.py                  # CPU_ATTN, SmolLM2, 1K-token prompt
    python benchmarks/scheduler_pinning.py --backend MAGICPIG --context 4096

vLLM's CPU platform keeps a core from its worker (``VLLM_CPU_NUM_OF_RESERVED_CPU``) for the
engine core's scheduler, but does not bind the scheduler there: it may run on any core, and
while a step runs it polls for the worker's output with ``sched_yield``. When Linux places it
on the worker's core, the two share that core. This benchmark times decode steps of one engine
with its scheduler (and this process) pinned to the cores the worker is not bound to, and left
free, taking turns (ABBA) so the machine's drift falls on both; it also samples on which core
the scheduler ran during each free run. Both modes run the same engine, the same prompt and the
same threads, so the difference is where the scheduler ran. (``e2e_decode.py`` pins both of its
engines' schedulers; its first side-by-side run, unpinned, had found one engine 40% slower than
the other with its scheduler seen on its worker's core. This benchmark's first run, 12 timings
each, found no difference: 53.6 against 52.5 ms a step.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_decode  # noqa: E402  (the engines and the decode timing it uses)

RESULTS = Path(__file__).resolve().parent / "results"


class CoreSampler:
    """Samples, every ``period`` seconds, whether the scheduler's main thread last ran on a worker core."""

    def __init__(self, pid: int, worker_cores: set[int], period: float = 0.05) -> None:
        self.pid, self.worker_cores, self.period = pid, worker_cores, period
        self.samples = self.on_worker = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        path = Path(f"/proc/{self.pid}/stat")
        while not self._stop.is_set():
            fields = path.read_text().rsplit(")", 1)[1].split()
            self.samples += 1
            self.on_worker += int(fields[36]) in self.worker_cores  # field 39: the CPU it last ran on
            time.sleep(self.period)

    def __enter__(self) -> "CoreSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="CPU_ATTN", choices=e2e_decode.BACKENDS)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8, help="timings per mode, ABBA")
    ap.add_argument("--out", default=str(RESULTS / "scheduler_pinning"))
    args = ap.parse_args(argv)
    e2e_decode.os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM's default takes most of memory
    from vllm_magicpig import passkey
    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    magicpig = {"log_stats_interval": 0, "cost_model": False} if args.backend == "MAGICPIG" else {}
    max_len = args.context + e2e_decode.SHORT_TOKENS + args.decode_tokens + 64
    llm = e2e_decode._engine(model, args.backend, max_len, magicpig, 8192, False)
    pinned = e2e_decode.keep_off_worker_cores()
    if not pinned:
        print("the worker holds every core: nothing to compare")
        return 1
    _, _, others = e2e_decode._engine_processes()
    worker_cores = e2e_decode.worker_cores()
    scheduler = next(p for p in others if p.name().startswith("VLLM::EngineCore"))
    prompt = passkey.build(llm.get_tokenizer(), args.context, seed=5, depth=0.5).text
    e2e_decode._timed_generate(llm, [prompt], 1)  # prefill once; the timed runs hit the prefix cache

    def timed(mode: str) -> tuple[float, float]:
        e2e_decode.pin_schedulers(pinned if mode == "pinned" else sorted(e2e_decode.ALLOWED_CPUS))
        with CoreSampler(scheduler.pid, worker_cores) as sampler:
            short = e2e_decode._timed_generate(llm, [prompt], e2e_decode.SHORT_TOKENS)
            long = e2e_decode._timed_generate(llm, [prompt], e2e_decode.SHORT_TOKENS + args.decode_tokens)
        return 1000 * (long - short) / args.decode_tokens, sampler.on_worker / max(sampler.samples, 1)

    runs = e2e_decode.in_turn({"pinned": lambda: timed("pinned"), "free": lambda: timed("free")}, 2 * args.turns)
    e2e_decode.pin_schedulers(pinned)
    llm.llm_engine.engine_core.shutdown()

    command = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"Command: `python benchmarks/scheduler_pinning.py {command}` ({time.strftime('%Y-%m-%d')})", "",
             f"{args.backend}, SmolLM2-135M, {args.context}-token prompt from the prefix cache, batch 1, "
             f"{args.decode_tokens} decode steps a timing (a {e2e_decode.SHORT_TOKENS}-token run subtracted), "
             f"worker on cores {sorted(worker_cores)}, scheduler pinned to {pinned} or free on "
             f"{sorted(e2e_decode.ALLOWED_CPUS)}, {2 * args.turns} timings each in turn (ABBA).", "",
             "| scheduler | ms per step: median | min | max | runs | scheduler seen on the worker's core |",
             "|---|---|---|---|---|---|"]
    for mode in ("pinned", "free"):
        ms = [r[0] for r in runs[mode]]
        seen = statistics.mean(r[1] for r in runs[mode])
        lines.append(f"| {mode} | {statistics.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} | {len(ms)} | "
                     f"{seen:.0%} of samples |")
    ratio = statistics.median(r[0] for r in runs["free"]) / statistics.median(r[0] for r in runs["pinned"])
    lines += ["", f"Free over pinned, median ms per step: {ratio:.2f}x."]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
