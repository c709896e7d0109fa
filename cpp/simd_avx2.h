// AVX2 helpers for attend_avx2.cpp, the 8-lane counterparts of simd_math.h: 16-bit row loads, e^x,
// acos, dot products and lane masks.  Every function carries a target attribute, so this compiles
// on baseline x86-64 and runs only where resolve_isa() picked the AVX2 path.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include "attend.h"

#define MP_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace mp {

// 8 bf16 / fp16 values -> fp32.
MP_AVX2 inline __m256 load8(const uint16_t* p, int dtype) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

MP_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

MP_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes i .. i+7 of an n-entry range that exist: all-ones int32 lanes, as maskload/maskstore take.
MP_AVX2 inline __m256i live_lanes8(int n, int i) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// e^x for x <= 0: the kExpCoef polynomial times 2^k, as exp_neg in simd_math.h.  2^k is built in
// the exponent field (k >= -126 once x >= kExpFloor, so it is a normal float), and p * 2^k rounds
// once, as _mm512_scalef_ps and ldexp do; x < kExpFloor (and -inf) gives exactly 0.
MP_AVX2 inline __m256 exp_neg8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, k), _mm256_set1_ps(kLn2));
  __m256 p = _mm256_set1_ps(kExpCoef[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpCoef[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// acos on [-1, 1]: the kAcosCoef polynomial (attend.h), as acos_ps in simd_math.h.
MP_AVX2 inline __m256 acos8(__m256 x) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  __m256 p = _mm256_set1_ps(kAcosCoef[0]);
  for (int i = 1; i < kAcosTerms; ++i) p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(kAcosCoef[i]));
  const __m256 r =
      _mm256_mul_ps(_mm256_sqrt_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_set1_ps(1.f), ax), _mm256_setzero_ps())), p);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(r, _mm256_sub_ps(_mm256_set1_ps(static_cast<float>(PI)), r), neg);
}

// q . k over d (a multiple of 16) in two accumulators, so consecutive FMAs do not wait on each other.
MP_AVX2 inline float dot8_f32(const float* q, const float* k, int d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int j = 0; j < d; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8), a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// dot8_f32 of q with a bf16 / fp16 row, each 8 values converted as they are loaded: the same sums,
// in the same order, as dot8_f32 of the row converted to fp32 first.
MP_AVX2 inline float dot8_row(const float* q, const uint16_t* k, int d, int dtype) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int j = 0; j < d; j += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j, dtype), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), load8(k + j + 8, dtype), a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

}  // namespace mp
#endif
