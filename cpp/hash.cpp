// SimHash codes: the sign bits of x . w, packed K bits per table.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>

#include "common.h"

namespace mp {
namespace {

// Packs the sign bits of one row's K*L projections into L codes.
inline void pack_codes(const uint8_t* bits, int K, int L, uint16_t* codes) {
  for (int l = 0; l < L; ++l) {
    uint32_t c = 0;
    for (int j = 0; j < K; ++j) c |= static_cast<uint32_t>(bits[l * K + j]) << j;
    codes[l] = static_cast<uint16_t>(c);
  }
}

void hash_rows_scalar(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes) {
  const int C = K * L;
  std::vector<float> acc(C);
  std::vector<uint8_t> bits(C);
  for (int t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int i = 0; i < d; ++i) {
      const float xi = x[static_cast<size_t>(t) * d + i];
      const float* wr = w + static_cast<size_t>(i) * C;
      for (int c = 0; c < C; ++c) acc[c] += xi * wr[c];
    }
    for (int c = 0; c < C; ++c) bits[c] = acc[c] > 0.f;
    pack_codes(bits.data(), K, L, codes + static_cast<size_t>(t) * L);
  }
}

#if defined(__x86_64__)
// 4 rows at a time share each W load; columns in chunks of 16 (masked tail).
#define MP_HASH_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
MP_HASH_AVX512 void hash_rows_avx512(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes) {
  const int C = K * L;
  std::vector<uint8_t> bits(static_cast<size_t>(4) * C);
  for (int t0 = 0; t0 < T; t0 += 4) {
    const int nt = std::min(4, T - t0);
    const float* xr[4];
    for (int r = 0; r < 4; ++r) xr[r] = x + static_cast<size_t>(t0 + std::min(r, nt - 1)) * d;
    for (int c0 = 0; c0 < C; c0 += 16) {
      const __mmask16 m = (C - c0 >= 16) ? 0xffff : static_cast<__mmask16>((1u << (C - c0)) - 1);
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = 0; i < d; ++i) {
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + static_cast<size_t>(i) * C + c0);
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(xr[0][i]), wv, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(xr[1][i]), wv, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(xr[2][i]), wv, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(xr[3][i]), wv, a3);
      }
      const __m512 z = _mm512_setzero_ps();
      const __mmask16 s[4] = {_mm512_cmp_ps_mask(a0, z, _CMP_GT_OQ), _mm512_cmp_ps_mask(a1, z, _CMP_GT_OQ),
                              _mm512_cmp_ps_mask(a2, z, _CMP_GT_OQ), _mm512_cmp_ps_mask(a3, z, _CMP_GT_OQ)};
      const int nc = std::min(16, C - c0);
      for (int r = 0; r < nt; ++r)
        for (int j = 0; j < nc; ++j) bits[static_cast<size_t>(r) * C + c0 + j] = (s[r] >> j) & 1;
    }
    for (int r = 0; r < nt; ++r)
      pack_codes(bits.data() + static_cast<size_t>(r) * C, K, L, codes + static_cast<size_t>(t0 + r) * L);
  }
}
#endif

}  // namespace

// Keys (build) and queries (hash_codes) both come through here, so hashed with the same
// force_scalar they share the same arithmetic; FMA vs mul+add, the only difference between the
// twins, moves only sign bits that sit at float rounding.
void hash_rows(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes, bool force_scalar) {
  const Isa isa = resolve_isa(force_scalar);
#if defined(__x86_64__)
  if (isa != Isa::Scalar) return hash_rows_avx512(x, T, d, w, K, L, codes);
#endif
  (void)isa;
  hash_rows_scalar(x, T, d, w, K, L, codes);
}

}  // namespace mp
