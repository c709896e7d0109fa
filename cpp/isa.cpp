// Run-time ISA detection: the build targets baseline x86-64 (no -march=native), so every AVX2 and
// AVX-512 function carries a target attribute and runs only where this says the CPU has it.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common.h"

namespace mp {

namespace {

// MAGICPIG_ISA caps the path process-wide ("scalar", "avx2", "avx512", "avx512_bf16"), so a user
// or a test can run the kernel as it runs on an older CPU.  Unset or unknown: no cap (the Python
// module refuses unknown values at import, with the list).
Isa isa_cap() {
  static const Isa cap = [] {
    const char* v = std::getenv("MAGICPIG_ISA");
    if (v == nullptr) return Isa::Avx512Bf16;
    for (Isa isa : kIsas)
      if (std::strcmp(v, isa_name(isa)) == 0) return isa;
    return Isa::Avx512Bf16;
  }();
  return cap;
}

}  // namespace

Isa cpu_isa() {
#if defined(__x86_64__)
  static const Isa isa = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#if defined(__GNUC__) && __GNUC__ >= 10
    if (avx512 && __builtin_cpu_supports("avx512bf16")) return Isa::Avx512Bf16;
#endif
    if (avx512) return Isa::Avx512;
    return avx2 ? Isa::Avx2 : Isa::Scalar;
  }();
  return isa;
#else
  return Isa::Scalar;
#endif
}

Isa resolve_isa(bool force_scalar) {
  if (force_scalar) return Isa::Scalar;
  return std::min(cpu_isa(), isa_cap());
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
      return "avx512_bf16";
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2";
    case Isa::Scalar:
      break;
  }
  return "scalar";
}

const char* active_isa() { return isa_name(resolve_isa(false)); }

}  // namespace mp
