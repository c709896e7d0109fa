// A dense unit of vLLM's AMX cache (kv_layout.CpuAmxLayout) attended in place by the AVX-512 path:
// q.k from the K tiles and the V sums from the V tiles, with no row-major K or V tile between.
//
// Both tiles hold bf16 pairs in 32-bit lanes.  A K vector is one pair of elements (j, j + 1) for a
// group's 16 tokens; a V vector one pair of tokens (t, t + 1) for 16 elements.  A pair's low half
// shifted up 16 bits and its high half masked are exact fp32, so each vector gives two fp32
// vectors at the cost of two integer ops.  Copying the tiles out (gather_dense) cost a dense token
// ~10x what vLLM's own AMX kernel spends on it (results/decode_profile_amx.md).
//
// Same sums in the same order as the "vec" layout's path over the same values (dense_scores_avx2,
// then values_block over the gathered V rows): a score adds q[j] * k[j] for j = 0..d-1 by FMA, a
// run's last run % 8 tokens one at a time as column_dot, and a V sum adds w * v token by token.
// So a cache in either layout gives bit for bit the same output (test_kernel.py checks it).  The
// scalar twin is gather_dense's element-by-element tiled copy and attend_scalar.
#if defined(__x86_64__)
#include "simd_math.h"

namespace mp {
namespace {

MP_AVX512 inline __m512 low_bf16(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
MP_AVX512 inline __m512 high_bf16(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
MP_AVX512 inline __m512i load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }

// q . k of the token in slot `slot` of a (block, head)'s K tiles, j = 0..d-1 as column_dot sums it.
inline float tiled_key_dot(const float* q, const uint16_t* kbase, int slot, int d) {
  const uint16_t* k = kbase + static_cast<int64_t>(slot / 16) * 16 * d + (slot % 16) * 2;
  float qk = 0.f;
  for (int j = 0; j < d; ++j) qk += q[j] * bf16_to_f(k[(j / 2) * 32 + j % 2]);
  return qk;
}

}  // namespace

// Heads in fours, so one K vector (16 tokens' elements j, j + 1) serves eight FMAs; a group past the
// last head repeats it and drops those sums.  Lanes of a tile group outside the run (tokens of
// another unit, or slots never written) are computed and dropped.
MP_AVX512 void dense_scores_amx_avx512(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch) {
  const int d = args.d, G = heads.G, nr = unit.end - unit.begin;
  scratch.scores.resize(static_cast<size_t>(G) * nr);
  float* s = scratch.scores.data();
  alignas(64) float lanes[16];
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    const uint16_t* kbase = args.kc + b.blk * args.ks[0] + unit.kvh * args.ks[2];
    const int vec_end = b.off + run - run % 8;  // slots before it: FMA chains, as dense_scores_avx2
    for (int g0 = 0; g0 < G; g0 += 4) {
      const float* q[4];
      for (int g = 0; g < 4; ++g) q[g] = heads.q[std::min(g0 + g, G - 1)];
      for (int first = b.off / 16 * 16; first < vec_end; first += 16) {
        const uint16_t* kg = kbase + static_cast<int64_t>(first / 16) * 16 * d;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int p = 0; p < d / 2; ++p) {
          const __m512i kp = load_pairs(kg + p * 32);
          const __m512 k0 = low_bf16(kp), k1 = high_bf16(kp);
          for (int g = 0; g < 4; ++g) {
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][2 * p]), k0, acc[g]);
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][2 * p + 1]), k1, acc[g]);
          }
        }
        const int lo = std::max(first, b.off), hi = std::min(first + 16, vec_end);
        // A constant trip count keeps acc in registers (a loop to min(4, G - g0) made GCC store the
        // sums to the stack on every p, as it did in dense_scores_avx2).
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          if (g >= G - g0) break;
          _mm512_store_ps(lanes, acc[g]);
          std::copy(lanes + (lo - first), lanes + (hi - first),
                    s + static_cast<size_t>(g0 + g) * nr + i + (lo - b.off));
        }
      }
    }
    for (int slot = vec_end; slot < b.off + run; ++slot)
      for (int g = 0; g < G; ++g)
        s[static_cast<size_t>(g) * nr + i + (slot - b.off)] = tiled_key_dot(heads.q[g], kbase, slot, d);
  }
}

// The V pass of a dense AMX unit for heads g0 .. g0 + 3 and dimensions j0 .. j0 + 16 * NV, sums in
// registers as values_block's: each V vector gives tokens t and t + 1 of 16 elements, added in
// token order.  A run that starts on an odd slot or ends on an even one takes that token's half of
// its pair alone (the other half may be another unit's token, or a slot never written).
template <int NV>
MP_AVX512 void values_amx_block(const AttnArgs& args, const Unit& unit, const float* w, int gp, int g0, int j0, int G,
                                float* acc) {
  __m512 a[4][NV];
  for (int h = 0; h < 4; ++h)
    for (int k = 0; k < NV; ++k) a[h][k] = _mm512_setzero_ps();
  const int d = args.d, nr = unit.end - unit.begin;
  const int64_t group_stride = args.vt.j_outer;
  // Adds token `i` of the unit (its fp32 V vectors v) to the sums.
  auto add = [&](const __m512* v, int i) MP_AVX512 {
    const float* wi = w + static_cast<size_t>(i) * gp + g0;
    for (int h = 0; h < 4; ++h) {
      const __m512 b = _mm512_set1_ps(wi[h]);
      for (int k = 0; k < NV; ++k) a[h][k] = _mm512_fmadd_ps(b, v[k], a[h][k]);
    }
  };
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    const uint16_t* vbase = args.vc + b.blk * args.vs[0] + unit.kvh * args.vs[2] + (j0 / 16) * group_stride;
    const int end = b.off + run;
    __m512 lo[NV], hi[NV];
    auto load = [&](int slot) MP_AVX512 {  // the pair holding slot: its even token in lo, odd in hi
      const uint16_t* vp = vbase + (slot / 2) * 32;
      for (int k = 0; k < NV; ++k) {
        const __m512i vv = load_pairs(vp + k * group_stride);
        lo[k] = low_bf16(vv);
        hi[k] = high_bf16(vv);
      }
    };
    int slot = b.off;
    if (slot % 2 && slot < end) {
      load(slot);
      add(hi, i + slot - b.off);
      ++slot;
    }
    for (; slot + 1 < end; slot += 2) {
      load(slot);
      add(lo, i + slot - b.off);
      add(hi, i + slot + 1 - b.off);
    }
    if (slot < end) {
      load(slot);
      add(lo, i + slot - b.off);
    }
  }
  for (int h = 0; h < std::min(4, G - g0); ++h)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + static_cast<size_t>(g0 + h) * d + j0 + 16 * k, a[h][k]);
}

MP_AVX512 void values_amx_avx512(const AttnArgs& args, const Unit& unit, const float* w, int gp, int G, float* acc) {
  for_each_value_block(args.d, G, [&](int g0, int j0, auto nv) {
    values_amx_block<decltype(nv)::value>(args, unit, w, gp, g0, j0, G, acc);
  });
}

}  // namespace mp
#endif
