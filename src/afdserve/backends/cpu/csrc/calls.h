// The kernels of the other files, called from C++ (no dispatcher): what a fused op is made of.
// Each checks its inputs as its registered op does.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace afd {

bool attention_supported(c10::ScalarType dt);
bool layers_supported(c10::ScalarType dt);
bool linear_supported(c10::ScalarType dt);

// layers.cpp (AFD_VEC builds): (x + residual, rms_norm of it); without residual (undefined, y)
std::tuple<at::Tensor, at::Tensor> call_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                             const c10::optional<at::Tensor>& residual);
at::Tensor call_rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                           const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w, double eps);
// linear.cpp
at::Tensor call_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n,
                       c10::optional<at::ScalarType> out_dtype);
// attention.cpp
at::Tensor call_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& cu_q,
                                int64_t block_size, int64_t window, double scale, const c10::optional<at::Tensor>& sinks);

}  // namespace afd
