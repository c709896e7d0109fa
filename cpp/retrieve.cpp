// The rows a unit attends to: LSH retrieval (>= 2 collisions) from a segment, or a dense tile
// gathered from the paged cache.
#include <algorithm>

#include "attend.h"

namespace mp {
namespace {

// A cell is a uint16 per (token id, head): the retrieval epoch that last touched it (high 14 bits)
// and its collision count in that epoch (low 2 bits, saturating at 3).  A cell from an older epoch
// reads as "no collision yet", so cells never need clearing between units.
constexpr uint32_t kEpochMask = 0x3fff;
constexpr uint32_t kCountSaturated = 3;
inline uint32_t cell_pack(uint32_t epoch, uint32_t count) { return epoch << 2 | count; }
inline uint32_t cell_epoch(uint32_t cell) { return cell >> 2; }
inline uint32_t cell_count(uint32_t cell) { return cell & 3; }

// A sel entry is a uint32 per token id: the epoch in which some head first sampled it (high 16
// bits) and the mask of the heads that sampled it (low 16 bits, one per head of the unit).
inline uint32_t sel_pack(uint32_t epoch, uint32_t mask) { return epoch << 16 | mask; }
inline uint32_t sel_epoch(uint32_t sel) { return sel >> 16; }
inline uint16_t sel_mask(uint32_t sel) { return static_cast<uint16_t>(sel & 0xffff); }

void radix_sort_u16(std::vector<uint16_t>& v, std::vector<uint16_t>& tmp) {
  if (v.size() < 64) {
    std::sort(v.begin(), v.end());
    return;
  }
  tmp.resize(v.size());
  for (int shift = 0; shift < 16; shift += 8) {
    uint32_t cnt[257] = {0};
    for (uint16_t x : v) ++cnt[((x >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) cnt[b + 1] += cnt[b];
    for (uint16_t x : v) tmp[cnt[(x >> shift) & 0xff]++] = x;
    v.swap(tmp);
  }
}

// Starts a new epoch for a unit over n tokens and G heads, clearing only when the scratch grows,
// the head count changes or the epoch wraps.
uint32_t next_epoch(Scratch& scratch, int n, int G) {
  if (static_cast<int>(scratch.sel.size()) < n || scratch.cap_g != G) {
    scratch.cap_g = G;
    scratch.sel.assign(std::max<size_t>(scratch.sel.size(), n), 0);
    scratch.cell.assign(scratch.sel.size() * G, 0);
    scratch.epoch = 0;
  }
  scratch.epoch = (scratch.epoch + 1) & kEpochMask;
  if (scratch.epoch == 0) {
    std::fill(scratch.sel.begin(), scratch.sel.end(), 0u);
    std::fill(scratch.cell.begin(), scratch.cell.end(), 0);
    scratch.epoch = 1;
  }
  return scratch.epoch;
}

}  // namespace

void retrieve(const AttnArgs& args, const Unit& unit, Scratch& scratch, int64_t* sampled_per_head) {
  const Segment& seg = *unit.seg;
  const int G = unit.G, L = args.L;
  const uint32_t ep = next_epoch(scratch, seg.n, G);
  scratch.list.clear();
  scratch.rmask.clear();
  uint16_t* cell = scratch.cell.data();
  uint32_t* sel = scratch.sel.data();
  const int32_t* qc = args.qcodes + (static_cast<size_t>(unit.r) * args.H + unit.h0) * L;
  auto code = [&](int g, int l) { return static_cast<uint32_t>(qc[static_cast<size_t>(g) * L + l]); };
  // The index is far larger than the caches, so each (table, head) bucket costs two DRAM misses
  // (directory, then ids).  Resolve all bucket ranges first with prefetches in flight, so the
  // misses overlap instead of serialising inside the walk.
  scratch.buckets.resize(static_cast<size_t>(L) * G);
  for (int l = 0; l < L; ++l)
    for (int g = 0; g < G; ++g) seg.prefetch_bucket(unit.kvh * L + l, code(g, l));
  for (int l = 0; l < L; ++l) {
    const int t = unit.kvh * L + l;
    for (int g = 0; g < G; ++g) {
      const Segment::Bucket b = seg.bucket(t, code(g, l));
      scratch.buckets[l * G + g] = b;
      const uint16_t* p = seg.table_ids(t) + b.begin;
      for (int k = 0; k < b.end - b.begin; k += 32) __builtin_prefetch(p + k);
    }
  }
  for (int l = 0; l < L; ++l) {
    const uint16_t* ids = seg.table_ids(unit.kvh * L + l);
    for (int g = 0; g < G; ++g) {
      const Segment::Bucket b = scratch.buckets[l * G + g];
      for (int i = b.begin; i < b.end; ++i) {
        const uint32_t id = ids[i];
        uint16_t& c = cell[id * G + g];
        // Branch-free (the first/second-hit branch is a coin flip): a stale epoch restarts the
        // count at 1, a live one counts up and saturates so it never spills into the epoch.
        const uint32_t old = c;
        const uint32_t count = cell_epoch(old) == ep ? cell_count(old) + (cell_count(old) != kCountSaturated) : 1;
        c = static_cast<uint16_t>(cell_pack(ep, count));
        if (count != 2) continue;  // a key is sampled on its second collision, and only then
        ++sampled_per_head[g];
        uint32_t& s = sel[id];
        if (sel_epoch(s) != ep) {
          s = sel_pack(ep, 1u << g);
          scratch.list.push_back(static_cast<uint16_t>(id));
        } else {
          s |= 1u << g;
        }
      }
    }
  }
  // Ascending ids turn the row gathers into forward strides the prefetcher follows; a two-pass
  // byte radix sort keeps this linear in the sample size.
  radix_sort_u16(scratch.list, scratch.tmp);
  scratch.rmask.resize(scratch.list.size());
  for (size_t i = 0; i < scratch.list.size(); ++i) scratch.rmask[i] = sel_mask(sel[scratch.list[i]]);
}

void gather_dense(const AttnArgs& args, const Unit& unit, Scratch& scratch) {
  const int d = args.d, nr = unit.end - unit.begin;
  scratch.ktile.resize(static_cast<size_t>(nr) * d);
  scratch.vtile.resize(static_cast<size_t>(nr) * d);
  for (int i = 0; i < nr; ++i) {
    const int p = unit.begin + i;
    const int64_t blk = args.block_table[static_cast<size_t>(unit.r) * args.max_blocks + p / args.block_size];
    const int64_t off = p % args.block_size;
    const uint16_t* kr = args.kc + blk * args.ks[0] + off * args.ks[1] + unit.kvh * args.ks[2];
    const uint16_t* vr = args.vc + blk * args.vs[0] + off * args.vs[1] + unit.kvh * args.vs[2];
    uint16_t* kt = scratch.ktile.data() + static_cast<size_t>(i) * d;
    uint16_t* vt = scratch.vtile.data() + static_cast<size_t>(i) * d;
    if (args.ks[3] == 1)
      std::memcpy(kt, kr, d * 2);
    else
      for (int j = 0; j < d; ++j) kt[j] = kr[j * args.ks[3]];
    if (args.vs[3] == 1)
      std::memcpy(vt, vr, d * 2);
    else
      for (int j = 0; j < d; ++j) vt[j] = vr[j * args.vs[3]];
  }
}

}  // namespace mp
