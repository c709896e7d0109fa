// Benchmark-only (included by gather_roof.cpp and lookup_floor.cpp): a buffer on 2 MiB pages, as the
// kernel's index and mirror are (cpp/huge_pool.cpp), so the benchmarks' random reads pay the same
// TLB costs as the kernel's.
#pragma once
#include <sys/mman.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

// `bytes` bytes on 2 MiB pages, every byte set to `fill` (so faulted in); unmapped when it goes.
struct HugeBuffer {
  size_t bytes, huge = size_t{2} << 20;
  void* m;
  char* buf;
  HugeBuffer(size_t bytes_, int fill) : bytes(bytes_) {
    m = mmap(nullptr, bytes + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(m != MAP_FAILED, "mmap failed");
    buf = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(m) + huge - 1) / huge * huge);
    madvise(buf, bytes, MADV_HUGEPAGE);
    std::memset(buf, fill, bytes);
  }
  ~HugeBuffer() { munmap(m, bytes + huge); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
};
