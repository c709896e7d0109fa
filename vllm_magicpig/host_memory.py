"""How a CPU worker's memory is shared between vLLM's KV cache and MAGICPIG's index.

On vLLM's CPU platform the worker sizes its KV cache to fill ``--gpu-memory-utilization`` of its
memory node (0.92 by default), less the weights, and zeroes it at start-up. MAGICPIG's index
(hash tables and K/V mirror, capped by ``index_memory_mb``) lives beside it in the same process, so
left alone the two asked for more than the machine has: with vLLM's defaults on a 24 GB machine
the KV cache took 20.7 GiB, 0.6 GiB stayed free, and the worker was killed by the kernel's OOM
killer while indexing its second 7K-token prompt, mid-serve.

So the index's cap comes out of the worker's budget, where vLLM sizes it:

* **KV cache sized by vLLM** (no ``VLLM_CPU_KVCACHE_SPACE`` / ``--kv-cache-memory-bytes``): the KV
  cache gets the budget less the cap, so ``--gpu-memory-utilization`` covers both. A cap the user
  did not set is at most half of what the KV cache would have had (small machines); a cap the user
  set that leaves the KV cache nothing fails at start-up, naming the fix.
* **KV cache sized by the user**: it is kept, and the cap must fit beside it, with 512 MiB to spare,
  in the memory the node has free once the weights are loaded; otherwise start-up fails, naming the
  fix.

Tensor- or pipeline-parallel ranks on one memory node (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on a
one-node machine) run this check at the same moment: after every rank has loaded its weights (a
collective step of vLLM's start-up) and before any allocates its KV cache (the next one). Each then
sees the node's whole free memory, and vLLM sizes each rank's KV cache as if it were alone on the
node, so two ranks asked for twice what the node has. So the ranks count how many share the node
(``ranks_sharing_node``), and the plan divides it: where vLLM sizes the KV cache, each rank's
budget is its share of ``--gpu-memory-utilization`` of the node, less its own weights; where the
user sizes it, every rank's KV cache and cap must fit in the free memory together.

``patch`` wraps the CPU worker's ``determine_available_memory`` (vLLM's own memory check, run in the
worker after the weights load and before the KV cache is allocated); ``platform_hooks`` applies it
in the worker process.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from vllm_magicpig import serves_magicpig
from vllm_magicpig.config import CONFIG_KEY, MagicPigConfig, MagicPigConfigError, parse_config

WORKER_MODULE = "vllm.v1.worker.cpu_worker"
MIB = 2**20
GIB = 2**30
# A cap the user did not set takes at most this share of the KV cache vLLM would have sized: the
# default 4096 MiB is meant for machines where it is a small part, not all, of the memory.
DEFAULT_CAP_SHARE = 0.5
# Beside a KV cache the user sized, memory the worker needs besides the KV cache and the index (a
# build's scratch rows, the step's activations): a cap that fits only to the byte would not.
WORKING_MARGIN = 512 * MIB
_MARK = "_magicpig_host_memory"
logger = logging.getLogger("vllm.magicpig")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    kv_bytes: int  # what the worker's KV cache gets
    index_mb: int  # the index's cap
    note: str  # one line for the log: what was decided and why


def plan_worker_memory(cfg: MagicPigConfig, *, kv_bytes: int, kv_explicit: bool, available_bytes: int,
                       ranks_on_node: int = 1, weights_bytes: int = 0) -> MemoryPlan:
    """The worker's KV cache and index cap, from what vLLM would give its KV cache (``kv_bytes``),
    whether the user sized it (``kv_explicit``) and the memory its node has free now, weights loaded
    (``available_bytes``). ``ranks_on_node``: the parallel ranks allocating from this node, this one
    included, all planning now (module docs); ``weights_bytes``: what vLLM counted as this worker's
    non-KV memory when it sized ``kv_bytes`` (its resident set), needed to share a vLLM-sized budget.
    Raises MagicPigConfigError, naming the fix, where they cannot all fit."""
    given = "index_memory_mb" in cfg.given
    cap = cfg.index_memory_mb * MIB
    ranks = max(1, ranks_on_node)
    sharing = f", for each of the {ranks} ranks on this memory node," if ranks > 1 else ""
    if kv_explicit:
        # each rank's working memory, or the memory the index keeps free on the node at run time
        # (node_reserve_mb, node_memory.py), whichever is more: a cap that fits only below the reserve
        # would never be reached
        spare = max(ranks * WORKING_MARGIN, cfg.node_reserve_mb * MIB)
        spare_text = f"{spare // MIB} MiB to spare" + (" (node_reserve_mb)" if spare > ranks * WORKING_MARGIN else "")
        if ranks * (kv_bytes + cap) + spare > available_bytes:
            room = max(0, ((available_bytes - spare) // ranks - kv_bytes) // MIB)
            raise MagicPigConfigError(
                f"the KV cache you sized ({kv_bytes / GIB:.2f} GiB: VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes) "
                f"and MAGICPIG's index cap ({cfg.index_memory_mb} MiB, index_memory_mb"
                f"{'' if given else ', its default'}){sharing} do not fit, with {spare_text}, "
                f"in the {available_bytes / GIB:.2f} GiB this worker's memory node has free. Fix: a smaller KV "
                "cache, or " + (f'"index_memory_mb": {room} or less' if room else "free memory on this machine")
                + " in --additional-config")
        return MemoryPlan(kv_bytes, cfg.index_memory_mb,
                          f"MAGICPIG: the KV cache as sized ({kv_bytes / GIB:.2f} GiB) and the index's cap "
                          f"({cfg.index_memory_mb} MiB){sharing} fit in the {available_bytes / GIB:.2f} GiB free, "
                          f"with {spare_text}")
    sized = kv_bytes
    if ranks > 1:
        # vLLM gave each rank --gpu-memory-utilization of the whole node less its own weights; the
        # ranks share that budget
        kv_bytes = (kv_bytes + weights_bytes) // ranks - weights_bytes
        if kv_bytes <= 0:
            raise MagicPigConfigError(
                f"--gpu-memory-utilization's share of this memory node for each of its {ranks} ranks "
                f"({(sized + weights_bytes) / ranks / GIB:.2f} GiB) is no more than a rank's weights and "
                f"working memory ({weights_bytes / GIB:.2f} GiB): it leaves the KV cache nothing. Fix: a larger "
                "--gpu-memory-utilization, fewer ranks on this node, or size the KV cache yourself "
                "(VLLM_CPU_KVCACHE_SPACE)")
    share_mb = int(kv_bytes * DEFAULT_CAP_SHARE) // MIB  # the most an unset cap takes
    if not given:
        cap = min(cap, share_mb * MIB)
    if cap >= kv_bytes:
        raise MagicPigConfigError(
            f"MAGICPIG's index cap ({cfg.index_memory_mb} MiB, index_memory_mb) leaves vLLM's KV cache nothing of "
            f"the {kv_bytes / GIB:.2f} GiB that --gpu-memory-utilization gives it on this machine. Fix: a smaller "
            f"index_memory_mb (at most {share_mb} keeps half for the KV cache), or "
            f"a larger --gpu-memory-utilization")
    of = (f"{kv_bytes / GIB:.2f} GiB, this rank's share of the {sized / GIB:.2f} GiB vLLM sized it to as if "
          f"alone on its memory node with {ranks - 1} more rank{'s' if ranks > 2 else ''}" if ranks > 1
          else f"{kv_bytes / GIB:.2f} GiB vLLM sized it to")
    return MemoryPlan(kv_bytes - cap, cap // MIB,
                      f"MAGICPIG: the index's cap ({cap // MIB} MiB) comes out of the worker's memory budget "
                      f"(--gpu-memory-utilization): the KV cache gets {(kv_bytes - cap) / GIB:.2f} GiB of the {of}")


def _memory_node() -> int | None:
    """The memory node this worker allocates from, as vLLM's CPU worker finds it (None: no view)."""
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

        return get_allowed_cpu_list()[0].numa_node
    except Exception:  # noqa: BLE001 - an odd platform: one node, as far as this plan can tell
        return None


def node_available_bytes() -> int:
    """Free memory of the memory node this worker allocates from, as vLLM's CPU worker reads it."""
    return _available_on(_memory_node())


def node_available_reader() -> Callable[[], int]:
    """``node_available_bytes`` with the node found once: finding it takes ~3 ms (vLLM lists the
    allowed CPUs), a reading ~40 us, and the run-time guard (``node_memory.py``) reads often."""
    node = _memory_node()
    return lambda: _available_on(node)


def _available_on(node: int | None) -> int:
    try:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return get_memory_node_info(node).available_memory
    except Exception:  # noqa: BLE001 - no per-node view (one node, or an odd platform): the machine's
        import psutil

        return psutil.virtual_memory().available


def ranks_sharing_node() -> int:
    """How many ranks of this worker's parallel world (tensor and pipeline parallel) allocate from
    its memory node, itself included: one all-gather of (host, node) over the world's CPU group.
    Every rank runs it, in the same start-up step (``determine_available_memory``)."""
    import socket

    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    if not dist.is_initialized():  # no parallel world (a stand-in worker): alone
        return 1
    group = get_world_group()
    if group.world_size == 1:
        return 1
    mine = (socket.gethostname(), _memory_node())
    everyone: list = [None] * group.world_size
    dist.all_gather_object(everyone, mine, group=group.cpu_group)
    return sum(1 for theirs in everyone if theirs == mine)


def patch(worker_cls) -> None:
    """Make ``worker_cls`` (vLLM's CPUWorker) size its KV cache with the index's cap taken into
    account, when MAGICPIG is the attention backend. Idempotent."""
    original = worker_cls.determine_available_memory
    if getattr(original, _MARK, False):
        return

    def determine_available_memory(self) -> int:
        kv_bytes = original(self)
        vllm_config = self.vllm_config
        if not serves_magicpig(vllm_config):
            return kv_bytes
        import psutil

        cfg = parse_config(vllm_config.additional_config)
        # vLLM's own sizing counted this resident set as the non-KV memory (cpu_worker.py)
        plan = plan_worker_memory(cfg, kv_bytes=kv_bytes,
                                  kv_explicit=vllm_config.cache_config.kv_cache_memory_bytes is not None,
                                  available_bytes=node_available_bytes(), ranks_on_node=ranks_sharing_node(),
                                  weights_bytes=psutil.Process().memory_info().rss)
        if plan.index_mb != cfg.index_memory_mb:
            # the runtime, created by the attention builders after this, parses the worker's config
            additional = dict(vllm_config.additional_config or {})
            additional[CONFIG_KEY] = {**dict(additional.get(CONFIG_KEY) or {}), "index_memory_mb": plan.index_mb}
            vllm_config.additional_config = additional
        logger.info("%s", plan.note)
        return plan.kv_bytes

    setattr(determine_available_memory, _MARK, True)
    worker_cls.determine_available_memory = determine_available_memory
