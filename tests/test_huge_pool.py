"""The huge-page pool behind segments' big arrays (cpp/huge_pool.h): freed regions are reused,
split and coalesced without ever handing one byte to two live segments, and the pool stays
within its limit.

The pool is process-wide, so every test reads its counters as deltas and restores the limit.
Inputs are fresh random every run; the seed is in every message (MAGICPIG_TEST_SEED replays it).
"""
from __future__ import annotations

import random

import pytest
import torch

from vllm_magicpig import kernel as kx

from helpers import make_runtime, to_paged
from test_kernel import new_seed

HKV, D, K, L = 2, 64, 10, 150
MiB = 2**20


@pytest.fixture
def pool_limit():
    """Yields a setter; the limit in force before the test is put back after it."""
    before = kx.huge_pool_stats()["limit_bytes"]
    yield kx.set_huge_pool_limit
    kx.set_huge_pool_limit(before)


class Probe:
    """A segment over random keys, with what it must keep answering: its bucket codes and a
    sampled decode over it (which reads its K/V mirror)."""

    def __init__(self, n, gen, projection):
        keys = torch.randn(n, HKV, D, generator=gen).bfloat16()
        values = torch.randn(n, HKV, D, generator=gen).bfloat16()
        self.centre = keys.float().mean(0)
        self.seg = kx.build_segment(keys, values, self.centre, projection, K, L)
        self.kview, self.vview, self.block_table, self.cache = to_paged([(keys, values)], 16, generator=gen)
        self.query = keys[n // 3:n // 3 + 1].repeat_interleave(2, dim=1)  # collides with its own key
        self.ranges = torch.tensor([[[0, 0], [n, n]]], dtype=torch.int32)  # nothing exact: all sampled
        self.projection = projection
        self.want = self.answer()

    def answer(self):
        out = torch.empty_like(self.query)
        cnt = torch.zeros(1, self.query.shape[1], dtype=torch.int64)
        kx.magicpig_decode_attention(self.query, self.projection, [self.centre], [[self.seg]], self.kview,
                                     self.vview, block_table=self.block_table, dense_ranges=self.ranges,
                                     scale=D**-0.5, K=K, L=L, out=out, sampled_counts=cnt)
        return self.seg.codes(), out, cnt

    def intact(self):
        codes, out, cnt = self.answer()
        want_codes, want_out, want_cnt = self.want
        return torch.equal(codes, want_codes) and torch.equal(out, want_out) and torch.equal(cnt, want_cnt)


def test_a_freed_segments_memory_is_reused_and_its_replacement_answers_the_same(pool_limit):
    seed, gen = new_seed()
    pool_limit(1 << 30)
    projection = torch.randn(D, K * L, generator=gen)
    first = Probe(8192, torch.Generator().manual_seed(seed), projection)
    assert first.want[2].sum() > 0, f"seed={seed}: the probe sampled nothing"
    before = kx.huge_pool_stats()
    del first
    freed = kx.huge_pool_stats()
    assert freed["pooled_bytes"] - before["pooled_bytes"] >= 8 * MiB, f"seed={seed}: {before} -> {freed}"
    assert freed["live_bytes"] < before["live_bytes"], f"seed={seed}: {before} -> {freed}"
    again = Probe(8192, torch.Generator().manual_seed(seed), projection)  # same inputs, reused memory
    after = kx.huge_pool_stats()
    assert after["reuses"] - freed["reuses"] >= 2, f"seed={seed}: mirror and ids not reused: {freed} -> {after}"
    assert after["fresh_maps"] == freed["fresh_maps"], f"seed={seed}: {freed} -> {after}"
    assert after["pooled_bytes"] < freed["pooled_bytes"], f"seed={seed}: {freed} -> {after}"
    assert again.intact(), f"seed={seed}"


def test_regions_split_for_small_builds_coalesce_back_for_a_big_one(pool_limit):
    """A big segment is freed, two small ones are cut from its regions and freed in turn: the
    pieces must merge back, so that the big segment built again needs no fresh mapping."""
    seed, gen = new_seed()
    projection = torch.randn(D, K * L, generator=gen)
    pool_limit(kx.huge_pool_stats()["live_bytes"])  # empty the pool: its contents are this test's own
    pool_limit(1 << 30)
    big = Probe(16384, torch.Generator().manual_seed(seed), projection)  # arrays of 8 and 10 MiB
    want = big.want
    del big
    small = [Probe(4096, gen, projection) for _ in range(2)]  # 2 and 4 MiB each, cut from those
    assert all(p.intact() for p in small), f"seed={seed}"
    cut = kx.huge_pool_stats()
    del small[0]
    del small[0]
    again = Probe(16384, torch.Generator().manual_seed(seed), projection)
    st = kx.huge_pool_stats()
    assert st["fresh_maps"] == cut["fresh_maps"], f"seed={seed}: pieces did not coalesce: {cut} -> {st}"
    assert all(torch.equal(a, b) for a, b in zip(again.want, want)), f"seed={seed}"
    assert again.intact(), f"seed={seed}"


def test_churn_of_mixed_sizes_never_shares_memory_between_live_segments(pool_limit):
    """Builds and frees segments of random sizes in random order, so the pool splits big free
    regions for small builds and coalesces neighbours for big ones. A region handed to two live
    segments would let a later build overwrite an earlier segment: every live segment is checked
    after every build."""
    seed, gen = new_seed()
    pool_limit(1 << 30)
    rng = random.Random(seed)
    projection = torch.randn(D, K * L, generator=gen)
    start = kx.huge_pool_stats()
    live: list[Probe] = []
    for step in range(14):
        if live and (len(live) >= 4 or rng.random() < 0.4):
            live.pop(rng.randrange(len(live)))
        live.append(Probe(16 * rng.randint(256, 1280), gen, projection))  # 4K-20K tokens: 2-10 MiB arrays
        for i in range(len(live)):
            assert live[i].intact(), f"seed={seed} step={step}: segment {i} of {len(live)} changed"
        st = kx.huge_pool_stats()
        assert st["live_bytes"] + st["pooled_bytes"] <= st["limit_bytes"] or st["pooled_bytes"] == 0, \
            f"seed={seed} step={step}: {st}"
    mid = kx.huge_pool_stats()
    assert mid["reuses"] > start["reuses"], f"seed={seed}: never reused: {start} -> {mid}"
    live.clear()
    end = kx.huge_pool_stats()
    assert end["live_bytes"] == start["live_bytes"], f"seed={seed}: {start} -> {end}"


def test_the_limit_bounds_live_plus_pooled_memory(pool_limit):
    seed, gen = new_seed()
    projection = torch.randn(D, K * L, generator=gen)
    pool_limit(1 << 30)
    kept = Probe(8192, gen, projection)
    dropped = Probe(8192, gen, projection)
    del dropped
    assert kx.huge_pool_stats()["pooled_bytes"] > 0, f"seed={seed}"
    pool_limit(kx.huge_pool_stats()["live_bytes"])  # room for what is live, none to keep
    st = kx.huge_pool_stats()
    assert st["pooled_bytes"] == 0, f"seed={seed}: lowering the limit kept {st}"
    unmapped = st["unmapped"]
    another = Probe(8192, gen, projection)
    del another  # over the limit: straight back to the OS
    st = kx.huge_pool_stats()
    assert st["pooled_bytes"] == 0 and st["unmapped"] > unmapped, f"seed={seed}: {st}"
    assert kept.intact(), f"seed={seed}"
    with pytest.raises(ValueError, match="limit_bytes"):
        kx.set_huge_pool_limit(-1)


def test_the_runtime_caps_the_pool_at_index_memory_mb(pool_limit):
    """The backend's ops pass index_memory_mb to the pool, and the stats report what it keeps."""
    from vllm_magicpig.config import MagicPigConfig

    rt = make_runtime(MagicPigConfig(index_memory_mb=96))
    assert kx.huge_pool_stats()["limit_bytes"] == 96 * MiB
    snap = rt.stats.snapshot()
    assert snap["pooled_bytes"] == kx.huge_pool_stats()["pooled_bytes"]
