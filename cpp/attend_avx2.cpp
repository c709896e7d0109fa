// AVX2 attention, the 8-lane twin of attend_avx512 (attend_avx512.cpp) for CPUs without AVX-512
// (AMD before Zen 4, most Intel client parts): the same three phases, correction table and
// polynomials as attend_scalar, 8 rows per vector in the logits and softmax, 8 dims per vector in
// the dot products, and the V accumulation in one walk down the rows per 64 dims (values_walk8).
#if defined(__x86_64__)
#include "simd_avx2.h"

namespace mp {

// scale * q[j] for j = 0..7 (s: the scale in every lane), one rounding per element as attend_scalar's.
MP_AVX2 static inline __m256 int8_load8(const int8_t* q, __m256 s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
}
// scale * q[j] into out[0..d).
MP_AVX2 static inline void int8_row_to_f32(Int8Part p, float* out, int d) {
  const __m256 s = _mm256_set1_ps(p.scale);
  for (int j = 0; j < d; j += 8) _mm256_storeu_ps(out + j, int8_load8(p.q + j, s));
}

// Row pass 1: q.k for every (row, head) the mask asks for, into the head's next compact entry,
// and for segments the row's |k - c| beside it.  A bf16 / fp16 row is dotted straight from its 16-bit
// values (dot8_row), converted as it is read: nearly every sampled row is one head's (the heads of a
// unit sample few keys in common), so converting it to an fp32 row first stored and loaded again d
// floats for the one dot product that reads them.
MP_AVX2 static void qk_avx2(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch) {
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
      sc[p] = rows.kv8 ? dot8_f32(heads.q[g], kf, d) : dot8_row(heads.q[g], kr, d, args.dtype);
      nm[p] = kn;
    }
  }
}

// sampled_words_scalar, 32 tokens a vector: bit 1 of each count byte shifted up to the byte's sign
// bit (a 16-bit shift moves no other bit there), then gathered by movemask.
MP_AVX2 int sampled_words_avx2(const uint8_t* collisions, int words, uint64_t* out) {
  int c = 0;
  for (int w = 0; w < words; ++w) {
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(collisions + w * 64));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(collisions + w * 64 + 32));
    const uint64_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(lo, 6))) |
                       static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(hi, 6))))
                           << 32;
    out[w] = m;
    c += __builtin_popcountll(m);
  }
  return c;
}

// Heads in fours, so a K vector (8 tokens' element j) serves four FMAs; a group past the last
// head repeats it and drops those sums.  Tokens go 16 at a time (two K vectors, 8 independent FMA
// chains: 4 chains, one per head, left the FMA units waiting on each chain's latency), then 8, and a
// run's last < 8 one at a time, as the twin.  Each token's score is one FMA chain over j = 0..d-1
// whatever its step, so the steps give the same bits.  The dtype is a template parameter, not a
// branch inside the j loop.
template <int DT, int NT>
MP_AVX2 inline void dense_step(const uint16_t* kb, int64_t kj, int d, const float* const* q, float* s, size_t nr,
                               int cols) {
  __m256 acc[4][NT];
  for (int g = 0; g < 4; ++g)
    for (int u = 0; u < NT; ++u) acc[g][u] = _mm256_setzero_ps();
  for (int j = 0; j < d; ++j) {
    __m256 k[NT];
    for (int u = 0; u < NT; ++u) k[u] = load8(kb + j * kj + 8 * u, DT);
    for (int g = 0; g < 4; ++g) {
      const __m256 qb = _mm256_broadcast_ss(q[g] + j);
      for (int u = 0; u < NT; ++u) acc[g][u] = _mm256_fmadd_ps(qb, k[u], acc[g][u]);
    }
  }
  // A constant trip count, so every acc index is a constant and the sums stay in registers (a loop to
  // cols made GCC keep acc in memory too, stored on every j).
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g)
    if (g < cols)
      for (int u = 0; u < NT; ++u) _mm256_storeu_ps(s + static_cast<size_t>(g) * nr + 8 * u, acc[g][u]);
}

template <int DT>
MP_AVX2 void dense_scores_dt(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch) {
  const int d = args.d, G = heads.G, nr = unit.end - unit.begin;
  const int64_t kj = args.ks[3];
  scratch.scores.resize(static_cast<size_t>(G) * nr);
  float* s = scratch.scores.data();
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    const uint16_t* kb = args.kc + b.blk * args.ks[0] + b.off + unit.kvh * args.ks[2];
    for (int g0 = 0; g0 < G; g0 += 4) {
      const float* q[4];
      for (int g = 0; g < 4; ++g) q[g] = heads.q[std::min(g0 + g, G - 1)];
      const int cols = std::min(4, G - g0);
      float* sg = s + static_cast<size_t>(g0) * nr + i;
      int t = 0;
      for (; t + 16 <= run; t += 16) dense_step<DT, 2>(kb + t, kj, d, q, sg + t, nr, cols);
      for (; t + 8 <= run; t += 8) dense_step<DT, 1>(kb + t, kj, d, q, sg + t, nr, cols);
    }
    for (int t = run - run % 8; t < run; ++t)
      for (int g = 0; g < G; ++g)
        s[static_cast<size_t>(g) * nr + i + t] = column_dot(heads.q[g], kb, kj, t, d, args.dtype);
  }
}

MP_AVX2 void dense_scores_avx2(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch) {
  if (args.dtype == BF16)
    dense_scores_dt<BF16>(args, unit, heads, scratch);
  else
    dense_scores_dt<FP16>(args, unit, heads, scratch);
}

// The V pass over dimensions j0 .. j0 + 8 * NV - 1, in one walk down the rows: a row's V vectors are
// loaded (int8 ones through int8_load8) once, and added into the sums of just the heads its mask
// names, acc[g] in the unit's partial (L1).  Rows are mostly one head's (the heads of a unit sample
// few keys in common), so this does a quarter of the multiply-adds of summing 4 heads in registers with
// a weight of 0 for the others, and reads the rows once instead of once per 16 dimensions.  Each sum is
// w * v added row by row in ascending order, as attend_scalar's: the same bits.  The first block's walk
// prefetches the rows ahead; the others find them in L1 or L2.
template <bool Int8, int NV>
MP_AVX2 static void values_walk8(const Rows& rows, int d, int dtype, const float* sc, int G, int j0, float* acc) {
  int pos[MAXG];
  std::copy(rows.off, rows.off + G, pos);
  const bool prefetch = j0 == 0;
  for (int i = 0; i < rows.n; ++i) {
    if (prefetch && i + kPrefetchRows < rows.n) prefetch_value(rows, i + kPrefetchRows, d);
    __m256 v[NV];
    if constexpr (Int8) {
      const Int8Part p = int8_value(rows.row8(i), d);
      const __m256 s = _mm256_set1_ps(p.scale);
      for (int k = 0; k < NV; ++k) v[k] = int8_load8(p.q + j0 + 8 * k, s);
    } else {
      const uint16_t* vr = rows.row(rows.vb, i) + j0;
      for (int k = 0; k < NV; ++k) v[k] = load8(vr + 8 * k, dtype);
    }
    for (uint32_t m = rows.mask[i]; m; m &= m - 1) {
      const int g = __builtin_ctz(m);
      const __m256 w = _mm256_broadcast_ss(sc + pos[g]++);
      float* a = acc + static_cast<size_t>(g) * d + j0;
      for (int k = 0; k < NV; ++k) _mm256_storeu_ps(a + 8 * k, _mm256_fmadd_ps(w, v[k], _mm256_loadu_ps(a + 8 * k)));
    }
  }
}

// values_walk8 over all of d, 64 dimensions a walk (the last walk 16, 32 or 48).
template <bool Int8>
MP_AVX2 static void values_avx2(const Rows& rows, int d, int dtype, const float* sc, int G, float* acc) {
  std::fill(acc, acc + static_cast<size_t>(G) * d, 0.f);
  for (int j0 = 0; j0 < d; j0 += 64) {
    const int nv = std::min(8, (d - j0) / 8);
    if (nv == 8)
      values_walk8<Int8, 8>(rows, d, dtype, sc, G, j0, acc);
    else if (nv == 6)
      values_walk8<Int8, 6>(rows, d, dtype, sc, G, j0, acc);
    else if (nv == 4)
      values_walk8<Int8, 4>(rows, d, dtype, sc, G, j0, acc);
    else
      values_walk8<Int8, 2>(rows, d, dtype, sc, G, j0, acc);
  }
}

MP_AVX2 void attend_avx2(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                         const float* neg_log_u_table) {
  const int d = args.d, G = heads.G;
  // Every access past an entry range below is masked.
  scratch.scores.resize(rows.off[G]);
  scratch.norms.resize(rows.off[G]);
  scratch.row_f32.resize(d);
  PhaseTimer pt(rows.seg);  // a dense unit is timed whole (sparse_decode.cpp)
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

  // acc[g] = sum of w[g] * v over head g's rows.
  if (rows.kv8)
    values_avx2<true>(rows, d, args.dtype, scratch.scores.data(), G, part.acc);
  else
    values_avx2<false>(rows, d, args.dtype, scratch.scores.data(), G, part.acc);
  pt.tick(kPhaseSoftmaxV);
}

}  // namespace mp
#endif
