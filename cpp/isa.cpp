// Run-time ISA detection: the build targets baseline x86-64 (no -march=native), so every AVX-512
// function carries a target attribute and runs only where this says the CPU has it.
#include <cstdlib>

#include "common.h"

namespace mp {

bool cpu_has_avx512() {
#if defined(__x86_64__)
  // MAGICPIG_NO_AVX512=1 lets a user (or a test) pin the portable path process-wide.
  static const bool ok = !std::getenv("MAGICPIG_NO_AVX512") && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

bool cpu_has_avx512bf16() {
#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 10
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

Isa resolve_isa(bool force_scalar) {
  if (force_scalar || !cpu_has_avx512()) return Isa::Scalar;
  return cpu_has_avx512bf16() ? Isa::Avx512Bf16 : Isa::Avx512;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
      return "avx512_bf16";
    case Isa::Avx512:
      return "avx512";
    case Isa::Scalar:
      break;
  }
  return "scalar";
}

const char* active_isa() { return isa_name(resolve_isa(false)); }

}  // namespace mp
