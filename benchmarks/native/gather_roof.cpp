// Benchmark-only (compiled by kernel_bench.py at run time, never part of the extension): the
// random-access roof for the bytes the sparse kernel reads.  Sampled rows are whole K/V rows at
// random token positions, so the roof that bounds them is a gather of random rows of that size
// out of a buffer far larger than the caches, with the kernel's own aids: 2 MiB pages and software
// prefetch a few rows ahead, on the same threads.  A sequential copy's bandwidth is not reachable
// by such reads on a machine where each line is a DRAM round trip.
#include <immintrin.h>
#include <sys/mman.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

// GB/s of reading `rows` random rows of `row_bytes` (a multiple of 64) from a `buffer_mb` MiB
// buffer on `threads` threads, `ahead` rows prefetched ahead; the best of `reps` passes.
double gather_gbps(int64_t row_bytes, int64_t rows, int64_t buffer_mb, int64_t ahead, int64_t threads, int64_t reps) {
  const size_t bytes = static_cast<size_t>(buffer_mb) << 20, huge = size_t{2} << 20;
  void* m = mmap(nullptr, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(m != MAP_FAILED, "mmap failed");
  char* buf = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + huge - 1) / huge * huge);
  madvise(buf, bytes, MADV_HUGEPAGE);
  std::memset(buf, 1, bytes);
  const int64_t nrows = static_cast<int64_t>(bytes) / row_bytes;
  std::vector<int64_t> idx(rows);
  std::mt19937_64 rng(1);
  for (auto& i : idx) i = static_cast<int64_t>(rng() % static_cast<uint64_t>(nrows));
  double best = 0, sink = 0;
  for (int64_t rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    double acc = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : acc)
    for (int64_t i = 0; i < rows; ++i) {
      if (i + ahead < rows)
        for (int64_t j = 0; j < row_bytes; j += 64) __builtin_prefetch(buf + idx[i + ahead] * row_bytes + j);
      const char* p = buf + idx[i] * row_bytes;
      __m128i x = _mm_setzero_si128();  // every byte of the row is read, 16 at a time
      for (int64_t j = 0; j < row_bytes; j += 16)
        x = _mm_xor_si128(x, _mm_load_si128(reinterpret_cast<const __m128i*>(p + j)));
      acc += static_cast<double>(_mm_cvtsi128_si32(x) & 1);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(rows) * row_bytes / s / 1e9);
    sink += acc;
  }
  munmap(m, bytes + huge);
  return sink < 0 ? 0 : best;  // sink keeps the reads alive
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gather_gbps", &gather_gbps); }
