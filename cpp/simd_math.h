// AVX-512 helpers for attend_avx512.cpp and dense_amx_avx512.cpp: 16-bit row loads, e^x, acos, dot
// products, and the V passes' weights by row and blocks of heads and dimensions.  Every intrinsic
// function carries a target attribute, so this compiles on baseline x86-64 and runs only where
// resolve_isa() picked an AVX-512 path.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <type_traits>
#include <vector>

#include "attend.h"

#define MP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define MP_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))

namespace mp {

// 16 bf16 / fp16 values -> fp32.
MP_AVX512 inline __m512 load16(const uint16_t* p, int dtype) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// e^x for x <= 0 (softmax weights), the kExpCoef polynomial (attend.h), as exp_neg in
// attend_scalar.cpp; x < kExpFloor (and -inf) gives exactly 0.
MP_AVX512 inline __m512 exp_neg(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(kLn2));
  __m512 p = _mm512_set1_ps(kExpCoef[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpCoef[i]));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, k));
}

// acos on [-1, 1]: the kAcosCoef polynomial (attend.h), as acos_poly in attend_scalar.cpp.
MP_AVX512 inline __m512 acos_ps(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  __m512 p = _mm512_set1_ps(kAcosCoef[0]);
  for (int i = 1; i < kAcosTerms; ++i) p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(kAcosCoef[i]));
  const __m512 r =
      _mm512_mul_ps(_mm512_sqrt_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), ax), _mm512_setzero_ps())), p);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_sub_ps(r, neg, _mm512_set1_ps(static_cast<float>(PI)), r);
}

// Head g's softmax weight of row i at w[i * gp + g], gp = G rounded up to 4: 0 where the head does
// not attend the row, and for the heads past G.  The AVX-512 V passes run every row through all the
// heads of a 4-head block, their sums in registers: no branch on the row's mask (whose head count
// varies from row to row) and no load and store of a head's sums per row.  (The AVX2 pass, with 8
// floats a vector, needed four walks down the rows for that at head_dim 64; it adds each row into
// just its heads' sums in L1 instead, values_walk8, in one walk per 64 dimensions.)
// Each sum still adds w * v over the rows in order, and a weight of 0 adds 0 * v: the same sums as
// attend_scalar's, which skips such rows, for finite v.  A head whose entries are all taken reads
// one past them (the next head's, or a padding entry): scores needs off[G] + 1 entries.
inline int row_weights(const Rows& rows, int G, const float* sc, std::vector<float>& w) {
  const int gp = (G + 3) & ~3, n = rows.n;
  w.resize(static_cast<size_t>(n) * gp);
  int pos[MAXG];
  std::copy(rows.off, rows.off + G, pos);
  for (int i = 0; i < n; ++i) {
    const uint32_t m = rows.mask[i];
    float* wi = w.data() + static_cast<size_t>(i) * gp;
    for (int g = 0; g < G; ++g) {
      const int bit = static_cast<int>((m >> g) & 1u);
      const float x = sc[pos[g]];
      wi[g] = bit ? x : 0.f;
      pos[g] += bit;
    }
    for (int g = G; g < gp; ++g) wi[g] = 0.f;
  }
  return gp;
}

// The SIMD V passes' blocks: heads in fours (g0), dimensions in 64s (j0), and a block's width in
// 16-float vectors (1..4, the last block of a head_dim not a multiple of 64 is narrower) as a
// compile-time constant: f(g0, j0, std::integral_constant<int, NV>{}), so its sums stay in registers.
template <class F>
inline void for_each_value_block(int d, int G, F&& f) {
  for (int g0 = 0; g0 < G; g0 += 4)
    for (int j0 = 0; j0 < d; j0 += 64) {
      const int nv = std::min(4, (d - j0) / 16);
      if (nv == 4)
        f(g0, j0, std::integral_constant<int, 4>{});
      else if (nv == 3)
        f(g0, j0, std::integral_constant<int, 3>{});
      else if (nv == 2)
        f(g0, j0, std::integral_constant<int, 2>{});
      else
        f(g0, j0, std::integral_constant<int, 1>{});
    }
}

MP_AVX512 inline float dot_f32(const float* q, const float* k, int d) {
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(k + j), acc);
  return _mm512_reduce_add_ps(acc);
}

// dot_f32 of q with a bf16 / fp16 row, each 16 values converted as they are loaded: the same sums,
// in the same order, as dot_f32 of the row converted to fp32 first.
MP_AVX512 inline float dot_row(const float* q, const uint16_t* k, int d, int dtype) {
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load16(k + j, dtype), acc);
  return _mm512_reduce_add_ps(acc);
}

MP_AVX512BF16 inline float dot_bf16(const uint16_t* q, const uint16_t* k, int d) {
  __m512 acc = _mm512_setzero_ps();
  int j = 0;
  for (; j + 32 <= d; j += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + j), (__m512bh)_mm512_loadu_si512(k + j));
  if (j < d) acc = _mm512_fmadd_ps(load16(q + j, BF16), load16(k + j, BF16), acc);
  return _mm512_reduce_add_ps(acc);
}

}  // namespace mp
#endif
