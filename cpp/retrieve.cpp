// The rows a unit attends to: LSH retrieval (>= 2 collisions) from a segment, or a dense tile
// gathered from the paged cache.
#include <algorithm>
#include <cstring>

#include "attend.h"

namespace mp {

// Retrieval counts collisions per head in a byte per token of the segment (32 KiB for a full
// 32K-token segment: L1 and L2), each id of a walked bucket one read-modify-write of its byte,
// c = c | c << 1 | 1: 0, 1, 3, 7, ... 255, never wrapping whatever L, so bit 1 marks the keys hit
// at least twice.  Two interleaved bitsets (hit once, hit twice), a quarter of the bytes, took 17
// instructions an id (their 16-byte update went through vector registers) against 10, and their
// walk was about two thirds of the lookup's time; the bytes made the lookup 5-15% cheaper
// (results/kernel_bench_collision_bytes_avx2.md).  The keys hit twice come out of a scan of the
// bytes in ascending order, so neither a sort nor a per-token epoch is needed.
int sampled_words_scalar(const uint8_t* collisions, int words, uint64_t* out) {
  int c = 0;
  for (int w = 0; w < words; ++w) {
    uint64_t m = 0;
    for (int b = 0; b < 64; ++b) m |= static_cast<uint64_t>((collisions[w * 64 + b] >> 1) & 1) << b;
    out[w] = m;
    c += __builtin_popcountll(m);
  }
  return c;
}

void retrieve(const AttnArgs& args, const Unit& unit, Isa isa, Scratch& scratch, int* counts) {
  const Segment& seg = *unit.seg;
  // L strides the codes and the tables; only the first L_read are walked
  const int G = unit.G, L = args.L, L_read = args.L_read, words = (seg.n + 63) / 64;
  const int32_t* qc = args.qcodes + (static_cast<size_t>(unit.r) * args.H + unit.h0) * L;
  auto code = [&](int g, int l) { return static_cast<uint32_t>(qc[static_cast<size_t>(g) * L + l]); };
  // The index is far larger than the caches, so each (table, head) bucket costs two dependent DRAM
  // misses: its directory entry, then its ids.  The (head, table) pairs are walked as a pipeline in
  // walk order (g, l): the pair kDirAhead ahead has its directory entry prefetched, the pair kIdsAhead
  // ahead is resolved (its entry has had kDirAhead - kIdsAhead walks to arrive) and its id lines
  // prefetched, and the current pair is walked, so misses stay in flight all through the walk.
  // Prefetching all L_read * G entries up front, then resolving them all, then walking, made the
  // lookup 13% slower at 128K tokens and 19% at 8K, the same at 32K (benchmarks/kernel_ab.py;
  // results/kernel_bench_lookup_pipeline_avx2.md): a core keeps only a few dozen misses in flight.
  constexpr int kDirAhead = 16, kIdsAhead = 8;
  const int P = L_read * G;
  scratch.buckets.resize(P);
  // A position in walk order (head g, table l), stepped without divisions.
  struct Pair {
    int g = 0, l = 0, s = 0;
    void next(int L_read) {
      ++s;
      if (++l == L_read) l = 0, ++g;
    }
  };
  Pair dir, res;  // the next pair to prefetch the directory entry of, and to resolve
  auto prefetch_next_entry = [&] {
    if (dir.s == P) return;
    seg.prefetch_bucket(unit.kvh * L + dir.l, code(dir.g, dir.l));
    dir.next(L_read);
  };
  auto resolve_next = [&] {
    if (res.s == P) return;
    const int t = unit.kvh * L + res.l;
    const Segment::Bucket b = seg.bucket(t, code(res.g, res.l));
    scratch.buckets[res.s] = b;
    // Every line the bucket's ids touch (a bucket rarely starts on a line boundary).
    const uintptr_t first = reinterpret_cast<uintptr_t>(seg.table_ids(t) + b.begin) & ~uintptr_t{63};
    const uintptr_t end = reinterpret_cast<uintptr_t>(seg.table_ids(t) + b.end);
    for (uintptr_t a = first; a < end; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a));
    res.next(L_read);
  };
  for (int i = 0; i < kDirAhead; ++i) prefetch_next_entry();
  for (int i = 0; i < kIdsAhead; ++i) resolve_next();
  const size_t nbytes = static_cast<size_t>(words) * 64;  // past n: zero, never counted
  scratch.collisions.resize(nbytes);
  scratch.sampled.resize(static_cast<size_t>(words) * G);
  uint8_t* collisions = scratch.collisions.data();
  for (int g = 0; g < G; ++g) {
    std::memset(collisions, 0, nbytes);
    for (int l = 0; l < L_read; ++l) {
      prefetch_next_entry();
      resolve_next();
      const Segment::Bucket b = scratch.buckets[g * L_read + l];
      const uint16_t* ids = seg.table_ids(unit.kvh * L + l);
      for (int i = b.begin; i < b.end; ++i) {
        uint8_t& c = collisions[ids[i]];
        c = static_cast<uint8_t>(c | c << 1 | 1);
      }
    }
    uint64_t* s = scratch.sampled.data() + static_cast<size_t>(g) * words;
#if defined(__x86_64__)
    if (isa >= Isa::Avx2) {
      counts[g] = sampled_words_avx2(collisions, words, s);
      continue;
    }
#endif
    counts[g] = sampled_words_scalar(collisions, words, s);
  }
  // The union over heads, ascending, with the mask of the heads that sampled each key.
  scratch.list.clear();
  scratch.rmask.clear();
  const uint64_t* sampled = scratch.sampled.data();
  for (int w = 0; w < words; ++w) {
    uint64_t u = 0;
    for (int g = 0; g < G; ++g) u |= sampled[static_cast<size_t>(g) * words + w];
    while (u) {
      const int bit = __builtin_ctzll(u);
      u &= u - 1;
      uint32_t mask = 0;
      for (int g = 0; g < G; ++g)
        mask |= static_cast<uint32_t>((sampled[static_cast<size_t>(g) * words + w] >> bit) & 1) << g;
      scratch.list.push_back(static_cast<uint16_t>(w * 64 + bit));
      scratch.rmask.push_back(static_cast<uint16_t>(mask));
    }
  }
}

bool amx_key_tiles(const AttnArgs& args) {
  const AttnArgs::CacheTiles& t = args.kt;
  return t.tiled(args.block_size, args.d) && t.tg == 16 && args.ks[1] == 2 && t.t_outer == 16 * args.d && t.jg == 2 &&
         args.ks[3] == 1 && t.j_outer == 32;
}
bool amx_value_tiles(const AttnArgs& args) {
  const AttnArgs::CacheTiles& t = args.vt;
  return t.tiled(args.block_size, args.d) && t.tg == 2 && args.vs[1] == 1 && t.t_outer == 32 && t.jg == 16 &&
         args.vs[3] == 2 && t.j_outer == 16 * args.block_size;
}

// The unit's dense tokens as row-major K and V tiles, a run of tokens inside one block at a time.
// Rows that are not contiguous in the cache (a column-major K whose q.k is not read in place by
// dense_scores_*) are read a column at a time, down contiguous memory, rather than one strided
// element per (token, j).  A tiled cache (AMX's) is read token-major, a bf16 pair at a time where
// the tiles are vLLM's AMX ones, else element by element through its offsets: a tile's 16 tokens
// of K share its cache lines, so they stay in L1 across the tokens.
void gather_dense(const AttnArgs& args, const Unit& unit, Scratch& scratch, bool keys) {
  const int d = args.d, nr = unit.end - unit.begin;
  if (keys) scratch.ktile.resize(static_cast<size_t>(nr) * d);
  scratch.vtile.resize(static_cast<size_t>(nr) * d);
  auto copy_run = [d](const uint16_t* src, const int64_t* st, int run, uint16_t* dst) {
    if (st[3] == 1) {  // row-major rows
      for (int t = 0; t < run; ++t) std::memcpy(dst + static_cast<size_t>(t) * d, src + t * st[1], d * 2);
    } else {
      for (int j = 0; j < d; ++j) {
        const uint16_t* col = src + j * st[3];
        for (int t = 0; t < run; ++t) dst[static_cast<size_t>(t) * d + j] = col[t * st[1]];
      }
    }
  };
  // src: the (block, head) base; off: the run's first slot in the block.
  auto copy_tiled = [d](const uint16_t* src, const int64_t* st, const AttnArgs::CacheTiles& tl, int off, int run,
                        const int64_t* elem, uint16_t* dst) {
    for (int t = 0; t < run; ++t) {
      const uint16_t* row = src + tl.slot(off + t, st);
      for (int j = 0; j < d; ++j) dst[static_cast<size_t>(t) * d + j] = row[elem[j]];
    }
  };
  // vLLM's AMX tiles (kv_layout.CpuAmxLayout), read a bf16 pair at a time: K's elements j, j + 1 of
  // a token are adjacent, V's tokens t, t + 1 of an element are.  copy_tiled is their scalar twin.
  auto copy_amx_k = [d](const uint16_t* src, int off, int run, uint16_t* dst) {
    for (int t = 0; t < run; ++t) {
      const int slot = off + t;
      const uint16_t* first = src + static_cast<int64_t>(slot / 16) * 16 * d + (slot % 16) * 2;
      uint16_t* row = dst + static_cast<size_t>(t) * d;
      for (int p = 0; p < d / 2; ++p) std::memcpy(row + 2 * p, first + p * 32, 4);
    }
  };
  auto copy_amx_v = [d](const uint16_t* src, int64_t group_stride, int off, int run, uint16_t* dst) {
    for (int t = 0; t < run; ++t) {
      const int slot = off + t;
      const uint16_t* first = src + (slot / 2) * 32 + slot % 2;
      uint16_t* row = dst + static_cast<size_t>(t) * d;
      for (int g = 0; g < d / 16; ++g)
        for (int e = 0; e < 16; ++e) row[g * 16 + e] = first[g * group_stride + e * 2];
    }
  };
  const bool k_tiled = args.kt.tiled(args.block_size, d), v_tiled = args.vt.tiled(args.block_size, d);
  const bool fast = !args.force_scalar;
  const bool k_amx = fast && amx_key_tiles(args), v_amx = fast && amx_value_tiles(args);
  // The generic tiled copy's element offsets, computed only where it runs (not on "vec" caches).
  int64_t *kelem = nullptr, *velem = nullptr;
  if ((keys && k_tiled && !k_amx) || (v_tiled && !v_amx)) {
    scratch.elem_off.resize(2 * static_cast<size_t>(d));
    kelem = scratch.elem_off.data();
    velem = kelem + d;
    for (int j = 0; j < d; ++j) {
      kelem[j] = args.kt.elem(j, args.ks);
      velem[j] = args.vt.elem(j, args.vs);
    }
  }
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    uint16_t* kdst = scratch.ktile.data() + static_cast<size_t>(i) * d;
    uint16_t* vdst = scratch.vtile.data() + static_cast<size_t>(i) * d;
    const uint16_t* kbase = args.kc + b.blk * args.ks[0] + unit.kvh * args.ks[2];
    const uint16_t* vbase = args.vc + b.blk * args.vs[0] + unit.kvh * args.vs[2];
    if (keys) {
      if (k_amx)
        copy_amx_k(kbase, b.off, run, kdst);
      else if (k_tiled)
        copy_tiled(kbase, args.ks, args.kt, b.off, run, kelem, kdst);
      else
        copy_run(kbase + b.off * args.ks[1], args.ks, run, kdst);
    }
    if (v_amx)
      copy_amx_v(vbase, args.vt.j_outer, b.off, run, vdst);
    else if (v_tiled)
      copy_tiled(vbase, args.vs, args.vt, b.off, run, velem, vdst);
    else
      copy_run(vbase + b.off * args.vs[1], args.vs, run, vdst);
  }
}

}  // namespace mp
