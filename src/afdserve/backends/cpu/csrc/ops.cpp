// What the kernels of this build can run: supported(kernel, dtype).
#include "vec.h"

#include <torch/library.h>

#include <string>

namespace afd {

bool moe_supported(c10::ScalarType dt);
bool attention_supported(c10::ScalarType dt);
bool layers_supported(c10::ScalarType dt);
bool linear_supported(c10::ScalarType dt);

namespace {

bool supported(const std::string& kernel, c10::ScalarType dt) {
  if (kernel == "fused_moe") return moe_supported(dt);
  if (kernel == "paged_attention") return attention_supported(dt);
  if (kernel == "rms_norm" || kernel == "rope_cache") return layers_supported(dt);
  if (kernel == "linear") return linear_supported(dt);
  if (kernel == "attention_half") return layers_supported(dt) && linear_supported(dt) && attention_supported(dt);
  return false;
}

}  // namespace
}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) { m.def("supported(str kernel, ScalarType dtype) -> bool", &afd::supported); }
