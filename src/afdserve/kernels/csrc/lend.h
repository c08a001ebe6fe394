// Threads lent by idle worker processes of this machine (afdserve.runtime.core_board).
//
// A board in shared memory holds, per lender slot, the threads its owner lends while it waits (0
// while it computes) and which process holds them. A kernel that runs in slices claims, before
// each slice, the lent threads no other process holds, runs the slice on its own threads plus
// those, and gives them back: an owner that wakes takes its cores back at the next slice boundary.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace afd {

// Claims the lent threads it can (at most the board's limit) and returns how many.
int borrow_threads();
// Gives every slot claimed by borrow_threads back.
void return_threads();
// A board is registered in this process.
bool lending();

// f over [0, n) in up to `slices` consecutive ranges, each run by at::parallel_for on this
// process's own threads plus the threads borrowed for it (one range on the own threads when no
// board is registered or the caller says the work is too small to be worth more threads).
template <typename F>
void parallel_lent(int64_t n, int64_t slices, bool worth, const F& f) {
  if (!worth || !lending() || n <= 1) {
    at::parallel_for(0, n, 1, f);
    return;
  }
  const int own = omp_get_max_threads();
  const int64_t step = (n + std::min(n, slices) - 1) / std::min(n, slices);
  for (int64_t a = 0; a < n; a += step) {
    const int lent = borrow_threads();
    omp_set_num_threads(own + lent);
    at::parallel_for(a, std::min(n, a + step), 1, f);
    if (lent > 0) return_threads();
  }
  omp_set_num_threads(own);
}

}  // namespace afd
