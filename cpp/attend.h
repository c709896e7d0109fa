// Internal to sparse decode attention: what the driver (sparse_decode.cpp), retrieval and dense
// gather (retrieve.cpp) and the twin attention paths (attend_scalar.cpp, attend_avx2.cpp,
// attend_avx512.cpp) share.
//
// A unit is (request, KV head, group of <= MAXG query heads, one segment or one dense chunk).  It
// collects its rows (retrieve or gather_dense), then attends: q.k -> logits and softmax -> V
// accumulation, leaving a partial (max, sum, acc) per head that the driver merges by log-sum-exp.
// A dense chunk of a cache with column-major K gets its q.k from dense_scores_* instead of K rows.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace mp {

constexpr int MAXG = 16;     // query heads per unit: head masks fit a uint16
constexpr int DCHUNK = 256;  // dense tokens per unit
constexpr int NT = 8192;     // intervals of the -log(u + 1e-4) table over theta in [0, pi]
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr double PI = 3.14159265358979323846;

// acos on [-1, 1] as sqrt(1 - |x|) * poly(|x|), reflected for x < 0 (Abramowitz & Stegun 4.4.46,
// |error| <= 2e-8 rad).  Both attention paths evaluate this same polynomial (Horner, highest
// coefficient first) so their table positions differ only by FMA rounding.
constexpr int kAcosTerms = 8;
constexpr float kAcosCoef[kAcosTerms] = {-0.0012624911f, 0.0066700901f, -0.0170881256f, 0.0308918810f,
                                         -0.0501743046f, 0.0889789874f, -0.2145988016f, 1.5707963050f};
// e^x for x <= 0 as 2^k * e^f, k = round(x / ln2), |f| <= ln2/2, e^f by its Taylor polynomial
// (relative error ~1e-7), highest coefficient first; both paths evaluate it the same way.
constexpr int kExpTerms = 7;
constexpr float kExpCoef[kExpTerms] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.69314718055994531f;
// Weights e^x below e^-87 (under FLT_MIN) are flushed to exactly 0 by both paths, so both leave the
// same rows out of the V sums (attend_scalar skips them; the SIMD V passes add 0 * v, see row_weights
// in simd_math.h).
constexpr float kExpFloor = -87.f;
// A centred key at the centre (or q = 0) has no direction: below this |q||k - c| the key is
// treated as orthogonal (cos = 0).
constexpr float kMinNormProduct = 1e-30f;

// Query head h reads KV head h / gsz; the gsz query heads of one KV head go in chunks of <= chunk
// (<= MAXG, one bit each in a uint16 mask).  The unit builder and the merge both go through this, so
// a head's partial is read back from the slot it was written to.  Every head's result is the same
// whatever the chunk size (retrieval, logits and accumulation are per head, in ascending token
// order), so the driver may pick it for load balance.
struct HeadGroups {
  int hkv, gsz, chunk, nchunk;
  HeadGroups(int H, int hkv_, int chunk_)
      : hkv(hkv_), gsz(H / hkv_), chunk(chunk_), nchunk((H / hkv_ + chunk_ - 1) / chunk_) {}
  int index(int r, int kvh, int c) const { return (r * hkv + kvh) * nchunk + c; }
  int first_head(int kvh, int c) const { return kvh * gsz + c * chunk; }
  int size(int c) const { return std::min(chunk, gsz - c * chunk); }
  struct Slot {
    int group, lane;  // group index(r, kvh, chunk); lane = head - first_head(kvh, chunk)
  };
  Slot head_group(int r, int h) const {
    const int kvh = h / gsz, c = (h - kvh * gsz) / chunk;
    return {index(r, kvh, c), h - first_head(kvh, c)};
  }
};

struct Unit {
  int r, kvh, h0, G;
  const Segment* seg;  // null: dense tokens [begin, end)
  int begin, end;
};

// The rows one unit attends to, all in row-major [d] layout of the cache dtype: the union over
// the unit's heads, in ascending token order, with a mask of the heads that attend each row.
// Head g's own rows, in the same order, get the compact entries [off[g], off[g + 1]) of the
// per-entry scratch arrays (scores, norms), so the logits and the softmax run over dense arrays
// and a head's arithmetic never depends on which other heads share its unit.
//
// A segment with an int8 mirror gives kv8 instead of kb / vb / knorm: row i is the whole int8 row
// (common.h's int8_row_bytes) at kv8 + idx[i] * stride bytes, its norm and scales inside.
struct Rows {
  const uint16_t* kb;
  const uint16_t* vb;
  const int8_t* kv8;
  const uint16_t* idx;   // row i is kb + idx[i]*stride (segment) or kb + i*stride (dense tile)
  const uint16_t* mask;  // per row: bit g = query head g attends this row
  const float* knorm;    // cache-mirror segment only: |k - c| by token id
  int n;
  int stride;  // from one token's row to the next: 2d elements in a segment's K/V mirror, d in a tile,
               // int8_row_bytes(d) bytes in an int8 mirror
  bool seg;
  bool scores_ready;  // dense tile whose q.k are already in scratch.scores (dense_scores_*): no K rows
  const Unit* amx;    // dense unit of vLLM's AMX cache: V read from its tiles (values_amx_avx512), no vb
  int off[MAXG + 1];
  const uint16_t* row(const uint16_t* base, int i) const {
    return base + static_cast<size_t>(idx ? idx[i] : i) * stride;
  }
  const int8_t* row8(int i) const { return kv8 + static_cast<size_t>(idx[i]) * stride; }
  // |k - c| of row i (segments only).
  float norm(int i) const {
    if (!kv8) return knorm[idx[i]];
    float v;
    std::memcpy(&v, row8(i), 4);
    return v;
  }
};

// The cache lines of bytes [p, p + nbytes).
MP_PREFETCH void prefetch_bytes(const void* p, int nbytes) {
  const char* c = static_cast<const char*>(p);
  for (int j = 0; j < nbytes; j += 64) __builtin_prefetch(c + j);
  __builtin_prefetch(c + nbytes - 1);
}
// What each pass of the attention reads of row i ahead of time: its K row (with the norm of a
// segment's key), or its V row.
MP_PREFETCH void prefetch_key(const Rows& rows, int i, int d) {
  if (rows.kv8) {
    prefetch_bytes(rows.row8(i), kInt8KeyOffset + d);
    return;
  }
  for (int j = 0; j < d; j += 32) __builtin_prefetch(rows.row(rows.kb, i) + j);
  if (rows.seg) __builtin_prefetch(rows.knorm + rows.idx[i]);
}
MP_PREFETCH void prefetch_value(const Rows& rows, int i, int d) {
  if (rows.kv8) {
    prefetch_bytes(rows.row8(i) + int8_value_offset(d), d + 4);
    return;
  }
  for (int j = 0; j < d; j += 32) __builtin_prefetch(rows.row(rows.vb, i) + j);
}
// The q.k pass's prefetch: row i's K lines into L1 and, for a segment, its V lines into L2 as well.
// A segment's mirror keeps a token's V row right after its K row (one record), so its V lines come
// with the K lines' misses, while those are in flight, and the V pass, after the softmax, finds them in
// L2: a unit's sampled V rows (~1K rows x 128 B at 16K tokens) fit there.  Prefetched only in the V
// pass, each V row was a second round of misses to DRAM (the cold layer's V pass: ~30% of its time).
MP_PREFETCH void prefetch_row(const Rows& rows, int i, int d) {
  prefetch_key(rows, i, d);
  if (!rows.seg) return;  // a dense tile's V rows lie elsewhere in vLLM's cache
  if (rows.kv8) {
    const char* v = reinterpret_cast<const char*>(rows.row8(i)) + int8_value_offset(d);
    for (int j = 0; j < d + 4; j += 64) __builtin_prefetch(v + j, 0, 2);
    __builtin_prefetch(v + d + 3, 0, 2);
    return;
  }
  for (int j = 0; j < d; j += 32) __builtin_prefetch(rows.row(rows.vb, i) + j, 0, 2);
}

struct Heads {
  int G;
  const float* q[MAXG];
  float qn[MAXG], qdc[MAXG];
  const uint16_t* qbf;  // [G][d] bf16 copy of q (Isa::Avx512Bf16 only)
};

// Result of one unit for its G heads.
struct Partial {
  float* max;
  float* sum;
  float* acc;  // [G][d]
};

// Per-thread scratch, kept across calls.
struct Scratch {
  // Collision counts of one head (retrieve.cpp), a byte per token: 0, 1, then >= 3 with bit 1 set.
  std::vector<uint8_t> collisions;
  std::vector<uint64_t> sampled;  // [G][words]: the tokens each head samples
  std::vector<uint16_t> list, rmask, ktile, vtile;
  std::vector<float> qf;                 // [G][d] the unit's queries in fp32
  std::vector<Segment::Bucket> buckets;  // [G][L_read] bucket ranges of one unit, in walk order
  std::vector<float> scores;             // compact entries: q.k, then logits, then softmax weights
  std::vector<float> norms;              // compact entries: |k - c| of the entry's row (segments)
  std::vector<float> wrow;               // [n][G rounded up to 4] softmax weights by row (AVX-512's row_weights)
  std::vector<float> row_f32;            // one K or V row converted to fp32
  std::vector<int64_t> elem_off;         // [2][d] a tiled cache's offsets of K's, V's elements j
};

// Rows ahead of the current one whose lines are prefetched in the row loops.
constexpr int kPrefetchRows = 16;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct PhaseTimer {  // adds the time since the last tick to a phase when profiling is on
  // enabled = false: this timer never ticks (the attention of a dense unit, timed whole by its caller)
  explicit PhaseTimer(bool enabled = true) : on(enabled && g_profile.load(std::memory_order_relaxed)) {}
  bool on;
  int64_t t = on ? now_ns() : 0;
  void tick(Phase phase) {
    if (!on) return;
    const int64_t n = now_ns();
    g_prof[phase].fetch_add(n - t, std::memory_order_relaxed);
    t = n;
  }
};

// u = P(a key at cosine cs to q collides with it in >= 2 of L tables of K bits).
double sample_prob(double cs, int K, int L);
// -log(u + 1e-4) at theta = pi * i / NT for i in [0, NT], plus one copy of the last entry; built
// once per (K, L) and kept for the process.
const float* corr_table(int K, int L);

// The run of a dense unit's tokens that starts at its i-th token and stays inside one block: its
// length, the physical block and the offset of its first token there.  gather_dense and
// dense_scores_* walk a unit run by run.
struct BlockRun {
  int run, off;
  int64_t blk;
};
inline BlockRun block_run(const AttnArgs& args, const Unit& unit, int i) {
  const int p = unit.begin + i, bs = args.block_size, off = p % bs;
  return {std::min(unit.end - p, bs - off), off,
          args.block_table[static_cast<size_t>(unit.r) * args.max_blocks + p / bs]};
}
// Whether V keeps a token's d values side by side and a block's tokens one after the other (vLLM's
// CPU "vec" layout), so a dense unit inside one block reads its V rows in place: row i of the unit at
// dense_values(args, unit) + i * d (the address gather_dense copies that run from).
inline bool values_rows_in_place(const AttnArgs& args) {
  return args.vs[3] == 1 && args.vs[1] == args.d && !args.vt.tiled(args.block_size, args.d);
}
inline const uint16_t* dense_values(const AttnArgs& args, const Unit& unit) {
  const BlockRun b = block_run(args, unit, 0);
  return args.vc + b.blk * args.vs[0] + unit.kvh * args.vs[2] + b.off * args.vs[1];
}
// q . k of token t of a column-major K run (element j at kb[j * kj + t]), summed in float for
// j = 0..d-1: dense_scores_scalar's score, and dense_scores_avx2's for a run's last < 8 tokens.
inline float column_dot(const float* q, const uint16_t* kb, int64_t kj, int t, int d, int dtype) {
  float qk = 0.f;
  for (int j = 0; j < d; ++j) qk += q[j] * to_f(kb[j * kj + t], dtype);
  return qk;
}

// Collects the union over the unit's heads of the keys with >= 2 table collisions into
// scratch.list (ascending ids) and scratch.rmask, and each head's sample count into counts[g].
void retrieve(const AttnArgs& args, const Unit& unit, Isa isa, Scratch& scratch, int* counts);
// The tokens whose collision count (retrieve's bytes) has bit 1 set, as a bitset of `words` words;
// returns how many.  The scalar twin is sampled_words_scalar (retrieve.cpp).
int sampled_words_scalar(const uint8_t* collisions, int words, uint64_t* out);
// Copies dense tokens [unit.begin, unit.end) out of the strided paged cache into row-major tiles
// (the V tile only when ``keys`` is false).
void gather_dense(const AttnArgs& args, const Unit& unit, Scratch& scratch, bool keys);
// Whether the cache keeps K column-major per block (vLLM's CPU layout: a block's tokens side by
// side for each element j), so dense_scores_* read a dense unit's q.k straight from it.
inline bool keys_column_major(const AttnArgs& args) {
  return args.ks[1] == 1 && args.ks[3] != 1 && !args.kt.tiled(args.block_size, args.d);
}
// q.k of the unit's G heads with its dense tokens, read from column-major K: head g's score of
// token i into scratch.scores[g * n + i] (the compact layout attend reads for a dense tile), 8
// tokens per vector and no K tile.  The scalar twin sums each score in the same order, j = 0..d-1.
void dense_scores_scalar(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch);

void attend_scalar(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                   const float* neg_log_u_table);
// Whether the cache's K / V are vLLM's AMX tiles (kv_layout.CpuAmxLayout), which gather_dense reads
// a bf16 pair at a time and the AVX-512 path (bf16 caches) in place (dense_amx_avx512.cpp).
bool amx_key_tiles(const AttnArgs& args);
bool amx_value_tiles(const AttnArgs& args);
#if defined(__x86_64__)
// A dense unit of an AMX cache: q.k into scratch.scores as dense_scores_avx2 lays them out, and
// acc[g] = sum of w[g] * v over its tokens (w: row_weights', gp its row width).
void dense_scores_amx_avx512(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch);
void values_amx_avx512(const AttnArgs& args, const Unit& unit, const float* w, int gp, int G, float* acc);
void dense_scores_avx2(const AttnArgs& args, const Unit& unit, const Heads& heads, Scratch& scratch);
int sampled_words_avx2(const uint8_t* collisions, int words, uint64_t* out);
void attend_avx2(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                 const float* neg_log_u_table);
// isa is Avx512 or Avx512Bf16 (the bf16 dot for q.k).
void attend_avx512(const AttnArgs& args, const Rows& rows, const Heads& heads, Scratch& scratch, Partial part,
                   const float* neg_log_u_table, Isa isa);
#endif

}  // namespace mp
