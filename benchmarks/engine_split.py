"""Where a sparse layer's time goes inside a running engine: MAGICPIG's Python pieces, the native
call's set-up and the kernel's phases, timed in vLLM's own worker.

    python benchmarks/engine_split.py --context 16384 --batch 1          # SmolLM2, 3 reps
    python benchmarks/engine_split.py --context 16384 --batch 4 --tree ../old   # another built checkout

``decode_profile.py --cold`` runs the layer path in a loop, where the interpreter's code and data stay
warm; in an engine the path runs once a layer, between the model's other work, and costs several times
more. This benchmark starts one MAGICPIG engine (SmolLM2, the row's distinct prompts, the index built
first, the cost model off so that every decode is sampled), then wraps timers around the backend's
methods inside the worker (``collective_rpc`` with a callable, so ``VLLM_ALLOW_INSECURE_SERIALIZATION``
is set) and turns the kernel's phase timers on. Each rep decodes ``--short`` and ``--long`` tokens and
keeps the difference, so the prefix-cache recompute and the first decode steps drop out (``--short 0``:
the long run alone, whose timers nest, so each part is a time, never a difference of two noisy ones).

A sparse layer splits into: the kernel's phases; the native call's set-up (the native run less its
phases: argument conversion, checks, the unit list); the kernel wrapper's Python
(``CpuKernelOps.attend_queries`` less the native run: ``DecodeStep.serves`` / ``attend`` / ``_run``);
and the Python above it (``MagicPigImplMixin.forward`` less ``attend_queries``: the backend's
dispatch, ``SparseLayer``, the decode method and its index lookups, the accounting). Each rep's
figures are for the same engine: compare trees by running them in turn (``--tree``), as a single
run's reps drift by 10% on these machines. Results: ``benchmarks/results/engine_split.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timed_tree import use_tree_from_argv  # noqa: E402

TREE = use_tree_from_argv()

RESULTS = Path(__file__).resolve().parent / "results"

# (module, class or None, attribute, label): what the worker times. A module-level function is
# wrapped in its module (``magicpig_decode`` calls ``index_sparse_requests`` through its globals).
TIMED = [
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "execute_model", "worker step"),
    ("vllm_magicpig.backend_common", "MagicPigBuilderMixin", "build", "metadata build"),
    ("vllm_magicpig.planner", "StepPlanner", "plan", "plan"),
    ("vllm_magicpig.backend_common", "MagicPigImplMixin", "forward", "layer"),
    ("vllm_magicpig.layer", "SparseLayer", "forward", "SparseLayer.forward"),
    ("vllm_magicpig.layer", "SparseLayer", "_account", "accounting"),
    ("vllm_magicpig.magicpig_decode", "MagicPigDecode", "forward", "decode method"),
    ("vllm_magicpig.magicpig_decode", None, "index_sparse_requests", "index lookups"),
    ("vllm_magicpig.ops", "CpuKernelOps", "attend_queries", "ops call"),
    ("vllm_magicpig.kernel", "DecodeStep", "serves", "DecodeStep.serves"),
]
# What the table shows, in order (labels as above, plus the native run and the phases).
PHASE_PREFIX = "phase "  # the kernel's phases one by one, after COLUMNS
COLUMNS = ["layer", "phases", "native set-up", "wrapper", "above ops", "decode method", "index lookups",
           "accounting", "DecodeStep.serves", "metadata build", "plan"]


# ----------------------------------------------------------------------------- in the worker
def install(_worker=None):
    """Wrap the TIMED methods (and the native run) with timers, in the worker process."""
    import builtins
    import importlib
    import time
    from collections import defaultdict

    from vllm_magicpig import kernel

    totals, calls = defaultdict(float), defaultdict(int)
    builtins._magicpig_split = (totals, calls)

    def timed(fn, label, only=None):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if only is None or only(*args):
                    totals[label] += time.perf_counter() - t0
                    calls[label] += 1
        return wrapper

    for module, cls, attr, label in TIMED:
        owner = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        # the backend's forward also serves dense layers: only the sparse ones count as "layer"
        only = (lambda self, *a: self.sparse_layer is not None) if label == "layer" else None
        setattr(owner, attr, timed(getattr(owner, attr), label, only))

    class NativeRun:  # the native step object, its run timed
        def __init__(self, native):
            self.native = native

        def run(self, *args):
            t0 = time.perf_counter()
            try:
                return self.native.run(*args)
            finally:
                totals["native run"] += time.perf_counter() - t0
                calls["native run"] += 1

    init = kernel.DecodeStep.__init__

    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._c = NativeRun(self._c)

    kernel.DecodeStep.__init__ = wrapped_init
    return True


def reset(_worker=None):
    import builtins

    from vllm_magicpig import kernel

    totals, calls = builtins._magicpig_split
    totals.clear()
    calls.clear()
    kernel.start_phase_timers()
    return True


def read(_worker=None):
    """label -> (seconds, calls) since the reset, with the kernel's phases as "phases"."""
    import builtins

    from vllm_magicpig import kernel

    totals, calls = builtins._magicpig_split
    out = {k: (totals[k], calls[k]) for k in totals}
    phases = kernel.stop_phase_timers()
    out["phases"] = (sum(phases.values()), calls.get("native run", 0))
    for name, seconds in phases.items():  # each phase too: which of them the engine's cold caches slow
        out[PHASE_PREFIX + name] = (seconds, calls.get("native run", 0))
    return out


# ----------------------------------------------------------------------------- arithmetic
def window(long: dict, short: dict) -> dict:
    """label -> (seconds, calls) of the long run less the short one."""
    return {k: (v[0] - short.get(k, (0.0, 0))[0], v[1] - short.get(k, (0.0, 0))[1]) for k, v in long.items()}


def split_row(diff: dict, steps: int) -> dict:
    """One rep's row: the worker's ms per step, the sparse layers a step, and each part in us per
    sparse layer (its seconds over the window's sparse layer calls; the builder's parts in us per step)."""
    layer_calls = max(diff.get("layer", (0.0, 0))[1], 1)

    def us(label):
        return 1e6 * diff.get(label, (0.0, 0))[0] / layer_calls

    row = {"step ms": 1e3 * diff.get("worker step", (0.0, 0))[0] / steps, "sparse layers": layer_calls / steps,
           "layer": us("layer"), "phases": us("phases")}
    row["native set-up"] = us("native run") - row["phases"]
    row["wrapper"] = us("ops call") - us("native run")
    row["above ops"] = row["layer"] - us("ops call")
    for label in ("decode method", "index lookups", "accounting", "DecodeStep.serves"):
        row[label] = us(label)
    for label in diff:
        if label.startswith(PHASE_PREFIX):
            row[label] = us(label)
    for label in ("metadata build", "plan"):  # once a step: us per step
        row[label] = 1e6 * diff.get(label, (0.0, 0))[0] / steps
    return row


def table(rows: list[dict]) -> list[str]:
    phases = [k for k in (rows[0] if rows else {}) if k.startswith(PHASE_PREFIX)]
    head = ["rep", "step ms", "sparse layers a step"] + COLUMNS + phases
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        lines.append("| " + " | ".join([str(i), f"{row['step ms']:.2f}", f"{row['sparse layers']:.1f}"]
                                       + [f"{row.get(c, 0.0):.1f}" for c in COLUMNS + phases]) + " |")
    return lines


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=9, help="tokens of the short run")
    ap.add_argument("--long", type=int, default=41, help="tokens of the long run")
    ap.add_argument("--tree", type=Path, default=None, help="another built checkout to time (timed_tree.py)")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_split")
    args = ap.parse_args(argv)
    if args.short < 0 or args.long <= args.short:
        ap.error("--long must exceed --short >= 0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with our callables
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TREE), os.environ.get("PYTHONPATH", "")])  # the worker's too
    import e2e_decode as e2e

    from vllm_magicpig.models import prepare_smollm2

    model = str(prepare_smollm2())
    e2e.bind_threads("default")
    kv_gib = e2e.kv_space_gib([args.context], [args.batch], 512, e2e.kv_bytes_per_token(model))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))  # else vLLM takes most of memory for it
    # cost model off: this splits a sampled layer, and at 4K on some machines the cost model serves
    # the prompt exactly (sampling and exact attention near even), which would leave no kernel to time
    magicpig = {"K": 10, "L": 150, "index_memory_mb": 8192, "log_stats_interval": 0, "cost_model": False}
    llm = e2e._engine(model, "MAGICPIG", args.context + 512, magicpig, 8192, False)
    e2e.pin_schedulers(e2e.keep_off_worker_cores())
    tok = llm.get_tokenizer()
    prompts = [e2e.distinct_prompt(tok, args.context, seed=1000 + args.context + i) for i in range(args.batch)]
    e2e._generate(llm, prompts, 1)
    e2e.warm_up(llm, prompts)
    llm.collective_rpc(install)
    steps = args.long - args.short
    rows = []
    for _ in range(args.reps):
        runs = {0: {}}  # --short 0: the long run alone (its first step, the prompt's recompute, included)
        for tokens in {args.short, args.long} - {0}:
            llm.collective_rpc(reset)
            e2e._generate(llm, prompts, tokens)
            runs[tokens] = llm.collective_rpc(read)[0]
        rows.append(split_row(window(runs[args.long], runs[args.short]), steps))
    st = e2e._stats(llm)
    lines = [f"Command: `python benchmarks/engine_split.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"tree={TREE} context={args.context} batch={args.batch} "
             f"sampled fraction={st.get('sampled_fraction')} "
             "(K=10, L=150, cost model off, vLLM's default thread binding)", "",
             "us per sparse layer (the window's steps: the long run less the short); metadata build and plan in "
             "us per step. native set-up = native run less phases; wrapper = ops call less native run; above ops = "
             "layer less ops call (decode method, index lookups, accounting are inside it).", ""] + table(rows)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
