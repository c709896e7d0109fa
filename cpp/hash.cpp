// SimHash codes: the sign bits of x . w, packed K bits per table.
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstring>

#include "common.h"
#if defined(__x86_64__)
#include "simd_avx2.h"  // MP_AVX2, live_lanes8
#endif

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

void hash_rows_scalar(const float* x, int T, int d, const float* w, int ldw, int K, int L, uint16_t* codes, int ldc) {
  const int C = K * L;
  std::vector<float> acc(C);
  std::vector<uint8_t> bits(C);
  for (int t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int i = 0; i < d; ++i) {
      const float xi = x[static_cast<size_t>(t) * d + i];
      const float* wr = w + static_cast<size_t>(i) * ldw;
      for (int c = 0; c < C; ++c) acc[c] += xi * wr[c];
    }
    for (int c = 0; c < C; ++c) bits[c] = acc[c] > 0.f;
    pack_codes(bits.data(), K, L, codes + static_cast<size_t>(t) * ldc);
  }
}

#if defined(__x86_64__)
// Codes straight from the sign masks: bit c of a row (word c / 16, bit c % 16, little-endian) is
// column c = l * K + j, so table l's code is the K bits from bit l * K; K <= 16 and a shift of at
// most 7 fit one unaligned 32-bit read. ``m`` must have 4 readable bytes past bit C - 1.
inline void pack_from_masks(const uint16_t* m, int K, int L, uint16_t* codes) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(m);
  const uint32_t keep = (1u << K) - 1;
  for (int l = 0; l < L; ++l) {
    const int bit = l * K;
    uint32_t v;
    std::memcpy(&v, bytes + bit / 8, sizeof v);
    codes[l] = static_cast<uint16_t>((v >> (bit % 8)) & keep);
  }
}

// Rows in groups of up to kHashMaxRows, 64 columns per tile: NR x 4 accumulators, so each step of
// the d loop loads 4 W vectors and broadcasts NR x values for 4 NR FMAs (6 rows: 24 accumulators,
// 4 W vectors and a broadcast, inside the 32 zmm registers). A group's size follows the rows left
// (9 query heads: 5 + 4), where fixed groups of 4 computed 12 rows for 9 and read W three times.
// Columns left over go 16 at a time (masked tail). A column's sum is x[0] w[0] + ... + x[d-1] w[d-1]
// by FMA from zero whatever the group, so the codes do not depend on the grouping. The signs are
// kept as 16-bit masks, and the codes cut from them (pack_from_masks) without a byte per bit.
#define MP_HASH_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
constexpr int kHashMaxRows = 6;

// The AVX-512 drivers' loop: rows [0, T) in groups of up to kHashMaxRows, sized evenly by the rows
// left (7: 4 + 3); group(rows, nr, masks, stride) writes nr rows of sign masks, which are cut into
// codes [t * ldc + l].  row(t) points at row t.
template <class Row, class Group>
void hash_in_row_groups(int T, int C, int K, int L, uint16_t* codes, int ldc, Row row, Group group) {
  const int stride = (C + 15) / 16 + 2;  // + 2 words: pack_from_masks reads 4 bytes
  std::vector<uint16_t> masks(static_cast<size_t>(kHashMaxRows) * stride, 0);
  for (int t0 = 0; t0 < T;) {
    const int groups = (T - t0 + kHashMaxRows - 1) / kHashMaxRows;
    const int nr = (T - t0 + groups - 1) / groups;
    decltype(row(0)) rows[kHashMaxRows];
    for (int r = 0; r < nr; ++r) rows[r] = row(t0 + r);
    group(rows, nr, masks.data(), stride);
    for (int r = 0; r < nr; ++r)
      pack_from_masks(masks.data() + static_cast<size_t>(r) * stride, K, L, codes + static_cast<size_t>(t0 + r) * ldc);
    t0 += nr;
  }
}

template <int NR>
MP_HASH_AVX512 void hash_group_avx512(const float* const* xr, int d, const float* w, int ldw, int C, uint16_t* masks,
                                      int stride) {
  const __m512 z = _mm512_setzero_ps();
  int c0 = 0;
  for (; c0 + 64 <= C; c0 += 64) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = z;
    for (int i = 0; i < d; ++i) {
      const float* wi = w + static_cast<size_t>(i) * ldw + c0;
      const __m512 w0 = _mm512_loadu_ps(wi), w1 = _mm512_loadu_ps(wi + 16), w2 = _mm512_loadu_ps(wi + 32),
                   w3 = _mm512_loadu_ps(wi + 48);
      for (int r = 0; r < NR; ++r) {
        const __m512 xb = _mm512_set1_ps(xr[r][i]);
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k)
        masks[static_cast<size_t>(r) * stride + c0 / 16 + k] = _mm512_cmp_ps_mask(acc[r][k], z, _CMP_GT_OQ);
  }
  for (; c0 < C; c0 += 16) {
    const __mmask16 m = (C - c0 >= 16) ? 0xffff : static_cast<__mmask16>((1u << (C - c0)) - 1);
    __m512 a[NR];
    for (int r = 0; r < NR; ++r) a[r] = z;
    for (int i = 0; i < d; ++i) {
      const __m512 wv = _mm512_maskz_loadu_ps(m, w + static_cast<size_t>(i) * ldw + c0);
      for (int r = 0; r < NR; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][i]), wv, a[r]);
    }
    // masked-off lanes summed zeros: their bits are 0 and never read
    for (int r = 0; r < NR; ++r)
      masks[static_cast<size_t>(r) * stride + c0 / 16] = _mm512_cmp_ps_mask(a[r], z, _CMP_GT_OQ);
  }
}

// hash_group_avx512<n> for n rows, at [n - 1].
using HashGroup = void (*)(const float* const*, int, const float*, int, int, uint16_t*, int);
const HashGroup kHashGroups[kHashMaxRows] = {hash_group_avx512<1>, hash_group_avx512<2>, hash_group_avx512<3>,
                                             hash_group_avx512<4>, hash_group_avx512<5>, hash_group_avx512<6>};

MP_HASH_AVX512 void hash_rows_avx512(const float* x, int T, int d, const float* w, int ldw, int K, int L,
                                     uint16_t* codes, int ldc) {
  const int C = K * L;
  hash_in_row_groups(
      T, C, K, L, codes, ldc, [&](int t) { return x + static_cast<size_t>(t) * d; },
      [&](const float* const* xr, int nr, uint16_t* masks, int stride) {
        kHashGroups[nr - 1](xr, d, w, ldw, C, masks, stride);
      });
}

// The AVX2 twin of hash_rows_avx512.  Each column sums its d products in the same order with the
// same FMAs as the AVX-512 path, so the two give the same codes; only the loop order differs.  Rows
// go in blocks of kHashRowBlock, and inside a block the columns are the outer loop: a 16-column
// tile of W (d x 64 bytes) is then read from L1 by every row group of the block.  Row groups
// outermost (the AVX-512 path's order) stream all of W, d x K*L floats (384 KB at d = 64 and
// K*L = 1500, 768 KB at d = 128: past this machine's 512 KB L2), once per group, and the hash ran
// at a quarter of the FMA peak, bound by those reads.  A group is 6 rows x 16 columns: 12 accumulators
// (more than the ~10 FMAs two FMA units keep in flight), 2 W vectors and a broadcast, inside the
// 16 ymm registers.  The signs go into the same little-endian bit rows (a byte per 8 columns) for
// pack_from_masks.
MP_AVX2 inline uint8_t sign_bits(__m256 a) {  // bit j: lane j > 0
  return static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ)));
}
constexpr int kHashRowBlock = 96, kHashGroup = 6;  // rows per block (a multiple of the group), rows per group
MP_AVX2 void hash_rows_avx2(const float* x, int T, int d, const float* w, int ldw, int K, int L, uint16_t* codes,
                            int ldc) {
  const int C = K * L, stride = (C + 15) / 16 + 2;  // uint16 words per row, as hash_rows_avx512
  std::vector<uint16_t> masks(static_cast<size_t>(kHashRowBlock) * stride, 0);
  uint8_t* mb = reinterpret_cast<uint8_t*>(masks.data());
  const int bstride = 2 * stride;  // bytes per row
  const __m256 z = _mm256_setzero_ps();
  constexpr int R = kHashGroup;
  for (int b0 = 0; b0 < T; b0 += kHashRowBlock) {
    const int nb = std::min(kHashRowBlock, T - b0);
    int c0 = 0;
    for (; c0 + 16 <= C; c0 += 16) {
      for (int t0 = 0; t0 < nb; t0 += R) {
        const float* xr[R];  // rows past the block's end repeat its last row; their bits are never read
        for (int r = 0; r < R; ++r) xr[r] = x + static_cast<size_t>(b0 + std::min(t0 + r, nb - 1)) * d;
        __m256 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = z;
        for (int i = 0; i < d; ++i) {
          const float* wi = w + static_cast<size_t>(i) * ldw + c0;
          const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8);
          for (int r = 0; r < R; ++r) {
            const __m256 xb = _mm256_broadcast_ss(xr[r] + i);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
          }
        }
        for (int r = 0; r < R; ++r) {
          uint8_t* row = mb + static_cast<size_t>(t0 + r) * bstride;
          row[c0 / 8] = sign_bits(acc[r][0]);
          row[c0 / 8 + 1] = sign_bits(acc[r][1]);
        }
      }
    }
    for (; c0 < C; c0 += 8) {
      const __m256i live = live_lanes8(C, c0);
      for (int t0 = 0; t0 < nb; t0 += R) {
        const float* xr[R];
        for (int r = 0; r < R; ++r) xr[r] = x + static_cast<size_t>(b0 + std::min(t0 + r, nb - 1)) * d;
        __m256 a[R];
        for (int r = 0; r < R; ++r) a[r] = z;
        for (int i = 0; i < d; ++i) {
          const __m256 wv = _mm256_maskload_ps(w + static_cast<size_t>(i) * ldw + c0, live);
          for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(xr[r] + i), wv, a[r]);
        }
        // masked-off lanes summed zeros: their bits are 0 and never read
        for (int r = 0; r < R; ++r) mb[static_cast<size_t>(t0 + r) * bstride + c0 / 8] = sign_bits(a[r]);
      }
    }
    for (int r = 0; r < nb; ++r)
      pack_from_masks(masks.data() + static_cast<size_t>(r) * stride, K, L, codes + static_cast<size_t>(b0 + r) * ldc);
  }
}
#endif

// ---- kBf16Pairs (common.h): bf16 keys against a bf16-valued projection ----

// The scalar twin of bf16_pairs_group_avx512: per column, each pair's two products (exact in
// float32: 8-bit by 8-bit significands) added to a float32 sum in the order the instruction's
// definition gives (odd element, then even), then compared with c . w.  Columns are the inner loop,
// each its own sum, as in hash_rows_scalar (GCC 12 at -O3 vectorized a per-column loop over the
// pairs into wrong sums).
void bf16_pairs_rows_scalar(const uint16_t* keys, size_t row_stride, int T, int d, const float* w, int C,
                            const float* cw, int K, int L, uint16_t* codes) {
  std::vector<float> acc(C);
  std::vector<uint8_t> bits(C);
  for (int t = 0; t < T; ++t) {
    const uint16_t* k = keys + static_cast<size_t>(t) * row_stride;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int i = 0; i < d / 2; ++i) {
      const float k0 = bf16_to_f(k[2 * i]), k1 = bf16_to_f(k[2 * i + 1]);
      const float* w0 = w + static_cast<size_t>(2 * i) * C;
      const float* w1 = w0 + C;
      for (int c = 0; c < C; ++c) {
        acc[c] += k1 * w1[c];
        acc[c] += k0 * w0[c];
      }
    }
    for (int c = 0; c < C; ++c) bits[c] = acc[c] > cw[c];
    pack_codes(bits.data(), K, L, codes + static_cast<size_t>(t) * L);
  }
}

// An AMX tile: 16 rows of 64 bytes (kAmxTiles below).  Outside the x86 block: Bf16KeyHasher, compiled
// on every platform, sizes its tile columns with them.
constexpr int kAmxRows = 16, kAmxPairRows = 16, kAmxCols = 16;

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 10
#define MP_HASH_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define MP_HAS_BF16_HASH 1

// hash_group_avx512's tiling (NR rows x 64 columns, 4 NR accumulators) with one vdpbf16ps per pair
// of key elements where the float32 path has two FMAs: a row's pair is one 32-bit broadcast, a
// column's pair is adjacent in `pairs`.  The sign of (k - c) . w is k . w > c . w, so the keys need
// no centring pass.  A column's sum is the same chain of pair products whatever the group.
template <int NR>
MP_HASH_BF16 void bf16_pairs_group_avx512(const uint16_t* const* kr, int d, const uint16_t* pairs, int C,
                                          const float* cw, uint16_t* masks, int stride) {
  int c0 = 0;
  for (; c0 + 64 <= C; c0 += 64) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_setzero_ps();
    for (int i = 0; i < d / 2; ++i) {
      const uint16_t* wi = pairs + (static_cast<size_t>(i) * C + c0) * 2;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wi), w1 = (__m512bh)_mm512_loadu_si512(wi + 32),
                     w2 = (__m512bh)_mm512_loadu_si512(wi + 64), w3 = (__m512bh)_mm512_loadu_si512(wi + 96);
      for (int r = 0; r < NR; ++r) {
        int32_t pair;
        std::memcpy(&pair, kr[r] + 2 * i, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
      }
    }
    for (int k = 0; k < 4; ++k) {
      const __m512 threshold = _mm512_loadu_ps(cw + c0 + 16 * k);
      for (int r = 0; r < NR; ++r)
        masks[static_cast<size_t>(r) * stride + c0 / 16 + k] = _mm512_cmp_ps_mask(acc[r][k], threshold, _CMP_GT_OQ);
    }
  }
  for (; c0 < C; c0 += 16) {
    const int live = std::min(16, C - c0);
    const __mmask16 m = static_cast<__mmask16>((1u << live) - 1);
    const __mmask32 m2 = static_cast<__mmask32>((uint64_t{1} << (2 * live)) - 1);
    __m512 a[NR];
    for (int r = 0; r < NR; ++r) a[r] = _mm512_setzero_ps();
    for (int i = 0; i < d / 2; ++i) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m2, pairs + (static_cast<size_t>(i) * C + c0) * 2);
      for (int r = 0; r < NR; ++r) {
        int32_t pair;
        std::memcpy(&pair, kr[r] + 2 * i, sizeof pair);
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(pair), wv);
      }
    }
    // masked-off lanes compare 0 > 0: their bits are 0 and never read
    const __m512 threshold = _mm512_maskz_loadu_ps(m, cw + c0);
    for (int r = 0; r < NR; ++r)
      masks[static_cast<size_t>(r) * stride + c0 / 16] = _mm512_cmp_ps_mask(a[r], threshold, _CMP_GT_OQ);
  }
}

using Bf16PairsGroup = void (*)(const uint16_t* const*, int, const uint16_t*, int, const float*, uint16_t*, int);
const Bf16PairsGroup kBf16PairsGroups[kHashMaxRows] = {bf16_pairs_group_avx512<1>, bf16_pairs_group_avx512<2>,
                                                       bf16_pairs_group_avx512<3>, bf16_pairs_group_avx512<4>,
                                                       bf16_pairs_group_avx512<5>, bf16_pairs_group_avx512<6>};

void bf16_pairs_rows_avx512(const uint16_t* keys, size_t row_stride, int T, int d, const uint16_t* pairs, int C,
                            const float* cw, int K, int L, uint16_t* codes) {
  hash_in_row_groups(
      T, C, K, L, codes, L, [&](int t) { return keys + static_cast<size_t>(t) * row_stride; },
      [&](const uint16_t* const* kr, int nr, uint16_t* masks, int stride) {
        kBf16PairsGroups[nr - 1](kr, d, pairs, C, cw, masks, stride);
      });
}

#if __GNUC__ >= 11
#define MP_AMX_TILES __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq")))
#define MP_HAS_AMX_HASH 1

// ---- kAmxTiles: the bf16-pairs key hash as a tile matrix product ----
//
// keys [T x d] . w [d x C] on AMX tiles: a tile product (tdpbf16ps) is 16 keys x 16 columns x 32
// elements, 8,192 pair products in one instruction, where vdpbf16ps gives 32 (the AVX-512 pairs path
// ran at 95 GFLOP/s on this kind of Xeon, slower than its float32 FMAs: results/index_build_amx.md).
// A block is 32 keys x 32 columns: four accumulator tiles (0-3), two of keys (4, 5), two of w (6, 7).
// The key tiles are read straight from the rows (any row stride); a block with fewer than 32 keys left
// reads them from a zero-padded copy instead, so no tile reads past the rows.  The products are the
// pairs path's (bf16 x bf16, exact in float32) summed in float32 in an order the hardware does not
// document; the scalar twin (bf16_pairs_rows_scalar) sums the same products in its own order, so
// the two agree up to float32 ties, as the float32 path's FMA and mul+add twins do.  A key's sums do
// not depend on the keys beside it (tile rows are independent), so merges and rebuilds agree.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

MP_AMX_TILES void amx_pairs_rows(const uint16_t* keys, size_t row_stride, int T, int d, const uint16_t* tiles, int Cp,
                                 const float* cw, int K, int L, uint16_t* codes) {
  // The thread's tile configuration is put back after: vLLM's own AMX attention may run on this
  // thread between builds, keeping the configuration it loaded.
  alignas(64) uint8_t saved[64];
  _tile_storeconfig(saved);
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  const int ksteps = d / 32, ctiles = Cp / kAmxCols, stride = Cp / 16 + 2;  // + 2: pack_from_masks reads 4 bytes
  const size_t tile_elems = static_cast<size_t>(kAmxPairRows) * kAmxCols * 2;
  std::vector<uint16_t> masks(static_cast<size_t>(2 * kAmxRows) * stride, 0);
  std::vector<uint16_t> pad;
  alignas(64) float acc[2 * kAmxRows][2 * kAmxCols];
  for (int r0 = 0; r0 < T; r0 += 2 * kAmxRows) {
    const int nr = std::min(2 * kAmxRows, T - r0);
    const uint16_t* a = keys + static_cast<size_t>(r0) * row_stride;
    size_t a_stride = row_stride * 2;
    if (nr < 2 * kAmxRows) {
      pad.assign(static_cast<size_t>(2 * kAmxRows) * d, 0);
      for (int r = 0; r < nr; ++r) std::memcpy(pad.data() + static_cast<size_t>(r) * d, a + r * row_stride, d * 2);
      a = pad.data();
      a_stride = static_cast<size_t>(d) * 2;
    }
    const uint16_t* a1 = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(a) + kAmxRows * a_stride);
    for (int ct = 0; ct < ctiles; ct += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int ks = 0; ks < ksteps; ++ks) {
        const uint16_t* b = tiles + (static_cast<size_t>(ks) * ctiles + ct) * tile_elems;
        _tile_loadd(4, a + ks * 32, a_stride);
        _tile_loadd(5, a1 + ks * 32, a_stride);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + tile_elems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, &acc[0][0], sizeof acc[0]);
      _tile_stored(1, &acc[0][kAmxCols], sizeof acc[0]);
      _tile_stored(2, &acc[kAmxRows][0], sizeof acc[0]);
      _tile_stored(3, &acc[kAmxRows][kAmxCols], sizeof acc[0]);
      const __m512 t0 = _mm512_loadu_ps(cw + ct * kAmxCols), t1 = _mm512_loadu_ps(cw + (ct + 1) * kAmxCols);
      for (int r = 0; r < nr; ++r) {
        masks[static_cast<size_t>(r) * stride + ct] = _mm512_cmp_ps_mask(_mm512_load_ps(acc[r]), t0, _CMP_GT_OQ);
        masks[static_cast<size_t>(r) * stride + ct + 1] =
            _mm512_cmp_ps_mask(_mm512_load_ps(acc[r] + kAmxCols), t1, _CMP_GT_OQ);
      }
    }
    for (int r = 0; r < nr; ++r)
      pack_from_masks(masks.data() + static_cast<size_t>(r) * stride, K, L, codes + static_cast<size_t>(r0 + r) * L);
  }
  if (saved[0] != 0)
    _tile_loadconfig(saved);
  else
    _tile_release();
}
#endif
#endif

bool bf16_valued(const float* w, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, w + i, sizeof u);
    if (u & 0xffffu) return false;
  }
  return true;
}

}  // namespace

KeyHash key_hash_for(int dtype, const float* w, int d, int K, int L) {
#if defined(MP_HAS_BF16_HASH)
  const Isa isa = resolve_isa(false);
  if (dtype == BF16 && d % 2 == 0 && isa >= Isa::Avx512Bf16 && bf16_valued(w, static_cast<size_t>(d) * K * L)) {
#if defined(MP_HAS_AMX_HASH)
    if (isa >= Isa::Amx && d % 32 == 0) return KeyHash::kAmxTiles;  // a tile's depth is 32 elements
#endif
    return KeyHash::kBf16Pairs;
  }
#else
  (void)dtype, (void)w, (void)d, (void)K, (void)L;
#endif
  return KeyHash::kCentredFp32;
}

const char* key_hash_name(KeyHash h) {
  switch (h) {
    case KeyHash::kAmxTiles:
      return "amx_tiles";
    case KeyHash::kBf16Pairs:
      return "bf16_pairs";
    case KeyHash::kCentredFp32:
      break;
  }
  return "centred_fp32";
}

Bf16KeyHasher::Bf16KeyHasher(const float* w, int d, int K, int L, const float* centre, int hkv, bool force_scalar,
                             bool amx_tiles)
    : w_(w), d_(d), K_(K), L_(L), simd_(!force_scalar), amx_(amx_tiles && !force_scalar) {
  const int C = K * L;
  cp_ = amx_ ? (C + 2 * kAmxCols - 1) / (2 * kAmxCols) * (2 * kAmxCols) : C;
  // The projection's bf16 bits (exact: bf16-valued) laid out for the fast path that runs: pairs
  // [d/2][C][2] for the AVX-512 pair dot product, or [d/32][cp/16] tiles, each 16 pair rows x 16
  // columns x (w[2i][c], w[2i+1][c]) in one contiguous 1 KB, for AMX (columns past C zero).  The
  // scalar twin reads w itself.
  auto bits = [w, C](int j, int c) {
    uint32_t u;
    std::memcpy(&u, w + static_cast<size_t>(j) * C + c, sizeof u);
    return static_cast<uint16_t>(u >> 16);
  };
  if (amx_) {
    const int ctiles = cp_ / kAmxCols;
    amx_tiles_.assign(static_cast<size_t>(d) * cp_, 0);
    for (int i = 0; i < d / 2; ++i)
      for (int c = 0; c < C; ++c) {
        const size_t tile = static_cast<size_t>(i / kAmxPairRows) * ctiles + c / kAmxCols;
        uint16_t* dst = amx_tiles_.data() + tile * kAmxPairRows * kAmxCols * 2 +
                        (static_cast<size_t>(i % kAmxPairRows) * kAmxCols + c % kAmxCols) * 2;
        dst[0] = bits(2 * i, c);
        dst[1] = bits(2 * i + 1, c);
      }
  } else if (simd_) {
    pairs_.resize(static_cast<size_t>(d) * C);
    for (int i = 0; i < d / 2; ++i)
      for (int c = 0; c < C; ++c) {
        pairs_[(static_cast<size_t>(i) * C + c) * 2] = bits(2 * i, c);
        pairs_[(static_cast<size_t>(i) * C + c) * 2 + 1] = bits(2 * i + 1, c);
      }
  }
  // c_h . w per column, in double; rows of w outermost so the inner loop runs along a row (a
  // growth step's build of a few hundred tokens pays this once)
  cw_.assign(static_cast<size_t>(hkv) * cp_, 0.f);  // padding columns: 0 > 0, bits never read
  std::vector<double> sum(C);
  for (int h = 0; h < hkv; ++h) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int j = 0; j < d; ++j) {
      const double cj = centre[static_cast<size_t>(h) * d + j];
      const float* wj = w + static_cast<size_t>(j) * C;
      for (int c = 0; c < C; ++c) sum[c] += cj * wj[c];
    }
    for (int c = 0; c < C; ++c) cw_[static_cast<size_t>(h) * cp_ + c] = static_cast<float>(sum[c]);
  }
}

void Bf16KeyHasher::hash(const uint16_t* keys, size_t row_stride, int T, int h, uint16_t* codes) const {
  const int C = K_ * L_;
  const float* cw = cw_.data() + static_cast<size_t>(h) * cp_;
#if defined(MP_HAS_AMX_HASH)
  if (amx_) return amx_pairs_rows(keys, row_stride, T, d_, amx_tiles_.data(), cp_, cw, K_, L_, codes);
#endif
#if defined(MP_HAS_BF16_HASH)
  if (simd_) return bf16_pairs_rows_avx512(keys, row_stride, T, d_, pairs_.data(), C, cw, K_, L_, codes);
#endif
  bf16_pairs_rows_scalar(keys, row_stride, T, d_, w_, C, cw, K_, L_, codes);
}

void hash_rows_strided(const float* x, int T, int d, const float* w, int ldw, int K, int L, uint16_t* codes, int ldc,
                       bool force_scalar) {
  const Isa isa = resolve_isa(force_scalar);
#if defined(__x86_64__)
  if (isa >= Isa::Avx512) return hash_rows_avx512(x, T, d, w, ldw, K, L, codes, ldc);
  if (isa == Isa::Avx2) return hash_rows_avx2(x, T, d, w, ldw, K, L, codes, ldc);
#endif
  (void)isa;
  hash_rows_scalar(x, T, d, w, ldw, K, L, codes, ldc);
}

// Keys (build) and queries (hash_codes) both come through here, so hashed with the same
// force_scalar they share the same arithmetic; FMA vs mul+add, the only difference between the
// twins, moves only sign bits that sit at float rounding.
void hash_rows(const float* x, int T, int d, const float* w, int K, int L, uint16_t* codes, bool force_scalar) {
  hash_rows_strided(x, T, d, w, K * L, K, L, codes, L, force_scalar);
}

}  // namespace mp
