"""Sparse decode (placeholder until the kernel is wired in)."""
from __future__ import annotations


class StepPlanner:
    def __init__(self, cfg, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size

    def plan(self, cam, num_decodes: int, method: str):
        return None


class LayerState:
    def __init__(self, cfg, layer_name, layer_index, num_heads, num_kv_heads, head_size, scale) -> None:
        self.cfg = cfg
