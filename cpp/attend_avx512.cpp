// AVX-512 attention, the twin of attend_scalar (attend_scalar.cpp): 16 rows per vector in the
// logits and softmax, 16 dims per vector in the dot products and the V accumulation.
#if defined(__x86_64__)
#include "simd_math.h"

namespace mp {
namespace {

// q.k for every (row, head) pair the mask asks for; other entries become -inf.
MP_AVX512 void qk_avx512(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
  const int d = args.d, G = heads.G, n = rows.n;
  float* kf = scratch.row_f32.data();
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(rows.row(rows.kb, i + 8, d), d);
    const uint16_t* kr = rows.row(rows.kb, i, d);
    for (int j = 0; j < d; j += 16) _mm512_storeu_ps(kf + j, load16(kr + j, args.dtype));
    for (int g = 0; g < G; ++g)
      scratch.scores[static_cast<size_t>(g) * n + i] = ((rows.mask[i] >> g) & 1) ? dot_f32(heads.q[g], kf, d) : NEG_INF;
  }
}

MP_AVX512BF16 void qk_avx512bf16(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
  const int d = args.d, G = heads.G, n = rows.n;
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(rows.row(rows.kb, i + 8, d), d);
    const uint16_t* kr = rows.row(rows.kb, i, d);
    for (int g = 0; g < G; ++g)
      scratch.scores[static_cast<size_t>(g) * n + i] =
          ((rows.mask[i] >> g) & 1) ? dot_bf16(heads.qbf + static_cast<size_t>(g) * d, kr, d) : NEG_INF;
  }
}

MP_AVX512 inline __mmask16 live_lanes(int n, int i) {
  return (n - i >= 16) ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
}

}  // namespace

MP_AVX512 void attend_avx512(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                             const float* neg_log_u_table, Isa isa) {
  const int d = args.d, G = heads.G, n = rows.n;
  // Every access past n below is masked, so no padding is needed.
  scratch.scores.resize(static_cast<size_t>(G) * n);
  scratch.row_f32.resize(d);
  PhaseTimer pt;
  if (isa == Isa::Avx512Bf16)
    qk_avx512bf16(args, rows, heads, scratch);
  else
    qk_avx512(args, rows, heads, scratch);

  // Logits (scale*q.k, minus log(u + 1e-4) for sampled keys), then softmax weights, per head, 16
  // rows at a time.
  const __m512 vscale = _mm512_set1_ps(args.scale), ninf = _mm512_set1_ps(NEG_INF);
  const __m512 tscale = _mm512_set1_ps(static_cast<float>(NT / PI));
  for (int g = 0; g < G; ++g) {
    float* s = scratch.scores.data() + static_cast<size_t>(g) * n;
    const __m512 qn = _mm512_set1_ps(heads.qn[g]), qdc = _mm512_set1_ps(heads.qdc[g]);
    __m512 vmax = ninf;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 live = live_lanes(n, i);
      const __m512i msk = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, rows.mask + i));
      const __mmask16 on = _mm512_test_epi32_mask(msk, _mm512_set1_epi32(1 << g)) & live;
      const __m512 qk = _mm512_maskz_loadu_ps(on, s + i);
      __m512 v = _mm512_mul_ps(qk, vscale);
      if (rows.seg) {
        const __m512i id = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, rows.idx + i));
        const __m512 kn = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, id, rows.knorm, 4);
        const __m512 den = _mm512_mul_ps(qn, kn);
        const __mmask16 ok = _mm512_cmp_ps_mask(den, _mm512_set1_ps(kMinNormProduct), _CMP_GT_OQ) & on;
        __m512 cs = _mm512_maskz_div_ps(ok, _mm512_sub_ps(qk, qdc), den);
        cs = _mm512_min_ps(_mm512_max_ps(cs, _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
        const __m512 x = _mm512_mul_ps(acos_ps(cs), tscale);
        __m512i i0 = _mm512_cvttps_epi32(x);
        i0 = _mm512_min_epi32(_mm512_max_epi32(i0, _mm512_setzero_si512()), _mm512_set1_epi32(NT - 1));
        const __m512 fr = _mm512_sub_ps(x, _mm512_cvtepi32_ps(i0));
        const __m512 f0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, i0, neg_log_u_table, 4);
        const __m512 f1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, _mm512_add_epi32(i0, _mm512_set1_epi32(1)),
                                                   neg_log_u_table, 4);
        v = _mm512_add_ps(v, _mm512_fmadd_ps(fr, _mm512_sub_ps(f1, f0), f0));
      }
      v = _mm512_mask_mov_ps(ninf, on, v);
      _mm512_mask_storeu_ps(s + i, live, v);
      vmax = _mm512_max_ps(vmax, v);
    }
    const float m = _mm512_reduce_max_ps(vmax);
    float l = 0.f;
    if (m != NEG_INF) {
      __m512 vl = _mm512_setzero_ps();
      const __m512 vm = _mm512_set1_ps(m);
      for (int i = 0; i < n; i += 16) {
        const __mmask16 live = live_lanes(n, i);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), vm)));
        _mm512_mask_storeu_ps(s + i, live, p);
        vl = _mm512_add_ps(vl, p);
      }
      l = _mm512_reduce_add_ps(vl);
    } else {  // no row for this head: zero weights, so the V pass skips them all
      std::fill(s, s + n, 0.f);
    }
    part.max[g] = m;
    part.sum[g] = l;
  }
  pt.tick(kPhaseGatherLogits);

  // acc[g] += p[g][i] * v_i, each V row converted once for all heads.
  std::fill(part.acc, part.acc + static_cast<size_t>(G) * d, 0.f);
  float* vf = scratch.row_f32.data();
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(rows.row(rows.vb, i + 8, d), d);
    const uint16_t* vr = rows.row(rows.vb, i, d);
    for (int j = 0; j < d; j += 16) _mm512_storeu_ps(vf + j, load16(vr + j, args.dtype));
    for (int g = 0; g < G; ++g) {
      const float p = scratch.scores[static_cast<size_t>(g) * n + i];
      if (p == 0.f) continue;
      const __m512 vp = _mm512_set1_ps(p);
      float* acc = part.acc + static_cast<size_t>(g) * d;
      for (int j = 0; j < d; j += 16)
        _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(vp, _mm512_loadu_ps(vf + j), _mm512_loadu_ps(acc + j)));
    }
  }
  pt.tick(kPhaseSoftmaxV);
}

}  // namespace mp
#endif
