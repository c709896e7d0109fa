// Sparse decode attention: LSH retrieval (>= 2 collisions) over segments plus exact dense tokens,
// one self-normalised softmax per query head.
//
// Work units are (request, KV head, group of <= 16 query heads, segment or dense chunk).  Each
// unit reads every K/V row it needs once for all of its query heads and leaves a partial
// (max, sum, acc) per head; partials are merged by log-sum-exp at the end.  This keeps batch-1
// decodes parallel and makes the cost follow the bucket entries walked, not the context length.
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>

#include "common.h"

namespace mp {

// Optional phase timers (ns summed over threads) for the benchmark's breakdown.
std::atomic<bool> g_profile{false};
std::atomic<int64_t> g_prof[4];  // lookup, gather/logits, softmax/V, merge

namespace {

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}
struct PhaseTimer {  // adds the time since the last tick to phase i when profiling is on
  bool on = g_profile.load(std::memory_order_relaxed);
  int64_t t = on ? now_ns() : 0;
  void tick(int i) {
    if (!on) return;
    const int64_t n = now_ns();
    g_prof[i].fetch_add(n - t, std::memory_order_relaxed);
    t = n;
  }
};

constexpr int MAXG = 16;        // query heads per unit: head masks fit a uint16
constexpr int DCHUNK = 256;     // dense tokens per unit
constexpr int NT = 8192;        // intervals of the -log(u + 1e-4) table over theta in [0, pi]
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr double PI = 3.14159265358979323846;

// u = P(Binomial(L, p^K) >= 2) written without the 1 - (1-P1)^L - ... cancellation blow-up.
inline double sample_prob(double cs, int K, int L) {
  const double th = std::acos(std::min(1.0, std::max(-1.0, cs)));
  const double p = 1.0 - th / PI, P1 = std::pow(p, K);
  const double u = 1.0 - std::pow(1.0 - P1, L - 1) * (1.0 + (L - 1) * P1);
  return std::max(0.0, u);
}

// The fast path interpolates -log(u + 1e-4) in theta (smooth there, unlike in cos near +-1);
// with 8192 intervals the interpolation error is ~1e-5 in the logit for the K, L in use.
const float* corr_table(int K, int L) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::vector<float>> cache;
  std::lock_guard<std::mutex> g(mu);
  auto& t = cache[{K, L}];
  if (t.empty()) {
    t.resize(NT + 2);
    for (int i = 0; i <= NT; ++i) {
      const double th = PI * i / NT, p = 1.0 - th / PI, P1 = std::pow(p, K);
      const double u = std::max(0.0, 1.0 - std::pow(1.0 - P1, L - 1) * (1.0 + (L - 1) * P1));
      t[i] = static_cast<float>(-std::log(u + 1e-4));
    }
    t[NT + 1] = t[NT];  // lets the gather of i0 + 1 stay in bounds
  }
  return t.data();
}

struct Unit {
  int r, kvh, h0, G;
  const Segment* seg;  // null: dense tokens [a, b)
  int a, b;
};

// The rows one unit attends to, all in row-major [d] layout of the cache dtype.
struct Rows {
  const uint16_t* kb;
  const uint16_t* vb;
  const uint16_t* idx;   // row i is kb + idx[i]*d (segment) or kb + i*d (dense tile)
  const uint16_t* mask;  // per row: bit g = query head g attends this row
  const float* knorm;    // segment only: |k - c| by token id
  int n;
  bool seg;
  const uint16_t* row(const uint16_t* base, int i, int d) const {
    return base + static_cast<size_t>(idx ? idx[i] : i) * d;
  }
};

struct Heads {
  int G;
  const float* q[MAXG];
  float qn[MAXG], qdc[MAXG];
  const uint16_t* qbf;  // [G][d] bf16 copy of q (avx512bf16 path)
};

// Result of one unit for its G heads.
struct Out {
  float* m;
  float* l;
  float* acc;  // [G][d]
};

// Per-thread scratch, kept across calls so retrieval never clears O(n) memory per step.
struct Scratch {
  // cell[id*G + g]: (epoch << 2) | collisions(0..2) of token id for head g.
  std::vector<uint16_t> cell;
  // sel[id]: (epoch << 16) | mask of heads that sampled id; lets us build the union list once.
  std::vector<uint32_t> sel;
  uint32_t epoch = 0;
  int cap_g = 0;
  std::vector<uint16_t> list, tmp, rmask, ktile, vtile, qbf;
  std::vector<float> s, buf;
  std::vector<int> rb, re;
};
thread_local Scratch tls;

void radix_sort_u16(std::vector<uint16_t>& v, std::vector<uint16_t>& tmp) {
  if (v.size() < 64) { std::sort(v.begin(), v.end()); return; }
  tmp.resize(v.size());
  for (int shift = 0; shift < 16; shift += 8) {
    uint32_t cnt[257] = {0};
    for (uint16_t x : v) ++cnt[((x >> shift) & 0xff) + 1];
    for (int b = 0; b < 256; ++b) cnt[b + 1] += cnt[b];
    for (uint16_t x : v) tmp[cnt[(x >> shift) & 0xff]++] = x;
    v.swap(tmp);
  }
}

// Collects the union over the unit's heads of the keys with >= 2 table collisions.
void retrieve(const AttnArgs& a, const Unit& u, Scratch& S, int64_t* cnt) {
  const Segment& seg = *u.seg;
  const int n = seg.n, G = u.G, L = a.L;
  if (static_cast<int>(S.sel.size()) < n || S.cap_g != G) {
    S.cap_g = G;
    S.sel.assign(std::max<size_t>(S.sel.size(), n), 0);
    S.cell.assign(S.sel.size() * G, 0);
    S.epoch = 0;
  }
  S.epoch = (S.epoch + 1) & 0x3fff;  // 14 bits so it fits beside the count in a uint16 cell
  if (S.epoch == 0) {
    std::fill(S.sel.begin(), S.sel.end(), 0u);
    std::fill(S.cell.begin(), S.cell.end(), 0);
    S.epoch = 1;
  }
  const uint32_t ep = S.epoch;
  S.list.clear();
  S.rmask.clear();
  uint16_t* cell = S.cell.data();
  uint32_t* sel = S.sel.data();
  // The index is far larger than the caches, so each (table, head) bucket costs two DRAM misses
  // (offset, then ids).  Resolve all bucket ranges first with prefetches in flight, so the misses
  // overlap instead of serialising inside the walk.
  const int nb = L * G;
  S.rb.resize(nb);
  S.re.resize(nb);
  const int32_t* qc = a.qcodes + (static_cast<size_t>(u.r) * a.H + u.h0) * L;
  if (seg.dense_dir)
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < G; ++g)
        __builtin_prefetch((seg.off.data() + static_cast<size_t>(u.kvh * L + l) * ((1u << seg.K) + 1) +
                                                   qc[static_cast<size_t>(g) * L + l]));
  for (int l = 0; l < L; ++l) {
    const int t = u.kvh * L + l;
    for (int g = 0; g < G; ++g) {
      int b, e;
      seg.bucket(t, static_cast<uint32_t>(qc[static_cast<size_t>(g) * L + l]), b, e);
      S.rb[l * G + g] = b;
      S.re[l * G + g] = e;
      const uint16_t* p = seg.ids.data() + static_cast<size_t>(t) * n + b;
      for (int k = 0; k < e - b; k += 32) __builtin_prefetch(p + k);
    }
  }
  for (int l = 0; l < L; ++l) {
    const int t = u.kvh * L + l;
    const uint16_t* ids = seg.ids.data() + static_cast<size_t>(t) * n;
    for (int g = 0; g < G; ++g) {
      const int b = S.rb[l * G + g], e = S.re[l * G + g];
      for (int i = b; i < e; ++i) {
        const uint32_t id = ids[i];
        uint16_t& c = cell[id * G + g];
        // Branch-free count update (the first/second-hit branch is a coin flip): a stale epoch
        // restarts at 1, otherwise count up, saturating at 3 so it never spills into the epoch.
        const uint32_t cv = c;
        const uint32_t nv = ((cv >> 2) == ep) ? cv + ((cv & 3) != 3) : (ep << 2 | 1);
        c = static_cast<uint16_t>(nv);
        if ((nv & 3) == 2 && (cv & 3) == 1 && (cv >> 2) == ep) {
          ++cnt[g];
          uint32_t& m = sel[id];
          if ((m >> 16) != ep) {
            m = ep << 16 | (1u << g);
            S.list.push_back(static_cast<uint16_t>(id));
          } else {
            m |= 1u << g;
          }
        }
      }
    }
  }
  // Ascending ids turn the row gathers into forward strides the prefetcher follows; a two-pass
  // byte radix sort keeps this linear in the sample size.
  radix_sort_u16(S.list, S.tmp);
  S.rmask.resize(S.list.size());
  for (size_t i = 0; i < S.list.size(); ++i) S.rmask[i] = static_cast<uint16_t>(sel[S.list[i]] & 0xffff);
}

// Copies dense tokens [a, b) out of the strided paged cache into row-major tiles.
void gather_dense(const AttnArgs& a, const Unit& u, Scratch& S) {
  const int d = a.d, nr = u.b - u.a;
  S.ktile.resize(static_cast<size_t>(nr) * d);
  S.vtile.resize(static_cast<size_t>(nr) * d);
  for (int i = 0; i < nr; ++i) {
    const int p = u.a + i;
    const int64_t blk = a.block_table[static_cast<size_t>(u.r) * a.max_blocks + p / a.block_size];
    const int64_t off = p % a.block_size;
    const uint16_t* kr = a.kc + blk * a.ks[0] + off * a.ks[1] + u.kvh * a.ks[2];
    const uint16_t* vr = a.vc + blk * a.vs[0] + off * a.vs[1] + u.kvh * a.vs[2];
    uint16_t* kt = S.ktile.data() + static_cast<size_t>(i) * d;
    uint16_t* vt = S.vtile.data() + static_cast<size_t>(i) * d;
    if (a.ks[3] == 1) std::memcpy(kt, kr, d * 2);
    else for (int j = 0; j < d; ++j) kt[j] = kr[j * a.ks[3]];
    if (a.vs[3] == 1) std::memcpy(vt, vr, d * 2);
    else for (int j = 0; j < d; ++j) vt[j] = vr[j * a.vs[3]];
  }
}

// ------------------------------------------------------------------ scalar path
void compute_scalar(const AttnArgs& a, const Rows& R, const Heads& Q, Scratch& S, Out o) {
  const int d = a.d, G = Q.G, n = R.n;
  S.s.resize(static_cast<size_t>(G) * n);
  S.buf.resize(d);
  float* kf = S.buf.data();
  for (int i = 0; i < n; ++i) {
    const uint16_t* kr = R.row(R.kb, i, d);
    for (int j = 0; j < d; ++j) kf[j] = to_f(kr[j], a.dtype);
    for (int g = 0; g < G; ++g) {
      float& s = S.s[static_cast<size_t>(g) * n + i];
      if (!((R.mask[i] >> g) & 1)) { s = NEG_INF; continue; }
      float qk = 0.f;
      for (int j = 0; j < d; ++j) qk += Q.q[g][j] * kf[j];
      s = a.scale * qk;
      if (R.seg) {
        const double den = static_cast<double>(Q.qn[g]) * R.knorm[R.idx[i]];
        // Centred key at the centre (or q = 0): no direction, so treat it as orthogonal.
        const double cs = den > 1e-30 ? (static_cast<double>(qk) - Q.qdc[g]) / den : 0.0;
        s -= static_cast<float>(std::log(sample_prob(cs, a.K, a.L) + 1e-4));
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* s = S.s.data() + static_cast<size_t>(g) * n;
    float m = NEG_INF, l = 0.f;
    for (int i = 0; i < n; ++i) m = std::max(m, s[i]);
    if (m != NEG_INF)
      for (int i = 0; i < n; ++i) { s[i] = std::exp(s[i] - m); l += s[i]; }
    o.m[g] = m;
    o.l[g] = l;
  }
  std::fill(o.acc, o.acc + static_cast<size_t>(G) * d, 0.f);
  for (int i = 0; i < n; ++i) {
    const uint16_t* vr = R.row(R.vb, i, d);
    for (int j = 0; j < d; ++j) kf[j] = to_f(vr[j], a.dtype);
    for (int g = 0; g < G; ++g) {
      if (!((R.mask[i] >> g) & 1)) continue;
      const float p = S.s[static_cast<size_t>(g) * n + i];
      float* acc = o.acc + static_cast<size_t>(g) * d;
      for (int j = 0; j < d; ++j) acc[j] += p * kf[j];
    }
  }
}

// ------------------------------------------------------------------ AVX-512 path
#if defined(__x86_64__)
#define MP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define MP_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")))

MP_AVX512 inline __m512 load16(const uint16_t* p, int dtype) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if (dtype == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// e^x for x <= 0 (softmax weights); -inf and very negative inputs give 0.
MP_AVX512 inline __m512 exp_neg(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.f / 720);  // Taylor of e^f, |f| <= ln2/2: rel. error ~1e-7
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, k));
}

// acos on [-1, 1] (Abramowitz & Stegun 4.4.46, |error| <= 2e-8 rad).
MP_AVX512 inline __m512 acos_ps(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  __m512 p = _mm512_set1_ps(-0.0012624911f);
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(0.0066700901f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(-0.0170881256f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(0.0308918810f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(-0.0501743046f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(0.0889789874f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(-0.2145988016f));
  p = _mm512_fmadd_ps(p, ax, _mm512_set1_ps(1.5707963050f));
  const __m512 r = _mm512_mul_ps(_mm512_sqrt_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), ax),
                                                              _mm512_setzero_ps())), p);
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_sub_ps(r, neg, _mm512_set1_ps(static_cast<float>(PI)), r);
}

inline void prefetch_row(const uint16_t* p, int d) {
  for (int j = 0; j < d; j += 32) __builtin_prefetch(p + j);
}

MP_AVX512 inline float dot_f32(const float* q, const float* k, int d) {
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(k + j), acc);
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

// q.k for every (row, head) pair the mask asks for; other entries become -inf.
MP_AVX512 void qk_avx512(const AttnArgs& a, const Rows& R, const Heads& Q, Scratch& S) {
  const int d = a.d, G = Q.G, n = R.n;
  float* kf = S.buf.data();
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(R.row(R.kb, i + 8, d), d);
    const uint16_t* kr = R.row(R.kb, i, d);
    for (int j = 0; j < d; j += 16) _mm512_storeu_ps(kf + j, load16(kr + j, a.dtype));
    for (int g = 0; g < G; ++g)
      S.s[static_cast<size_t>(g) * n + i] = ((R.mask[i] >> g) & 1) ? dot_f32(Q.q[g], kf, d) : NEG_INF;
  }
}

MP_AVX512BF16 void qk_avx512bf16(const AttnArgs& a, const Rows& R, const Heads& Q, Scratch& S) {
  const int d = a.d, G = Q.G, n = R.n;
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(R.row(R.kb, i + 8, d), d);
    const uint16_t* kr = R.row(R.kb, i, d);
    for (int g = 0; g < G; ++g)
      S.s[static_cast<size_t>(g) * n + i] =
          ((R.mask[i] >> g) & 1) ? dot_bf16(Q.qbf + static_cast<size_t>(g) * d, kr, d) : NEG_INF;
  }
}

MP_AVX512 void compute_avx512(const AttnArgs& a, const Rows& R, const Heads& Q, Scratch& S, Out o,
                              bool use_bf16_dot, const float* tab) {
  const int d = a.d, G = Q.G, n = R.n;
  S.s.resize(static_cast<size_t>(G) * n + 16);
  S.buf.resize(d);
  PhaseTimer pt;
  if (use_bf16_dot) qk_avx512bf16(a, R, Q, S); else qk_avx512(a, R, Q, S);

  // Logits: scale*q.k, minus log(u + 1e-4) for sampled keys, 16 rows at a time per head.
  const __m512 vscale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(NEG_INF);
  const __m512 tscale = _mm512_set1_ps(static_cast<float>(NT / PI));
  for (int g = 0; g < G; ++g) {
    float* s = S.s.data() + static_cast<size_t>(g) * n;
    const __m512 qn = _mm512_set1_ps(Q.qn[g]), qdc = _mm512_set1_ps(Q.qdc[g]);
    __m512 vmax = ninf;
    for (int i = 0; i < n; i += 16) {
      const __mmask16 live = (n - i >= 16) ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m512i msk = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, R.mask + i));
      const __mmask16 on = _mm512_test_epi32_mask(msk, _mm512_set1_epi32(1 << g)) & live;
      const __m512 qk = _mm512_maskz_loadu_ps(on, s + i);
      __m512 v = _mm512_mul_ps(qk, vscale);
      if (R.seg) {
        const __m512i id = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, R.idx + i));
        const __m512 kn = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, id, R.knorm, 4);
        const __m512 den = _mm512_mul_ps(qn, kn);
        const __mmask16 ok = _mm512_cmp_ps_mask(den, _mm512_set1_ps(1e-30f), _CMP_GT_OQ) & on;
        __m512 cs = _mm512_maskz_div_ps(ok, _mm512_sub_ps(qk, qdc), den);
        cs = _mm512_min_ps(_mm512_max_ps(cs, _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
        const __m512 x = _mm512_mul_ps(acos_ps(cs), tscale);
        __m512i i0 = _mm512_cvttps_epi32(x);
        i0 = _mm512_min_epi32(_mm512_max_epi32(i0, _mm512_setzero_si512()), _mm512_set1_epi32(NT - 1));
        const __m512 fr = _mm512_sub_ps(x, _mm512_cvtepi32_ps(i0));
        const __m512 f0 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, i0, tab, 4);
        const __m512 f1 = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on,
                                                   _mm512_add_epi32(i0, _mm512_set1_epi32(1)), tab, 4);
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
        const __mmask16 live = (n - i >= 16) ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m512 p = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + i), vm));
        const __m512 pl = _mm512_maskz_mov_ps(live, p);
        _mm512_mask_storeu_ps(s + i, live, pl);
        vl = _mm512_add_ps(vl, pl);
      }
      l = _mm512_reduce_add_ps(vl);
    }
    o.m[g] = m;
    o.l[g] = l;
  }
  pt.tick(1);

  // acc[g] += p[g][i] * v_i, each V row converted once for all heads.
  std::fill(o.acc, o.acc + static_cast<size_t>(G) * d, 0.f);
  float* vf = S.buf.data();
  for (int i = 0; i < n; ++i) {
    if (i + 8 < n) prefetch_row(R.row(R.vb, i + 8, d), d);
    const uint16_t* vr = R.row(R.vb, i, d);
    for (int j = 0; j < d; j += 16) _mm512_storeu_ps(vf + j, load16(vr + j, a.dtype));
    for (int g = 0; g < G; ++g) {
      const float p = S.s[static_cast<size_t>(g) * n + i];
      if (p == 0.f) continue;
      const __m512 vp = _mm512_set1_ps(p);
      float* acc = o.acc + static_cast<size_t>(g) * d;
      for (int j = 0; j < d; j += 16)
        _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(vp, _mm512_loadu_ps(vf + j), _mm512_loadu_ps(acc + j)));
    }
  }
  pt.tick(2);
}
#endif

}  // namespace

void sparse_decode(const AttnArgs& a) {
  const int gsz = a.H / a.hkv, nchunk = (gsz + MAXG - 1) / MAXG;
  const bool fast = !a.force_scalar && cpu_has_avx512();
  const bool bf16_dot = fast && a.q_is_bf16 && a.dtype == BF16 && cpu_has_avx512bf16();
  const float* tab = fast ? corr_table(a.K, a.L) : nullptr;

  // Units grouped per (request, KV head, head chunk) so each group's partials are contiguous.
  std::vector<Unit> units;
  std::vector<int> first;  // first[(r*hkv + kvh)*nchunk + c] .. first[... + 1]
  for (int r = 0; r < a.R; ++r)
    for (int kvh = 0; kvh < a.hkv; ++kvh)
      for (int c = 0; c < nchunk; ++c) {
        first.push_back(static_cast<int>(units.size()));
        const int h0 = kvh * gsz + c * MAXG, G = std::min(MAXG, gsz - c * MAXG);
        for (const auto& sp : (*a.segs)[r]) units.push_back({r, kvh, h0, G, sp.get(), 0, 0});
        for (int k = 0; k < 2; ++k) {
          const int lo = a.ranges[r * 4 + k * 2], hi = a.ranges[r * 4 + k * 2 + 1];
          for (int p = lo; p < hi; p += DCHUNK) units.push_back({r, kvh, h0, G, nullptr, p, std::min(hi, p + DCHUNK)});
        }
      }
  first.push_back(static_cast<int>(units.size()));
  const int nu = static_cast<int>(units.size());

  // Largest units first so the dynamic schedule balances well.
  std::vector<int> order(nu);
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int i) { return units[i].seg ? units[i].seg->n / 8 : units[i].b - units[i].a; };
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return cost(x) > cost(y); });

  std::vector<float> pm(static_cast<size_t>(nu) * MAXG), pl(pm.size());
  std::vector<float> pacc(pm.size() * a.d);
  std::vector<int64_t> pcnt(pm.size(), 0);

#pragma omp parallel for schedule(dynamic, 1)
  for (int oi = 0; oi < nu; ++oi) {
    const int ui = order[oi];
    const Unit& u = units[ui];
    Scratch& S = tls;
    Heads Q;
    Q.G = u.G;
    for (int g = 0; g < u.G; ++g) {
      const size_t h = static_cast<size_t>(u.r) * a.H + u.h0 + g;
      Q.q[g] = a.q + h * a.d;
      double ss = 0;
      for (int j = 0; j < a.d; ++j) ss += static_cast<double>(Q.q[g][j]) * Q.q[g][j];
      Q.qn[g] = static_cast<float>(std::sqrt(ss));
      Q.qdc[g] = a.qdc[h];
    }
    if (bf16_dot) {  // q is exactly bf16: keep its raw bits for dpbf16
      S.qbf.resize(static_cast<size_t>(u.G) * a.d);
      for (int g = 0; g < u.G; ++g)
        for (int j = 0; j < a.d; ++j) {
          uint32_t bits;
          std::memcpy(&bits, &Q.q[g][j], 4);
          S.qbf[static_cast<size_t>(g) * a.d + j] = static_cast<uint16_t>(bits >> 16);
        }
      Q.qbf = S.qbf.data();
    }
    Rows R{};
    PhaseTimer pt;
    if (u.seg) {
      retrieve(a, u, S, pcnt.data() + static_cast<size_t>(ui) * MAXG);
      const size_t base = static_cast<size_t>(u.kvh) * u.seg->n;
      R = {u.seg->kmir.data() + base * a.d, u.seg->vmir.data() + base * a.d, S.list.data(), S.rmask.data(),
           u.seg->knorm.data() + base, static_cast<int>(S.list.size()), true};
    } else {
      gather_dense(a, u, S);
      S.rmask.assign(u.b - u.a, static_cast<uint16_t>((1u << u.G) - 1));
      R = {S.ktile.data(), S.vtile.data(), nullptr, S.rmask.data(), nullptr, u.b - u.a, false};
    }
    pt.tick(u.seg ? 0 : 1);
    const size_t o0 = static_cast<size_t>(ui) * MAXG;
    Out o{pm.data() + o0, pl.data() + o0, pacc.data() + o0 * a.d};
#if defined(__x86_64__)
    if (fast) { compute_avx512(a, R, Q, S, o, bf16_dot, tab); continue; }
#endif
    compute_scalar(a, R, Q, S, o);
  }

  // LSE merge of the partials of each query head.
  PhaseTimer pt;
#pragma omp parallel for
  for (int rh = 0; rh < a.R * a.H; ++rh) {
    const int r = rh / a.H, h = rh % a.H, kvh = h / gsz, c = (h % gsz) / MAXG, g = (h % gsz) % MAXG;
    const int grp = (r * a.hkv + kvh) * nchunk + c;
    float M = NEG_INF;
    int64_t cnt = 0;
    for (int ui = first[grp]; ui < first[grp + 1]; ++ui) {
      const size_t k = static_cast<size_t>(ui) * MAXG + g;
      if (pl[k] > 0.f) M = std::max(M, pm[k]);
      cnt += pcnt[k];
    }
    float* out = a.out + static_cast<size_t>(rh) * a.d;
    std::fill(out, out + a.d, 0.f);
    double sum = 0;
    if (M != NEG_INF) {
      for (int ui = first[grp]; ui < first[grp + 1]; ++ui) {
        const size_t k = static_cast<size_t>(ui) * MAXG + g;
        if (!(pl[k] > 0.f)) continue;
        const float w = std::exp(pm[k] - M);
        sum += static_cast<double>(w) * pl[k];
        const float* acc = pacc.data() + k * a.d;
        for (int j = 0; j < a.d; ++j) out[j] += w * acc[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int j = 0; j < a.d; ++j) out[j] *= inv;
    }
    if (a.lse) a.lse[rh] = M == NEG_INF ? NEG_INF : M + static_cast<float>(std::log(sum));
    if (a.counts) a.counts[rh] = cnt;
  }
  pt.tick(3);
}

}  // namespace mp
