// The board of lent threads and the helpers that use them (lend.h).
#include "lend.h"

#include <pthread.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <immintrin.h>
#include <mutex>
#include <thread>
#include <vector>

namespace afd {
namespace {

at::Tensor board;        // int32 [2, slots]: row 0 the threads each slot's owner lends, row 1 who holds them
int64_t most = 0;        // threads this process borrows at most
int32_t me = 0;          // this process's id in row 1
std::atomic<int64_t> helped{0};  // chunks run by helpers (diagnostics and tests)

int32_t* lends() { return board.data_ptr<int32_t>(); }
int32_t* holders() { return board.data_ptr<int32_t>() + board.size(1); }

int32_t load(const int32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

// the slot's threads are lent and this process holds them (its owner resets both when it wakes)
bool still_lent(int64_t slot) { return load(lends() + slot) > 0 && load(holders() + slot) == me; }

void unclaim(int64_t i) {
  int32_t mine = me;  // an owner that woke has cleared it already
  __atomic_compare_exchange_n(holders() + i, &mine, 0, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

// claims slot i if its owner lends and nobody holds it; the threads it lends (0: not claimed)
int32_t claim(int64_t i) {
  const int32_t n = load(lends() + i);
  if (n <= 0) return 0;
  int32_t free = 0;
  if (!__atomic_compare_exchange_n(holders() + i, &free, me, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return 0;
  if (load(lends() + i) > 0) return n;
  unclaim(i);  // the owner woke between the two reads: the claim lapses
  return 0;
}

// One lent call's work: chunks handed out by a counter.
struct Job {
  const std::function<void(int64_t, int64_t)>* f = nullptr;
  int64_t n = 0, grain = 1, chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int> helpers{0};  // helpers inside the job: the caller returns when none is left
  std::mutex mu;
  std::exception_ptr error;

  bool run_chunk() {  // false: no chunk left
    const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
    if (c >= chunks) return false;
    try {
      (*f)(c * grain, std::min(n, (c + 1) * grain));
    } catch (...) {
      std::lock_guard<std::mutex> g(mu);
      if (!error) error = std::current_exception();
      next.store(chunks, std::memory_order_relaxed);  // the others stop at their next chunk
    }
    return true;
  }
};

// A thread of this process that runs chunks on a claimed slot's lent core.
struct Helper {
  std::mutex mu;
  std::condition_variable cv;
  Job* job = nullptr;         // set by the recruiting thread, cleared by the helper when it leaves
  bool started = false;       // it took the job (until then the caller may take it back: retract)
  int64_t slot = -1;
  std::atomic<bool> busy{false};

  void main() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return job != nullptr; });
      Job* j = job;
      started = true;
      lk.unlock();
      while (still_lent(slot)) {
        if (!j->run_chunk()) break;
        helped.fetch_add(1, std::memory_order_relaxed);
      }
      lk.lock();
      job = nullptr;
      started = false;
      busy.store(false, std::memory_order_release);
      j->helpers.fetch_sub(1, std::memory_order_acq_rel);  // last touch of the job: its caller may return
    }
  }
};

// Helpers live as long as the process (detached: a process may exit while they sleep); a forked
// child has none of their threads, so it starts with an empty pool.
std::vector<Helper*> pool;
std::vector<int64_t> held;  // slots claimed by the running call
bool running = false;        // a lent call is running (a nested or concurrent one runs unlent)
std::mutex running_mu;
[[maybe_unused]] const int forget_helpers_on_fork = pthread_atfork(nullptr, nullptr, [] { pool.clear(); });

// Takes the job back from the helpers that have not woken to start it: the lent core may be its
// owner's again, and the caller must not wait for a thread that gets no core to run on.
void retract(Job& job) {
  for (Helper* h : pool) {
    std::lock_guard<std::mutex> g(h->mu);
    if (h->job == &job && !h->started) {
      h->job = nullptr;
      h->busy.store(false, std::memory_order_release);
      job.helpers.fetch_sub(1, std::memory_order_acq_rel);
    }
  }
}

Helper* idle_helper() {
  for (Helper* h : pool) {
    if (!h->busy.load(std::memory_order_acquire)) return h;
  }
  if (static_cast<int64_t>(pool.size()) >= most) return nullptr;
  Helper* h = new Helper();
  pool.push_back(h);
  std::thread([h] { h->main(); }).detach();
  return h;
}

// Claims the slots lent now that nobody holds, within `most` threads working for this process's
// helpers, and sends an idle helper per lent thread into the job.
void recruit(Job& job) {
  int64_t working = 0;
  for (Helper* h : pool) working += h->busy.load(std::memory_order_acquire) ? 1 : 0;
  const int64_t slots = board.size(1);
  const int32_t* l = lends();
  for (int64_t i = 0; i < slots && working < most; ++i) {
    const int32_t n = load(l + i);
    if (n <= 0 || working + n > most) continue;
    if (load(holders() + i) != 0 || claim(i) == 0) continue;
    held.push_back(i);
    for (int32_t t = 0; t < n; ++t) {
      Helper* h = idle_helper();
      if (h == nullptr) break;
      {
        std::lock_guard<std::mutex> g(h->mu);
        h->busy.store(true, std::memory_order_release);
        h->slot = i;
        h->job = &job;
        job.helpers.fetch_add(1, std::memory_order_acq_rel);
      }
      h->cv.notify_one();
      ++working;
    }
  }
}

void lend_board(const at::Tensor& b, int64_t limit) {
  TORCH_CHECK(b.numel() == 0 || (b.scalar_type() == at::kInt && b.dim() == 2 && b.size(0) == 2 && b.is_contiguous()),
              "lend_board: the board must be a contiguous int32 [2, slots] tensor (or empty: no board)");
  TORCH_CHECK(limit >= 0, "lend_board: the limit must be >= 0");
  std::lock_guard<std::mutex> g(running_mu);
  TORCH_CHECK(!running, "lend_board: a lent call is running");
  board = b.numel() == 0 ? at::Tensor() : b;
  most = limit;
  me = static_cast<int32_t>(getpid());
  held.clear();
}

// what a call would borrow now (claimed and given back at once): diagnostics and tests
int64_t lent_threads_now() {
  if (!lending()) return 0;
  std::lock_guard<std::mutex> g(running_mu);
  int64_t got = 0;
  for (int64_t i = 0; i < board.size(1) && got < most; ++i) {
    const int32_t n = load(lends() + i);
    if (n <= 0 || got + n > most) continue;
    if (claim(i) > 0) {
      got += n;
      unclaim(i);
    }
  }
  return got;
}

int64_t lent_chunks() { return helped.load(); }

}  // namespace

bool lending() { return board.defined() && most > 0; }

void parallel_lent(int64_t n, int64_t grain, bool worth, const std::function<void(int64_t, int64_t)>& f) {
  std::unique_lock<std::mutex> g(running_mu, std::defer_lock);
  if (!worth || !lending() || n <= 1 || !g.try_lock() || running) {
    at::parallel_for(0, n, 1, f);
    return;
  }
  running = true;
  g.unlock();
  Job job;
  job.f = &f;
  job.n = n;
  job.grain = std::max<int64_t>(1, grain);
  job.chunks = (n + job.grain - 1) / job.grain;
  // each own thread takes chunks until none is left; the first also recruits lent threads between its chunks
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      do {
        if (t == 0) recruit(job);
      } while (job.run_chunk());
    }
  });
  retract(job);
  for (int spins = 0; job.helpers.load(std::memory_order_acquire) > 0; ++spins) {  // each finishes its chunk
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();  // a helper preempted mid-chunk needs a core
    }
  }
  for (int64_t i : held) unclaim(i);
  held.clear();
  g.lock();
  running = false;
  g.unlock();
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("lend_board(Tensor board, int most) -> ()", &afd::lend_board);
  m.def("lent_threads_now() -> int", &afd::lent_threads_now);
  m.def("lent_chunks() -> int", &afd::lent_chunks);
}
