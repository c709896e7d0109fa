"""Start-up checks: a bad config or a model MAGICPIG cannot serve fails here.

Runs inside the CPU platform's ``check_and_update_config`` (see platform_hooks), i.e.
while the front end builds ``VllmConfig``: ``LLM(...)`` raises and ``vllm serve``
exits before any weights load, instead of failing mid-serve.
"""
from __future__ import annotations

from vllm_magicpig.config import MagicPigConfig, MagicPigConfigError, parse_config, validate_for_model

# head_dim the kernel supports (its vector loops step 16 lanes; 64 and 128 are tested).
SUPPORTED_HEAD_SIZES = (64, 128)
_FALLBACK = "run this model without --attention-backend MAGICPIG"


def _fail(what: str, fix: str) -> None:
    raise MagicPigConfigError(f"MAGICPIG cannot serve this configuration: {what}. Fix: {fix}.")


def check_vllm_config(vllm_config) -> MagicPigConfig:
    cfg = parse_config(vllm_config.additional_config)
    model = vllm_config.model_config
    if model is None:  # config built without a model (some unit paths)
        return cfg

    if getattr(model, "use_mla", False):
        _fail("the model uses MLA (latent attention)", _FALLBACK)
    if model.get_sliding_window() is not None:
        _fail("the model uses sliding-window attention", _FALLBACK)
    if model.uses_alibi:
        _fail("the model uses ALiBi position biases", _FALLBACK)
    hf = model.hf_text_config
    if getattr(hf, "sinks", None) is not None or "GptOss" in " ".join(model.architectures or []):
        _fail("the model uses learned attention sinks", _FALLBACK)
    if model.is_encoder_decoder or getattr(model, "runner_type", "generate") != "generate":
        _fail("only decoder-only generative models with causal attention are supported", _FALLBACK)
    if str(model.dtype).replace("torch.", "") not in ("bfloat16", "float16"):
        _fail(f"model dtype {model.dtype} (the kernel reads bf16/fp16 KV)", "pass --dtype bfloat16")
    head = model.get_head_size()
    if head not in SUPPORTED_HEAD_SIZES:
        _fail(f"head_dim {head} (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))})", _FALLBACK)

    cache = vllm_config.cache_config
    if str(cache.cache_dtype) not in ("auto", "bfloat16", "float16"):
        _fail(f"KV cache dtype {cache.cache_dtype!r}", "drop --kv-cache-dtype (use 'auto')")
    if vllm_config.speculative_config is not None:
        _fail("speculative decoding is enabled", "drop --speculative-config")

    num_layers = total_layers(model, vllm_config.parallel_config)
    validate_for_model(cfg, num_layers=num_layers, block_size=cache.block_size)
    return cfg


def total_layers(model_config, parallel_config) -> int:
    """All decoder layers of the model (dense-layer indices are global, not per stage)."""
    n = getattr(model_config.hf_text_config, "num_hidden_layers", None)
    return int(n) if n else model_config.get_num_layers(parallel_config)
