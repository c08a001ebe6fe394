// The board of lent threads (lend.h): registered by lend_board, read by parallel_lent.
#include "lend.h"

#include <torch/library.h>
#include <unistd.h>

#include <vector>

namespace afd {
namespace {

at::Tensor board;        // int32 [2, slots]: row 0 the threads each slot's owner lends, row 1 who holds them
int64_t most = 0;        // threads this process borrows at most
int32_t me = 0;          // this process's id in row 1
std::vector<int64_t> held;  // slots claimed by the last borrow_threads

void lend_board(const at::Tensor& b, int64_t limit) {
  TORCH_CHECK(b.numel() == 0 || (b.scalar_type() == at::kInt && b.dim() == 2 && b.size(0) == 2 && b.is_contiguous()),
              "lend_board: the board must be a contiguous int32 [2, slots] tensor (or empty: no board)");
  TORCH_CHECK(limit >= 0, "lend_board: the limit must be >= 0");
  board = b.numel() == 0 ? at::Tensor() : b;
  most = limit;
  me = static_cast<int32_t>(getpid());
  held.clear();
}

}  // namespace

bool lending() { return board.defined() && most > 0; }

int borrow_threads() {
  int32_t* idle = board.data_ptr<int32_t>();
  const int64_t slots = board.size(1);
  int32_t* holder = idle + slots;
  int64_t got = 0;
  for (int64_t i = 0; i < slots && got < most; ++i) {
    const int32_t n = __atomic_load_n(idle + i, __ATOMIC_ACQUIRE);
    if (n <= 0 || got + n > most) continue;
    int32_t free = 0;
    if (__atomic_compare_exchange_n(holder + i, &free, me, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      // the owner may have woken between the two reads: then it reset the holder, and this claim lapses
      if (__atomic_load_n(idle + i, __ATOMIC_ACQUIRE) > 0) {
        held.push_back(i);
        got += n;
      } else {
        int32_t mine = me;
        __atomic_compare_exchange_n(holder + i, &mine, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
      }
    }
  }
  return static_cast<int>(got);
}

void return_threads() {
  int32_t* holder = board.data_ptr<int32_t>() + board.size(1);
  for (int64_t i : held) {
    int32_t mine = me;  // an owner that woke has cleared it already
    __atomic_compare_exchange_n(holder + i, &mine, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  }
  held.clear();
}

namespace {

// what a slice would borrow now (claimed and given back at once): diagnostics and tests
int64_t lent_threads_now() {
  if (!lending()) return 0;
  const int n = borrow_threads();
  return_threads();
  return n;
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("lend_board(Tensor board, int most) -> ()", &afd::lend_board);
  m.def("lent_threads_now() -> int", &afd::lent_threads_now);
}
