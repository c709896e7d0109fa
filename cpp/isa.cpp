// Run-time ISA detection: the build targets baseline x86-64 (no -march=native), so every AVX2 and
// AVX-512 function carries a target attribute and runs only where this says the CPU has it.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common.h"
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mp {

namespace {

// MAGICPIG_ISA caps the path process-wide ("scalar", "avx2", "avx512", "avx512_bf16", "amx"), so a user
// or a test can run the kernel as it runs on an older CPU.  Unset or unknown: no cap (the Python
// module refuses unknown values at import, with the list).
Isa isa_cap() {
  static const Isa cap = [] {
    const char* v = std::getenv("MAGICPIG_ISA");
    if (v == nullptr) return Isa::Amx;
    for (Isa isa : kIsas)
      if (std::strcmp(v, isa_name(isa)) == 0) return isa;
    return Isa::Amx;
  }();
  return cap;
}

#if defined(__x86_64__) && defined(__linux__)
// Linux hands out the AMX tile state (8 KB of register file a thread) only to a process that asks:
// until then the first tile instruction faults.  Asked once; refused (an old kernel, a too small
// signal stack), the CPU counts as having no AMX.
bool os_grants_amx_tiles() {
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted >> kXfeatureXtiledata & 1)) return true;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && (granted >> kXfeatureXtiledata & 1);
}
#endif

}  // namespace

Isa cpu_isa() {
#if defined(__x86_64__)
  static const Isa isa = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#if defined(__GNUC__) && __GNUC__ >= 10
    const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
#if __GNUC__ >= 11 && defined(__linux__)
    if (bf16 && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") && os_grants_amx_tiles())
      return Isa::Amx;
#endif
    if (bf16) return Isa::Avx512Bf16;
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
    case Isa::Amx:
      return "amx";
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
