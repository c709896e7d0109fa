// Sparse decode attention: LSH retrieval (>= 2 collisions) over segments plus exact dense tokens,
// one self-normalised softmax per query head.
//
// Work units are (request, KV head, group of <= 16 query heads, segment or dense chunk).  Each
// unit reads every K/V row it needs once for all of its query heads and leaves a partial
// (max, sum, acc) per head; partials are merged by log-sum-exp at the end.  This keeps batch-1
// decodes parallel and makes the cost follow the bucket entries walked, not the context length.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "attend.h"

namespace mp {

std::atomic<bool> g_profile{false};
std::atomic<int64_t> g_prof[kNumPhases];
std::atomic<int> g_last_team_size{0};

namespace {

thread_local Scratch tls_scratch;

// Query row ``row`` (= request * H + head) of q, in float: the attention and the query hashing
// read the same values.
void query_row_to_float(const AttnArgs& args, size_t row, float* out) {
  if (args.q_dtype == FP32) {
    std::memcpy(out, static_cast<const float*>(args.q) + row * args.d, args.d * sizeof(float));
  } else {
    const uint16_t* q16 = static_cast<const uint16_t*>(args.q) + row * args.d;
    for (int j = 0; j < args.d; ++j) out[j] = to_f(q16[j], args.q_dtype);
  }
}

Heads load_heads(const AttnArgs& args, const Unit& unit, Isa isa, Scratch& scratch) {
  Heads heads;
  heads.G = unit.G;
  heads.qbf = nullptr;
  const size_t h0 = static_cast<size_t>(unit.r) * args.H + unit.h0;
  scratch.qf.resize(static_cast<size_t>(unit.G) * args.d);
  for (int g = 0; g < unit.G; ++g) {
    const size_t h = h0 + g;
    float* qf = scratch.qf.data() + static_cast<size_t>(g) * args.d;
    query_row_to_float(args, h, qf);
    heads.q[g] = qf;
    double ss = 0;
    for (int j = 0; j < args.d; ++j) ss += static_cast<double>(heads.q[g][j]) * heads.q[g][j];
    heads.qn[g] = static_cast<float>(std::sqrt(ss));
    heads.qdc[g] = args.qdc[h];
  }
  if (isa == Isa::Avx512Bf16)  // q is bf16: its raw bits feed dpbf16
    heads.qbf = static_cast<const uint16_t*>(args.q) + h0 * args.d;
  return heads;
}

// The per-layer work that used to be three torch ops and a second native call: SimHash codes of
// the query heads of every request with segments (hash_rows, the arithmetic that hashed the keys,
// so a query and a key with equal rows get equal codes) and q . centre of each head with its KV
// head's centre (summed in double). Requests without segments get zeros: their codes are never read.
// The heads of all those requests go through one hash call per block of tables, so W (d x K*L
// floats, 384 KB at d = 64) is read once per block, not once per request, and the row groups fill
// (4 requests' 36 heads: 6 groups of 6). The blocks give every thread a share even at batch 1
// (hashing one request's heads is ~20% of a 16K-token layer there); a column's arithmetic does not
// depend on its block, so the codes do not depend on the team size.
void prepare_queries(const AttnArgs& args, int nt, std::vector<int32_t>& qcodes, std::vector<float>& qdc) {
  const int R = args.R, H = args.H, d = args.d, K = args.K, L = args.L, G = args.H / args.hkv;
  qcodes.assign(static_cast<size_t>(R) * H * L, 0);
  qdc.assign(static_cast<size_t>(R) * H, 0.f);
  static thread_local std::vector<int> hashed;  // the requests with segments
  static thread_local std::vector<float> qf;    // their heads, in float, request by request
  hashed.clear();
  for (int r = 0; r < R; ++r)
    if (args.centres[r] != nullptr && !(*args.segs)[r].empty()) hashed.push_back(r);
  const int rows = static_cast<int>(hashed.size()) * H;
  if (rows == 0) return;
  qf.resize(static_cast<size_t>(rows) * d);
  for (size_t i = 0; i < hashed.size(); ++i) {
    const int r = hashed[i];
    const float* centre = args.centres[r];
    for (int h = 0; h < H; ++h) {
      const size_t row = static_cast<size_t>(r) * H + h;
      float* x = qf.data() + (i * H + h) * d;
      query_row_to_float(args, row, x);
      const float* c = centre + static_cast<size_t>(h / G) * d;
      double dot = 0;
      for (int j = 0; j < d; ++j) dot += static_cast<double>(x[j]) * c[j];
      qdc[row] = static_cast<float>(dot);
    }
  }
  const int parts = std::max(1, std::min(nt, L));
  const int block = (L + parts - 1) / parts;
  // the team reads the calling thread's buffers (a thread_local named inside the region is the
  // reading thread's own, empty one)
  const float* heads = qf.data();
  const int* requests = hashed.data();
#pragma omp parallel for schedule(static) num_threads(parts)
  for (int part = 0; part < parts; ++part) {
    const int l0 = part * block, nl = std::min(L, l0 + block) - l0;
    if (nl <= 0) continue;
    std::vector<uint16_t> c16(static_cast<size_t>(rows) * nl);
    hash_rows_strided(heads, rows, d, args.w + static_cast<size_t>(l0) * K, K * L, K, nl, c16.data(), nl,
                      args.force_scalar);
    for (int i = 0; i < rows; ++i) {
      const size_t row = static_cast<size_t>(requests[i / H]) * H + i % H;
      std::copy(c16.begin() + static_cast<size_t>(i) * nl, c16.begin() + static_cast<size_t>(i + 1) * nl,
                qcodes.begin() + row * L + l0);
    }
  }
}

}  // namespace

int64_t sparse_decode(const AttnArgs& in) {
  AttnArgs args = in;
  static thread_local std::vector<int32_t> tls_qcodes;
  static thread_local std::vector<float> tls_qdc;
  if (args.qcodes == nullptr) {
    PhaseTimer pt;
    prepare_queries(args, team_size(args.num_threads), tls_qcodes, tls_qdc);
    pt.tick(kPhaseQueries);
    args.qcodes = tls_qcodes.data();
    args.qdc = tls_qdc.data();
  }
  Isa isa = std::min(resolve_isa(args.force_scalar), Isa::Avx512Bf16);  // AMX tiles: the key hash only
  // The bf16 dot needs both operands exactly bf16; otherwise the plain AVX-512 path.
  if (isa == Isa::Avx512Bf16 && !(args.q_dtype == BF16 && args.dtype == BF16)) isa = Isa::Avx512;
  const float* neg_log_u_table = corr_table(args.K, args.L_read);
  // How dense units read the cache, the same for all of them.  vLLM's AMX tiles (bf16) on the
  // AVX-512 path: q.k and the V sums straight from the tiles, no tile copied (dense_amx_avx512.cpp).
  // Column-major K (the "vec" layout): q.k straight from the cache (see the unit loop).
  const bool dense_amx = isa >= Isa::Avx512 && args.dtype == BF16 && amx_key_tiles(args) && amx_value_tiles(args);
  const bool dense_direct = dense_amx || keys_column_major(args);
  // Row-major V rows side by side in a block (the "vec" layout's V): a dense unit's V rows are read
  // in place, no V tile copied.  The copy wrote and read again every exact token's V row (the sinks
  // and the not yet indexed tail, ~516 tokens a request): its memmove was 4.5% of a cold 16K layer.
  const bool v_in_place = dense_direct && !dense_amx && values_rows_in_place(args);
  const int nt = team_size(args.num_threads);
  // Heads per unit: all of a KV head's query heads (up to MAXG) share their unit's K/V row reads,
  // unless that leaves fewer than kUnitsPerThread segment units per thread, too few for the dynamic
  // schedule to balance (3 KV heads of one 32K segment on 2 threads: 2 units on one, 1 on the
  // other); then smaller chunks.  One thread keeps whole groups.  A head's result does not depend
  // on its chunk (attend.h).
  constexpr int kUnitsPerThread = 4;
  int seg_units = 0;
  for (int r = 0; r < args.R; ++r) seg_units += static_cast<int>((*args.segs)[r].size()) * args.hkv;
  const int gsz = args.hkv > 0 ? args.H / args.hkv : 0;
  int chunk = std::max(1, std::min(gsz, MAXG));
  while (nt > 1 && chunk > 1 && seg_units * ((gsz + chunk - 1) / chunk) < kUnitsPerThread * nt) --chunk;
  const HeadGroups groups(args.H, args.hkv, chunk);

  // Units in group order, so each group's partials are contiguous:
  // group_begin[g] .. group_begin[g + 1] for g = groups.index(r, kvh, chunk).
  std::vector<Unit> units;
  std::vector<int> group_begin;
  for (int r = 0; r < args.R; ++r)
    for (int kvh = 0; kvh < args.hkv; ++kvh)
      for (int c = 0; c < groups.nchunk; ++c) {
        group_begin.push_back(static_cast<int>(units.size()));
        const int h0 = groups.first_head(kvh, c), G = groups.size(c);
        for (const auto& sp : (*args.segs)[r]) units.push_back({r, kvh, h0, G, sp.get(), 0, 0});
        for (int k = 0; k < 2; ++k) {
          const int lo = args.ranges[r * 4 + k * 2], hi = args.ranges[r * 4 + k * 2 + 1];
          for (int p = lo, e; p < hi; p = e) {
            e = std::min(hi, p + DCHUNK);
            // Where dense units read the cache in place (q.k always; V in place or from the AMX
            // tiles) they end at block boundaries, so a unit's rows lie in one block: the same units
            // in both layouts, so the AMX tiles' output stays the vec layout's bit for bit.
            if (dense_direct) e = std::min(e, (p / args.block_size + 1) * args.block_size);
            units.push_back({r, kvh, h0, G, nullptr, p, e});
          }
        }
      }
  group_begin.push_back(static_cast<int>(units.size()));
  const int nu = static_cast<int>(units.size());

  // Largest units first so the dynamic schedule balances well.
  std::vector<int> order(nu);
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int i) { return (units[i].seg ? units[i].seg->n / 8 : units[i].end - units[i].begin) * units[i].G; };
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return cost(x) > cost(y); });

  // Partials: MAXG slots per unit, of which a unit writes its first G (all the merge reads).  Kept
  // per calling thread across calls: at 128K tokens they are ~1 MB, which a fresh vector would
  // zero (and fault in) on every step.  The team reads them through these pointers (a
  // thread_local named inside the parallel regions would be each worker's own).
  static thread_local std::vector<float> tls_max, tls_sum, tls_acc;
  static thread_local std::vector<int64_t> tls_count;
  const size_t nslot = static_cast<size_t>(nu) * MAXG;
  tls_max.resize(nslot);
  tls_sum.resize(nslot);
  tls_count.resize(nslot);
  tls_acc.resize(nslot * args.d);
  float* const part_max = tls_max.data();
  float* const part_sum = tls_sum.data();
  float* const part_acc = tls_acc.data();
  int64_t* const part_count = tls_count.data();

  // Every unit writes only its own partial slots and the merge below reads them in unit order, so
  // the result does not depend on the team size or on which thread ran which unit.
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int oi = 0; oi < nu; ++oi) {
    if (oi == 0) g_last_team_size.store(omp_get_num_threads(), std::memory_order_relaxed);
    const int ui = order[oi];
    const Unit& unit = units[ui];
    Scratch& scratch = tls_scratch;
    PhaseTimer pt;
    const Heads heads = load_heads(args, unit, isa, scratch);
    const size_t slot = static_cast<size_t>(ui) * MAXG;
    Rows rows{};
    if (unit.seg) {
      int counts[MAXG];
      retrieve(args, unit, isa, scratch, counts);
      rows.off[0] = 0;
      for (int g = 0; g < unit.G; ++g) {
        part_count[slot + g] = counts[g];
        rows.off[g + 1] = rows.off[g] + counts[g];
      }
      const Segment& seg = *unit.seg;
      const size_t base = static_cast<size_t>(unit.kvh) * seg.n;
      if (seg.mirror == kMirrorInt8) {
        rows.kv8 = seg.kv_row8(unit.kvh, 0);
        rows.stride = static_cast<int>(int8_row_bytes(args.d));
      } else {
        rows.kb = seg.kv_row(unit.kvh, 0);
        rows.vb = rows.kb + args.d;
        rows.stride = 2 * args.d;
        rows.knorm = seg.knorm.data() + base;
      }
      rows.idx = scratch.list.data();
      rows.mask = scratch.rmask.data();
      rows.n = static_cast<int>(scratch.list.size());
      rows.seg = true;
      pt.tick(kPhaseLookup);
    } else {
      // Column-major K (the "vec" cache): q.k straight from the cache, 16 tokens a step, and V
      // read in place too (v_in_place) or else copied to a tile.  A K tile of such a cache is a
      // transpose, one strided element per (token, j), which with the per-row dot products made an
      // exact tail token cost ~4x what vLLM's own kernel spends on it.
      if (!dense_amx && !v_in_place) gather_dense(args, unit, scratch, !dense_direct);
      rows.n = unit.end - unit.begin;
      if (dense_direct) {
#if defined(__x86_64__)
        if (dense_amx)
          dense_scores_amx_avx512(args, unit, heads, scratch);
        else if (isa >= Isa::Avx2)
          dense_scores_avx2(args, unit, heads, scratch);
        else
#endif
          dense_scores_scalar(args, unit, heads, scratch);
        rows.scores_ready = true;
      }
      scratch.rmask.assign(rows.n, static_cast<uint16_t>((1u << unit.G) - 1));
      rows.kb = dense_direct ? nullptr : scratch.ktile.data();
      rows.vb = dense_amx ? nullptr : v_in_place ? dense_values(args, unit) : scratch.vtile.data();
      rows.amx = dense_amx ? &unit : nullptr;
      rows.stride = args.d;              // a tile's, and in place (values_rows_in_place) the cache's token stride
      rows.mask = scratch.rmask.data();  // idx and knorm stay null: rows are the tile, in order
      std::fill_n(part_count + slot, unit.G, int64_t{0});
      for (int g = 0; g <= unit.G; ++g) rows.off[g] = g * rows.n;
    }
    const Partial part{part_max + slot, part_sum + slot, part_acc + slot * args.d};
#if defined(__x86_64__)
    if (isa >= Isa::Avx512)
      attend_avx512(args, rows, heads, scratch, part, neg_log_u_table, isa);
    else if (isa == Isa::Avx2)
      attend_avx2(args, rows, heads, scratch, part, neg_log_u_table);
    else
#endif
      attend_scalar(args, rows, heads, scratch, part, neg_log_u_table);
    if (!unit.seg) pt.tick(kPhaseDense);  // a segment unit's attention ticked its own phases
  }

  // LSE merge of the partials of each query head.
  PhaseTimer pt;
  int64_t sampled = 0;
#pragma omp parallel for num_threads(nt) reduction(+ : sampled)
  for (int rh = 0; rh < args.R * args.H; ++rh) {
    const HeadGroups::Slot hs = groups.head_group(rh / args.H, rh % args.H);
    float M = NEG_INF;
    int64_t count = 0;
    for (int ui = group_begin[hs.group]; ui < group_begin[hs.group + 1]; ++ui) {
      const size_t k = static_cast<size_t>(ui) * MAXG + hs.lane;
      if (part_sum[k] > 0.f) M = std::max(M, part_max[k]);
      count += part_count[k];
    }
    static thread_local std::vector<float> outf;
    outf.assign(args.d, 0.f);
    float* out = outf.data();
    double sum = 0;
    if (M != NEG_INF) {
      for (int ui = group_begin[hs.group]; ui < group_begin[hs.group + 1]; ++ui) {
        const size_t k = static_cast<size_t>(ui) * MAXG + hs.lane;
        if (!(part_sum[k] > 0.f)) continue;
        const float w = std::exp(part_max[k] - M);
        sum += static_cast<double>(w) * part_sum[k];
        const float* acc = part_acc + k * args.d;
        for (int j = 0; j < args.d; ++j) out[j] += w * acc[j];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int j = 0; j < args.d; ++j) out[j] *= inv;
    }
    if (args.out_dtype == FP32) {
      std::memcpy(static_cast<float*>(args.out) + static_cast<size_t>(rh) * args.d, out, args.d * sizeof(float));
    } else {
      uint16_t* o = static_cast<uint16_t*>(args.out) + static_cast<size_t>(rh) * args.d;
      for (int j = 0; j < args.d; ++j) o[j] = f_to_bf16(out[j]);
    }
    if (args.lse) args.lse[rh] = M == NEG_INF ? NEG_INF : M + static_cast<float>(std::log(sum));
    if (args.counts) args.counts[rh] = count;
    sampled += count;
  }
  pt.tick(kPhaseMerge);
  return sampled;
}

}  // namespace mp
