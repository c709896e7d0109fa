// Benchmark-only (compiled by kernel_bench.py at run time, never part of the extension): the
// random-access roof for the bytes the sparse kernel reads.  Sampled rows are whole K/V rows at
// random token positions, so the roof that bounds them is a gather of random rows of that size
// out of a buffer far larger than the caches, with the kernel's own aids: 2 MiB pages and software
// prefetch a few rows ahead, on the same threads.  A sequential copy's bandwidth is not reachable
// by such reads on a machine where each line is a DRAM round trip.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "huge_buffer.h"

namespace {

std::vector<int64_t> random_indices(int64_t count, int64_t below) {
  std::vector<int64_t> idx(count);
  std::mt19937_64 rng(1);
  for (auto& i : idx) i = static_cast<int64_t>(rng() % static_cast<uint64_t>(below));
  return idx;
}

// The best GB/s over `reps` passes of read(i) for every i in [0, rows) on `threads` threads, counting
// `bytes` a row.  read returns a bit of what it read, summed into a sink that keeps the reads alive.
template <typename Read>
double best_gbps(int64_t rows, int64_t bytes, int64_t threads, int64_t reps, Read read) {
  double best = 0, sink = 0;
  for (int64_t rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    double acc = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : acc)
    for (int64_t i = 0; i < rows; ++i) acc += read(i);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(rows) * bytes / s / 1e9);
    sink += acc;
  }
  return sink < 0 ? 0 : best;
}

}  // namespace

// GB/s of reading `rows` random rows of `row_bytes` (a multiple of 64) from a `buffer_mb` MiB
// buffer on `threads` threads, `ahead` rows prefetched ahead; the best of `reps` passes.
double gather_gbps(int64_t row_bytes, int64_t rows, int64_t buffer_mb, int64_t ahead, int64_t threads, int64_t reps) {
  HugeBuffer hb(static_cast<size_t>(buffer_mb) << 20, 1);
  const char* buf = hb.buf;
  const std::vector<int64_t> idx = random_indices(rows, static_cast<int64_t>(hb.bytes) / row_bytes);
  return best_gbps(rows, row_bytes, threads, reps, [&](int64_t i) {
    if (i + ahead < rows)
      for (int64_t j = 0; j < row_bytes; j += 64) __builtin_prefetch(buf + idx[i + ahead] * row_bytes + j);
    const char* p = buf + idx[i] * row_bytes;
    __m128i x = _mm_setzero_si128();  // every byte of the row is read, 16 at a time
    for (int64_t j = 0; j < row_bytes; j += 16)
      x = _mm_xor_si128(x, _mm_load_si128(reinterpret_cast<const __m128i*>(p + j)));
    return static_cast<double>(_mm_cvtsi128_si32(x) & 1);
  });
}

// The same gather of `rows` random tokens' K and V rows (head_dim d, 16-bit), read where vLLM's CPU
// cache keeps them instead of from the mirror: each (block, head) region of `block` tokens holds K
// column-major ([d][block]: a token's K row is d elements `block` apart, one cache line each) and
// then V row-major ([block][d]).  GB/s of the 4d useful bytes per token, with the same prefetch: what
// the kernel would reach reading sampled rows from the paged cache instead of keeping a copy.
double paged_gather_gbps(int64_t d, int64_t block, int64_t rows, int64_t buffer_mb, int64_t ahead, int64_t threads,
                         int64_t reps) {
  HugeBuffer hb(static_cast<size_t>(buffer_mb) << 20, 1);
  const char* buf = hb.buf;
  const int64_t region = 2 * block * d * 2;  // bytes of one (block, head) region
  const std::vector<int64_t> idx = random_indices(rows, static_cast<int64_t>(hb.bytes) / region * block);
  auto key_elem = [&](int64_t t, int64_t j) { return buf + (t / block) * region + (j * block + t % block) * 2; };
  auto value_row = [&](int64_t t) { return buf + (t / block) * region + (block * d + (t % block) * d) * 2; };
  return best_gbps(rows, 4 * d, threads, reps, [&](int64_t i) {
    if (i + ahead < rows) {
      const int64_t t = idx[i + ahead];
      for (int64_t j = 0; j < d; ++j) __builtin_prefetch(key_elem(t, j));
      for (int64_t j = 0; j < 2 * d; j += 64) __builtin_prefetch(value_row(t) + j);
    }
    const int64_t t = idx[i];
    uint32_t x = 0;  // every element of both rows is read
    for (int64_t j = 0; j < d; ++j) {
      uint16_t k;
      std::memcpy(&k, key_elem(t, j), 2);
      x ^= k;
    }
    const char* v = value_row(t);
    for (int64_t j = 0; j < 2 * d; j += 4) {
      uint32_t w;
      std::memcpy(&w, v + j, 4);
      x ^= w;
    }
    return static_cast<double>(x & 1);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gather_gbps", &gather_gbps);
  m.def("paged_gather_gbps", &paged_gather_gbps);
}
