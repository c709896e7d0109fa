// Shared declarations for the MagicPIG CPU kernel (vllm_magicpig._C).
//
// Thread-safety contract:
// - A Segment is immutable once build_segment / merge_segments return it: any number of
//   concurrent sparse_decode calls (and merges) may read the same segment through SegmentPtr.
// - build_segment(_from_codes), merge_segments, hash_rows and sparse_decode only read their inputs and write
//   their outputs; their per-thread scratch is thread_local, so concurrent calls do not interfere.
// - The phase timers (g_profile, g_prof) are process-wide: concurrent profiled calls add into the
//   same counters, and set_profiling from one caller resets them for all.  So is g_last_team_size:
//   with concurrent calls it holds whichever sparse_decode recorded last.
// - The huge-page pool behind segments' big arrays (huge_pool.h) is process-wide and takes a lock, so
//   builds on the background indexer and merges on the engine's thread may allocate at once.
//
// Threads: every entry point takes num_threads, and every OpenMP region it opens asks for a team of
// that many threads (a num_threads clause), or omp_get_max_threads() when it is <= 0.  The
// extension shares torch's OpenMP runtime, so the default follows torch.set_num_threads, which a
// vLLM CUDA worker sets to 1: callers there pass their own count.
#pragma once
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "huge_pool.h"

namespace mp {

// Token ids and bucket offsets (which reach n) inside a segment are uint16.
constexpr int kMaxSegmentTokens = 32768;

enum DType : int { BF16 = 0, FP16 = 1, FP32 = 2 };  // FP32: queries and outputs only

// What every helper that prefetches is declared with.  GCC (12, at -O1 and up) takes a function
// whose only effect is __builtin_prefetch for one without side effects, and deletes a call to it
// that was not inlined first: a plain inline prefetch helper called in a row loop compiled to
// nothing (from d1c1615 to e98c1e9 the extension held one prefetch instruction, every row loop's
// gone).  Forced inlining puts the prefetch in the caller before that analysis runs;
// tests/test_kernel_build.py looks for them in the built extension.
#define MP_PREFETCH inline __attribute__((always_inline))

// The team size of a region opened for a caller that asked for `requested` threads.
inline int team_size(int requested) { return requested > 0 ? requested : omp_get_max_threads(); }

inline float bf16_to_f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Plain IEEE half -> float, so the scalar path needs no F16C.
inline float fp16_to_f(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400));
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_f(uint16_t h, int dtype) { return dtype == BF16 ? bf16_to_f(h) : fp16_to_f(h); }

// float -> bf16, rounding to nearest even as torch does (a NaN stays a quiet NaN).
inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Allocator for the big arrays of a segment: from 2 MiB up they come from the huge-page pool
// (huge_pool.h: 2 MiB aligned, advised huge, reused after a segment is freed).
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return std::allocator<T>().allocate(n);
    return static_cast<T*>(huge_alloc(bytes));
  }
  // resize() leaves new elements default-initialised (not zeroed): every array of a segment is
  // written in full by its build or merge, so zeroing first would write each byte twice.
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePage)
      std::allocator<T>().deallocate(p, n);
    else
      huge_free(p, n * sizeof(T));
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const {
    return false;
  }
};
template <typename T>
using BigVec = std::vector<T, HugePageAllocator<T>>;

// How a segment keeps its K/V rows: the cache's 16-bit rows as they are, or 8-bit rows with a scale
// per row, which halve the bytes a sampled key costs to read and to hold.
enum MirrorKind : int { kMirrorCache = 0, kMirrorInt8 = 1 };

// One int8 mirror row, 2d + 12 bytes: [|k - c| fp32][K scale fp32][K int8 x d][V scale fp32][V int8 x d].
// The K pass reads its first 8 + d bytes, the V pass the rest: each pass's bytes are contiguous, and
// the centred-key norm rides in the K pass's first line instead of a separate random read.
inline size_t int8_row_bytes(int d) { return 2 * static_cast<size_t>(d) + 12; }
constexpr int kInt8KeyOffset = 8;                      // K scale at 4, K bytes from 8
inline int int8_value_offset(int d) { return 8 + d; }  // V scale here, V bytes 4 further
// The K (or V) part of an int8 row: its scale and its d bytes; element j stands for scale * q[j].
struct Int8Part {
  float scale;
  const int8_t* q;
};
inline Int8Part int8_key(const int8_t* row) {
  float s;
  std::memcpy(&s, row + 4, 4);
  return {s, row + kInt8KeyOffset};
}
inline Int8Part int8_value(const int8_t* row, int d) {
  float s;
  std::memcpy(&s, row + int8_value_offset(d), 4);
  return {s, row + int8_value_offset(d) + 4};
}
// The d values an int8 part stands for, scale * q[j] (one rounding each), into out: the scalar twin of
// the attention paths' vector conversions.
inline void int8_to_f32(Int8Part p, float* out, int d) {
  for (int j = 0; j < d; ++j) out[j] = p.scale * static_cast<float>(p.q[j]);
}
// Quantizes x[0..d) to q with scale max|x| / 127 (0 for an all-zero row): q = nearbyint(x * 127 / max|x|),
// so scale * q is within scale / 2 of x.  Returns the scale.  eval/reference.py's int8_rows is its twin.
inline float quantize_int8(const float* x, int d, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < d; ++j) amax = std::max(amax, std::fabs(x[j]));
  if (!(amax > 0.f)) {
    std::fill(q, q + d, int8_t{0});
    return 0.f;
  }
  const float inv = 127.f / amax;
  // Rounds half to even by adding and taking away 1.5 * 2^23 (|x * inv| <= 127 here): what
  // nearbyint gives in the default rounding mode, without its library call per element, which
  // kept this loop scalar and made an int8 build cost twice a bf16 one.
  constexpr float kRound = 12582912.f;
  for (int j = 0; j < d; ++j) {
    const float r = (x[j] * inv + kRound) - kRound;
    q[j] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, r)));
  }
  return amax / 127.f;
}

// Whether a segment of n tokens keeps a dense bucket directory (2^K + 1 starts a table, one read a
// lookup) rather than a compact one (its distinct codes and their starts, 4 bytes a non-empty bucket,
// binary searched).  Uniform codes fill ~2^K (1 - e^(-n / 2^K)) buckets, so from n = 2^K / 2 the
// dense form costs at most 1.27x the compact one's bytes, while a compact lookup is ~log2(distinct)
// dependent reads: at 1,020 tokens (K=10, just short of the old n >= 2^K rule) the lookup took 2.5x
// as long as at 3,964 tokens with a dense directory.  Below 2^K / 2 the dense form's bytes per token
// grow as 2^K / n, so such segments (and at large K, most segments) keep the compact form.
inline bool dense_directory_pays(int n, int K) { return 2 * static_cast<int64_t>(n) >= (int64_t{1} << K); }

// One immutable LSH segment: a row-major K/V mirror of a contiguous run of tokens plus, per
// (KV head, table), a CSR bucket sort of its token ids.  Built once, then read-only, so it may be
// shared by any number of concurrent kernel calls.
struct Segment {
  int n = 0, hkv = 0, d = 0, K = 0, L = 0, dtype = BF16;
  int mirror = kMirrorCache;
  bool dense_dir = true;  // dense 2^K offset table, else sorted distinct codes
  // The K/V mirror, [hkv][n][2][d]: token i's K row, then its V row.  Decode reads the sampled rows at
  // random over hundreds of MB, K first, then V; side by side, a token's V row shares its K row's page
  // (and DRAM row), so the V pass finds it nearby.  Against separate K and V arrays this cut the V pass
  // by half at 128K tokens (benchmarks/results/kernel_bench.md).
  BigVec<uint16_t> kv;
  BigVec<float> knorm;                  // [hkv][n]  |k - c|, fp32 (cache mirror only)
  BigVec<int8_t> kv8;                   // int8 mirror: [hkv][n] rows of int8_row_bytes(d), norms inside
  BigVec<uint16_t> ids;                 // [hkv*L][n] token ids grouped by bucket (ascending inside)
  BigVec<uint16_t> off;                 // dense: [hkv*L][2^K + 1] bucket starts
  std::vector<uint32_t> dir_begin;      // compact: [hkv*L + 1] range into ucode/ustart
  std::vector<uint16_t> ucode, ustart;  // compact: distinct codes (ascending) and bucket starts

  struct Bucket {
    int begin, end;  // [begin, end) into table_ids(t)
  };

  // Token ids of table t = kvh*L + l, grouped by bucket.
  const uint16_t* table_ids(int t) const { return ids.data() + static_cast<size_t>(t) * n; }

  // Dense directory only: the 2^K + 1 bucket starts of table t.
  const uint16_t* dense_offsets(int t) const { return off.data() + static_cast<size_t>(t) * ((1u << K) + 1); }

  Bucket bucket(int t, uint32_t code) const {
    if (dense_dir) {
      const uint16_t* o = dense_offsets(t);
      return {o[code], o[code + 1]};
    }
    // lower_bound over the table's distinct codes, halving without a branch on the codes: a query's
    // code is random, so a branch at each step was a misprediction every other step.  Without the
    // branch nothing is read ahead speculatively, and cold (an engine's layers evict each other)
    // each halving waited for its line: 1.5x slower than the branches.  So both candidates of the
    // next halving are prefetched (benchmarks/results/decode_profile_bucket_directory_amx.md, K=12:
    // the lookup warm 1.5-2.3x faster than with the branches, cold 1.0-1.1x).
    const uint32_t first = dir_begin[t], end = dir_begin[t + 1];
    if (first == end) return {0, 0};
    const uint16_t* base = ucode.data() + first;
    for (uint32_t len = end - first; len > 1;) {
      const uint32_t half = len / 2;
      __builtin_prefetch(base + half / 2);
      __builtin_prefetch(base + half + half / 2);
      base += (base[half] < code) ? half : 0;  // a select (cmov), not a jump
      len -= half;
    }
    const uint32_t lo = static_cast<uint32_t>(base - ucode.data()) + (*base < code);
    if (lo == end || ucode[lo] != code) return {0, 0};
    return {ustart[lo], (lo + 1 < end) ? ustart[lo + 1] : n};
  }

  // Starts the load of what bucket(t, code) reads first: a dense directory's entry, or a compact
  // one's first probe (the middle of the table's distinct codes).  Either is a DRAM miss in an
  // engine, whose layers evict each other, worth overlapping with the walks before it.
  MP_PREFETCH void prefetch_bucket(int t, uint32_t code) const {
    if (dense_dir) {
      __builtin_prefetch(dense_offsets(t) + code);
      return;
    }
    const uint32_t first = dir_begin[t], len = dir_begin[t + 1] - first;
    __builtin_prefetch(ucode.data() + first + len / 2);
  }

  size_t index_bytes() const {
    return ids.size() * 2 + off.size() * 2 + dir_begin.size() * 4 + ucode.size() * 2 + ustart.size() * 2;
  }
  // Token i of KV head h: its K row; its V row follows at + d.
  const uint16_t* kv_row(int h, int i) const { return kv.data() + (static_cast<size_t>(h) * n + i) * 2 * d; }
  // Int8 mirror: token i of KV head h's whole row (see int8_row_bytes).
  const int8_t* kv_row8(int h, int i) const {
    return kv8.data() + (static_cast<size_t>(h) * n + i) * int8_row_bytes(d);
  }
  size_t mirror_bytes() const { return kv.size() * 2 + knorm.size() * 4 + kv8.size(); }
};

using SegmentPtr = std::shared_ptr<const Segment>;

// ---- ISA (isa.cpp) ----
// The instruction sets a call may run on, slowest to fastest (the order is compared).  Resolved once
// at the top of each entry point; nothing below the entry point re-detects or re-reads the environment.
// Amx is Avx512Bf16 with AMX tiles (and the OS's leave to use them) for the key hash, the one
// matrix product large enough for them; attention runs the Avx512Bf16 path there.
enum class Isa { Scalar, Avx2, Avx512, Avx512Bf16, Amx };
constexpr Isa kIsas[] = {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx};  // in that order
// The fastest ISA this CPU runs, capped by MAGICPIG_ISA, or Scalar when force_scalar says so.
Isa resolve_isa(bool force_scalar);
Isa cpu_isa();                  // the fastest ISA this CPU runs, whatever MAGICPIG_ISA says
const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512", "avx512_bf16", "amx"
const char* active_isa();       // isa_name(resolve_isa(false))

// ---- hashing (hash.cpp) ----
// codes[t*L + l] for T float rows x[t*d ..]; w is float [d][K*L].  Keys (build) and queries
// (hash_codes) both come through here.
void hash_rows(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes, bool force_scalar);
// The same for tables [l0, l0 + L) of a wider projection: w points at column l0 * K of a [d][ldw]
// matrix and codes at table l0 of rows ldc apart.  Each column's arithmetic is hash_rows's, so
// splitting the tables of a call across threads gives the same codes.
void hash_rows_strided(const float* x, int T, int d, const float* w, int ldw, int K, int L, uint16_t* codes, int ldc,
                       bool force_scalar);

// How a build hashes its keys (hash.cpp).  Both compute sign((k - c) . w) per column; they differ
// only in float32 rounding, so their codes agree up to ties.
//  - kCentredFp32: k - c in float32, then hash_rows (any key dtype, any projection);
//  - kBf16Pairs: bf16 keys against a projection whose entries are all bf16 values (runtime.py makes
//    it so): k . w by the AVX-512 BF16 pair dot product (each product exact in float32, summed in
//    float32), compared with c . w; half the instructions of the float32 FMAs, keys read as they
//    are in the cache.  Chosen by the CPU (and MAGICPIG_ISA), never by force_scalar: force_scalar
//    runs the chosen method's scalar twin.
//  - kAmxTiles: kBf16Pairs's products on AMX tiles (Isa::Amx, d a multiple of 32), summed in an order
//    the hardware does not document: its scalar twin is kBf16Pairs's, agreeing up to ties.
enum class KeyHash { kCentredFp32, kBf16Pairs, kAmxTiles };
KeyHash key_hash_for(int dtype, const float* w, int d, int K, int L);
const char* key_hash_name(KeyHash h);  // "centred_fp32", "bf16_pairs", "amx_tiles"

// kBf16Pairs (or kAmxTiles, with amx_tiles) for one build: the projection packed as bf16 pairs
// [d/2][K*L][2] (and as AMX tiles) and c . w per KV head.  Reads w (the scalar twin) until it is destroyed.
class Bf16KeyHasher {
 public:
  Bf16KeyHasher(const float* w, int d, int K, int L, const float* centre, int hkv, bool force_scalar,
                bool amx_tiles = false);
  // codes[t*L + l] of the T bf16 key rows at keys + t * row_stride (KV head h's centre).
  void hash(const uint16_t* keys, size_t row_stride, int T, int h, uint16_t* codes) const;

 private:
  const float* w_;
  int d_, K_, L_;
  bool simd_, amx_;
  int cp_;                           // columns as stored: C, rounded up to 32 for the tiles
  std::vector<uint16_t> pairs_;      // kBf16Pairs' AVX-512 path: [d/2][C][2]: w[2i][c], w[2i+1][c]
  std::vector<uint16_t> amx_tiles_;  // kAmxTiles: the same pairs as [d/32][cp/16] tiles of [16][16][2]
  std::vector<float> cw_;            // [hkv][cp]: c_h . w[:, c], summed in double; 0 past C
};

// ---- segment building (segment.cpp) ----
std::shared_ptr<Segment> build_segment(const uint16_t* keys, const uint16_t* values, int n, int hkv, int d, int dtype,
                                       const float* centre, const float* w, int K, int L, bool force_scalar,
                                       int num_threads, int mirror = kMirrorCache);
// As build_segment, with the codes [hkv][L][n] given instead of hashed: code_bytes 2 reads them as
// uint16, 4 as int32.  Throws std::invalid_argument if a code is outside [0, 2^K).
std::shared_ptr<Segment> build_segment_from_codes(const uint16_t* keys, const uint16_t* values, int n, int hkv, int d,
                                                  int dtype, const float* centre, const void* codes, int code_bytes,
                                                  int K, int L, int num_threads, int mirror = kMirrorCache);
std::shared_ptr<Segment> merge_segments(const std::vector<SegmentPtr>& parts, int num_threads);
// Writes the per-token codes of table t (inverse of the bucket sort); used by merge and codes().
void recover_codes(const Segment& s, int t, uint16_t* codes);

// ---- attention (sparse_decode.cpp) ----
struct AttnArgs {
  int R, H, hkv, d, K, L, dtype;  // R: requests, H: query heads, hkv: KV heads
  // Tables read, <= L: a key is sampled on >= 2 collisions among the first L_read of the segments'
  // L tables, and weighted for (K, L_read).  Budget mode steers the sampled fraction with it without
  // rehashing: the first L_read tables of a segment are exactly a segment of L_read tables.
  int L_read;
  float scale;
  const void* q;                // [R][H][d] of q_dtype
  int q_dtype;                  // BF16 (enables the avx512bf16 dot on a bf16 cache), FP16 or FP32
  const int32_t* qcodes;        // [R][H][L]; null: hashed here from q with w (prepare_queries)
  const float* qdc;             // [R][H]; null: q . centre computed here
  const float* w;               // [d][K*L] projection, when qcodes is null
  const float* const* centres;  // [R] -> [hkv][d] float centre (null: request without segments)
  const std::vector<std::vector<SegmentPtr>>* segs;
  // Paged caches, element strides (block, slot, head, dim), and each cache's tiling (CacheTiles):
  // element (slot t, dim j) of a (block, head) is at (t / tg) * t_outer + (t % tg) * s[1] +
  // (j / jg) * j_outer + (j % jg) * s[3].  An untiled cache has tg >= block_size, jg >= d.
  const uint16_t* kc;
  int64_t ks[4];
  const uint16_t* vc;
  int64_t vs[4];
  struct CacheTiles {
    int64_t tg, t_outer, jg, j_outer;
    bool tiled(int block_size, int d) const { return tg < block_size || jg < d; }
    int64_t slot(int t, const int64_t* s) const { return (t / tg) * t_outer + (t % tg) * s[1]; }
    int64_t elem(int j, const int64_t* s) const { return (j / jg) * j_outer + (j % jg) * s[3]; }
  };
  CacheTiles kt, vt;
  const int32_t* block_table;
  int max_blocks, block_size;
  const int32_t* ranges;  // [R][2][2]
  void* out;              // [R][H][d] of out_dtype
  int out_dtype;          // BF16 or FP32
  float* lse;             // [R][H]
  int64_t* counts;        // [R][H]
  bool force_scalar;
  int num_threads;  // <= 0: omp_get_max_threads()
};
// Returns the sampled keys summed over every request and query head (the sum of counts).
int64_t sparse_decode(const AttnArgs& args);

// ---- phase timers (sparse_decode.cpp) ----
// Optional, for the benchmark's breakdown: nanoseconds summed over threads per phase.  A segment
// unit's time goes to lookup, gather_logits and softmax_v; a dense unit's (sinks, window and the
// not yet indexed tail) to dense as a whole; the queries' hashing and q . c to queries.  Together
// with merge they cover the call but for the unit list's set-up.
enum Phase : int {
  kPhaseQueries,
  kPhaseLookup,
  kPhaseGatherLogits,
  kPhaseSoftmaxV,
  kPhaseDense,
  kPhaseMerge,
  kNumPhases
};
inline constexpr const char* kPhaseNames[kNumPhases] = {"queries",   "lookup", "gather_logits",
                                                        "softmax_v", "dense",  "merge"};
extern std::atomic<bool> g_profile;
extern std::atomic<int64_t> g_prof[kNumPhases];
// The team size of the unit loop of the last sparse_decode with any unit (0 before one); for tests.
extern std::atomic<int> g_last_team_size;

}  // namespace mp
