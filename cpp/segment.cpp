// Segment build (centre, hash, bucket sort), build from precomputed codes, and merge.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common.h"

namespace mp {

void recover_codes(const Segment& s, int t, uint16_t* codes) {
  const uint16_t* ids = s.table_ids(t);
  if (s.dense_dir) {
    const uint16_t* o = s.dense_offsets(t);
    for (uint32_t c = 0; c < (1u << s.K); ++c)
      for (int i = o[c]; i < o[c + 1]; ++i) codes[ids[i]] = static_cast<uint16_t>(c);
    return;
  }
  for (uint32_t j = s.dir_begin[t]; j < s.dir_begin[t + 1]; ++j) {
    const int e = (j + 1 < s.dir_begin[t + 1]) ? s.ustart[j + 1] : s.n;
    for (int i = s.ustart[j]; i < e; ++i) codes[ids[i]] = s.ucode[j];
  }
}

// A compact bucket directory while it is written: per table, its distinct codes and their starts.
struct CompactDir {
  std::vector<std::vector<uint16_t>> codes, starts;
};

// Sizes the CSR of s (s.n tokens) for sort_tables / merge_tables, which write every id and every
// bucket start, and picks its directory form (dense_directory_pays).
static CompactDir size_tables(Segment& s) {
  const size_t T = static_cast<size_t>(s.hkv) * s.L;
  const uint32_t B = 1u << s.K;
  s.ids.resize(T * s.n);
  s.dense_dir = dense_directory_pays(s.n, s.K);
  CompactDir dir;
  if (s.dense_dir) {
    s.off.resize(T * (B + 1));
  } else {
    dir.codes.resize(T);
    dir.starts.resize(T);
  }
  return dir;
}

// Concatenates the per-table compact directories into s (nothing to do for a dense one).
static void finish_compact_dir(Segment& s, const CompactDir& dir) {
  if (s.dense_dir) return;
  const int T = s.hkv * s.L;
  s.dir_begin.assign(T + 1, 0);
  for (int t = 0; t < T; ++t) s.dir_begin[t + 1] = s.dir_begin[t] + static_cast<uint32_t>(dir.codes[t].size());
  s.ucode.reserve(s.dir_begin[T]);
  s.ustart.reserve(s.dir_begin[T]);
  for (int t = 0; t < T; ++t) {
    s.ucode.insert(s.ucode.end(), dir.codes[t].begin(), dir.codes[t].end());
    s.ustart.insert(s.ustart.end(), dir.starts[t].begin(), dir.starts[t].end());
  }
}

// Stable counting sort of every (KV head, table) row of codes [hkv*L][n] into the CSR index.
// Stability keeps ids ascending inside a bucket, which is what makes merge == concatenation.
static void sort_tables(Segment& s, const uint16_t* codes, int nt) {
  const int T = s.hkv * s.L, n = s.n;
  const uint32_t B = 1u << s.K;
  CompactDir dir = size_tables(s);
  auto& uc = dir.codes;
  auto& us = dir.starts;
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint32_t> cnt(B + 1);
#pragma omp for schedule(dynamic)
    for (int t = 0; t < T; ++t) {
      const uint16_t* c = codes + static_cast<size_t>(t) * n;
      std::fill(cnt.begin(), cnt.end(), 0u);
      for (int i = 0; i < n; ++i) ++cnt[c[i] + 1];
      if (!s.dense_dir)
        for (uint32_t b = 0; b < B; ++b)
          if (cnt[b + 1]) uc[t].push_back(static_cast<uint16_t>(b));
      for (uint32_t b = 0; b < B; ++b) cnt[b + 1] += cnt[b];  // cnt[b] = start of bucket b
      if (s.dense_dir) {
        uint16_t* o = s.off.data() + static_cast<size_t>(t) * (B + 1);
        for (uint32_t b = 0; b <= B; ++b) o[b] = static_cast<uint16_t>(cnt[b]);
      } else {
        for (uint16_t b : uc[t]) us[t].push_back(static_cast<uint16_t>(cnt[b]));
      }
      uint16_t* ids = s.ids.data() + static_cast<size_t>(t) * n;
      for (int i = 0; i < n; ++i) ids[cnt[c[i]]++] = static_cast<uint16_t>(i);
    }
  }
  finish_compact_dir(s, dir);
}

namespace {

// A segment of n tokens with its mirror and norms sized; sort_tables fills the index.
std::shared_ptr<Segment> new_segment(int n, int hkv, int d, int dtype, int K, int L, int mirror) {
  auto sp = std::make_shared<Segment>();
  Segment& s = *sp;
  s.n = n;
  s.hkv = hkv;
  s.d = d;
  s.K = K;
  s.L = L;
  s.dtype = dtype;
  s.mirror = mirror;
  if (mirror == kMirrorInt8) {
    s.kv8.resize(static_cast<size_t>(hkv) * n * int8_row_bytes(d));
  } else {
    s.kv.resize(static_cast<size_t>(hkv) * n * 2 * d);
    s.knorm.resize(static_cast<size_t>(hkv) * n);
  }
  return sp;
}

// mirror_block for an int8 mirror: each K and V row quantized (quantize_int8), and |k - c| taken
// over the dequantized key, so the kernel's estimator over these rows is exactly its estimator over
// the keys and values they stand for.  The centred keys left for hashing are the cache's own, so a
// key's codes, and so which keys are sampled, do not depend on the mirror.
template <bool kKeepCentred>
void mirror_block_int8(Segment& s, const uint16_t* keys, const uint16_t* values, const float* c, int h, int t0, int T,
                       float* x) {
  const int n = s.n, hkv = s.hkv, d = s.d, dtype = s.dtype;
  const size_t rb = int8_row_bytes(d);
  std::vector<float> row(d);
  for (int t = 0; t < T; ++t) {
    const size_t i = t0 + t, src = (i * hkv + h) * d;
    int8_t* dst = s.kv8.data() + (h * static_cast<size_t>(n) + i) * rb;
    for (int j = 0; j < d; ++j) row[j] = to_f(keys[src + j], dtype);
    if (kKeepCentred)
      for (int j = 0; j < d; ++j) x[static_cast<size_t>(t) * d + j] = row[j] - c[j];
    const float ks = quantize_int8(row.data(), d, dst + kInt8KeyOffset);
    double ss = 0;
    for (int j = 0; j < d; ++j) {
      const float v = ks * static_cast<float>(dst[kInt8KeyOffset + j]) - c[j];
      ss += static_cast<double>(v) * v;
    }
    const float kn = static_cast<float>(std::sqrt(ss));
    std::memcpy(dst, &kn, 4);
    std::memcpy(dst + 4, &ks, 4);
    for (int j = 0; j < d; ++j) row[j] = to_f(values[src + j], dtype);
    const int vo = int8_value_offset(d);
    const float vs = quantize_int8(row.data(), d, dst + vo + 4);
    std::memcpy(dst + vo, &vs, 4);
  }
}

// Copies tokens [t0, t0 + T) of KV head h of keys/values [n][hkv][d] into the head-major mirror
// and writes their centred-key norms |k - c| (fp32, summed in double).  kKeepCentred also leaves
// the centred keys k - c in x [T][d] (fp32), for hashing.  Both builds go through here, so their
// mirrors and norms are the same bits.
template <bool kKeepCentred>
void mirror_block(Segment& s, const uint16_t* keys, const uint16_t* values, const float* centre, int h, int t0, int T,
                  float* x) {
  const int n = s.n, hkv = s.hkv, d = s.d, dtype = s.dtype;
  const float* c = centre + static_cast<size_t>(h) * d;
  if (s.mirror == kMirrorInt8) {
    mirror_block_int8<kKeepCentred>(s, keys, values, c, h, t0, T, x);
    return;
  }
  for (int t = 0; t < T; ++t) {
    const size_t i = t0 + t, src = (i * hkv + h) * d, dst = (h * static_cast<size_t>(n) + i) * 2 * d;
    std::memcpy(&s.kv[dst], keys + src, d * 2);
    std::memcpy(&s.kv[dst + d], values + src, d * 2);
    double ss = 0;
    for (int j = 0; j < d; ++j) {
      const float v = to_f(keys[src + j], dtype) - c[j];
      if (kKeepCentred) x[static_cast<size_t>(t) * d + j] = v;
      ss += static_cast<double>(v) * v;
    }
    s.knorm[h * static_cast<size_t>(n) + i] = static_cast<float>(std::sqrt(ss));
  }
}

constexpr int kMirrorBlock = 64;  // tokens per job of the mirror (and hash) loop

}  // namespace

std::shared_ptr<Segment> build_segment(const uint16_t* keys, const uint16_t* values, int n, int hkv, int d, int dtype,
                                       const float* centre, const float* w, int K, int L, bool force_scalar,
                                       int num_threads, int mirror) {
  const int nt = team_size(num_threads);
  auto sp = new_segment(n, hkv, d, dtype, K, L, mirror);
  Segment& s = *sp;
  std::vector<uint16_t> codes(static_cast<size_t>(hkv) * L * n);
  const int TB = kMirrorBlock, nblk = (n + TB - 1) / TB;
  std::unique_ptr<Bf16KeyHasher> pairs;  // kBf16Pairs, kAmxTiles: hash the keys as the cache holds them
  const KeyHash method = key_hash_for(dtype, w, d, K, L);
  if (method != KeyHash::kCentredFp32)
    pairs = std::make_unique<Bf16KeyHasher>(w, d, K, L, centre, hkv, force_scalar, method == KeyHash::kAmxTiles);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> x(pairs ? 0 : static_cast<size_t>(TB) * d);
    std::vector<uint16_t> cb(static_cast<size_t>(TB) * L);
#pragma omp for schedule(dynamic)
    for (int job = 0; job < hkv * nblk; ++job) {
      const int h = job / nblk, t0 = (job % nblk) * TB, T = std::min(TB, n - t0);
      if (pairs) {
        mirror_block<false>(s, keys, values, centre, h, t0, T, nullptr);
        pairs->hash(keys + (static_cast<size_t>(t0) * hkv + h) * d, static_cast<size_t>(hkv) * d, T, h, cb.data());
      } else {
        mirror_block<true>(s, keys, values, centre, h, t0, T, x.data());
        hash_rows(x.data(), T, d, w, K, L, cb.data(), force_scalar);
      }
      for (int l = 0; l < L; ++l) {  // table-major: each table's T codes land in one run
        uint16_t* dst = codes.data() + (static_cast<size_t>(h) * L + l) * n + t0;
        for (int t = 0; t < T; ++t) dst[t] = cb[static_cast<size_t>(t) * L + l];
      }
    }
  }
  sort_tables(s, codes.data(), nt);
  return sp;
}

std::shared_ptr<Segment> build_segment_from_codes(const uint16_t* keys, const uint16_t* values, int n, int hkv, int d,
                                                  int dtype, const float* centre, const void* codes, int code_bytes,
                                                  int K, int L, int num_threads, int mirror) {
  if (code_bytes != 2 && code_bytes != 4)
    throw std::invalid_argument("build_segment_from_codes: code_bytes must be 2 (uint16) or 4 (int32), got " +
                                std::to_string(code_bytes));
  const int nt = team_size(num_threads), T = hkv * L;
  const uint32_t B = 1u << K;
  // sort_tables indexes a 2^K counter array by code, so every code is checked here (fused with the
  // int32 -> uint16 narrowing, which needs the pass anyway); uint16 codes are sorted in place.
  const uint16_t* c16 = static_cast<const uint16_t*>(codes);
  std::vector<uint16_t> narrowed;
  int bad = 0;
  if (code_bytes == 4) {
    narrowed.resize(static_cast<size_t>(T) * n);
    const int32_t* c32 = static_cast<const int32_t*>(codes);
#pragma omp parallel for schedule(static) num_threads(nt) reduction(| : bad)
    for (int t = 0; t < T; ++t)
      for (size_t i = static_cast<size_t>(t) * n, e = i + n; i < e; ++i) {
        const uint32_t v = static_cast<uint32_t>(c32[i]);  // a negative code wraps to >= 2^K
        bad |= v >= B;
        narrowed[i] = static_cast<uint16_t>(v);
      }
    c16 = narrowed.data();
  } else if (K < 16) {
#pragma omp parallel for schedule(static) num_threads(nt) reduction(| : bad)
    for (int t = 0; t < T; ++t)
      for (size_t i = static_cast<size_t>(t) * n, e = i + n; i < e; ++i) bad |= c16[i] >= B;
  }
  if (bad)
    throw std::invalid_argument("build_segment_from_codes: codes must lie in [0, 2^K=" + std::to_string(B) + ")");
  auto sp = new_segment(n, hkv, d, dtype, K, L, mirror);
  Segment& s = *sp;
  const int TB = kMirrorBlock, nblk = (n + TB - 1) / TB;
#pragma omp parallel for schedule(dynamic) num_threads(nt)
  for (int job = 0; job < hkv * nblk; ++job) {
    const int h = job / nblk, t0 = (job % nblk) * TB;
    mirror_block<false>(s, keys, values, centre, h, t0, std::min(TB, n - t0), nullptr);
  }
  sort_tables(s, c16, nt);
  return sp;
}

// The merged CSR straight from the parts' CSRs: bucket b of the merge is the parts' buckets b in
// order, their ids shifted by the part's first token (so ids stay ascending inside a bucket, as a
// stable sort of the concatenation leaves them). Each id is read and written once, in runs; a
// decode that grows a 16K-token segment by 512 tokens used to recover every code and re-sort them.
//
// Two parts into a dense output (B <= n: every decode growth of a segment past 1K tokens, [held
// segment, new tokens]) go through merge_two_into_dense instead: the bucket-major loop paid a few
// branches per (bucket, part), 460K of them for SmolLM2's 3 heads x 150 tables x 1024 buckets,
// whatever the token count, so growing a segment by 512 tokens cost ~7 ms before an id moved.
static void merge_two_into_dense(Segment& s, const Segment& a, const Segment& b, int nt);

static void merge_tables(Segment& s, const std::vector<SegmentPtr>& parts, int nt) {
  const int T = s.hkv * s.L, n = s.n, P = static_cast<int>(parts.size());
  const uint32_t B = 1u << s.K;
  CompactDir dir = size_tables(s);
  if (s.dense_dir && P == 2) {
    merge_two_into_dense(s, *parts[0], *parts[1], nt);
    return;
  }
  auto& uc = dir.codes;
  auto& us = dir.starts;
  bool any_dense = false;
  std::vector<int> base(P);
  for (int p = 0, o = 0; p < P; o += parts[p]->n, ++p) {
    base[p] = o;
    any_dense |= parts[p]->dense_dir;
  }
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint32_t> cur(P), end(P);  // compact parts: cursor into their distinct codes
#pragma omp for schedule(dynamic)
    for (int t = 0; t < T; ++t) {
      for (int p = 0; p < P; ++p)
        if (!parts[p]->dense_dir) cur[p] = parts[p]->dir_begin[t], end[p] = parts[p]->dir_begin[t + 1];
      uint16_t* out = s.ids.data() + static_cast<size_t>(t) * n;
      uint16_t* o = s.dense_dir ? s.off.data() + static_cast<size_t>(t) * (B + 1) : nullptr;
      int pos = 0;
      uint32_t filled = 0;  // dense output: bucket starts written below this code
      // Codes in ascending order: every code when a part is dense (then B <= its n, so this is
      // O(n)), else the union of the compact parts' distinct codes.
      uint32_t b = 0;
      while (true) {
        if (!any_dense) {
          b = B;
          for (int p = 0; p < P; ++p)
            if (cur[p] < end[p]) b = std::min<uint32_t>(b, parts[p]->ucode[cur[p]]);
        }
        if (b >= B) break;
        const int start = pos;
        for (int p = 0; p < P; ++p) {
          const Segment& q = *parts[p];
          int lo = 0, hi = 0;
          if (q.dense_dir) {
            const uint16_t* qo = q.dense_offsets(t);
            lo = qo[b], hi = qo[b + 1];
          } else if (cur[p] < end[p] && q.ucode[cur[p]] == b) {
            lo = q.ustart[cur[p]];
            hi = (cur[p] + 1 < end[p]) ? q.ustart[cur[p] + 1] : q.n;
            ++cur[p];
          }
          const uint16_t* in = q.table_ids(t);
          const uint16_t shift = static_cast<uint16_t>(base[p]);
          for (int i = lo; i < hi; ++i) out[pos++] = static_cast<uint16_t>(in[i] + shift);
        }
        if (o) {
          for (; filled <= b; ++filled) o[filled] = static_cast<uint16_t>(start);  // empty codes below b too
        } else if (pos > start) {
          uc[t].push_back(static_cast<uint16_t>(b));
          us[t].push_back(static_cast<uint16_t>(start));
        }
        if (any_dense) ++b;
      }
      if (o)
        for (; filled <= B; ++filled) o[filled] = static_cast<uint16_t>(pos);
    }
  }
  finish_compact_dir(s, dir);
}

// Bucket starts of table t of q in dense form: dense[b] = first id position of bucket b, dense[B] = q.n.
static const uint16_t* dense_starts(const Segment& q, int t, uint32_t B, uint16_t* scratch) {
  if (q.dense_dir) return q.dense_offsets(t);
  uint32_t b = 0;  // an empty bucket starts where the next non-empty one does (q.n past the last)
  for (uint32_t j = q.dir_begin[t]; j < q.dir_begin[t + 1]; ++j)
    for (const uint32_t code = q.ucode[j]; b <= code; ++b) scratch[b] = q.ustart[j];
  for (; b <= B; ++b) scratch[b] = static_cast<uint16_t>(q.n);
  return scratch;
}

// Per table, with sa / sb the parts' dense bucket starts: merged bucket c starts at sa[c] + sb[c].
// a's ids keep their values and move by sb[c], which is constant between two non-empty buckets
// of b, so they go in one block copy per non-empty bucket of b; b's runs follow, shifted by a.n.
static void merge_two_into_dense(Segment& s, const Segment& a, const Segment& b, int nt) {
  const int T = s.hkv * s.L, n = s.n;
  const uint32_t B = 1u << s.K;
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint16_t> scratch_a(B + 1), scratch_b(B + 1);
#pragma omp for schedule(dynamic)
    for (int t = 0; t < T; ++t) {
      const uint16_t* sa = dense_starts(a, t, B, scratch_a.data());
      const uint16_t* sb = dense_starts(b, t, B, scratch_b.data());
      uint16_t* o = s.off.data() + static_cast<size_t>(t) * (B + 1);
      for (uint32_t c = 0; c <= B; ++c) o[c] = static_cast<uint16_t>(sa[c] + sb[c]);  // <= n, which fits
      uint16_t* out = s.ids.data() + static_cast<size_t>(t) * n;
      const uint16_t* ia = a.table_ids(t);
      const uint16_t* ib = b.table_ids(t);
      const uint16_t shift = static_cast<uint16_t>(a.n);
      int done_a = 0;                    // a's ids copied so far (those of buckets below the current one)
      auto run_of_b = [&](uint32_t c) {  // a's ids of buckets (previous, c], then b's bucket c
        const int end_a = sa[c + 1];
        std::memcpy(out + done_a + sb[c], ia + done_a, static_cast<size_t>(end_a - done_a) * sizeof(uint16_t));
        done_a = end_a;
        uint16_t* dst = out + end_a + sb[c];
        for (int i = sb[c]; i < sb[c + 1]; ++i) *dst++ = static_cast<uint16_t>(ib[i] + shift);
      };
      if (b.dense_dir) {
        for (uint32_t c = 0; c < B; ++c)
          if (sb[c + 1] > sb[c]) run_of_b(c);
      } else {
        for (uint32_t j = b.dir_begin[t]; j < b.dir_begin[t + 1]; ++j) run_of_b(b.ucode[j]);
      }
      std::memcpy(out + done_a + b.n, ia + done_a, static_cast<size_t>(a.n - done_a) * sizeof(uint16_t));
    }
  }
}

std::shared_ptr<Segment> merge_segments(const std::vector<SegmentPtr>& parts, int num_threads) {
  const int nt = team_size(num_threads);
  if (parts.empty()) throw std::invalid_argument("merge_segments: no segments");
  const Segment& a = *parts[0];
  auto sp = std::make_shared<Segment>();
  Segment& s = *sp;
  s.hkv = a.hkv;
  s.d = a.d;
  s.K = a.K;
  s.L = a.L;
  s.dtype = a.dtype;
  s.mirror = a.mirror;
  for (auto& p : parts) {
    s.n += p->n;  // checked as it grows, so no number of parts can overflow it
    if (s.n > kMaxSegmentTokens)
      throw std::invalid_argument("merge_segments: merged segment exceeds " + std::to_string(kMaxSegmentTokens) +
                                  " tokens");
  }
  const int n = s.n, d = s.d, T = s.hkv * s.L;
  const bool i8 = s.mirror == kMirrorInt8;
  const size_t rb = int8_row_bytes(d);
  if (i8) {
    s.kv8.resize(static_cast<size_t>(s.hkv) * n * rb);
  } else {
    s.kv.resize(static_cast<size_t>(s.hkv) * n * 2 * d);
    s.knorm.resize(static_cast<size_t>(s.hkv) * n);
  }
  for (int h = 0; h < s.hkv; ++h) {
    size_t o = 0;
    for (auto& p : parts) {
      const size_t src = static_cast<size_t>(h) * p->n, dst = static_cast<size_t>(h) * n + o;
      if (i8) {
        std::copy_n(p->kv8.begin() + src * rb, static_cast<size_t>(p->n) * rb, s.kv8.begin() + dst * rb);
      } else {
        std::copy_n(p->kv.begin() + src * 2 * d, static_cast<size_t>(p->n) * 2 * d, s.kv.begin() + dst * 2 * d);
        std::copy_n(p->knorm.begin() + src, p->n, s.knorm.begin() + dst);
      }
      o += p->n;
    }
  }
  merge_tables(s, parts, nt);
  return sp;
}

}  // namespace mp
