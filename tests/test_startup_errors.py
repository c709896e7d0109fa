"""Start-up errors: configs and models MAGICPIG cannot serve fail in vLLM's front end.

Each case constructs a real ``vllm.LLM(...)`` and must fail while the front end builds
``VllmConfig`` (the platform's ``check_and_update_config``, wrapped by ``register()``),
i.e. before any engine-core or worker process is spawned, with a message that names
the problem and the fix.

To prove "before any engine process starts", an autouse fixture replaces
``EngineCoreClient.make_client`` (the call that spawns the engine core) with a guard
that records the attempt and raises. A check that moved into the workers would then
surface as the guard's message, not the expected one, and the test fails (instead of
spending a minute starting an engine). Two control tests show the guard is reached by
a config MAGICPIG accepts.

Models other than SmolLM2 cannot be downloaded here, so the MLA / sliding-window /
ALiBi / sinks / encoder / head-size cases use tiny local folders that hold only a
``config.json`` (plus SmolLM2's tokenizer). No weights are needed: the checks fire
before anything is loaded.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

# A config error must surface within this many seconds (vLLM import and the model
# registry's first inspection of a new architecture included; an engine start on this
# machine takes 20-40 s more, and the guard stops it anyway).
FAST_S = 60.0

GUARD_MSG = "TEST GUARD: engine-core start attempted"


@pytest.fixture(autouse=True)
def engine_start_guard(monkeypatch):
    from vllm.v1.engine.core_client import EngineCoreClient

    calls: list[tuple] = []

    def make_client(*args, **kwargs):
        calls.append((args, kwargs))
        raise RuntimeError(GUARD_MSG)

    monkeypatch.setattr(EngineCoreClient, "make_client", staticmethod(make_client))
    return calls


def _pattern(*parts: str) -> str:
    return "(?s)" + ".*".join(re.escape(p) for p in parts)


def _expect_frontend_error(guard_calls, *parts: str, model: str, backend: str | None = "MAGICPIG", **kwargs):
    """LLM(...) must raise quickly, before the engine starts, with every part in order."""
    from vllm import LLM

    args = dict(model=model, enforce_eager=True, max_model_len=2048, seed=0)
    if backend is not None:
        args["attention_backend"] = backend
    args.update(kwargs)
    t0 = time.monotonic()
    with pytest.raises(Exception, match=_pattern(*parts)) as ei:
        LLM(**args)
    elapsed = time.monotonic() - t0
    assert not guard_calls, "the engine core was started before the config was rejected"
    assert elapsed < FAST_S, f"rejected only after {elapsed:.1f}s"
    assert isinstance(ei.value, ValueError), type(ei.value)  # pydantic ValidationError is one
    return str(ei.value)


def _expect_engine_start(guard_calls, *, model: str, backend: str | None = "MAGICPIG", **kwargs):
    from vllm import LLM

    args = dict(model=model, enforce_eager=True, max_model_len=2048, seed=0)
    if backend is not None:
        args["attention_backend"] = backend
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=re.escape(GUARD_MSG)):
        LLM(**args)
    assert len(guard_calls) == 1


# --------------------------------------------------------------------------- tiny model folders

_BASE = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)

TINY_CONFIGS = {
    # Mistral with a sliding window of 256 tokens.
    "mistral_swa": dict(_BASE, architectures=["MistralForCausalLM"], model_type="mistral",
                        head_dim=64, sliding_window=256),
    # Falcon-7B-style (alibi=True) and Bloom (always ALiBi).
    "falcon_alibi": dict(vocab_size=49152, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         architectures=["FalconForCausalLM"], model_type="falcon", alibi=True,
                         new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                         bias=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2),
    "bloom": dict(vocab_size=49152, hidden_size=256, n_layer=2, n_head=4,
                  architectures=["BloomForCausalLM"], model_type="bloom", torch_dtype="bfloat16"),
    # DeepSeek-V2-style multi-head latent attention (kv_lora_rank set).
    "deepseek_v2_mla": dict(_BASE, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                            kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=32,
                            v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
                            first_k_dense_replace=2, moe_intermediate_size=128),
    # gpt-oss has learned attention sinks (no sliding window here, so the sinks check is what fires).
    "gpt_oss_sinks": dict(vocab_size=49152, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=None,
                          layer_types=["full_attention", "full_attention"],
                          architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                          torch_dtype="bfloat16", max_position_embeddings=4096),
    # An encoder (BERT): vLLM runs it as a pooling model, with bidirectional attention.
    "bert_encoder": dict(vocab_size=49152, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=512, architectures=["BertModel"], model_type="bert",
                         max_position_embeddings=512, torch_dtype="bfloat16"),
    # A Llama with head_dim 96 (the kernel supports 64 and 128).
    "llama_hd96": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                       hidden_size=384, head_dim=96),
    # A plain small Llama (control: accepted by MAGICPIG).
    "llama_ok": dict(_BASE, architectures=["LlamaForCausalLM"], model_type="llama", head_dim=64),
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, model_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for name, cfg in TINY_CONFIGS.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(model_path, f), d / f)
        out[name] = str(d)
    return out


FALLBACK_FIX = "Fix: run this model without --attention-backend MAGICPIG"


# --------------------------------------------------------------------------- bad MAGICPIG config


def test_bad_K(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "'K'=0", "out of range", "allowed: 1..16",
                           model=model_path, additional_config={"magicpig": {"K": 0}})


def test_string_K(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "'K'", "must be an integer", "'10'",
                           model=model_path, additional_config={"magicpig": {"K": "10"}})


def test_unknown_key(engine_start_guard, model_path):
    msg = _expect_frontend_error(engine_start_guard, "unknown key(s) 'num_tables'", "allowed keys:",
                                 model=model_path, additional_config={"magicpig": {"num_tables": 150}})
    assert re.search(r"allowed keys:.*\bL\b.*\bsink_tokens\b", msg), msg


def test_target_cost_with_explicit_K_L(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "'target_cost' chooses K and L per layer", "'K' and 'L'",
                           "drop 'K' and 'L'", model=model_path,
                           additional_config={"magicpig": {"target_cost": 0.02, "K": 10, "L": 150}})


def test_target_cost_out_of_range(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "'target_cost'=0.9", "allowed: a number in 0.001..0.5",
                           model=model_path, additional_config={"magicpig": {"target_cost": 0.9}})


def test_dense_layer_outside_model(engine_start_guard, model_path):
    # SmolLM2-135M has 30 layers: 0..29.
    _expect_frontend_error(engine_start_guard, "'dense_layers'", "[30]", "allowed: 0..29",
                           model=model_path, additional_config={"magicpig": {"dense_layers": [0, 30]}})


def test_segment_not_block_multiple(engine_start_guard, model_path):
    # The CPU platform's default KV block size is 128.
    _expect_frontend_error(engine_start_guard, "'segment_tokens'=1000", "multiple of the KV block size (128)",
                           model=model_path, additional_config={"magicpig": {"segment_tokens": 1000}})


# --------------------------------------------------------------------------- unsupported vLLM features


def test_fp8_kv_cache(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "KV cache dtype 'fp8'", "Fix: drop --kv-cache-dtype",
                           model=model_path, kv_cache_dtype="fp8")


def test_speculative_decoding(engine_start_guard, model_path):
    # vLLM 0.32 supports ngram speculation on CPU, so it is MAGICPIG's check that fires.
    _expect_frontend_error(
        engine_start_guard, "speculative decoding is enabled", "Fix: drop --speculative-config",
        model=model_path,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
    )


def test_float32_dtype(engine_start_guard, model_path):
    _expect_frontend_error(engine_start_guard, "model dtype torch.float32", "Fix: pass --dtype bfloat16",
                           model=model_path, dtype="float32")


# --------------------------------------------------------------------------- unsupported models


@pytest.mark.parametrize(
    "name,feature",
    [
        ("mistral_swa", "the model uses sliding-window attention"),
        ("falcon_alibi", "the model uses ALiBi position biases"),
        ("bloom", "the model uses ALiBi position biases"),
        ("deepseek_v2_mla", "the model uses MLA (latent attention)"),
        ("gpt_oss_sinks", "the model uses learned attention sinks"),
        ("bert_encoder", "only decoder-only generative models with causal attention are supported"),
        ("llama_hd96", "head_dim 96 (supported: 64, 128)"),
    ],
)
def test_unsupported_model(engine_start_guard, tiny_models, name, feature):
    kwargs = {"max_model_len": 512} if name == "bert_encoder" else {}
    _expect_frontend_error(engine_start_guard, "MAGICPIG cannot serve this configuration", feature, FALLBACK_FIX,
                           model=tiny_models[name], **kwargs)


# --------------------------------------------------------------------------- controls: the guard is reachable


def test_control_valid_config_reaches_engine_start(engine_start_guard, model_path):
    """The SmolLM2 model with a valid MAGICPIG config passes every front-end check."""
    _expect_engine_start(engine_start_guard, model=model_path,
                         additional_config={"magicpig": {"K": 8, "L": 64, "dense_layers": [0, 29]}})


def test_control_budget_mode_reaches_engine_start(engine_start_guard, model_path):
    _expect_engine_start(engine_start_guard, model=model_path,
                         additional_config={"magicpig": {"target_cost": 0.02, "max_L": 120}})


def test_control_tiny_llama_accepted(engine_start_guard, tiny_models):
    _expect_engine_start(engine_start_guard, model=tiny_models["llama_ok"])


def test_control_fix_works_without_magicpig(engine_start_guard, tiny_models):
    """The suggested fix (drop --attention-backend MAGICPIG) gets the sliding-window model started,
    and a MAGICPIG config is not validated when MAGICPIG is not selected."""
    _expect_engine_start(engine_start_guard, model=tiny_models["mistral_swa"], backend=None,
                         additional_config={"magicpig": {"K": 0}})
