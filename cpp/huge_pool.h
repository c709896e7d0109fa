// Memory for the big arrays of segments: 2 MiB-aligned anonymous mappings advised as transparent
// huge pages, kept for reuse when a segment is freed.
//
// Why not malloc: decode reads sampled rows and buckets at random over tens to hundreds of MB, so
// with 4 KiB pages nearly every row is also a TLB miss (a nested page walk under a hypervisor).
// glibc serves blocks under its mmap threshold (which grows to 32 MiB once big blocks are freed)
// from heap memory freed earlier, already faulted as 4 KiB pages, whatever madvise says afterwards.
// Fresh mappings fault as huge pages, but each first touch of one may compact memory, and an
// engine builds and frees segments all the time (prompts come and go, decode grows segments).  So
// freed regions go to a pool, coalesced by address, and the next build takes the best fit there:
// huge pages, already faulted.
//
// Bound: the pool holds freed regions only while live + pooled bytes stay within a limit
// (set_huge_pool_limit; the backend passes index_memory_mb, the index's own cap), so the memory
// the index holds, used or waiting for reuse, stays under what the user allowed it.  Regions
// that do not fit go back to the OS at once.
//
// Thread-safe: the engine thread merges segments while the background indexer builds others.
#pragma once
#include <cstddef>

namespace mp {

constexpr size_t kHugePage = size_t{2} << 20;

// A region of at least `bytes` (rounded up to 2 MiB), 2 MiB aligned, contents undefined.
// Throws std::bad_alloc when the OS refuses.
void* huge_alloc(size_t bytes);
// Returns a region from huge_alloc(bytes) (same `bytes`).
void huge_free(void* p, size_t bytes);

struct HugePoolStats {
  size_t live_bytes = 0;    // regions handed out and not yet freed
  size_t pooled_bytes = 0;  // freed regions kept for reuse
  size_t limit_bytes = 0;   // live + pooled above this: freed regions are unmapped
  size_t fresh_maps = 0;    // allocations that mapped new memory
  size_t reuses = 0;        // allocations served from the pool
  size_t unmapped = 0;      // freed regions returned to the OS
};
HugePoolStats huge_pool_stats();
// Also unmaps pooled regions above the new limit.
void set_huge_pool_limit(size_t bytes);

}  // namespace mp
