// Scalar attention, the twin of attend_avx512 (attend_avx512.cpp) and the production path on CPUs
// without AVX-512.  Same three phases, same correction table and interpolation, same acos and e^x
// polynomials, same zero weights (this path skips their rows, the SIMD V passes add 0 * v): the two
// differ only in vector width, FMA and summation order.
// Also home of the correction table both paths read.
#include <cmath>
#include <map>
#include <mutex>
#include <utility>

#include "attend.h"

namespace mp {

// Written without the 1 - (1-P1)^L - L*P1*(1-P1)^(L-1) cancellation blow-up.
double sample_prob(double cs, int K, int L) {
  const double th = std::acos(std::min(1.0, std::max(-1.0, cs)));
  const double p = 1.0 - th / PI, P1 = std::pow(p, K);
  const double u = 1.0 - std::pow(1.0 - P1, L - 1) * (1.0 + (L - 1) * P1);
  return std::max(0.0, u);
}

// Tabulated in theta, where -log(u + 1e-4) is smooth (in cos it is steep near +-1); with 8192
// intervals the linear interpolation error is ~1e-5 in the logit for the K, L in use.
const float* corr_table(int K, int L) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::vector<float>> cache;
  std::lock_guard<std::mutex> g(mu);
  auto& t = cache[{K, L}];
  if (t.empty()) {
    t.resize(NT + 2);
    for (int i = 0; i <= NT; ++i) t[i] = static_cast<float>(-std::log(sample_prob(std::cos(PI * i / NT), K, L) + 1e-4));
    t[NT + 1] = t[NT];  // lets the read of i0 + 1 stay in bounds
  }
  return t.data();
}

namespace {

inline float acos_poly(float x) {
  const float ax = std::fabs(x);
  float p = kAcosCoef[0];
  for (int i = 1; i < kAcosTerms; ++i) p = p * ax + kAcosCoef[i];
  const float r = std::sqrt(std::max(1.f - ax, 0.f)) * p;
  return x < 0.f ? static_cast<float>(PI) - r : r;
}

inline float exp_neg(float x) {
  if (x < kExpFloor) return 0.f;  // also -inf
  const float t = x * kLog2e;
  const float k = std::nearbyint(t);  // round half to even, as _MM_FROUND_TO_NEAREST_INT
  const float f = (t - k) * kLn2;
  float p = kExpCoef[0];
  for (int i = 1; i < kExpTerms; ++i) p = p * f + kExpCoef[i];
  return std::ldexp(p, static_cast<int>(k));  // one rounding, as _mm512_scalef_ps
}

// -log(u + 1e-4) for a sampled key: linear interpolation of the table at theta = acos(cs).
inline float correction(float qk, float qn, float qdc, float knorm, const float* table) {
  const float den = qn * knorm;
  float cs = den > kMinNormProduct ? (qk - qdc) / den : 0.f;
  // Clamped the way _mm512_max_ps / _mm512_min_ps clamp, so a NaN cosine lands on -1 in both twins.
  cs = cs > -1.f ? cs : -1.f;
  cs = cs < 1.f ? cs : 1.f;
  const float x = acos_poly(cs) * static_cast<float>(NT / PI);
  const int i0 = std::min(std::max(static_cast<int>(x), 0), NT - 1);
  const float fr = x - static_cast<float>(i0);
  return fr * (table[i0 + 1] - table[i0]) + table[i0];
}

}  // namespace

void dense_scores_scalar(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch) {
  const int G = heads.G, nr = unit.end - unit.begin;
  scratch.scores.resize(static_cast<size_t>(G) * nr);
  float* s = scratch.scores.data();
  for (int i = 0, run; i < nr; i += run) {
    const BlockRun b = block_run(args, unit, i);
    run = b.run;
    const uint16_t* kb = args.kc + b.blk * args.ks[0] + b.off + unit.kvh * args.ks[2];
    for (int t = 0; t < run; ++t)
      for (int g = 0; g < G; ++g)
        s[static_cast<size_t>(g) * nr + i + t] = column_dot(heads.q[g], kb, args.ks[3], t, args.d, args.dtype);
  }
}

void attend_scalar(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                   const float* neg_log_u_table) {
  const int d = args.d, G = heads.G, n = rows.n;
  scratch.scores.resize(rows.off[G]);
  scratch.norms.resize(rows.off[G]);
  scratch.row_f32.resize(d);
  float* row = scratch.row_f32.data();
  float* sc = scratch.scores.data();
  float* nm = scratch.norms.data();
  PhaseTimer pt(rows.seg);  // a dense unit is timed whole (sparse_decode.cpp)

  // q.k for every (row, head) the mask asks for, into the head's next compact entry, with the
  // row's |k - c| beside it for segments.
  int pos[MAXG];
  std::copy(rows.off, rows.off + G, pos);
  for (int i = 0; i < (rows.scores_ready ? 0 : n); ++i) {
    if (rows.kv8) {
      int8_to_f32(int8_key(rows.row8(i)), row, d);
    } else {
      const uint16_t* kr = rows.row(rows.kb, i);
      for (int j = 0; j < d; ++j) row[j] = to_f(kr[j], args.dtype);
    }
    const float kn = rows.seg ? rows.norm(i) : 0.f;
    for (uint32_t m = rows.mask[i]; m; m &= m - 1) {
      const int g = __builtin_ctz(m), p = pos[g]++;
      float qk = 0.f;
      for (int j = 0; j < d; ++j) qk += heads.q[g][j] * row[j];
      sc[p] = qk;
      nm[p] = kn;
    }
  }

  // Logits (scale*q.k, minus log(u + 1e-4) for sampled keys), then softmax weights, per head over
  // its compact entries.
  for (int g = 0; g < G; ++g) {
    float* s = sc + rows.off[g];
    const float* kn = nm + rows.off[g];
    const int c = rows.off[g + 1] - rows.off[g];
    float m = NEG_INF;
    for (int i = 0; i < c; ++i) {
      float v = s[i] * args.scale;
      if (rows.seg) v += correction(s[i], heads.qn[g], heads.qdc[g], kn[i], neg_log_u_table);
      s[i] = v;
      m = std::max(m, v);
    }
    float l = 0.f;
    if (m != NEG_INF) {
      for (int i = 0; i < c; ++i) {
        s[i] = exp_neg(s[i] - m);
        l += s[i];
      }
    } else {  // no row for this head (or none with a finite logit): zero weights
      std::fill(s, s + c, 0.f);
    }
    part.max[g] = m;
    part.sum[g] = l;
  }
  pt.tick(kPhaseGatherLogits);

  // acc[g] += p[g] * v for every (row, head) of the mask, each V row converted once for all heads.
  std::fill(part.acc, part.acc + static_cast<size_t>(G) * d, 0.f);
  std::copy(rows.off, rows.off + G, pos);
  for (int i = 0; i < n; ++i) {
    if (rows.kv8) {
      int8_to_f32(int8_value(rows.row8(i), d), row, d);
    } else {
      const uint16_t* vr = rows.row(rows.vb, i);
      for (int j = 0; j < d; ++j) row[j] = to_f(vr[j], args.dtype);
    }
    for (uint32_t msk = rows.mask[i]; msk; msk &= msk - 1) {
      const int g = __builtin_ctz(msk);
      const float p = sc[pos[g]++];
      if (p == 0.f) continue;
      float* acc = part.acc + static_cast<size_t>(g) * d;
      for (int j = 0; j < d; ++j) acc[j] += p * row[j];
    }
  }
  pt.tick(kPhaseSoftmaxV);
}

}  // namespace mp
