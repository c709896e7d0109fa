// Benchmark-only (compiled by lookup_floor.py at run time, never part of the extension): what the
// kernel's bucket walk costs on its own, and what a bucket layout without a directory read would
// save.  The kernel's lookup (cpp/retrieve.cpp) finds each (query head, table) bucket in two
// dependent reads, its directory entry and then its ids, both at random in an index far larger than
// the caches; this walk does the same over `layers` copies of random tables (uniform codes, as
// SimHash gives keys without a common direction), in turn as an engine's layers are, on 2 MiB
// pages and with the kernel's prefetch pipeline.  With `bounds_known` the buckets' bounds are read
// before the clock starts, so only the ids are read at random: a layout whose code gives the ids'
// address directly.  Each id updates a collision byte, as the kernel's does.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "huge_buffer.h"

namespace {

struct Bounds {
  int begin, end;
};

}  // namespace

// Per layer: `kv_heads` x `tables` tables over `n` tokens, each its ids grouped by bucket
// (2^K buckets) and a directory of 2^K + 1 starts; `heads_per_kv` query heads walk every table of
// their KV head.  Returns {ns per bucket, ns per id, ids per bucket, us per layer}, the best of
// `reps` passes over the layers.
std::vector<double> walk(int64_t n, int64_t K, int64_t tables, int64_t kv_heads, int64_t heads_per_kv, int64_t layers,
                         bool bounds_known, int64_t reps, int64_t seed) {
  TORCH_CHECK(n > 0 && n <= 65536 && K >= 1 && K <= 16 && tables >= 2 && kv_heads >= 1 && heads_per_kv >= 1 &&
                  layers >= 1 && reps >= 1,
              "lookup_floor.walk: bad sizes");
  const int64_t B = int64_t{1} << K, T = kv_heads * tables;
  HugeBuffer id_buf(static_cast<size_t>(layers * T * n) * 2, 0),
      dir_buf(static_cast<size_t>(layers * T * (B + 1)) * 2, 0);
  uint16_t* const ids = reinterpret_cast<uint16_t*>(id_buf.buf);
  uint16_t* const dir = reinterpret_cast<uint16_t*>(dir_buf.buf);
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> code(n), count(B + 1);
  std::vector<int64_t> order(n);
  for (int64_t t = 0; t < layers * T; ++t) {  // a counting sort of random codes, ids ascending in a bucket
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) ++count[(code[i] = static_cast<uint32_t>(rng() % B)) + 1];
    uint16_t* d = dir + t * (B + 1);
    for (int64_t b = 0; b < B; ++b) count[b + 1] += count[b];
    for (int64_t b = 0; b <= B; ++b) d[b] = static_cast<uint16_t>(std::min<int64_t>(count[b], 65535));
    for (int64_t i = 0; i < n; ++i) ids[t * n + count[code[i]]++] = static_cast<uint16_t>(i);
  }
  const int64_t P = heads_per_kv * tables;  // (head, table) pairs of one KV head, in walk order
  std::vector<uint32_t> qcode(static_cast<size_t>(kv_heads * P));
  std::vector<Bounds> known(qcode.size()), bk(P);
  std::vector<uint8_t> coll(n);
  constexpr int kDirAhead = 16, kIdsAhead = 8;  // as cpp/retrieve.cpp
  double best_ns = 1e300, buckets = 0, nids = 0, sink = 0;
  for (int64_t rep = 0; rep < reps; ++rep) {
    double ns = 0;
    buckets = nids = 0;
    for (int64_t ly = 0; ly < layers; ++ly) {
      for (auto& c : qcode) c = static_cast<uint32_t>(rng() % B);
      const uint16_t* lids = ids + ly * T * n;
      const uint16_t* ldir = dir + ly * T * (B + 1);
      auto entry = [&](int64_t h, int64_t s) {  // pair s of KV head h: its directory entry
        return ldir + (h * tables + s % tables) * (B + 1) + qcode[h * P + s];
      };
      if (bounds_known)
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t s = 0; s < P; ++s) known[h * P + s] = {entry(h, s)[0], entry(h, s)[1]};
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t h = 0; h < kv_heads; ++h) {
        const Bounds* kb = known.data() + h * P;
        auto table_ids = [&](int64_t s) { return lids + (h * tables + s % tables) * n; };
        auto resolve = [&](int64_t s) {
          if (s >= P) return;
          const Bounds b = bounds_known ? kb[s] : Bounds{entry(h, s)[0], entry(h, s)[1]};
          bk[s] = b;
          const uintptr_t end = reinterpret_cast<uintptr_t>(table_ids(s) + b.end);
          for (uintptr_t a = reinterpret_cast<uintptr_t>(table_ids(s) + b.begin) & ~uintptr_t{63}; a < end; a += 64)
            __builtin_prefetch(reinterpret_cast<const void*>(a));
        };
        if (!bounds_known)
          for (int64_t s = 0; s < kDirAhead && s < P; ++s) __builtin_prefetch(entry(h, s));
        for (int64_t s = 0; s < kIdsAhead; ++s) resolve(s);
        for (int64_t g = 0; g < heads_per_kv; ++g) {
          std::memset(coll.data(), 0, n);
          for (int64_t l = 0; l < tables; ++l) {
            const int64_t s = g * tables + l;
            if (!bounds_known && s + kDirAhead < P) __builtin_prefetch(entry(h, s + kDirAhead));
            resolve(s + kIdsAhead);
            const uint16_t* id = table_ids(s);
            for (int i = bk[s].begin; i < bk[s].end; ++i) {
              uint8_t& c = coll[id[i]];
              c = static_cast<uint8_t>(c | c << 1 | 1);
            }
            nids += bk[s].end - bk[s].begin;
            buckets += 1;
          }
          sink += coll[g % n];
        }
      }
      ns += std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    }
    best_ns = std::min(best_ns, ns);
  }
  TORCH_CHECK(sink >= 0, "unreachable");
  return {best_ns / buckets, best_ns / nids, nids / buckets, best_ns / layers / 1e3};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("walk", &walk); }
