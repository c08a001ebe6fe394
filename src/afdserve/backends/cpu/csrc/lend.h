// Threads lent by idle worker processes of this machine (afdserve.backends.cpu.cores).
//
// A board in shared memory holds, per lender slot, the threads its owner lends while it waits (0
// while it computes) and which process holds them. A big kernel splits its work into chunks of
// about kChunkMacs multiply-adds that its own threads take in turn; between chunks one of them
// claims the lent threads no other process holds and wakes as many helper threads of this process,
// which take chunks too. A helper stops at the first chunk boundary after its slot's owner woke
// (the owner resets the slot), so a waiting worker's core is used within about one chunk of its
// lending, and given back within about one chunk of its waking.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace afd {

// Multiply-adds per chunk of lent work (tens of microseconds on one core).
constexpr int64_t kChunkMacs = int64_t{1} << 21;

// A board is registered in this process and it may borrow.
bool lending();

// Items per chunk for items of `macs` multiply-adds each.
inline int64_t chunk_items(int64_t macs) { return std::max<int64_t>(1, kChunkMacs / std::max<int64_t>(1, macs)); }

// f over [0, n): in chunks of `grain` items taken by this process's own threads and by helpers for
// the threads idle neighbours lend (lend.cpp), or, when no board is registered, the work is not
// `worth` more threads or another lent call is running, by at::parallel_for on the own threads.
// Each item is computed by one thread, whichever it is: results do not depend on who helped.
void parallel_lent(int64_t n, int64_t grain, bool worth, const std::function<void(int64_t, int64_t)>& f);

}  // namespace afd
