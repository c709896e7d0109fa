// pybind11 surface of vllm_magicpig._C.  Tensors arrive as data_ptr() integers plus sizes; the
// Python wrapper (vllm_magicpig/kernel.py) validates everything before calling in.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>

#include "common.h"

namespace py = pybind11;
using namespace mp;

namespace mp {
extern std::atomic<bool> g_profile;
extern std::atomic<int64_t> g_prof[4];
void recover_codes(const Segment& s, int t, uint16_t* codes);
}

template <typename T>
static T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

PYBIND11_MODULE(_C, m) {
  m.doc() = "MagicPIG CPU kernel: LSH segments and sparse decode attention";

  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_readonly("num_tokens", &Segment::n)
      .def_readonly("num_kv_heads", &Segment::hkv)
      .def_readonly("head_dim", &Segment::d)
      .def_readonly("K", &Segment::K)
      .def_readonly("L", &Segment::L)
      .def_readonly("dtype_code", &Segment::dtype)
      .def_readonly("dense_directory", &Segment::dense_dir)
      .def_property_readonly("index_bytes", &Segment::index_bytes)
      .def_property_readonly("mirror_bytes", &Segment::mirror_bytes)
      .def("codes_into", [](const Segment& s, uintptr_t out) {  // int32 [hkv][L][n]
        int32_t* o = ptr<int32_t>(out);
        std::vector<uint16_t> c(s.n);
        for (int t = 0; t < s.hkv * s.L; ++t) {
          recover_codes(s, t, c.data());
          for (int i = 0; i < s.n; ++i) o[static_cast<size_t>(t) * s.n + i] = c[i];
        }
      });

  m.def("build_segment",
        [](uintptr_t k, uintptr_t v, int n, int hkv, int d, int dtype, uintptr_t c, uintptr_t w, int K, int L) {
          py::gil_scoped_release nogil;
          return build_segment(ptr<const uint16_t>(k), ptr<const uint16_t>(v), n, hkv, d, dtype,
                               ptr<const float>(c), ptr<const float>(w), K, L);
        });

  m.def("merge_segments", [](const std::vector<std::shared_ptr<Segment>>& parts) {
    std::vector<SegmentPtr> cp(parts.begin(), parts.end());
    py::gil_scoped_release nogil;
    return merge_segments(cp);
  });

  m.def("hash_codes", [](uintptr_t x, int N, int d, uintptr_t w, int K, int L, uintptr_t out) {
    py::gil_scoped_release nogil;
    std::vector<uint16_t> c(static_cast<size_t>(N) * L);
    const float* xp = ptr<const float>(x);
    const int TB = 64, nb = (N + TB - 1) / TB;
#pragma omp parallel for schedule(dynamic)
    for (int b = 0; b < nb; ++b)
      hash_rows(xp + static_cast<size_t>(b) * TB * d, std::min(TB, N - b * TB), d, ptr<const float>(w), K, L,
                c.data() + static_cast<size_t>(b) * TB * L);
    int32_t* o = ptr<int32_t>(out);
    for (size_t i = 0; i < c.size(); ++i) o[i] = c[i];
  });

  m.def("sparse_decode",
        [](int R, int H, int hkv, int d, int K, int L, int dtype, float scale, uintptr_t q, bool q_is_bf16,
           uintptr_t qcodes, uintptr_t qdc, const std::vector<std::vector<std::shared_ptr<Segment>>>& segs,
           uintptr_t kc, std::vector<int64_t> ks, uintptr_t vc, std::vector<int64_t> vs, uintptr_t bt,
           int max_blocks, int block_size, uintptr_t ranges, uintptr_t out, uintptr_t lse, uintptr_t counts,
           bool force_scalar) {
          std::vector<std::vector<SegmentPtr>> sg(segs.size());
          for (size_t r = 0; r < segs.size(); ++r) sg[r].assign(segs[r].begin(), segs[r].end());
          AttnArgs a{};
          a.R = R; a.H = H; a.hkv = hkv; a.d = d; a.K = K; a.L = L; a.dtype = dtype; a.scale = scale;
          a.q = ptr<const float>(q); a.q_is_bf16 = q_is_bf16;
          a.qcodes = ptr<const int32_t>(qcodes); a.qdc = ptr<const float>(qdc); a.segs = &sg;
          a.kc = ptr<const uint16_t>(kc); a.vc = ptr<const uint16_t>(vc);
          for (int i = 0; i < 4; ++i) { a.ks[i] = ks.at(i); a.vs[i] = vs.at(i); }
          a.block_table = ptr<const int32_t>(bt); a.max_blocks = max_blocks; a.block_size = block_size;
          a.ranges = ptr<const int32_t>(ranges);
          a.out = ptr<float>(out); a.lse = ptr<float>(lse); a.counts = ptr<int64_t>(counts);
          a.force_scalar = force_scalar;
          py::gil_scoped_release nogil;
          sparse_decode(a);
        });

  m.def("set_profiling", [](bool on) {
    for (auto& p : g_prof) p = 0;
    g_profile = on;
  }, "Turn the phase timers on/off (and zero them).");
  m.def("profile", []() {  // seconds summed over threads since set_profiling(True)
    py::dict d;
    const char* names[4] = {"lookup", "gather_logits", "softmax_v", "merge"};
    for (int i = 0; i < 4; ++i) d[names[i]] = g_prof[i].load() * 1e-9;
    return d;
  });
  m.def("active_isa", &active_isa);
  m.def("has_avx512", &cpu_has_avx512);
}
