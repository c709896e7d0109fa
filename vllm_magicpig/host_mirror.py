"""The host mirror of an accelerator's KV cache: completed KV blocks copied to host memory as they
complete, so that building a request's index at its first decode does not wait on a copy.

Per engine step the planner tells the mirror which blocks were written (:meth:`HostMirror.begin_step`):
blocks whose last slot was written are complete and get copied; blocks written into lose what was
mirrored of them (vLLM freed and reused them). Each sparse layer's forward then enqueues its copies
(:meth:`HostMirror.copy_layer`) on the copy engine's side stream, after the step's KV write. The
planner covers only blocks whose copy has completed (:meth:`HostMirror.ready_blocks`): a block still
in flight stays in the exact tail, attended on the device, so nothing ever waits on a copy. A block
that a request needs and that is neither mirrored nor in flight (a prefix-cache hit on blocks
mirrored long ago and dropped since) is copied in the next forward.

The staged rows of a (layer, block) are handed to the segment build (:meth:`HostMirror.rows`) and
released once the segment holds its own copy. Staging is bounded (``max_bytes``): when it is full,
the oldest staged rows go first, blocks that find no room count as mirrored all the same, and a
build that finds its rows gone gathers them from the device then (counted as ``staging_misses``).
The keys are hashed on the device either way.

The copy engine is the only device-specific part: :class:`CudaCopyEngine` (a side stream, pinned
buffers, events) on CUDA, :class:`SyncCopyEngine` (plain copies, completed at once) elsewhere and
in tests.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import torch

from vllm_magicpig.kv_layout import KVViews, logical_blocks
from vllm_magicpig.stats import Stats


class CopyEngine(Protocol):
    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy into asynchronously (pinned on CUDA)."""

    def copy_blocks(self, kv: KVViews, blocks: list[int], dst_k: torch.Tensor, dst_v: torch.Tensor) -> Any:
        """Enqueue the copy of ``blocks`` of ``kv`` into ``dst_k`` / ``dst_v`` ``[n, bs, Hkv, D]``,
        after the work already queued on the device; return an event with ``query()``."""

    def order_after(self, event: Any) -> None:
        """Make the device's next work (a KV write into a block being copied) wait for ``event``."""


class _Done:
    @staticmethod
    def query() -> bool:
        return True


class SyncCopyEngine:
    """Copies at once, on the caller's thread: the CPU platform and the tests (where the "device"
    is the CPU). Events are complete on return."""

    def allocate(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def copy_blocks(self, kv, blocks, dst_k, dst_v):
        idx = torch.tensor(blocks, dtype=torch.long, device=kv.key.device)
        dst_k.copy_(logical_blocks(kv.key, idx))
        dst_v.copy_(logical_blocks(kv.value, idx))
        return _Done()

    def order_after(self, event):
        pass


class CudaCopyEngine:
    """Device-to-host copies on a side stream into pinned memory. The side stream first waits for
    the current stream (the step's KV write); an event marks each copy's completion. The gathered
    temporaries are allocated on the side stream, so the caching allocator keeps them until the
    copy has run."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.stream = torch.cuda.Stream(device=device)

    def allocate(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def copy_blocks(self, kv, blocks, dst_k, dst_v):
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            idx = torch.tensor(blocks, dtype=torch.long).to(kv.key.device, non_blocking=True)
            dst_k.copy_(logical_blocks(kv.key, idx), non_blocking=True)
            dst_v.copy_(logical_blocks(kv.value, idx), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def order_after(self, event):
        torch.cuda.current_stream().wait_event(event)


class _Batch:
    """The host buffers of one ``copy_layer`` call: ``keys`` / ``values`` ``[n, bs, Hkv, D]``, one block a row.
    They are freed when the last of their blocks is dropped."""

    __slots__ = ("keys", "values", "slot_bytes")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot_bytes: int) -> None:
        self.keys, self.values, self.slot_bytes = keys, values, slot_bytes


class HostMirror:
    def __init__(self, engine: CopyEngine, stats: Stats, max_bytes: int) -> None:
        self.engine = engine
        self.stats = stats
        self.max_bytes = max_bytes
        self.staged_bytes = 0
        self._ready: set[int] = set()  # blocks copied (in every layer that copies) since their last write
        self._pending: dict[int, Any] = {}  # block -> event of its newest copy (the step's last layer)
        self._to_copy: list[int] = []  # this step's blocks, copied by every sparse layer's forward
        self._wanted: set[int] = set()  # blocks a request needs that nobody is copying
        # (layer, block) -> (its copy's batch, the block's index in it), oldest first; block -> its staged layers.
        # An index rather than a view per block: a 98K-token prefill copies 6144 blocks a layer, and making
        # 2 x 6144 tensor views in Python took 20 ms of the forward on an H200 host (device_check.py).
        self._rows: OrderedDict[tuple[str, int], tuple[_Batch, int]] = OrderedDict()
        self._layers_of: dict[int, set[str]] = {}

    # ------------------------------------------------------------------ once per step (planner)
    def begin_step(self, written: list[int], completed: list[int]) -> None:
        """``written``: blocks this step writes KV into; ``completed``: those whose last slot it writes."""
        for b, event in list(self._pending.items()):
            if event.query():
                del self._pending[b]
                self._ready.add(b)
        for b in written:
            event = self._pending.pop(b, None)
            if event is not None:  # a copy still reads the block: the write must come after it
                self.engine.order_after(event)
            self._ready.discard(b)
            self._drop_block(b)
        self._to_copy = sorted(set(completed) | self._wanted)
        self._wanted.clear()

    def ready_blocks(self, row: list[int]) -> int:
        """How many leading blocks of ``row`` (full blocks only) are mirrored. Those after them
        that are neither mirrored nor being copied are copied this step."""
        n = 0
        while n < len(row) and row[n] in self._ready:
            n += 1
        missing = [b for b in row[n:] if b not in self._ready and b not in self._pending]
        if missing:
            self._wanted.update(missing)
            self._to_copy = sorted(set(self._to_copy) | self._wanted)
        return n

    # ------------------------------------------------------------------ per sparse layer (impl)
    def copy_layer(self, layer: str, kv: KVViews) -> None:
        """Enqueue this layer's copies of the step's blocks (after the step's KV write)."""
        if not self._to_copy:
            return
        bs, hkv, d = kv.block_size, kv.num_kv_heads, kv.head_dim
        slot_bytes = 2 * bs * hkv * d * kv.key.element_size()
        blocks = [b for b in self._to_copy if (layer, b) not in self._rows]
        room = self._make_room(len(blocks) * slot_bytes, slot_bytes)
        for b in blocks[room:]:
            # No room to stage: the segment build will gather these rows from the device (as with no
            # mirror at all), so they must not hold up coverage.
            if b not in self._pending:
                self._ready.add(b)
        blocks = blocks[:room]
        if not blocks:
            return
        dst_k = self.engine.allocate((len(blocks), bs, hkv, d), kv.key.dtype)
        dst_v = self.engine.allocate((len(blocks), bs, hkv, d), kv.value.dtype)
        event = self.engine.copy_blocks(kv, blocks, dst_k, dst_v)
        batch = _Batch(dst_k, dst_v, slot_bytes)
        for i, b in enumerate(blocks):
            self._rows[(layer, b)] = (batch, i)
            self._layers_of.setdefault(b, set()).add(layer)
            self._pending[b] = event  # the newest copy: on one stream, it completes after the older ones
        self.staged_bytes += len(blocks) * slot_bytes
        self.stats.index["blocks_mirrored"] += len(blocks)
        self._publish()

    def _make_room(self, need: int, slot_bytes: int) -> int:
        """Drop the oldest staged rows that are no longer in flight until ``need`` fits; return
        how many slots fit."""
        while self.staged_bytes + need > self.max_bytes and self._rows:
            (layer, b), _ = next(iter(self._rows.items()))
            if b in self._pending:
                break
            self._drop_rows(layer, b)
        return max(0, (self.max_bytes - self.staged_bytes) // slot_bytes)

    # ------------------------------------------------------------------ segment builds
    def rows(self, layer: str, blocks: tuple[int, ...], lo: int, hi: int):
        """Tokens [lo, hi) of a block run, from this layer's staged rows: (keys, values)
        ``[n, Hkv, D]`` host tensors, or None when any block's rows are not staged (or not yet copied)."""
        runs: list[list] = []  # [batch, first index, count]: blocks that lie side by side in one copy's batch
        for b in blocks:
            staged = self._rows.get((layer, b))
            event = self._pending.get(b)
            if staged is None or (event is not None and not event.query()):
                self.stats.index["staging_misses"] += 1
                return None
            batch, i = staged
            if runs and runs[-1][0] is batch and runs[-1][1] + runs[-1][2] == i:
                runs[-1][2] += 1
            else:
                runs.append([batch, i, 1])
        keys = torch.cat([batch.keys[i:i + n] for batch, i, n in runs]).flatten(0, 1)
        values = torch.cat([batch.values[i:i + n] for batch, i, n in runs]).flatten(0, 1)
        return keys[lo:hi], values[lo:hi]

    def release(self, layer: str, blocks: tuple[int, ...]) -> None:
        """The segment over ``blocks`` holds its own copy: free this layer's staged rows."""
        for b in blocks:
            self._drop_rows(layer, b)

    # ------------------------------------------------------------------ bookkeeping
    def _drop_block(self, b: int) -> None:
        for layer in list(self._layers_of.get(b, ())):
            self._drop_rows(layer, b)

    def _drop_rows(self, layer: str, b: int) -> None:
        staged = self._rows.pop((layer, b), None)
        if staged is not None:
            layers = self._layers_of[b]
            layers.discard(layer)
            if not layers:
                del self._layers_of[b]
            self.staged_bytes -= staged[0].slot_bytes
            self._publish()

    def _publish(self) -> None:
        self.stats.index["staged_bytes"] = self.staged_bytes
