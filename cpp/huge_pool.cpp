// The pool of 2 MiB-aligned regions behind segments' big arrays (why: huge_pool.h).
#include "huge_pool.h"

#include <sys/mman.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <new>

namespace mp {
namespace {

size_t round_up(size_t bytes) { return (bytes + kHugePage - 1) / kHugePage * kHugePage; }

// A fresh mapping of `bytes` (a multiple of 2 MiB), 2 MiB aligned, advised huge before its first
// touch so that its pages fault in as huge ones; nullptr when the OS refuses.
void* map_fresh(size_t bytes) {
  const size_t span = bytes + kHugePage;  // mmap aligns to 4 KiB only: over-map, then trim
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = round_up(start);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + span, used_end = aligned + bytes;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
#endif
  return reinterpret_cast<void*>(aligned);
}

class Pool {
 public:
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = by_size_.lower_bound(bytes);  // best fit: the smallest free region that holds it
      if (it != by_size_.end()) {
        const size_t size = it->first;
        const uintptr_t start = it->second;
        by_size_.erase(it);
        by_addr_.erase(start);
        // The rest stays free; its neighbours cannot be free (free regions are coalesced).
        if (size > bytes) add_free(start + bytes, size - bytes);
        st_.pooled_bytes -= bytes;
        st_.live_bytes += bytes;
        ++st_.reuses;
        return reinterpret_cast<void*>(start);
      }
    }
    void* p = map_fresh(bytes);
    if (!p) {  // the pool's free regions are too small for this one: give them back and retry
      release_all();
      p = map_fresh(bytes);
      if (!p) throw std::bad_alloc();
    }
    std::lock_guard<std::mutex> g(mu_);
    st_.live_bytes += bytes;
    ++st_.fresh_maps;
    unmap_over_limit();
    return p;
  }

  void give(void* p, size_t bytes) {
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    {
      std::lock_guard<std::mutex> g(mu_);
      st_.live_bytes -= bytes;
      if (st_.live_bytes + st_.pooled_bytes + bytes <= st_.limit_bytes) {
        st_.pooled_bytes += bytes;
        insert_coalesced(start, bytes);
        return;
      }
      ++st_.unmapped;
    }
    munmap(p, bytes);
  }

  HugePoolStats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return st_;
  }

  void set_limit(size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    st_.limit_bytes = bytes;
    unmap_over_limit();
  }

 private:
  void release_all() {
    std::lock_guard<std::mutex> g(mu_);
    while (st_.pooled_bytes > 0) unmap_largest();
  }
  void add_free(uintptr_t start, size_t size) {
    by_addr_.emplace(start, size);
    by_size_.emplace(size, start);
  }
  void erase_free(uintptr_t start, size_t size) {
    by_addr_.erase(start);
    auto range = by_size_.equal_range(size);
    for (auto it = range.first; it != range.second; ++it)
      if (it->second == start) {
        by_size_.erase(it);
        return;
      }
  }
  // Merges a freed region with free neighbours, so that a later, bigger build can take them as one.
  void insert_coalesced(uintptr_t start, size_t size) {
    auto next = by_addr_.lower_bound(start);
    if (next != by_addr_.end() && next->first == start + size) {
      const size_t next_size = next->second;
      erase_free(next->first, next_size);
      size += next_size;
    }
    auto prev = by_addr_.lower_bound(start);
    if (prev != by_addr_.begin()) {
      --prev;
      if (prev->first + prev->second == start) {
        const uintptr_t prev_start = prev->first;
        const size_t prev_size = prev->second;
        erase_free(prev_start, prev_size);
        start = prev_start;
        size += prev_size;
      }
    }
    add_free(start, size);
  }
  // Largest first: fewest munmap calls for the bytes released.
  void unmap_largest() {
    auto it = std::prev(by_size_.end());
    const size_t size = it->first;
    const uintptr_t start = it->second;
    by_size_.erase(it);
    by_addr_.erase(start);
    st_.pooled_bytes -= size;
    ++st_.unmapped;
    munmap(reinterpret_cast<void*>(start), size);
  }
  void unmap_over_limit() {
    while (st_.pooled_bytes > 0 && st_.live_bytes + st_.pooled_bytes > st_.limit_bytes) unmap_largest();
  }

  std::mutex mu_;
  std::map<uintptr_t, size_t> by_addr_;               // free regions: start -> bytes
  std::multimap<size_t, uintptr_t> by_size_;          // the same regions: bytes -> start
  HugePoolStats st_{0, 0, size_t{1} << 30, 0, 0, 0};  // 1 GiB until the backend sets its cap
};

// Never destroyed: segments held by Python objects may be freed during interpreter teardown,
// after static destructors would have run.
Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

}  // namespace

void* huge_alloc(size_t bytes) { return pool().take(round_up(bytes)); }
void huge_free(void* p, size_t bytes) { pool().give(p, round_up(bytes)); }
HugePoolStats huge_pool_stats() { return pool().stats(); }
void set_huge_pool_limit(size_t bytes) { pool().set_limit(bytes); }

}  // namespace mp
