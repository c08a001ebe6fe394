// A linear layer over a packed weight (gemm.h): y = x W^T (+ bias), the projections and the LM head.
// One call packs the rows of x once and splits the column blocks between the threads: each thread
// streams a disjoint part of the weight once. The output may be float32 whatever x's dtype (the
// LM head's logits, without a rounding to bfloat16 and a copy). A big one (the LM head) runs in
// chunks that the threads idle workers lend take too (lend.h).
#include "calls.h"
#include "gemm.h"
#include "lend.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <immintrin.h>
#include <mutex>
#include <type_traits>
#include <vector>

namespace afd {

bool linear_supported(c10::ScalarType dt) {
  if (dt == at::kFloat) return kHaveVec;
  if (dt == at::kBFloat16) return kHaveBf16Gemm;
  return false;
}

namespace {

#if defined(AFD_VEC)

// linears of fewer multiply-adds than this do not borrow lent threads (the LM head does)
constexpr int64_t kLendMinMacs = int64_t{1} << 24;
// float32 outputs of at least this many bytes in all (the whole tensor that `out` is a view of: the
// LM head's logits, larger than a core's L2) are written past the caches
constexpr int64_t kStreamMinBytes = int64_t{2} << 20;

// out: [M, n]; with `stream`, float32 output blocks of a big output are written past the caches where
// aligned (the LM head's logits: megabytes that sampling reads once, later; a write that fills no
// line first)
// x W^T over a packed weight, one column block of 32 outputs at a time: x's rows packed once
// (gemm.h), the blocks split between this process's threads and lent ones (parallel_lent)
template <typename T>
struct Blocks {
  // a computed block: how many of its 32 outputs are real (n0 of the first 16, n1 of the second;
  // none past n) and their bias (zero without one, or past n)
  struct Out {
    int64_t col;
    int n0, n1;
    V16 b0, b1;
  };

  int64_t M, K, units, nblocks, n, per_group;
  std::vector<uint32_t> a;
  const T* w;
  const float* bias;

  Blocks(const at::Tensor& x, const at::Tensor& wt, const c10::optional<at::Tensor>& b, int64_t n_)
      : M(x.size(0)), K(x.size(1)), units(K / kPerUnit<T>), nblocks(wt.size(0)), n(n_), per_group(group_rows(M)),
        a(groups() * units * MR * kAW<T>, 0), w(wt.data_ptr<T>()), bias(b.has_value() ? b->data_ptr<float>() : nullptr) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<T>());
    at::parallel_for(0, groups(), 4, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t r = 0; r < per_group && g * per_group + r < M; ++r) {
          pack_row<T>(xp + (g * per_group + r) * units, units, static_cast<int>(r), a.data() + g * units * MR * kAW<T>);
        }
      }
    });
  }

  int64_t groups() const { return (M + per_group - 1) / per_group; }

  // f(c0, c1) over the blocks, in chunks (a big product also on lent threads)
  void run(const std::function<void(int64_t, int64_t)>& f) const {
    parallel_lent(nblocks, chunk_items(M * K * NB), M * K * n >= kLendMinMacs, f);
  }

  // block c for every row into acc (32 per row)
  Out compute(int64_t c, float* acc) const {
    const int64_t col = c * NB;
    Out o{col, static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, n - col))),
          static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, n - col - 16))), vzero(), vzero()};
    block_gemm<T>(a.data(), M, units, w + c * K * NB, acc, per_group);
    if (bias != nullptr) {
      o.b0 = load16(bias + col, o.n0);
      if (o.n1 > 0) o.b1 = load16(bias + col + 16, o.n1);
    }
    return o;
  }
};

template <typename T, typename O>
void linear_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                 const at::Tensor& out, bool stream) {
  const Blocks<T> bl(x, w, bias, n);
  const int64_t M = bl.M;
  O* op = out.data_ptr<O>();
  const int64_t ld = out.stride(0);
  stream = stream && M * ld * static_cast<int64_t>(sizeof(O)) >= kStreamMinBytes;
  bl.run([&](int64_t c0, int64_t c1) {
    std::vector<float> acc(M * NB);
    for (int64_t c = c0; c < c1; ++c) {
      const auto [col, n0, n1, b0, b1] = bl.compute(c, acc.data());
      for (int64_t r = 0; r < M; ++r) {
        const float* o = acc.data() + r * NB;
        O* dst = op + r * ld + col;
        if constexpr (std::is_same_v<O, float>) {
          if (stream && n1 == 16 && reinterpret_cast<uintptr_t>(dst) % kStreamAlign == 0) {
            vstream(dst, vadd(vload(o), b0));
            vstream(dst + 16, vadd(vload(o + 16), b1));
            continue;
          }
        }
        store16(dst, vadd(vload(o), b0), n0);
        if (n1 > 0) store16(dst + 16, vadd(vload(o + 16), b1), n1);
      }
    }
    if (stream) _mm_sfence();  // the streamed stores are visible before the call returns
  });
}

// (v, i) is torch.argmax's choice over (bv, bi) (i < 0: none): the larger value, a NaN counting as
// the largest, the lower index between equals (and between NaNs)
inline bool beats(float v, int64_t i, float bv, int64_t bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  const bool vn = std::isnan(v), bn = std::isnan(bv);
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// per row of x W^T (+ bias): its largest output and that output's column plus `offset` (beats)
// into val [M] and idx [M] (with `merge_into`, where it beats what they hold); the outputs are
// those linear_impl writes, never stored: each block's are compared with the row's best so far in
// registers, and only a block holding a larger one (or a NaN) is reduced to its best
template <typename T>
void argmax_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                 int64_t offset, const at::Tensor& val, const at::Tensor& idx, bool merge_into) {
  const Blocks<T> bl(x, w, bias, n);
  const int64_t M = bl.M;
  float* vp = val.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  if (!merge_into) std::fill(ip, ip + M, int64_t{-1});
  std::mutex merge;
  bl.run([&](int64_t c0, int64_t c1) {
    std::vector<float> acc(M * NB), bv(M, 0.0f);
    std::vector<int64_t> bi(M, -1);
    const V16 none = vset1(-INFINITY);  // the lanes past n
    for (int64_t c = c0; c < c1; ++c) {
      const auto [col, n0, n1, b0, b1] = bl.compute(c, acc.data());
      for (int64_t r = 0; r < M; ++r) {
        if (bi[r] >= 0 && std::isnan(bv[r])) continue;  // the first NaN stays
        V16 v0 = vadd(vload(acc.data() + r * NB), b0), v1 = vadd(vload(acc.data() + r * NB + 16), b1);
        if (n1 < 16) v0 = vfirst(none, v0, n0), v1 = vfirst(none, v1, n1);
        if (bi[r] >= 0 && (vexceeds(v0, bv[r]) | vexceeds(v1, bv[r])) == 0) continue;
        // the block's best: its first NaN, else the first of its largest
        const uint32_t nan = visnan(v0) | visnan(v1) << 16;
        const float top = nan != 0 ? NAN : vhmax(vmax(v0, v1));
        const int j = __builtin_ctz(nan != 0 ? nan : vequal(v0, top) | vequal(v1, top) << 16);
        if (beats(top, col + j, bv[r], bi[r])) bv[r] = top, bi[r] = col + j;
      }
    }
    std::lock_guard<std::mutex> lock(merge);  // chunks merge in any order: beats is order-free
    for (int64_t r = 0; r < M; ++r) {
      if (beats(bv[r], bi[r] < 0 ? -1 : bi[r] + offset, vp[r], ip[r])) vp[r] = bv[r], ip[r] = bi[r] + offset;
    }
  });
}

#endif  // AFD_VEC

void check_inputs(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(linear_supported(dt), "afdserve linear: no kernel for ", dt, " on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (dt == at::kFloat || x.size(1) % 2 == 0),
              "linear: x must be contiguous [M, K] (K even for bfloat16)");
  TORCH_CHECK(w.scalar_type() == dt && w.is_contiguous() && w.size(0) * NB >= n && n > w.size(0) * NB - NB
              && w.numel() == w.size(0) * x.size(1) * NB, "linear: w must be x's packed weight (afdserve.backends.cpu.ops.pack)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "linear: bias must be float32 [N]");
}

// x W^T (+ bias) into out ([M, n] of x's dtype or float32); inputs checked
void linear_into(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                 const at::Tensor& out, bool stream) {
  const auto dt = x.scalar_type(), odt = out.scalar_type();
  TORCH_CHECK(odt == dt || odt == at::kFloat, "linear: the output is x's dtype or float32");
  if (x.size(0) == 0) return;
#if defined(AFD_VEC)
  if (dt == at::kFloat) {
    linear_impl<float, float>(x, w, bias, n, out, stream);
  } else if (odt == at::kFloat) {
    linear_impl<at::BFloat16, float>(x, w, bias, n, out, stream);
  } else {
    linear_impl<at::BFloat16, at::BFloat16>(x, w, bias, n, out, stream);
  }
#endif
}

void linear_argmax(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                   int64_t offset, const at::Tensor& val, const at::Tensor& idx, bool merge) {
  check_inputs(x, w, bias, n);
  TORCH_CHECK(val.scalar_type() == at::kFloat && val.is_contiguous() && val.numel() == x.size(0)
              && idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.numel() == x.size(0) && n > 0,
              "linear_argmax: val must be float32 [M], idx int64 [M], n > 0");
  if (x.size(0) == 0) return;
#if defined(AFD_VEC)
  if (x.scalar_type() == at::kFloat) {
    argmax_impl<float>(x, w, bias, n, offset, val, idx, merge);
  } else {
    argmax_impl<at::BFloat16>(x, w, bias, n, offset, val, idx, merge);
  }
#endif
}

// `stream`: a big float32 output (the LM head's logits) is written past the caches
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                  c10::optional<at::ScalarType> out_dtype, bool stream) {
  check_inputs(x, w, bias, n);
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(out_dtype.value_or(x.scalar_type())));
  linear_into(x, w, bias, n, out, stream);
  return out;
}

}  // namespace

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                       c10::optional<at::ScalarType> out_dtype) {
  return linear(x, w, bias, n, out_dtype, false);
}

}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias, int n, ScalarType? out_dtype, bool stream=False) -> Tensor");
  m.def("linear_argmax(Tensor x, Tensor w, Tensor? bias, int n, int offset, Tensor(a!) val, Tensor(b!) idx, bool merge) -> ()");
}
TORCH_LIBRARY_IMPL(afdserve_kernels, CPU, m) {
  m.impl("linear", &afd::linear);
  m.impl("linear_argmax", &afd::linear_argmax);
}
