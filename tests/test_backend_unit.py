"""MAGICPIG's builder and impl at the vLLM seam, without an engine.

Modelled on vLLM's own ``tests/v1/attention/test_attention_backends.py``: each case is a batch
spec (sequence lengths, query lengths). It builds a real ``CommonAttentionMetadata`` over a
paged cache with shuffled block ids, written by vLLM's own cache-write op, runs
``MagicPigMetadataBuilder.build`` and ``MagicPigImpl.forward``, and compares with vLLM's
``CPU_ATTN`` builder and impl on the same cache. The counters must show what ran, so a silent
fallback to exact attention fails these tests. Seconds, not minutes: no model weights load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_magicpig.kv_layout import amx_granted

D, HKV, G, BS = 64, 3, 3, 128  # SmolLM2-135M's attention shape; CPU KV block size
H = HKV * G
NUM_LAYERS = 30
SPARSE_LAYER, DENSE_LAYER = "model.layers.3.self_attn.attn", "model.layers.0.self_attn.attn"
SEED = 1234  # pinned: these tests assert statistical properties (sampled fractions)


@dataclass
class BatchSpec:
    seq_lens: list[int]
    query_lens: list[int]  # 1 = a decode; decodes come first (the builder's reorder threshold)


@pytest.fixture(scope="module")
def vllm_env(model_path):
    """(make_config, builders) for SmolLM2's config: only config.json is read, no weights."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    import vllm_magicpig

    vllm_magicpig.register()
    model = ModelConfig(model=model_path, dtype=torch.bfloat16, max_model_len=8192, enforce_eager=True)

    def make_config(**magicpig):
        return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BS),
                          additional_config={"magicpig": magicpig})

    return make_config


class MockLayer:
    """The attributes of vLLM's Attention layer that the CPU impls read."""

    def __init__(self, name: str, isa: str = "vec") -> None:
        self.layer_name = name
        self.isa = isa
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0


class Harness:
    """A paged cache holding each request's context, and both backends over it."""

    def __init__(self, vllm_config, spec: BatchSpec, gen: torch.Generator, num_blocks: int | None = None,
                 isa: str = "vec") -> None:
        from unittest import mock

        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.backends.cpu_attn import (
            CPUAttentionBackendImpl,
            CPUAttentionMetadataBuilder,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from vllm_magicpig.backend import MagicPigImpl, MagicPigMetadataBuilder

        self.cfg, self.spec, self.gen, self.isa = vllm_config, spec, gen, isa
        kv_spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)
        names = [SPARSE_LAYER, DENSE_LAYER]
        # vLLM's builders choose the cache layout (ISA) from the CPU: "amx" where it has AMX tiles,
        # else "vec". The harness writes its cache in ``isa``'s layout, so both builders are given it.
        with set_current_vllm_config(vllm_config), \
                mock.patch("vllm.v1.attention.backends.cpu_attn._get_attn_isa", return_value=isa):
            self.mp_builder = MagicPigMetadataBuilder(kv_spec, names, vllm_config, torch.device("cpu"))
            self.ref_builder = CPUAttentionMetadataBuilder(kv_spec, names, vllm_config, torch.device("cpu"))
            args = (H, D, D**-0.5, HKV, None, None, "auto")
            self.mp_impls = {n: MagicPigImpl(*args) for n in names}
            self.ref_impl = CPUAttentionBackendImpl(*args)
        self.runtime = self.mp_builder.runtime
        blocks_per_req = [math.ceil(s / BS) for s in spec.seq_lens]
        total = num_blocks or sum(blocks_per_req) + 4
        self.cache = torch.zeros(total, HKV, BS, 2 * D, dtype=torch.bfloat16)
        perm = torch.randperm(total, generator=gen)
        self.block_table = torch.zeros(len(spec.seq_lens), max(blocks_per_req), dtype=torch.int32)
        used = 0
        for r, n in enumerate(blocks_per_req):
            self.block_table[r, :n] = perm[used : used + n]
            used += n
        # Keys share an offset, as real models' keys do (what centring removes).
        self.offset = torch.randn(HKV, D, generator=gen) * 2
        self.keys = [(torch.randn(s, HKV, D, generator=gen) + self.offset).bfloat16() for s in spec.seq_lens]
        self.values = [torch.randn(s, HKV, D, generator=gen).bfloat16() for s in spec.seq_lens]
        # Context before this step's tokens is in the cache already (as earlier steps wrote it).
        for r, (s, q) in enumerate(zip(spec.seq_lens, spec.query_lens)):
            self.write(r, 0, s - q)

    def slots(self, r: int, lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return self.block_table[r].long()[pos // BS] * BS + pos % BS

    def write(self, r: int, lo: int, hi: int) -> None:
        from vllm import _custom_ops as ops

        nb = self.cache.shape[0]
        kc, vc = self.cache.view(nb, HKV, 2 * BS, D).chunk(2, dim=2)
        if hi > lo:
            ops.cpu_attn_reshape_and_cache(self.keys[r][lo:hi], self.values[r][lo:hi], kc, vc,
                                           self.slots(r, lo, hi), self.isa)

    def common_metadata(self):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        spec = self.spec
        qlens = torch.tensor(spec.query_lens, dtype=torch.int32)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(qlens, 0)
        seq = torch.tensor(spec.seq_lens, dtype=torch.int32)
        slots = torch.cat([self.slots(r, s - q, s) for r, (s, q) in enumerate(zip(spec.seq_lens, spec.query_lens))])
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=len(seq),
            num_actual_tokens=int(qlens.sum()), max_query_len=int(qlens.max()), max_seq_len=int(seq.max()),
            block_table_tensor=self.block_table, slot_mapping=slots, seq_lens_cpu_upper_bound=seq,
            is_prefilling=qlens > 1)

    def step(self, layer: str = SPARSE_LAYER, query_scale: float = 1.0):
        """One engine step in one layer: write this step's K/V, then both backends' outputs."""
        from vllm.config import set_current_vllm_config

        spec = self.spec
        for r, (s, q) in enumerate(zip(spec.seq_lens, spec.query_lens)):
            self.write(r, s - q, s)
        cam = self.common_metadata()
        n = cam.num_actual_tokens
        # Queries lean against the key offset, as real queries do, so attention is peaked.
        query = ((torch.randn(n, H, D, generator=self.gen) - 0.5 * self.offset.repeat_interleave(G, 0))
                 * query_scale).bfloat16()
        key = torch.cat([self.keys[r][s - q : s] for r, (s, q) in enumerate(zip(spec.seq_lens, spec.query_lens))])
        value = torch.cat([self.values[r][s - q : s]
                           for r, (s, q) in enumerate(zip(spec.seq_lens, spec.query_lens))])
        self.last_query = query
        with set_current_vllm_config(self.cfg):
            mp_meta = self.mp_builder.build(0, cam)
            ref_meta = self.ref_builder.build(0, cam)
            out = torch.full((n, H, D), float("nan"), dtype=torch.bfloat16)
            ref = torch.full((n, H, D), float("nan"), dtype=torch.bfloat16)
            self.mp_impls[layer].forward(MockLayer(layer, self.isa), query, key, value, self.cache, mp_meta, out)
            self.ref_impl.forward(MockLayer(layer, self.isa), query, key, value, self.cache, ref_meta, ref)
        return out.float(), ref.float(), mp_meta

    def stats(self) -> dict:
        return self.runtime.stats.snapshot()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def exact_f64(h: Harness) -> torch.Tensor:
    """Exact causal attention over the harness's last step, in float64 (each query token attends its
    request's keys up to its own position): the truth both kernels' exact outputs are held to."""
    q = h.last_query.double()
    outs, row = [], 0
    for r, (s, ql) in enumerate(zip(h.spec.seq_lens, h.spec.query_lens)):
        k = h.keys[r][:s].double().repeat_interleave(G, 1)  # s, H, D
        v = h.values[r][:s].double().repeat_interleave(G, 1)
        logits = torch.einsum("qhd,shd->qhs", q[row : row + ql], k) * D**-0.5
        visible = torch.arange(s)[None, :] <= torch.arange(s - ql, s)[:, None]  # q, s
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        outs.append(torch.einsum("qhs,shd->qhd", torch.softmax(logits, -1), v))
        row += ql
    return torch.cat(outs)


def assert_as_exact_as_vllm(out: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor) -> None:
    """``out``'s rows came from vLLM's kernel over a sub-batch, ``ref``'s from it over the whole batch.
    They may differ in reduction order (vLLM's AMX kernel splits a request's keys by the batch it is in,
    and rounds its probabilities to bf16 in between; its AVX2 build tiles a prefill by its batch): on AMX
    a few outputs near zero move by tens of bf16 steps, either way. So each is held to the float64 truth:
    the sub-batch as close to it as the whole batch, within 10% in norm and 2x in the worst output."""
    assert rel_err(out.double(), truth) <= 1.1 * rel_err(ref.double(), truth) + 1e-4
    assert float((out.double() - truth).abs().max()) <= 2 * float((ref.double() - truth).abs().max()) + 1e-6


def harness(vllm_env, spec, num_blocks=None, isa="vec", **magicpig) -> Harness:
    # These cases decode without a prefill step first; test_background_index.py covers the indexer.
    magicpig.setdefault("background_index", False)
    # The cost model starts empty, as these cases count its observations from the first step; the
    # start-up calibration has its own cases (test_cost_calibration.py).
    magicpig.setdefault("cost_calibration", False)
    return Harness(vllm_env(**magicpig), spec, torch.Generator().manual_seed(SEED), num_blocks, isa)


def amx_isa() -> str:
    """"amx" on a CPU with AMX tiles, with this process granted their state (these tests call
    vLLM's AMX kernel directly: kv_layout.amx_granted); else a skip."""
    if not amx_granted():
        pytest.skip("vLLM picks its AMX cache layout only on CPUs with AMX tiles; this one has none")
    return "amx"


@pytest.fixture(params=["vec", "amx"])
def isa(request) -> str:
    """Both of vLLM's x86 CPU cache layouts MAGICPIG reads: "vec", and "amx" where the CPU has it."""
    return amx_isa() if request.param == "amx" else "vec"


# --------------------------------------------------------------------------- exact paths


def test_short_contexts_are_served_by_the_platform_kernel(vllm_env, isa):
    h = harness(vllm_env, BatchSpec([300, 700, 900], [1, 1, 1]), isa=isa)
    out, ref, meta = h.step()
    assert torch.equal(out, ref)  # the same kernel, the same cache
    st = h.stats()
    assert st["decode_sparse"] == 0 and st["decode_exact"] == {"short_context": 3}, st
    assert meta.sparse_plan.sparse == []


def test_dense_layer_is_served_by_the_platform_kernel(vllm_env, isa):
    h = harness(vllm_env, BatchSpec([3000, 2200], [1, 1]), isa=isa)
    out, ref, _ = h.step(layer=DENSE_LAYER)
    assert torch.equal(out, ref)
    st = h.stats()
    assert st["decode_sparse"] == 0 and st["decode_exact"] == {"dense_layer": 2}, st


# --------------------------------------------------------------------------- sparse decode


def test_pure_decode_is_sampled_and_near_exact_when_nearly_every_key_is_sampled(vllm_env, isa):
    """K=1: a key collides in >= 2 of L=64 one-bit tables almost surely (u ~ 1), so the estimator
    attends nearly every key with a ~0 correction: it must match CPU_ATTN, and the counters
    must show it was MAGICPIG that served the step."""
    h = harness(vllm_env, BatchSpec([3000, 1500, 2600], [1, 1, 1]), isa=isa, K=1, L=64)
    assert h.runtime.layout.name == {"vec": "cpu_vec", "amx": "cpu_amx"}[isa]  # vLLM's layout, kept
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0, 1, 2]
    st = h.stats()
    assert st["decode_sparse"] == 3 and st["decode_by_method"] == {"magicpig": 3}, st
    assert st["sampled_fraction"] > 0.95, st
    for r in range(3):
        assert rel_err(out[r], ref[r]) < 2e-2, r


def test_an_int8_mirror_halves_the_mirror_and_stays_near_exact(vllm_env):
    """mirror_dtype int8: segments keep 8-bit rows (2D + 12 bytes a token per KV head against 4D + 4),
    and with nearly every key sampled the output stays near CPU_ATTN's; the counters show MAGICPIG
    served the step."""
    spec = BatchSpec([3000, 1500, 2600], [1, 1, 1])
    held = {}
    for mirror in ("auto", "int8"):
        h = harness(vllm_env, spec, K=1, L=64, mirror_dtype=mirror)
        out, ref, meta = h.step()
        st = h.stats()
        assert meta.sparse_plan.sparse == [0, 1, 2]
        assert st["decode_sparse"] == 3 and st["decode_by_method"] == {"magicpig": 3}, st
        assert st["sampled_fraction"] > 0.95, st
        for r in range(3):
            assert rel_err(out[r], ref[r]) < 3e-2, (mirror, r)
        held[mirror] = st["mirror_bytes"]
    assert held["int8"] * (4 * D + 4) == held["auto"] * (2 * D + 12), held


def test_pure_decode_at_default_budget_samples_few_keys(vllm_env, isa):
    """The default (K, L) samples a few percent of the keys: the output is an estimate (its
    accuracy against the float64 estimator is test_decode_path's), not exact attention."""
    h = harness(vllm_env, BatchSpec([4000, 3000], [1, 1]), isa=isa)
    out, ref, _ = h.step(query_scale=2.0)
    st = h.stats()
    assert st["decode_sparse"] == 2 and 0 < st["sampled_fraction"] < 0.2, st
    assert st["index"]["segments_built"] == 2 and st["index"]["centres_computed"] == 2, st
    assert torch.isfinite(out[:2]).all()
    for r in range(2):
        assert rel_err(out[r], ref[r]) > 1e-3, r  # sampled, so not the exact output


def test_mixed_decode_and_prefill(vllm_env, isa):
    """Decodes first (the builder's reorder threshold): prefill rows are CPU_ATTN's, decode rows
    are sampled."""
    h = harness(vllm_env, BatchSpec([3000, 2100, 600, 1400], [1, 1, 37, 200]), isa=isa, K=1, L=64)
    out, ref, meta = h.step()
    assert meta.num_decodes == 2 and meta.num_prefills == 2
    # MAGICPIG hands vLLM's kernel the prefill part of the batch, the reference the whole batch.
    assert_as_exact_as_vllm(out[2:], ref[2:], exact_f64(h)[2:])
    for r in range(2):
        assert rel_err(out[r], ref[r]) < 2e-2
    st = h.stats()
    assert st["decode_sparse"] == 2 and st["prefill_tokens"] == 237 and st["prefill_chunks"] == 2, st


def test_a_mixed_step_with_nothing_to_sample_is_one_platform_call(vllm_env, isa):
    """Short decodes beside a prefill chunk: every layer hands vLLM's kernel the whole batch, as
    CPU_ATTN does (the same output, bit for bit), and no prefill metadata is built apart;
    the decodes are still counted, by reason, and the prefill step teaches the cost model nothing."""
    h = harness(vllm_env, BatchSpec([300, 700, 600], [1, 1, 37]), isa=isa)
    out, ref, meta = h.step()
    assert meta.num_decodes == 2 and meta.num_prefills == 1 and meta.platform_serves_decodes
    assert meta.prefill is None
    assert torch.equal(out, ref)
    st = h.stats()
    assert st["decode_exact"] == {"short_context": 2} and st["prefill_chunks"] == 1, st
    assert h.runtime.cost.exact.steps == 0


def test_index_over_its_cap_serves_exactly_and_says_why(vllm_env):
    """index_memory_mb=1 cannot hold a 6K-token segment in this layer: the request is served
    exactly by the same kernel call (whole context dense) and counted as evicted."""
    h = harness(vllm_env, BatchSpec([6000, 700], [1, 1]), index_memory_mb=1)
    out, ref, _ = h.step()
    st = h.stats()
    assert st["decode_sparse"] == 0, st
    assert st["decode_exact"] == {"evicted": 1, "short_context": 1}, st
    assert st["index"].get("segments_live", 0) == 0  # nothing over the cap is kept
    for r in range(2):
        assert rel_err(out[r], ref[r]) < 1e-2
    # The sampled part attended its request exactly after all: its time is no sampling's cost. The
    # exact part's (vLLM's kernel over the short request) is exact attention's.
    assert h.runtime.cost.sparse.steps == 0 and h.runtime.cost.exact.steps == 1


def test_kv_write_into_an_indexed_block_drops_what_was_built_from_it(vllm_env, isa):
    """vLLM reuses freed blocks: a write into a block a segment covers must invalidate the
    segment and the centre, and the next decode must index the new content."""
    h = harness(vllm_env, BatchSpec([3000], [1]), isa=isa, K=1, L=64)
    h.step()
    st = h.stats()
    assert st["index"]["segments_built"] == 1 and st["index"]["segments_live"] == 1, st
    # New content over the request's whole context (blocks reused by another request).
    h.keys[0] = (torch.randn(3000, HKV, D, generator=h.gen) - h.offset).bfloat16()
    h.values[0] = torch.randn(3000, HKV, D, generator=h.gen).bfloat16()
    # The reusing request's prefill step writes those blocks (the builder sees its slots).
    h.spec = BatchSpec([3000], [3000])
    h.step()
    st = h.stats()
    assert st["index"]["centres_invalidated"] >= 1, st  # and the segments built on that centre with it
    assert st["index"].get("segments_live", 0) == 0, st
    h.spec = BatchSpec([3000], [1])
    out, ref, _ = h.step()
    st = h.stats()
    assert st["index"]["segments_built"] == 2, st  # rebuilt from the new keys
    assert rel_err(out[0], ref[0]) < 2e-2  # stale segments would give the old keys' attention


def test_growth_merges_instead_of_rebuilding(vllm_env, isa):
    """Decoding past segment_tokens boundaries indexes only the new tokens: the decoded tokens get a
    segment of their own, which then grows by merging, while the prompt's segment stays as it was
    (shared by every request over the prompt): nothing of the prompt is hashed again."""
    h = harness(vllm_env, BatchSpec([2000], [1]), isa=isa, K=1, L=64, segment_tokens=256, num_blocks=None)
    h.step()  # the prompt's segment: tokens [4, 1920), its last full block before the local window
    h.keys[0] = torch.cat([h.keys[0], (torch.randn(560, HKV, D, generator=h.gen) + h.offset).bfloat16()])
    h.values[0] = torch.cat([h.values[0], torch.randn(560, HKV, D, generator=h.gen).bfloat16()])
    h.block_table = torch.cat([h.block_table, torch.zeros(1, 4, dtype=torch.int32)], dim=1)
    free = sorted(set(range(h.cache.shape[0])) - set(h.block_table[0, :16].tolist()))
    h.block_table[0, 16:20] = torch.tensor(free[:4], dtype=torch.int32)
    h.write(0, 2000, 2559)
    for seq, built, merged in ((2300, 2, 0), (2560, 3, 1)):  # covered to 2176 (a new segment), then 2432 (merge)
        h.spec = BatchSpec([seq], [1])
        out, ref, _ = h.step()
        st = h.stats()["index"]
        assert st["segments_built"] == built and st.get("segments_merged", 0) == merged, st
        assert rel_err(out[0], ref[0]) < 2e-2
    assert st["tokens_indexed"] == (1920 - 4) + 256 + 256, st  # the prompt once, then only new tokens
    assert st["segments_live"] == 2, st  # the prompt's segment and the grown one (its base dropped)


def test_a_host_mirror_copies_completed_blocks_in_sparse_layers_and_gates_coverage(vllm_env):
    """Where the cache lives on a device (CUDA), a host mirror is attached: the impl copies the
    blocks each step completes, in sparse layers only, and the planner covers mirrored blocks only.
    Here on the CPU platform, with the synchronous copy engine (a STAND-IN for the side stream)."""
    from vllm_magicpig.host_mirror import HostMirror, SyncCopyEngine

    h = harness(vllm_env, BatchSpec([3000], [3000]), K=1, L=64)
    mirror = HostMirror(SyncCopyEngine(), h.runtime.stats, 2**30)
    h.runtime.mirror = h.mp_builder.planner.mirror = mirror
    h.step(layer=DENSE_LAYER)  # the prefill step, in a dense layer: nothing to mirror
    assert h.stats()["index"].get("blocks_mirrored", 0) == 0
    h.step(layer=SPARSE_LAYER)  # the prefill step again (same writes), in a sparse layer
    assert h.stats()["index"]["blocks_mirrored"] == 3000 // BS  # the full blocks; the last is partial
    h.spec = BatchSpec([3001], [1])
    h.keys[0] = torch.cat([h.keys[0], (torch.randn(1, HKV, D, generator=h.gen) + h.offset).bfloat16()])
    h.values[0] = torch.cat([h.values[0], torch.randn(1, HKV, D, generator=h.gen).bfloat16()])
    out, ref, meta = h.step()
    assert meta.sparse_plan.sparse == [0] and h.stats()["decode_sparse"] == 1
    assert rel_err(out[0], ref[0]) < 2e-2


def test_the_cost_model_is_fed_from_pure_decode_steps(vllm_env):
    """Dense layers time exact attention, sparse layers time sampling (index builds excluded);
    steps with prefills are not timed (their cost is not the decodes')."""
    h = harness(vllm_env, BatchSpec([3000, 2600], [1, 1]), num_blocks=64)
    cost = h.runtime.cost
    h.step(layer=DENSE_LAYER)
    h.stats()  # a read folds the step's exact tally (exact_tally.py), as the next step's plan does
    assert cost.exact.steps == 1 and cost.sparse.steps == 0
    h.step(layer=SPARSE_LAYER)  # the first decode: builds the index, which is not counted as its cost
    assert cost.sparse.steps == 0  # recorded in the layer, not yet folded (sparse_tally.py)
    assert h.stats()["build_seconds"] > 0 and cost.sparse.steps == 1
    t = cost.sparse._t0 / cost.sparse._w  # the sum of requests x seconds, undecayed at the latest step
    assert 0 < t < h.stats()["sparse_seconds"] + 1.0
    h.spec = BatchSpec([3000, 2600, 900], [1, 1, 900])  # a mixed step: two decodes, one prefill
    h.keys.append((torch.randn(900, HKV, D, generator=h.gen) + h.offset).bfloat16())
    h.values.append(torch.randn(900, HKV, D, generator=h.gen).bfloat16())
    h.block_table = torch.cat([h.block_table, torch.zeros(1, h.block_table.shape[1], dtype=torch.int32)])
    free = sorted(set(range(h.cache.shape[0])) - set(h.block_table[:2].flatten().tolist()))
    h.block_table[2, :8] = torch.tensor(free[:8], dtype=torch.int32)
    h.step(layer=DENSE_LAYER)
    assert cost.exact.steps == 1
    snap = h.stats()["cost_model"]
    assert snap["exact_steps"] == 1 and snap["sparse_steps"] == 1


# --------------------------------------------------------------------------- steps that sample some decodes


def _spy_sparse_rows(h: Harness) -> list[int]:
    """The rows of each call into MAGICPIG's kernel (appended as the calls happen)."""
    rows, ops = [], h.runtime.ops
    attend = ops.attend_queries

    def spy(query, *args, **kwargs):
        rows.append(query.shape[0])
        return attend(query, *args, **kwargs)

    ops.attend_queries = spy
    return rows


@pytest.mark.parametrize("spec, sampled, prefills", [
    (BatchSpec([700, 3000, 900, 2600, 500], [1, 1, 1, 1, 1]), [1, 3], 0),  # exact rows 0, 2, 4: gathered
    (BatchSpec([3000, 2600, 700, 1400], [1, 1, 1, 200]), [0, 1], 1),  # exact row 2: a view; a prefill beside
])
def test_a_step_that_samples_some_decodes_hands_the_others_to_the_platform_kernel(vllm_env, isa, spec, sampled,
                                                                                  prefills):
    """MAGICPIG's kernel attends the sampled requests only; vLLM's kernel attends the exact ones over
    their own metadata (the same output as CPU_ATTN's for the whole batch) and the prefill part. Each
    decode is counted once, by its reason, and both parts' times teach the cost model."""
    h = harness(vllm_env, spec, isa=isa, K=1, L=64)
    calls = _spy_sparse_rows(h)
    out, ref, meta = h.step()
    decodes = len(spec.seq_lens) - prefills
    exact = [r for r in range(decodes) if r not in sampled]
    assert meta.sparse_plan.sparse == sampled and meta.split is not None
    assert calls == [len(sampled)]  # no exact request in MAGICPIG's call
    assert (meta.split.exact_rows.span is None) == (exact != list(range(exact[0], exact[-1] + 1)))
    # The same kernel over the same keys, over a sub-batch (assert_as_exact_as_vllm).
    truth = exact_f64(h)
    assert_as_exact_as_vllm(out[exact], ref[exact], truth[exact])
    if prefills:
        assert_as_exact_as_vllm(out[decodes:], ref[decodes:], truth[decodes:])
    for r in sampled:
        assert rel_err(out[r], ref[r]) < 2e-2, r
    st = h.stats()
    assert st["decode_sparse"] == len(sampled) and st["decode_exact"] == {"short_context": len(exact)}, st
    from vllm_magicpig.cost_model import KEY_SCALE

    cost = h.runtime.cost
    assert cost.exact.steps == 1 and cost.sparse.steps == 1  # the exact part's time and the sampled part's
    # the exact part's observation is of its own requests and keys: least squares' sums of requests^2 and
    # requests x keys (in KEY_SCALE units)
    assert cost.exact._s00 / cost.exact._w == pytest.approx(len(exact) ** 2)
    keys = sum(spec.seq_lens[r] for r in exact)
    assert cost.exact._s01 / cost.exact._w == pytest.approx(len(exact) * keys * KEY_SCALE)


def test_without_the_split_every_decode_goes_through_magicpigs_call(vllm_env):
    """A platform whose decode method attends exact parts itself (CUDA's split decode) turns the split
    off: MAGICPIG's call then serves every decode request, the exact ones over their whole context, with
    the same counts."""
    h = harness(vllm_env, BatchSpec([700, 3000, 900], [1, 1, 1]), K=1, L=64)
    h.mp_builder.splits_exact_decodes = False
    calls = _spy_sparse_rows(h)
    out, ref, meta = h.step()
    assert meta.split is None and calls == [3]
    for r in range(3):
        assert rel_err(out[r], ref[r]) < 2e-2, r
    st = h.stats()
    assert st["decode_sparse"] == 1 and st["decode_exact"] == {"short_context": 2}, st


def test_decode_rows_metadata_keeps_the_chosen_requests_fields():
    """The sub-batch of decode requests 0 and 2: every per-request and per-token field picked in order,
    one query token each, vLLM's caches unset."""
    import numpy as np
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_magicpig.backend_common import decode_rows_metadata

    seq = torch.tensor([300, 500, 700, 900], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 3, 40], dtype=torch.int32)
    table = torch.arange(4 * 8, dtype=torch.int32).view(4, 8)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=4, num_actual_tokens=40,
        max_query_len=37, max_seq_len=900, block_table_tensor=table, slot_mapping=torch.arange(40) * 10,
        seq_lens_cpu_upper_bound=seq, is_prefilling=torch.tensor([False, False, False, True]),
        positions=torch.arange(40) + 100, req_idx=np.array([7, 5, 3, 1]))
    sub = decode_rows_metadata(cam, torch.tensor([0, 2]), 700)
    assert sub.num_reqs == 2 and sub.num_actual_tokens == 2 and sub.max_query_len == 1 and sub.max_seq_len == 700
    assert sub.query_start_loc.tolist() == [0, 1, 2] and sub.query_start_loc_cpu.tolist() == [0, 1, 2]
    assert sub.seq_lens.tolist() == [300, 700] and sub.seq_lens_cpu_upper_bound.tolist() == [300, 700]
    assert torch.equal(sub.block_table_tensor, table[[0, 2]])
    assert sub.slot_mapping.tolist() == [0, 20] and sub.positions.tolist() == [100, 102]
    assert sub.is_prefilling.tolist() == [False, False] and sub.req_idx.tolist() == [7, 3]
    assert sub._num_computed_tokens_cache is None
