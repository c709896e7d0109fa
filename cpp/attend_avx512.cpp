// AVX-512 attention, the twin of attend_scalar (attend_scalar.cpp): 16 rows per vector in the
// logits and softmax, 16 dims per vector in the dot products, and the V accumulation in registers,
// 4 heads x 64 dims (values_block).
#if defined(__x86_64__)
#include "simd_math.h"

namespace mp {
namespace {

// scale * q[j] into out[0..d), one rounding per element as attend_scalar's.
MP_AVX512 inline void int8_row_to_f32(Int8Part p, float* out, int d) {
  const __m512 s = _mm512_set1_ps(p.scale);
  for (int j = 0; j < d; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + j));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))));
  }
}

// Row pass 1: q.k for every (row, head) the mask asks for, written to the head's next compact
// entry, and for segments the row's |k - c| beside it (the norm's line is prefetched with the row,
// so the logits read both contiguously).  A bf16 / fp16 row is dotted straight from its 16-bit
// values (dot_row), as qk_avx2 does: nearly every sampled row is one head's, so converting it to an
// fp32 row first stored and loaded again d floats for the one dot product that reads them.
MP_AVX512 void qk_avx512(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
  const int d = args.d, n = rows.n;
  float* kf = scratch.row_f32.data();
  float* sc = scratch.scores.data();
  float* nm = scratch.norms.data();
  int pos[MAXG];
  std::copy(rows.off, rows.off + heads.G, pos);
  for (int i = 0; i < std::min(n, kPrefetchRows); ++i) prefetch_row(rows, i, d);
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) prefetch_row(rows, i + kPrefetchRows, d);
    const float kn = rows.seg ? rows.norm(i) : 0.f;
    const uint16_t* kr = rows.kv8 ? nullptr : rows.row(rows.kb, i);
    if (rows.kv8) int8_row_to_f32(int8_key(rows.row8(i)), kf, d);
    for (uint32_t m = rows.mask[i]; m; m &= m - 1) {
      const int g = __builtin_ctz(m), p = pos[g]++;
      sc[p] = rows.kv8 ? dot_f32(heads.q[g], kf, d) : dot_row(heads.q[g], kr, d, args.dtype);
      nm[p] = kn;
    }
  }
}

MP_AVX512BF16 void qk_avx512bf16(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
  const int d = args.d, n = rows.n;
  float* sc = scratch.scores.data();
  float* nm = scratch.norms.data();
  int pos[MAXG];
  std::copy(rows.off, rows.off + heads.G, pos);
  for (int i = 0; i < std::min(n, kPrefetchRows); ++i) prefetch_row(rows, i, d);
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) prefetch_row(rows, i + kPrefetchRows, d);
    const uint16_t* kr = rows.row(rows.kb, i);
    const float kn = rows.seg ? rows.norm(i) : 0.f;
    for (uint32_t m = rows.mask[i]; m; m &= m - 1) {
      const int g = __builtin_ctz(m), p = pos[g]++;
      sc[p] = dot_bf16(heads.qbf + static_cast<size_t>(g) * d, kr, d);
      nm[p] = kn;
    }
  }
}

// The V pass for heads g0 .. g0 + 3 and dimensions j0 .. j0 + 16 * NV: the 4 x NV sums stay in
// registers down all the rows, each row's V vectors loaded once for the 4 heads (w: row_weights').
// The first block's pass prefetches the rows ahead; the other blocks find them in L1 or L2.  Each
// sum is w * v added row by row, as attend_scalar's; a V row converts as int8_row_to_f32 does.
template <int NV, bool Int8>
MP_AVX512 void values_block(const Rows& rows, int d, int dtype, const float* w, int gp, int g0, int j0, int G,
                            float* acc) {
  __m512 a[4][NV];
  for (int h = 0; h < 4; ++h)
    for (int k = 0; k < NV; ++k) a[h][k] = _mm512_setzero_ps();
  const bool prefetch = g0 == 0 && j0 == 0;
  for (int i = 0; i < rows.n; ++i) {
    if (prefetch && i + kPrefetchRows < rows.n) prefetch_value(rows, i + kPrefetchRows, d);
    __m512 v[NV];
    if constexpr (Int8) {
      const Int8Part p = int8_value(rows.row8(i), d);
      const __m512 s = _mm512_set1_ps(p.scale);
      for (int k = 0; k < NV; ++k) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + j0 + 16 * k));
        v[k] = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
      }
    } else {
      const uint16_t* vr = rows.row(rows.vb, i) + j0;
      for (int k = 0; k < NV; ++k) v[k] = load16(vr + 16 * k, dtype);
    }
    const float* wi = w + static_cast<size_t>(i) * gp + g0;
    for (int h = 0; h < 4; ++h) {
      const __m512 b = _mm512_set1_ps(wi[h]);
      for (int k = 0; k < NV; ++k) a[h][k] = _mm512_fmadd_ps(b, v[k], a[h][k]);
    }
  }
  for (int h = 0; h < std::min(4, G - g0); ++h)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + static_cast<size_t>(g0 + h) * d + j0 + 16 * k, a[h][k]);
}

MP_AVX512 inline __mmask16 live_lanes(int n, int i) {
  return (n - i >= 16) ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
}

}  // namespace

MP_AVX512 void attend_avx512(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                             const float* neg_log_u_table, Isa isa) {
  const int d = args.d, G = heads.G;
  // Every access past an entry range below is masked; the one padding entry is row_weights'.
  scratch.scores.resize(rows.off[G] + 1);
  scratch.norms.resize(rows.off[G]);
  scratch.row_f32.resize(d);
  PhaseTimer pt(rows.seg);  // a dense unit is timed whole (sparse_decode.cpp)
  if (rows.scores_ready) {
    // q.k of a dense tile came from dense_scores_avx2
  } else if (isa == Isa::Avx512Bf16 && !rows.kv8) {  // the bf16 dot reads 16-bit rows in place
    qk_avx512bf16(args, rows, heads, scratch);
  } else {
    qk_avx512(args, rows, heads, scratch);
  }

  // Logits (scale*q.k, minus log(u + 1e-4) for sampled keys), then softmax weights, per head over
  // its compact entries, 16 at a time.
  const __m512 vscale = _mm512_set1_ps(args.scale), ninf = _mm512_set1_ps(NEG_INF);
  const __m512 tscale = _mm512_set1_ps(static_cast<float>(NT / PI));
  for (int g = 0; g < G; ++g) {
    float* s = scratch.scores.data() + rows.off[g];
    const float* nm = scratch.norms.data() + rows.off[g];
    const int c = rows.off[g + 1] - rows.off[g];
    const __m512 qn = _mm512_set1_ps(heads.qn[g]), qdc = _mm512_set1_ps(heads.qdc[g]);
    __m512 vmax = ninf;
    for (int i = 0; i < c; i += 16) {
      const __mmask16 live = live_lanes(c, i);
      const __m512 qk = _mm512_maskz_loadu_ps(live, s + i);
      __m512 v = _mm512_mul_ps(qk, vscale);
      if (rows.seg) {
        const __m512 kn = _mm512_maskz_loadu_ps(live, nm + i);
        const __m512 den = _mm512_mul_ps(qn, kn);
        const __mmask16 ok = _mm512_cmp_ps_mask(den, _mm512_set1_ps(kMinNormProduct), _CMP_GT_OQ) & live;
        __m512 cs = _mm512_maskz_div_ps(ok, _mm512_sub_ps(qk, qdc), den);
        cs = _mm512_min_ps(_mm512_max_ps(cs, _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
        const __m512 x = _mm512_mul_ps(acos_ps(cs), tscale);
        __m512i i0 = _mm512_cvttps_epi32(x);
        i0 = _mm512_min_epi32(_mm512_max_epi32(i0, _mm512_setzero_si512()), _mm512_set1_epi32(NT - 1));
        const __m512 fr = _mm512_sub_ps(x, _mm512_cvtepi32_ps(i0));
        const __m512 f0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, i0, neg_log_u_table, 4);
        const __m512 f1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live,
                                                   _mm512_add_epi32(i0, _mm512_set1_epi32(1)), neg_log_u_table, 4);
        v = _mm512_add_ps(v, _mm512_fmadd_ps(fr, _mm512_sub_ps(f1, f0), f0));
      }
      v = _mm512_mask_mov_ps(ninf, live, v);
      _mm512_mask_storeu_ps(s + i, live, v);
      vmax = _mm512_max_ps(vmax, v);
    }
    const float m = _mm512_reduce_max_ps(vmax);
    float l = 0.f;
    if (m != NEG_INF) {
      __m512 vl = _mm512_setzero_ps();
      const __m512 vm = _mm512_set1_ps(m);
      for (int i = 0; i < c; i += 16) {
        const __mmask16 live = live_lanes(c, i);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), vm)));
        _mm512_mask_storeu_ps(s + i, live, p);
        vl = _mm512_add_ps(vl, p);
      }
      l = _mm512_reduce_add_ps(vl);
    } else {  // no row for this head (or none with a finite logit): zero weights
      std::fill(s, s + c, 0.f);
    }
    part.max[g] = m;
    part.sum[g] = l;
  }
  pt.tick(kPhaseGatherLogits);

  // acc[g] = sum of w[g] * v over the rows (row_weights), heads in fours, 64 dimensions at a time.
  const int gp = row_weights(rows, G, scratch.scores.data(), scratch.wrow);
  if (rows.amx) {
    values_amx_avx512(args, *rows.amx, scratch.wrow.data(), gp, G, part.acc);
    pt.tick(kPhaseSoftmaxV);
    return;
  }
  for_each_value_block(d, G, [&](int g0, int j0, auto nv) {
    constexpr int NV = decltype(nv)::value;
    if (rows.kv8)
      values_block<NV, true>(rows, d, args.dtype, scratch.wrow.data(), gp, g0, j0, G, part.acc);
    else
      values_block<NV, false>(rows, d, args.dtype, scratch.wrow.data(), gp, g0, j0, G, part.acc);
  });
  pt.tick(kPhaseSoftmaxV);
}

}  // namespace mp
#endif
