// Pieces of one job shared out between processes through a word in shared memory
// (afdserve.runtime.lm_head): the LM head's vocabulary blocks, taken from the bottom by the
// attention worker that owns the job and from the top by expert workers that have nothing else to
// do, until the two ends meet. Each word packs the job's tag (16 bits: a piece of an older job of
// the same lane is never taken for a newer one) and the untaken range [lo, hi) of 24 bits each.
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace afd {
namespace {

constexpr int64_t kBits = 24;
constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;

uint64_t pack(int64_t tag, int64_t lo, int64_t hi) {
  return (static_cast<uint64_t>(tag) & 0xffff) << (2 * kBits) | (static_cast<uint64_t>(lo) & kMask) << kBits |
         (static_cast<uint64_t>(hi) & kMask);
}

std::atomic<uint64_t>* word(const at::Tensor& words, int64_t index) {
  TORCH_CHECK(words.scalar_type() == at::kLong && words.is_contiguous() && words.device().is_cpu(),
              "claims: words must be a contiguous int64 CPU tensor");
  TORCH_CHECK(index >= 0 && index < words.numel(), "claims: index ", index, " out of range");
  static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "lock-free 64-bit atomics");
  return reinterpret_cast<std::atomic<uint64_t>*>(words.data_ptr<int64_t>() + index);
}

// A new job: tag `tag`, blocks [0, n) untaken.
void claims_open(const at::Tensor& words, int64_t index, int64_t tag, int64_t n) {
  TORCH_CHECK(n >= 0 && static_cast<uint64_t>(n) <= kMask, "claims: ", n, " blocks do not fit");
  word(words, index)->store(pack(tag, 0, n), std::memory_order_seq_cst);
}

// Takes up to `n` blocks of job `tag` from the bottom (top=false) or the top of what is left;
// returns start << 32 | end, or -1 when nothing is left (or the word holds another job now).
int64_t claims_take(const at::Tensor& words, int64_t index, int64_t tag, bool top, int64_t n) {
  TORCH_CHECK(n > 0, "claims: take at least one block");
  std::atomic<uint64_t>* w = word(words, index);
  uint64_t cur = w->load(std::memory_order_seq_cst);
  while (true) {
    const int64_t t = static_cast<int64_t>(cur >> (2 * kBits)), lo = static_cast<int64_t>((cur >> kBits) & kMask),
                  hi = static_cast<int64_t>(cur & kMask);
    if (t != (tag & 0xffff) || lo >= hi) return -1;
    const int64_t a = top ? std::max(lo, hi - n) : lo, b = top ? hi : std::min(hi, lo + n);
    const uint64_t next = top ? pack(t, lo, a) : pack(t, b, hi);
    if (w->compare_exchange_weak(cur, next, std::memory_order_seq_cst)) return a << 32 | b;
  }
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("claims_open(Tensor words, int index, int tag, int n) -> ()", &afd::claims_open);
  m.def("claims_take(Tensor words, int index, int tag, bool top, int n) -> int", &afd::claims_take);
}
