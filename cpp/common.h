// Shared declarations for the MagicPIG CPU kernel (vllm_magicpig._C).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace mp {

enum DType : int { BF16 = 0, FP16 = 1 };

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
      do { man <<= 1; ++e; } while (!(man & 0x400));
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

// One immutable LSH segment: a row-major K/V mirror of a contiguous run of tokens plus, per
// (KV head, table), a CSR bucket sort of its token ids.  Built once, then read-only, so it may be
// shared by any number of concurrent kernel calls.
struct Segment {
  int n = 0, hkv = 0, d = 0, K = 0, L = 0, dtype = BF16;
  bool dense_dir = true;           // dense 2^K offset table, else sorted distinct codes
  std::vector<uint16_t> kmir, vmir;  // [hkv][n][d]
  std::vector<float> knorm;          // [hkv][n]  |k - c|, fp32
  std::vector<uint16_t> ids;         // [hkv*L][n] token ids grouped by bucket (ascending inside)
  std::vector<uint16_t> off;         // dense: [hkv*L][2^K + 1] bucket starts (n <= 32768 fits)
  std::vector<uint32_t> dir_begin;   // compact: [hkv*L + 1] range into ucode/ustart
  std::vector<uint16_t> ucode, ustart;  // compact: distinct codes (ascending) and bucket starts

  // [begin, end) into ids[t*n ...] of bucket `code` in table t = kvh*L + l.
  inline void bucket(int t, uint32_t code, int& b, int& e) const {
    if (dense_dir) {
      const uint16_t* o = off.data() + static_cast<size_t>(t) * ((1u << K) + 1);
      b = o[code];
      e = o[code + 1];
      return;
    }
    uint32_t lo = dir_begin[t], hi = dir_begin[t + 1], end = hi;
    while (lo < hi) {  // lower_bound: distinct codes are few, the range stays in cache
      uint32_t mid = (lo + hi) >> 1;
      if (ucode[mid] < code) lo = mid + 1; else hi = mid;
    }
    if (lo == end || ucode[lo] != code) { b = e = 0; return; }
    b = ustart[lo];
    e = (lo + 1 < end) ? ustart[lo + 1] : n;
  }

  size_t index_bytes() const {
    return ids.size() * 2 + off.size() * 2 + dir_begin.size() * 4 + ucode.size() * 2 + ustart.size() * 2;
  }
  size_t mirror_bytes() const { return (kmir.size() + vmir.size()) * 2 + knorm.size() * 4; }
};

using SegmentPtr = std::shared_ptr<const Segment>;

// ---- hashing (hash.cpp) ----
// codes[t*L + l] for T float rows x[t*d ..]; w is float [d][K*L].  Picks AVX-512 when present.
void hash_rows(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes);
void hash_rows_scalar(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes);

// ---- segment building (segment.cpp) ----
std::shared_ptr<Segment> build_segment(const uint16_t* keys, const uint16_t* values, int n, int hkv,
                                       int d, int dtype, const float* centre, const float* w, int K,
                                       int L);
std::shared_ptr<Segment> merge_segments(const std::vector<SegmentPtr>& parts);

// ---- attention (attention.cpp) ----
struct AttnArgs {
  int R, H, hkv, d, K, L, dtype;
  float scale;
  const float* q;        // [R][H][d] fp32
  bool q_is_bf16;        // q values are exactly bf16 (enables the avx512bf16 dot)
  const int32_t* qcodes;  // [R][H][L]
  const float* qdc;      // [R][H]
  const std::vector<std::vector<SegmentPtr>>* segs;
  const uint16_t* kc; int64_t ks[4];  // paged caches, element strides (block, slot, head, dim)
  const uint16_t* vc; int64_t vs[4];
  const int32_t* block_table; int max_blocks, block_size;
  const int32_t* ranges;  // [R][2][2]
  float* out;             // [R][H][d] fp32
  float* lse;             // [R][H]
  int64_t* counts;        // [R][H]
  bool force_scalar;
};
void sparse_decode(const AttnArgs& a);

// ---- ISA (isa.cpp) ----
bool cpu_has_avx512();      // avx512f+bw+vl+dq (+fma, f16c)
bool cpu_has_avx512bf16();
const char* active_isa();

}  // namespace mp
