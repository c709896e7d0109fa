// AVX2 attention, the 8-lane twin of attend_avx512 (attend_avx512.cpp) for CPUs without AVX-512
// (AMD before Zen 4, most Intel client parts): the same three phases, correction table and
// polynomials as attend_scalar, 8 rows per vector in the logits and softmax, 8 dims per vector in
// the dot products, and the V accumulation in registers, 4 heads x 16 dims (values_block8).
#if defined(__x86_64__)
#include "simd_avx2.h"

namespace mp {

// scale * q[j] into out[0..d), one rounding per element as attend_scalar's.
MP_AVX2 static inline void int8_row_to_f32(Int8Part p, float* out, int d) {
  const __m256 s = _mm256_set1_ps(p.scale);
  for (int j = 0; j < d; j += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + j));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
  }
}

// Row pass 1: q.k for every (row, head) the mask asks for, into the head's next compact entry,
// and for segments the row's |k - c| beside it.
MP_AVX2 static void qk_avx2(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
  const int d = args.d, n = rows.n;
  float* kf = scratch.row_f32.data();
  float* sc = scratch.scores.data();
  float* nm = scratch.norms.data();
  int pos[MAXG];
  std::copy(rows.off, rows.off + heads.G, pos);
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) prefetch_key(rows, i + kPrefetchRows, d);
    if (rows.kv8) {
      int8_row_to_f32(int8_key(rows.row8(i)), kf, d);
    } else {
      const uint16_t* kr = rows.row(rows.kb, i);
      for (int j = 0; j < d; j += 8) _mm256_storeu_ps(kf + j, load8(kr + j, args.dtype));
    }
    const float kn = rows.seg ? rows.norm(i) : 0.f;
    for (uint32_t m = rows.mask[i]; m; m &= m - 1) {
      const int g = __builtin_ctz(m), p = pos[g]++;
      sc[p] = dot8_f32(heads.q[g], kf, d);
      nm[p] = kn;
    }
  }
}

// Heads in fours, so a K vector (8 tokens' element j) serves four FMAs; a group past the last
// head repeats it and drops those sums.  A run's last < 8 tokens go one at a time, as the twin.
MP_AVX2 void dense_scores_avx2(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch) {
  const int d = args.d, G = heads.G, nr = unit.end - unit.begin;
  const int64_t kj = args.ks[3];
  scratch.scores.resize(static_cast<size_t>(G) * nr);
  float* s = scratch.scores.data();
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    const uint16_t* kb = args.kc + b.blk * args.ks[0] + b.off + unit.kvh * args.ks[2];
    int t = 0;
    for (; t + 8 <= run; t += 8)
      for (int g0 = 0; g0 < G; g0 += 4) {
        const float* q[4];
        for (int g = 0; g < 4; ++g) q[g] = heads.q[std::min(g0 + g, G - 1)];
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int j = 0; j < d; ++j) {
          const __m256 k = load8(kb + j * kj + t, args.dtype);
          for (int g = 0; g < 4; ++g) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(q[g] + j), k, acc[g]);
        }
        for (int g = 0; g < std::min(4, G - g0); ++g)
          _mm256_storeu_ps(s + static_cast<size_t>(g0 + g) * nr + i + t, acc[g]);
      }
    for (; t < run; ++t)
      for (int g = 0; g < G; ++g)
        s[static_cast<size_t>(g) * nr + i + t] = column_dot(heads.q[g], kb, kj, t, d, args.dtype);
  }
}

// The V pass for heads g0 .. g0 + 3 and dimensions j0 .. j0 + 15: the 4 x 2 sums stay in registers
// down all the rows, each row's V vectors loaded once for the 4 heads (w: row_weights').  The first
// block's pass prefetches the rows ahead; the other blocks find them in L1 or L2.  Each sum is w * v
// added row by row, as attend_scalar's; a V row converts as int8_row_to_f32 does.
template <bool Int8>
MP_AVX2 static void values_block8(const Rows& rows, int d, int dtype, const float* w, int gp, int g0, int j0, int G,
                                  float* acc) {
  __m256 a[4][2];
  for (int h = 0; h < 4; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
  const bool prefetch = g0 == 0 && j0 == 0;
  for (int i = 0; i < rows.n; ++i) {
    if (prefetch && i + kPrefetchRows < rows.n) prefetch_value(rows, i + kPrefetchRows, d);
    __m256 v0, v1;
    if constexpr (Int8) {
      const Int8Part p = int8_value(rows.row8(i), d);
      const __m256 s = _mm256_set1_ps(p.scale);
      const __m128i b0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + j0));
      const __m128i b1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.q + j0 + 8));
      v0 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)));
      v1 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1)));
    } else {
      const uint16_t* vr = rows.row(rows.vb, i) + j0;
      v0 = load8(vr, dtype);
      v1 = load8(vr + 8, dtype);
    }
    const float* wi = w + static_cast<size_t>(i) * gp + g0;
    for (int h = 0; h < 4; ++h) {
      const __m256 b = _mm256_broadcast_ss(wi + h);
      a[h][0] = _mm256_fmadd_ps(b, v0, a[h][0]);
      a[h][1] = _mm256_fmadd_ps(b, v1, a[h][1]);
    }
  }
  for (int h = 0; h < std::min(4, G - g0); ++h) {
    float* o = acc + static_cast<size_t>(g0 + h) * d + j0;
    _mm256_storeu_ps(o, a[h][0]);
    _mm256_storeu_ps(o + 8, a[h][1]);
  }
}

MP_AVX2 void attend_avx2(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                         const float* neg_log_u_table) {
  const int d = args.d, G = heads.G;
  // Every access past an entry range below is masked; the one padding entry is row_weights'.
  scratch.scores.resize(rows.off[G] + 1);
  scratch.norms.resize(rows.off[G]);
  scratch.row_f32.resize(d);
  PhaseTimer pt;
  if (!rows.scores_ready) qk_avx2(args, rows, heads, scratch);

  // Logits (scale*q.k, minus log(u + 1e-4) for sampled keys), then softmax weights, per head over
  // its compact entries, 8 at a time.
  const __m256 vscale = _mm256_set1_ps(args.scale), ninf = _mm256_set1_ps(NEG_INF);
  const __m256 tscale = _mm256_set1_ps(static_cast<float>(NT / PI));
  for (int g = 0; g < G; ++g) {
    float* s = scratch.scores.data() + rows.off[g];
    const float* nm = scratch.norms.data() + rows.off[g];
    const int c = rows.off[g + 1] - rows.off[g];
    const __m256 qn = _mm256_set1_ps(heads.qn[g]), qdc = _mm256_set1_ps(heads.qdc[g]);
    __m256 vmax = ninf;
    for (int i = 0; i < c; i += 8) {
      const __m256i live = live_lanes8(c, i);
      const __m256 livef = _mm256_castsi256_ps(live);
      const __m256 qk = _mm256_maskload_ps(s + i, live);
      __m256 v = _mm256_mul_ps(qk, vscale);
      if (rows.seg) {
        const __m256 kn = _mm256_maskload_ps(nm + i, live);
        const __m256 den = _mm256_mul_ps(qn, kn);
        const __m256 ok = _mm256_and_ps(_mm256_cmp_ps(den, _mm256_set1_ps(kMinNormProduct), _CMP_GT_OQ), livef);
        __m256 cs = _mm256_and_ps(ok, _mm256_div_ps(_mm256_sub_ps(qk, qdc), den));
        cs = _mm256_min_ps(_mm256_max_ps(cs, _mm256_set1_ps(-1.f)), _mm256_set1_ps(1.f));
        const __m256 x = _mm256_mul_ps(acos8(cs), tscale);
        __m256i i0 = _mm256_cvttps_epi32(x);
        i0 = _mm256_min_epi32(_mm256_max_epi32(i0, _mm256_setzero_si256()), _mm256_set1_epi32(NT - 1));
        const __m256 fr = _mm256_sub_ps(x, _mm256_cvtepi32_ps(i0));
        const __m256 f0 = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), neg_log_u_table, i0, livef, 4);
        const __m256 f1 = _mm256_mask_i32gather_ps(_mm256_setzero_ps(), neg_log_u_table,
                                                   _mm256_add_epi32(i0, _mm256_set1_epi32(1)), livef, 4);
        v = _mm256_add_ps(v, _mm256_fmadd_ps(fr, _mm256_sub_ps(f1, f0), f0));
      }
      v = _mm256_blendv_ps(ninf, v, livef);
      _mm256_maskstore_ps(s + i, live, v);
      vmax = _mm256_max_ps(vmax, v);
    }
    const float m = hmax8(vmax);
    float l = 0.f;
    if (m != NEG_INF) {
      __m256 vl = _mm256_setzero_ps();
      const __m256 vm = _mm256_set1_ps(m);
      for (int i = 0; i < c; i += 8) {
        const __m256i live = live_lanes8(c, i);
        const __m256 p =
            _mm256_and_ps(_mm256_castsi256_ps(live), exp_neg8(_mm256_sub_ps(_mm256_maskload_ps(s + i, live), vm)));
        _mm256_maskstore_ps(s + i, live, p);
        vl = _mm256_add_ps(vl, p);
      }
      l = hsum8(vl);
    } else {  // no row for this head (or none with a finite logit): zero weights
      std::fill(s, s + c, 0.f);
    }
    part.max[g] = m;
    part.sum[g] = l;
  }
  pt.tick(kPhaseGatherLogits);

  // acc[g] = sum of w[g] * v over the rows (row_weights), heads in fours, 16 dimensions at a time.
  const int gp = row_weights(rows, G, scratch.scores.data(), scratch.wrow);
  for (int g0 = 0; g0 < G; g0 += 4)
    for (int j0 = 0; j0 < d; j0 += 16) {
      if (rows.kv8)
        values_block8<true>(rows, d, args.dtype, scratch.wrow.data(), gp, g0, j0, G, part.acc);
      else
        values_block8<false>(rows, d, args.dtype, scratch.wrow.data(), gp, g0, j0, G, part.acc);
    }
  pt.tick(kPhaseSoftmaxV);
}

}  // namespace mp
#endif
