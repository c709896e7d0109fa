// pybind11 surface of vllm_magicpig._C.  Tensors arrive as data_ptr() integers plus sizes; the
// Python wrapper (vllm_magicpig/kernel.py) validates shapes, dtypes and values before calling in.
// The guards here are only the O(1) ones on the integers, so that a direct caller of _C with a bad
// size gets a ValueError (std::invalid_argument) rather than an out-of-bounds access.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common.h"

namespace py = pybind11;
using namespace mp;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// A guard whose message is built only when it fails: DecodeStep::run checks every segment of every
// layer, and building each message up front (a dozen to_string calls and concatenations) cost more
// than the checks themselves on a step's hot path.
#define MP_REQUIRE(ok, what)                                   \
  do {                                                         \
    if (!(ok)) throw std::invalid_argument(std::string(what)); \
  } while (0)

std::string num(int64_t v) { return std::to_string(v); }

void check_kl(const char* fn, int K, int L) {
  MP_REQUIRE(1 <= K && K <= 16,
             std::string(fn) + ": K must be in 1..16 (codes index a uint16 directory), got " + num(K));
  MP_REQUIRE(L >= 2, std::string(fn) + ": L must be >= 2 (a key is sampled on >= 2 collisions), got " + num(L));
}

// The vector loops step 16 lanes with no tail.
void check_head_dim(const char* fn, int d) {
  MP_REQUIRE(d > 0 && d % 16 == 0, std::string(fn) + ": d must be a positive multiple of 16, got " + num(d));
}

void check_dtype(const char* fn, int dtype) {
  MP_REQUIRE(dtype == BF16 || dtype == FP16,
             std::string(fn) + ": dtype code must be 0 (bf16) or 1 (fp16), got " + num(dtype));
}

void check_ptr(const char* fn, const char* name, uintptr_t p) {
  MP_REQUIRE(p != 0, std::string(fn) + ": " + name + " is a null pointer");
}

// The O(1) guards shared by build_segment and build_segment_from_codes.
void check_segment_args(const char* fn, int n, int hkv, int d, int dtype, int K, int L, uintptr_t k, uintptr_t v,
                        uintptr_t c) {
  MP_REQUIRE(1 <= n && n <= kMaxSegmentTokens,
             std::string(fn) + ": n must be in 1.." + num(kMaxSegmentTokens) + ", got " + num(n));
  MP_REQUIRE(hkv >= 1, std::string(fn) + ": hkv must be >= 1, got " + num(hkv));
  check_head_dim(fn, d);
  check_dtype(fn, dtype);
  check_kl(fn, K, L);
  check_ptr(fn, "keys", k);
  check_ptr(fn, "values", v);
  check_ptr(fn, "centre", c);
}

void check_mirror(const char* fn, int mirror) {
  MP_REQUIRE(mirror == kMirrorCache || mirror == kMirrorInt8,
             std::string(fn) + ": mirror must be 0 (the cache's dtype) or 1 (int8), got " + num(mirror));
}

void check_segment(const char* fn, const Segment* s, int hkv, int d, int K, int L, int dtype) {
  MP_REQUIRE(s != nullptr, std::string(fn) + ": segment is None");
  MP_REQUIRE(s->hkv == hkv && s->d == d && s->K == K && s->L == L && s->dtype == dtype,
             std::string(fn) + ": a segment's (Hkv, D, K, L, dtype code) = (" + num(s->hkv) + ", " + num(s->d) + ", " +
                 num(s->K) + ", " + num(s->L) + ", " + num(s->dtype) + "), the call's (" + num(hkv) + ", " + num(d) +
                 ", " + num(K) + ", " + num(L) + ", " + num(dtype) + ")");
}

// The step-level half of a sparse_decode call (see DecodeStep's binding): the O(1) guards on the
// integers it shares with every layer, checked once, and an AttnArgs with those fields filled in.
class DecodeStep {
 public:
  DecodeStep(int R, int H, int hkv, int d, int K, int L, int L_read, int dtype, int q_dtype, uintptr_t w,
             std::vector<int64_t> ks, std::vector<int64_t> vs, uintptr_t bt, int max_blocks, int block_size,
             uintptr_t ranges, int out_dtype, bool force_scalar, int num_threads) {
    const char* fn = "sparse_decode";
    MP_REQUIRE(q_dtype == BF16 || q_dtype == FP16 || q_dtype == FP32,
               std::string(fn) + ": q_dtype must be 0 (bf16), 1 (fp16) or 2 (fp32), got " + num(q_dtype));
    MP_REQUIRE(out_dtype == BF16 || out_dtype == FP32,
               std::string(fn) + ": out_dtype must be 0 (bf16) or 2 (fp32), got " + num(out_dtype));
    MP_REQUIRE(R >= 0 && H >= 0, std::string(fn) + ": R and H must be >= 0, got " + num(R) + ", " + num(H));
    MP_REQUIRE(hkv >= 1 && H % hkv == 0,
               std::string(fn) + ": H (" + num(H) + ") must be a multiple of hkv (" + num(hkv) + ") >= 1");
    check_head_dim(fn, d);
    check_kl(fn, K, L);
    if (L_read == 0) L_read = L;
    MP_REQUIRE(L_read >= 2 && L_read <= L,
               std::string(fn) + ": L_read must be in 2..L (" + num(L) + ") or 0 for L, got " + num(L_read));
    check_dtype(fn, dtype);
    // 4 strides (block, slot, head, dim), or 8: those and the tiling (slot group, its stride, dim
    // group, its stride) of a tiled cache (AttnArgs::CacheTiles).
    MP_REQUIRE((ks.size() == 4 || ks.size() == 8) && vs.size() == ks.size(),
               std::string(fn) + ": cache strides must have 4 or 8 entries, the same for K and V");
    MP_REQUIRE(max_blocks >= 0, std::string(fn) + ": max_blocks must be >= 0, got " + num(max_blocks));
    MP_REQUIRE(block_size > 0, std::string(fn) + ": block_size must be > 0, got " + num(block_size));
    if (R > 0 && H > 0) check_ptr(fn, "ranges", ranges);  // the block table may be empty
    a_.R = R;
    a_.H = H;
    a_.hkv = hkv;
    a_.d = d;
    a_.K = K;
    a_.L = L;
    a_.L_read = L_read;
    a_.dtype = dtype;
    a_.q_dtype = q_dtype;
    a_.w = ptr<const float>(w);
    for (int i = 0; i < 4; ++i) {
      a_.ks[i] = ks[i];
      a_.vs[i] = vs[i];
    }
    auto tiles = [&](const std::vector<int64_t>& s, const char* name) {
      if (s.size() == 4) return AttnArgs::CacheTiles{block_size, 0, d, 0};
      MP_REQUIRE(s[4] >= 1 && s[6] >= 1,
                 std::string(fn) + ": " + name + " tile sizes must be >= 1, got " + num(s[4]) + ", " + num(s[6]));
      return AttnArgs::CacheTiles{s[4], s[5], s[6], s[7]};
    };
    a_.kt = tiles(ks, "ks");
    a_.vt = tiles(vs, "vs");
    a_.block_table = ptr<const int32_t>(bt);
    a_.max_blocks = max_blocks;
    a_.block_size = block_size;
    a_.ranges = ptr<const int32_t>(ranges);
    a_.out_dtype = out_dtype;
    a_.force_scalar = force_scalar;
    a_.num_threads = num_threads;
  }

  // Either the query codes and q . c are given, or the step's projection and a centre slot per
  // request (0 for a request without segments) to compute them from.
  int64_t run(float scale, uintptr_t q, uintptr_t qcodes, uintptr_t qdc, const std::vector<uintptr_t>& centres,
              const std::vector<std::vector<std::shared_ptr<Segment>>>& segs, uintptr_t kc, uintptr_t vc, uintptr_t out,
              uintptr_t lse, uintptr_t counts) const {
    const char* fn = "sparse_decode";
    const int R = a_.R;
    MP_REQUIRE(segs.size() == static_cast<size_t>(R),
               std::string(fn) + ": segs has " + num(segs.size()) + " entries for R=" + num(R) + " requests");
    MP_REQUIRE((qcodes != 0) == (qdc != 0), std::string(fn) + ": qcodes and qdc are given together or not at all");
    if (qcodes == 0) {
      MP_REQUIRE(centres.size() == static_cast<size_t>(R),
                 std::string(fn) + ": centres has " + num(centres.size()) + " entries for R=" + num(R) + " requests");
      if (R > 0 && a_.H > 0) check_ptr(fn, "w", reinterpret_cast<uintptr_t>(a_.w));
      for (int r = 0; r < R; ++r)
        MP_REQUIRE(centres[r] != 0 || segs[r].empty(),
                   std::string(fn) + ": request " + num(r) + " has segments but no centre");
    }
    if (R > 0 && a_.H > 0) {  // then these tensors are non-empty; the caches may be empty
      check_ptr(fn, "q", q);
      if (qcodes != 0) {
        check_ptr(fn, "qcodes", qcodes);
        check_ptr(fn, "qdc", qdc);
      }
      check_ptr(fn, "out", out);
    }
    std::vector<std::vector<SegmentPtr>> sg(segs.size());
    for (size_t r = 0; r < segs.size(); ++r) {
      for (const auto& s : segs[r]) check_segment(fn, s.get(), a_.hkv, a_.d, a_.K, a_.L, a_.dtype);
      sg[r].assign(segs[r].begin(), segs[r].end());
    }
    AttnArgs a = a_;
    a.scale = scale;
    a.q = ptr<const void>(q);
    a.qcodes = ptr<const int32_t>(qcodes);
    a.qdc = ptr<const float>(qdc);
    std::vector<const float*> cp(centres.size());
    for (size_t r = 0; r < centres.size(); ++r) cp[r] = ptr<const float>(centres[r]);
    a.centres = cp.data();
    a.segs = &sg;
    a.kc = ptr<const uint16_t>(kc);
    a.vc = ptr<const uint16_t>(vc);
    a.out = ptr<void>(out);
    a.lse = ptr<float>(lse);
    a.counts = ptr<int64_t>(counts);
    py::gil_scoped_release nogil;
    return sparse_decode(a);
  }

 private:
  AttnArgs a_{};
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "MagicPIG CPU kernel: LSH segments and sparse decode attention";
  m.attr("MAX_SEGMENT_TOKENS") = kMaxSegmentTokens;

  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_readonly("num_tokens", &Segment::n)
      .def_readonly("num_kv_heads", &Segment::hkv)
      .def_readonly("head_dim", &Segment::d)
      .def_readonly("K", &Segment::K)
      .def_readonly("L", &Segment::L)
      .def_readonly("dtype_code", &Segment::dtype)
      .def_readonly("dense_directory", &Segment::dense_dir)
      .def_readonly("mirror", &Segment::mirror)
      .def_property_readonly("index_bytes", &Segment::index_bytes)
      .def_property_readonly("mirror_bytes", &Segment::mirror_bytes)
      .def(
          "codes_into",
          [](const Segment& s, uintptr_t out) {  // int32 [hkv][L][n]
            check_ptr("codes_into", "out", out);
            int32_t* o = ptr<int32_t>(out);
            std::vector<uint16_t> c(s.n);
            for (int t = 0; t < s.hkv * s.L; ++t) {
              recover_codes(s, t, c.data());
              for (int i = 0; i < s.n; ++i) o[static_cast<size_t>(t) * s.n + i] = c[i];
            }
          },
          py::arg("out"))
      .def(
          "rows_into",
          [](const Segment& s, uintptr_t kout, uintptr_t vout) {  // fp32 [n][hkv][d] each: the rows decode reads
            check_ptr("rows_into", "kout", kout);
            check_ptr("rows_into", "vout", vout);
            float* ko = ptr<float>(kout);
            float* vo = ptr<float>(vout);
            for (int h = 0; h < s.hkv; ++h)
              for (int i = 0; i < s.n; ++i) {
                const size_t o = (static_cast<size_t>(i) * s.hkv + h) * s.d;
                if (s.mirror == kMirrorInt8) {
                  int8_to_f32(int8_key(s.kv_row8(h, i)), ko + o, s.d);
                  int8_to_f32(int8_value(s.kv_row8(h, i), s.d), vo + o, s.d);
                } else {
                  const uint16_t* r = s.kv_row(h, i);
                  for (int j = 0; j < s.d; ++j) {
                    ko[o + j] = to_f(r[j], s.dtype);
                    vo[o + j] = to_f(r[s.d + j], s.dtype);
                  }
                }
              }
          },
          py::arg("kout"), py::arg("vout"));

  m.def(
      "build_segment",
      [](uintptr_t k, uintptr_t v, int n, int hkv, int d, int dtype, uintptr_t c, uintptr_t w, int K, int L,
         bool force_scalar, int num_threads, int mirror) {
        const char* fn = "build_segment";
        check_segment_args(fn, n, hkv, d, dtype, K, L, k, v, c);
        check_ptr(fn, "w", w);
        check_mirror(fn, mirror);
        py::gil_scoped_release nogil;
        return build_segment(ptr<const uint16_t>(k), ptr<const uint16_t>(v), n, hkv, d, dtype, ptr<const float>(c),
                             ptr<const float>(w), K, L, force_scalar, num_threads, mirror);
      },
      py::arg("keys"), py::arg("values"), py::arg("n"), py::arg("hkv"), py::arg("d"), py::arg("dtype"),
      py::arg("centre"), py::arg("w"), py::arg("K"), py::arg("L"), py::arg("force_scalar") = false,
      py::arg("num_threads") = 0, py::arg("mirror") = 0);

  m.def(
      "build_segment_from_codes",
      [](uintptr_t k, uintptr_t v, int n, int hkv, int d, int dtype, uintptr_t c, uintptr_t codes, int code_bytes,
         int K, int L, int num_threads, int mirror) {
        const char* fn = "build_segment_from_codes";
        check_segment_args(fn, n, hkv, d, dtype, K, L, k, v, c);
        check_ptr(fn, "codes", codes);
        MP_REQUIRE(code_bytes == 2 || code_bytes == 4,
                   std::string(fn) + ": code_bytes must be 2 (uint16) or 4 (int32), got " + num(code_bytes));
        check_mirror(fn, mirror);
        py::gil_scoped_release nogil;
        return build_segment_from_codes(ptr<const uint16_t>(k), ptr<const uint16_t>(v), n, hkv, d, dtype,
                                        ptr<const float>(c), ptr<const void>(codes), code_bytes, K, L, num_threads,
                                        mirror);
      },
      py::arg("keys"), py::arg("values"), py::arg("n"), py::arg("hkv"), py::arg("d"), py::arg("dtype"),
      py::arg("centre"), py::arg("codes"), py::arg("code_bytes"), py::arg("K"), py::arg("L"),
      py::arg("num_threads") = 0, py::arg("mirror") = 0,
      "A segment over codes int32 (code_bytes 4) or uint16 (2) [hkv][L][n], as Segment.codes_into writes them; "
      "codes outside [0, 2^K) raise ValueError.");

  m.def(
      "merge_segments",
      [](const std::vector<std::shared_ptr<Segment>>& parts, int num_threads) {
        MP_REQUIRE(!parts.empty(), "merge_segments: no segments");
        const Segment* a = parts[0].get();
        MP_REQUIRE(a != nullptr, "merge_segments: segment is None");
        for (const auto& p : parts) {
          check_segment("merge_segments", p.get(), a->hkv, a->d, a->K, a->L, a->dtype);
          MP_REQUIRE(p->mirror == a->mirror, "merge_segments: segments with different mirrors (cache dtype / int8)");
        }
        std::vector<SegmentPtr> cp(parts.begin(), parts.end());
        py::gil_scoped_release nogil;
        return merge_segments(cp, num_threads);  // throws past kMaxSegmentTokens merged tokens
      },
      py::arg("parts"), py::arg("num_threads") = 0);

  m.def(
      "hash_codes",
      [](uintptr_t x, int N, int d, uintptr_t w, int K, int L, uintptr_t out, bool force_scalar, int num_threads) {
        const char* fn = "hash_codes";
        MP_REQUIRE(N >= 0, std::string(fn) + ": N must be >= 0, got " + num(N));
        // Any d > 0: hashing has no 16-lane loop over d.
        MP_REQUIRE(d > 0, std::string(fn) + ": d must be > 0, got " + num(d));
        check_kl(fn, K, L);
        if (N == 0) return;
        check_ptr(fn, "x", x);
        check_ptr(fn, "w", w);
        check_ptr(fn, "out", out);
        py::gil_scoped_release nogil;
        std::vector<uint16_t> c(static_cast<size_t>(N) * L);
        const float* xp = ptr<const float>(x);
        // One run of rows per thread: every row costs the same, and hash_rows blocks its rows itself.
        const int nt = team_size(num_threads), per = (N + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int b = 0; b < nt; ++b) {
          const int lo = b * per, rows = std::min(N, lo + per) - lo;
          if (rows > 0)
            hash_rows(xp + static_cast<size_t>(lo) * d, rows, d, ptr<const float>(w), K, L,
                      c.data() + static_cast<size_t>(lo) * L, force_scalar);
        }
        int32_t* o = ptr<int32_t>(out);
        for (size_t i = 0; i < c.size(); ++i) o[i] = c[i];
      },
      py::arg("x"), py::arg("N"), py::arg("d"), py::arg("w"), py::arg("K"), py::arg("L"), py::arg("out"),
      py::arg("force_scalar") = false, py::arg("num_threads") = 0);

  // A decode call's checks split in two: what every sparse layer of an engine step shares (sizes,
  // dtypes, the cache geometry, the block table and dense ranges, the projection) is checked once
  // when the step is made; run() checks only a layer's own inputs (its query, centres, segments,
  // caches and output).  The engine makes one per step, so its layers skip the shared checks.
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<int, int, int, int, int, int, int, int, int, uintptr_t, std::vector<int64_t>, std::vector<int64_t>,
                    uintptr_t, int, int, uintptr_t, int, bool, int>(),
           py::arg("R"), py::arg("H"), py::arg("hkv"), py::arg("d"), py::arg("K"), py::arg("L"), py::arg("L_read"),
           py::arg("dtype"), py::arg("q_dtype"), py::arg("w"), py::arg("ks"), py::arg("vs"), py::arg("bt"),
           py::arg("max_blocks"), py::arg("block_size"), py::arg("ranges"), py::arg("out_dtype"),
           py::arg("force_scalar"), py::arg("num_threads"))
      .def("run", &DecodeStep::run, py::arg("scale"), py::arg("q"), py::arg("qcodes"), py::arg("qdc"),
           py::arg("centres"), py::arg("segs"), py::arg("kc"), py::arg("vc"), py::arg("out"), py::arg("lse"),
           py::arg("counts"), "One layer's decode: returns the sampled keys summed over requests and heads.");

  m.def(
      "sparse_decode",
      [](int R, int H, int hkv, int d, int K, int L, int dtype, float scale, uintptr_t q, int q_dtype, uintptr_t qcodes,
         uintptr_t qdc, uintptr_t w, const std::vector<uintptr_t>& centres,
         const std::vector<std::vector<std::shared_ptr<Segment>>>& segs, uintptr_t kc, std::vector<int64_t> ks,
         uintptr_t vc, std::vector<int64_t> vs, uintptr_t bt, int max_blocks, int block_size, uintptr_t ranges,
         uintptr_t out, int out_dtype, uintptr_t lse, uintptr_t counts, bool force_scalar, int num_threads,
         int L_read) {
        const DecodeStep step(R, H, hkv, d, K, L, L_read, dtype, q_dtype, w, std::move(ks), std::move(vs), bt,
                              max_blocks, block_size, ranges, out_dtype, force_scalar, num_threads);
        return step.run(scale, q, qcodes, qdc, centres, segs, kc, vc, out, lse, counts);
      },
      py::arg("R"), py::arg("H"), py::arg("hkv"), py::arg("d"), py::arg("K"), py::arg("L"), py::arg("dtype"),
      py::arg("scale"), py::arg("q"), py::arg("q_dtype"), py::arg("qcodes"), py::arg("qdc"), py::arg("w"),
      py::arg("centres"), py::arg("segs"), py::arg("kc"), py::arg("ks"), py::arg("vc"), py::arg("vs"), py::arg("bt"),
      py::arg("max_blocks"), py::arg("block_size"), py::arg("ranges"), py::arg("out"), py::arg("out_dtype"),
      py::arg("lse"), py::arg("counts"), py::arg("force_scalar"), py::arg("num_threads") = 0, py::arg("L_read") = 0,
      "One decode call: a DecodeStep made and run once.");

  m.def(
      "set_profiling",
      [](bool on) {
        for (auto& p : g_prof) p = 0;
        g_profile = on;
      },
      py::arg("on"), "Turn the phase timers on/off (and zero them).");
  m.def(
      "profile",
      []() {
        py::dict d;
        for (int i = 0; i < kNumPhases; ++i) d[kPhaseNames[i]] = g_prof[i].load() * 1e-9;
        return d;
      },
      "Seconds per phase, summed over threads, since set_profiling(True).");
  m.def("active_isa", &active_isa);
  m.def(
      "key_hash",
      [](int dtype, uintptr_t w, int d, int K, int L) {
        check_kl("key_hash", K, L);
        check_ptr("key_hash", "w", w);
        return std::string(key_hash_name(key_hash_for(dtype, reinterpret_cast<const float*>(w), d, K, L)));
      },
      py::arg("dtype"), py::arg("w"), py::arg("d"), py::arg("K"), py::arg("L"),
      "How build_segment hashes keys of this dtype with this projection: 'bf16_pairs' or 'centred_fp32'.");
  m.def(
      "isa_names",
      []() {
        std::vector<std::string> names;
        for (Isa isa : kIsas) names.push_back(isa_name(isa));
        return names;
      },
      "The kernel's paths, slowest to fastest (the values MAGICPIG_ISA takes).");
  m.def("cpu_isa", []() { return isa_name(cpu_isa()); }, "The fastest path this CPU runs, whatever MAGICPIG_ISA says.");
  m.def(
      "max_threads", []() { return omp_get_max_threads(); },
      "omp_get_max_threads(): the team size of a call that passes no num_threads (torch's OpenMP runtime, so "
      "torch.set_num_threads changes it).");
  m.def(
      "last_team_size", []() { return g_last_team_size.load(); },
      "Threads in the team of the unit loop of the last sparse_decode with any unit (0 before one; process-wide).");
  m.def(
      "huge_pool_stats",
      []() {
        const HugePoolStats st = huge_pool_stats();
        py::dict d;
        d["live_bytes"] = st.live_bytes;
        d["pooled_bytes"] = st.pooled_bytes;
        d["limit_bytes"] = st.limit_bytes;
        d["fresh_maps"] = st.fresh_maps;
        d["reuses"] = st.reuses;
        d["unmapped"] = st.unmapped;
        return d;
      },
      "The huge-page pool behind segments' big arrays (process-wide): bytes handed out and kept for reuse, "
      "the limit on both together, and counts of fresh mappings, reuses and unmappings.");
  m.def("set_huge_pool_limit", &set_huge_pool_limit, py::arg("bytes"),
        "Freed segment memory is kept for reuse while live + pooled bytes stay within this (process-wide); "
        "pooled regions above it are unmapped now.");
}
