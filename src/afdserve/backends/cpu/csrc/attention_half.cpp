// The attention half of a layer in one call (the cpu attention backend: afdserve.backends.cpu.attention): the
// kernels of layers.cpp, linear.cpp and attention.cpp in the order the module runs them, called
// from C++, so a step pays one operator call per layer instead of one per kernel (and none of the
// Python between them):
//
//   xn = rms_norm(x, in_w); qkv = xn W_qkv^T (+ b_qkv); q = rope_cache(qkv, ...) (keys and values
//   into the caches); a = paged_attention(q, ...); o = a W_o^T (+ b_o); (h, y) = add_rms_norm(o, x,
//   post_w); and the router's logits y W_r^T in x's dtype, widened to float32 (when router_w is given;
//   an empty tensor otherwise), the rounding of `linear(y, W_r).float()`.
//
// Weights are the packed copies of afdserve.backends.cpu.ops.pack; biases float32.
#include "calls.h"
#include "vec.h"

#include <torch/library.h>

#include <tuple>

#if defined(AFD_VEC)
namespace afd {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_half(
    const at::Tensor& x, const at::Tensor& in_w, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    int64_t heads, int64_t kv_heads, const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w,
    const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& cu_q, int64_t block_size,
    int64_t window, double scale, const c10::optional<at::Tensor>& sinks, const at::Tensor& o_w,
    const c10::optional<at::Tensor>& o_b, const at::Tensor& post_w, const c10::optional<at::Tensor>& router_w,
    int64_t experts, double eps) {
  TORCH_CHECK(layers_supported(x.scalar_type()) && linear_supported(x.scalar_type())
              && attention_supported(x.scalar_type()), "afdserve attention_half: no kernel for ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && k_cache.dim() == 3, "attention_half: x must be contiguous [T, H]");
  const int64_t t = x.size(0), hidden = x.size(1), hd = k_cache.size(2);
  // each intermediate is freed once the next is computed, as the module's Python frees them: with
  // all of them held to the end, a prefill's would take fresh memory (page faults) every call
  at::Tensor xn = std::get<1>(call_norm(x, in_w, eps, c10::nullopt));
  at::Tensor qkv = call_linear(xn, qkv_w, qkv_b, (heads + 2 * kv_heads) * hd, c10::nullopt);
  xn.reset();
  at::Tensor q = call_rope_cache(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w, eps);
  qkv.reset();
  at::Tensor a = call_paged_attention(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale,
                                      sinks);
  q.reset();
  at::Tensor o = call_linear(a.view({t, heads * hd}), o_w, o_b, hidden, c10::nullopt);
  a.reset();
  auto [h, y] = call_norm(o, post_w, eps, x);
  o.reset();
  at::Tensor logits = router_w.has_value() ? call_linear(y, *router_w, c10::nullopt, experts, c10::nullopt).to(at::kFloat)
                                           : at::empty({0}, x.options().dtype(at::kFloat));
  return {h, y, logits};
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("attention_half(Tensor x, Tensor in_w, Tensor qkv_w, Tensor? qkv_b, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int heads, int kv_heads, Tensor? q_w, Tensor? k_w, "
        "Tensor block_tables, Tensor kv_lens, Tensor cu_q, int block_size, int window, float scale, Tensor? sinks, "
        "Tensor o_w, Tensor? o_b, Tensor post_w, Tensor? router_w, int experts, float eps) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(afdserve_kernels, CPU, m) { m.impl("attention_half", &afd::attention_half); }
#endif  // AFD_VEC
