// The small per-layer operations of the attention half, each one pass instead of a chain of
// PyTorch operators, with the same roundings as the PyTorch code they replace (afdserve.model):
//
// rms_norm(x, w, eps) -> y = w * (x * rsqrt(mean(x^2) + eps)), the normalized value rounded to the
//   dtype before the product with w (as transformers' RMSNorm: `weight * hidden.to(dtype)`);
// add_rms_norm(x, residual, w, eps) -> (h, y): h = x + residual rounded to the dtype, y = rms_norm(h).
// rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w?, k_w?, eps) -> q:
//   splits qkv [T, (heads + 2 kv_heads) * D] into heads, RMS-normalizes q and k per head (Qwen3:
//   q_w, k_w [D]), rotates the first R = cos.size(1) dimensions half-split (x*cos + rotate(x)*sin,
//   each product and the sum rounded to the dtype) and writes k and v into the caches at `slots`;
//   returns q [T, heads, D].
#include "calls.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>

namespace afd {

bool layers_supported(c10::ScalarType dt) {
  return kHaveVec && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
}

namespace {

#if defined(AFD_VEC)

// v rounded to T and back (identity for float32)
template <typename T>
inline V16 round_to(V16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// y[0:n] = w * rounded(x * rsqrt(mean(x^2) + eps)), x read as float32 from `x` (n <= 16 * kMaxChunks)
template <typename T, typename W>
inline void norm_row(const float* x, int64_t n, const W* w, float eps, T* y) {
  V16 ss = vzero();
  for (int64_t i = 0; i < n; i += 16) {
    V16 v = vload(x + i);  // the caller's buffer is padded with zeros to 16
    ss = vfmadd(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(vsum(ss) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - i));
    V16 v = round_to<T>(vmul(vload(x + i), vset1(inv)));
    store16(y + i, vmul(load16(w + i, m), v), m);
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, double eps, const c10::optional<at::Tensor>& res,
                   at::Tensor& h, at::Tensor& y) {
  const int64_t rows = x.size(0), d = x.size(1), dp = (d + 15) / 16 * 16;
  const T* xp = x.data_ptr<T>();
  const T* rp = res.has_value() ? res->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* hp = res.has_value() ? h.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(dp, 0.0f);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < d; i += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, d - i));
        V16 v = load16(xp + r * d + i, m);
        if (rp != nullptr) {
          v = round_to<T>(vadd(v, load16(rp + r * d + i, m)));
          store16(hp + r * d + i, v, m);
        }
        vstore(buf.data() + i, v);
      }
      norm_row<T>(buf.data(), d, wp, static_cast<float>(eps), yp + r * d);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                        const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(layers_supported(x.scalar_type()), "afdserve rms_norm: no kernel for ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous()
              && w.scalar_type() == x.scalar_type(), "rms_norm: x [T, D] contiguous, w [D] of x's dtype");
  TORCH_CHECK(!residual.has_value() || (residual->sizes() == x.sizes() && residual->is_contiguous()
              && residual->scalar_type() == x.scalar_type()), "rms_norm: residual must be like x");
  at::Tensor y = at::empty_like(x);
  at::Tensor h = residual.has_value() ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
      AT_DISPATCH_CASE(at::kFloat, [&] { rms_norm_impl<float>(x, w, eps, residual, h, y); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { rms_norm_impl<at::BFloat16>(x, w, eps, residual, h, y); })
      AT_DISPATCH_CASE(at::kHalf, [&] { rms_norm_impl<at::Half>(x, w, eps, residual, h, y); }));
  return {h, y};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return std::get<1>(norm(x, w, eps, {})); }

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  return norm(x, w, eps, residual);
}

// one head: normalized (if w), its first R dimensions rotated, into dst
template <typename T>
inline void rotate_head(const T* src, int64_t d, const T* cos, const T* sin, int64_t rot, const T* w, float eps,
                        float* buf, T* dst) {
  for (int64_t i = 0; i < d; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, d - i));
    vstore(buf + i, load16(src + i, m));
  }
  if (w != nullptr) {  // RMS norm of the head, rounded to T like the module's output
    alignas(64) T normed[512];
    norm_row<T>(buf, d, w, eps, normed);
    for (int64_t i = 0; i < d; i += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, d - i));
      vstore(buf + i, load16(normed + i, m));
    }
  }
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < d; i += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, d - i));
    V16 x = vload(buf + i);
    if (i < rot) {  // rot is a multiple of 2; its lanes past rot keep x (below)
      const int mr = static_cast<int>(std::min<int64_t>(16, rot - i));
      alignas(64) float other[16];
      for (int j = 0; j < mr; ++j) {
        const int64_t k = i + j;
        other[j] = k < half ? -buf[k + half] : buf[k - half];
      }
      V16 a = round_to<T>(vmul(x, load16(cos + i, mr)));
      V16 b = round_to<T>(vmul(load16(other, mr), load16(sin + i, mr)));
      x = vfirst(x, vadd(a, b), mr);
    }
    store16(dst + i, x, m);
  }
}

template <typename T>
void rope_cache_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                     at::Tensor& vc, const at::Tensor& slots, int64_t nh, int64_t nkv, const T* qw, const T* kw,
                     double eps, at::Tensor& q) {
  const int64_t T_ = qkv.size(0), d = kc.size(2), rot = cos.size(1), width = qkv.size(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* kp = kc.data_ptr<T>();
  T* vp = vc.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T_, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf((d + 15) / 16 * 16, 0.0f);
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = src + t * width;
      const T* c = cp + t * rot;
      const T* s = sp + t * rot;
      for (int64_t h = 0; h < nh; ++h) rotate_head<T>(row + h * d, d, c, s, rot, qw, e, buf.data(), qp + (t * nh + h) * d);
      const int64_t slot = sl[t];
      for (int64_t g = 0; g < nkv; ++g) {
        rotate_head<T>(row + (nh + g) * d, d, c, s, rot, kw, e, buf.data(), kp + (slot * nkv + g) * d);
        std::memcpy(vp + (slot * nkv + g) * d, row + (nh + nkv + g) * d, d * sizeof(T));
      }
    }
  });
}

at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                      at::Tensor v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                      const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w, double eps) {
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(layers_supported(dt), "afdserve rope_cache: no kernel for ", dt);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous()
              && k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.size(1) == kv_heads,
              "rope_cache: caches must be contiguous [slots, kv_heads, head_dim] of qkv's dtype");
  const int64_t d = k_cache.size(2);
  TORCH_CHECK(d <= 512, "rope_cache: head_dim above 512");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "rope_cache: qkv must be [T, (heads + 2 kv_heads) * head_dim] with unit column stride");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && cos.size(1) <= d
              && cos.size(1) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dt
              && sin.scalar_type() == dt, "rope_cache: cos/sin must be contiguous [T, R <= head_dim, even] of qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == qkv.size(0) && slots.is_contiguous(),
              "rope_cache: slots must be int64 [T]");
  for (const auto* w : {&q_w, &k_w}) {
    TORCH_CHECK(!w->has_value() || ((*w)->numel() == d && (*w)->is_contiguous() && (*w)->scalar_type() == dt),
                "rope_cache: q/k norm weights must be [head_dim] of qkv's dtype");
  }
  at::Tensor contiguous = qkv.stride(0) == qkv.size(1) ? qkv : qkv.contiguous();
  at::Tensor q = at::empty({qkv.size(0), heads, d}, qkv.options());
  AT_DISPATCH_SWITCH(dt, "rope_cache",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        rope_cache_impl<float>(contiguous, cos, sin, k_cache, v_cache, slots, heads, kv_heads,
                               q_w.has_value() ? q_w->data_ptr<float>() : nullptr,
                               k_w.has_value() ? k_w->data_ptr<float>() : nullptr, eps, q);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        rope_cache_impl<at::BFloat16>(contiguous, cos, sin, k_cache, v_cache, slots, heads, kv_heads,
                                      q_w.has_value() ? q_w->data_ptr<at::BFloat16>() : nullptr,
                                      k_w.has_value() ? k_w->data_ptr<at::BFloat16>() : nullptr, eps, q);
      })
      AT_DISPATCH_CASE(at::kHalf, [&] {
        rope_cache_impl<at::Half>(contiguous, cos, sin, k_cache, v_cache, slots, heads, kv_heads,
                                  q_w.has_value() ? q_w->data_ptr<at::Half>() : nullptr,
                                  k_w.has_value() ? k_w->data_ptr<at::Half>() : nullptr, eps, q);
      }));
  return q;
}

#endif  // AFD_VEC

}  // namespace

#if defined(AFD_VEC)
std::tuple<at::Tensor, at::Tensor> call_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                             const c10::optional<at::Tensor>& residual) {
  return norm(x, w, eps, residual);
}
at::Tensor call_rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                           const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w, double eps) {
  return rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w, eps);
}
#endif

}  // namespace afd

#if defined(AFD_VEC)
TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int heads, int kv_heads, Tensor? q_w, Tensor? k_w, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(afdserve_kernels, CPU, m) {
  m.impl("rms_norm", &afd::rms_norm);
  m.impl("add_rms_norm", &afd::add_rms_norm);
  m.impl("rope_cache", &afd::rope_cache);
}
#endif
