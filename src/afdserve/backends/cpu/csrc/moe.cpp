// Fused MoE experts for the CPU: every routed (token, expert) pair of a layer in one call, with no
// loop over experts on the Python side and no gathered copies of the tokens.
//
// Weights are packed once (afdserve.backends.cpu.ops.pack_gate_up, pack_down) into column blocks of 32 outputs:
//   bfloat16: [E][N/32][K/2][32][2]  (consecutive k in pairs: the operands of vdpbf16ps)
//   float32:  [E][N/32][K][32]
// The gate/up matrix [2I, K] of an expert is packed with its rows reordered so that block b holds
// gate rows 16b..16b+15 and up rows I+16b..I+16b+15: one block's accumulators give 16 activations.
// Rows past the real N are zero (so K of the down projection is I rounded up to 16).
//
// fused_moe: tokens are sorted by expert (counting sort; with `counts`, each pair's id is counted
// there too: an expert worker's load statistics, with no pass of their own); phase 1 runs gate/up
// and the activation into a [pairs, I] buffer, phase 2 the down projection into [pairs, H] float32,
// phase 3 sums each token's pairs in top-k order with their routing weights. Phases 1 and 2 are
// split between threads by column block, so every thread streams a disjoint part of every expert's
// weights once; they run in chunks of blocks taken by this process's threads and by any an idle
// neighbour lends (lend.h).
#include "gemm.h"
#include "lend.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace afd {

bool moe_supported(c10::ScalarType dt);

namespace {

#if defined(AFD_VEC)

// 0: silu(gate) * up; 1: gpt-oss's (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
inline V16 activation(V16 gate, V16 up, int kind, float alpha, float limit) {
  if (kind == 0) return vmul(vmul(gate, sigmoid16(gate)), up);
  V16 lim = vset1(limit);
  gate = vmin(gate, lim);
  up = vmax(vmin(up, lim), vsub(vzero(), lim));
  V16 glu = vmul(gate, sigmoid16(vmul(gate, vset1(alpha))));
  return vmul(vadd(up, vset1(1.0f)), glu);
}

// 16 activations of row r (columns col..col+15) into the packed rows of its group
template <typename T>
inline void store_packed(uint32_t* group, int64_t col, int r, V16 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    alignas(32) uint32_t pairs[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), to_bf16(v));
    for (int q = 0; q < 8; ++q) put_unit<T>(group, col / 2 + q, r, pairs[q]);  // rounded to bfloat16
  } else {
    alignas(64) float f[16];
    vstore(f, v);
    for (int q = 0; q < 16; ++q) std::memcpy(&group[(col + q) * MR + r], &f[q], 4);
  }
}

// fewer routed pairs than this do not borrow lent threads. With vdpbf16ps a decode-sized layer is a
// few hundred microseconds, and borrowing for decode rounds made decode steps slower in paired
// runs with and without lending (with slices and with chunks alike); where bfloat16 is widened to
// float32 (AVX2) the same layer takes milliseconds and a borrowed thread paid from a decode lane of
// 32 tokens on (benchmarks/step_trace.py)
constexpr int64_t kLendMinPairs = kHaveAvx512 && kHaveAvx512Bf16 ? 512 : 32;

template <typename T, typename Id>
at::Tensor fused_moe_impl(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                          const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                          const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& local,
                          int64_t inter, int64_t act, double alpha, double limit,
                          const c10::optional<at::Tensor>& counts) {
  const int64_t T_ = x.size(0), H = x.size(1), K = ids.size(1), E = w13.size(0);
  const int64_t nb1 = w13.size(1), ipad = nb1 * 16, nb2 = w2.size(1);
  const int64_t u1 = H / kPerUnit<T>, u2 = ipad / kPerUnit<T>;  // units of the gate/up and down inputs
  const T* xp = x.data_ptr<T>();
  const Id* idp = ids.data_ptr<Id>();
  const float* wp = weights.data_ptr<float>();
  const int64_t* lp = local.data_ptr<int64_t>();
  const int64_t nlocal = local.size(0);
  // counting sort of the (token, slot) pairs by local expert; each expert's pairs in groups of
  // per_group[e] rows (group_rows: at most MR, spread evenly)
  std::vector<int64_t> start(E + 1, 0), pair_of(T_ * K, -1), group0(E + 1, 0), per_group(E, 1);
  std::vector<int32_t> expert_of(T_ * K, -1);
  int64_t* cp = counts.has_value() ? counts->data_ptr<int64_t>() : nullptr;
  const int64_t ncounts = counts.has_value() ? counts->numel() : 0;
  for (int64_t i = 0; i < T_ * K; ++i) {
    int64_t g = static_cast<int64_t>(idp[i]);
    if (g >= 0 && g < ncounts) ++cp[g];
    int64_t e = (g >= 0 && g < nlocal) ? lp[g] : -1;
    if (e >= 0) { expert_of[i] = static_cast<int32_t>(e); ++start[e + 1]; }
  }
  for (int64_t e = 0; e < E; ++e) {
    per_group[e] = group_rows(start[e + 1]);
    group0[e + 1] = group0[e] + (start[e + 1] + per_group[e] - 1) / per_group[e];
    start[e + 1] += start[e];
  }
  const int64_t P = start[E], groups = group0[E];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), token_of(P);
  for (int64_t i = 0; i < T_ * K; ++i) {
    if (expert_of[i] < 0) continue;
    int64_t p = fill[expert_of[i]]++;
    pair_of[i] = p;
    token_of[p] = i / K;
  }
  at::Tensor out = at::empty({T_, H}, x.options());
  if (P == 0) return out.zero_();
  // packed inputs of the two projections, and the down projections' outputs per pair: tensors, so
  // that a prefill's reuse the allocator's memory; not zeroed (every unit of every row is written
  // before it is read; a group's rows past its last are never read)
  at::Tensor a1t = at::empty({groups * u1 * MR * kAW<T>}, x.options().dtype(at::kInt));
  at::Tensor a2t = at::empty({groups * u2 * MR * kAW<T>}, x.options().dtype(at::kInt));
  uint32_t* a1 = reinterpret_cast<uint32_t*>(a1t.data_ptr<int32_t>());
  uint32_t* a2 = reinterpret_cast<uint32_t*>(a2t.data_ptr<int32_t>());
  at::Tensor ybuf = at::empty({P, H}, x.options().dtype(at::kFloat));
  float* yp = ybuf.data_ptr<float>();
  const T* w13p = w13.data_ptr<T>();
  const T* w2p = w2.data_ptr<T>();
  const float* b13p = b13.has_value() ? b13->data_ptr<float>() : nullptr;  // [E, 2I] float32
  const float* b2p = b2.has_value() ? b2->data_ptr<float>() : nullptr;     // [E, H] float32
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  // phase 0: the token rows of each group, packed
  at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) {
      for (int64_t p = start[e]; p < start[e + 1]; ++p) {
        const int64_t g = group0[e] + (p - start[e]) / per_group[e];
        pack_row<T>(reinterpret_cast<const uint32_t*>(xp + token_of[p] * H), u1,
                    static_cast<int>((p - start[e]) % per_group[e]), a1 + g * u1 * MR * kAW<T>);
      }
    }
  });
  int64_t most = 0;  // rows of the busiest expert
  for (int64_t e = 0; e < E; ++e) most = std::max(most, start[e + 1] - start[e]);
  // phase 1: gate/up and the activation, by blocks of 16 intermediate columns; phases 1 and 2 run
  // in chunks that an idle neighbour's lent threads take too (lend.h)
  const int64_t macs1 = P * H * NB, macs2 = P * ipad * NB;  // per block of each phase
  const bool worth = P >= kLendMinPairs;
  parallel_lent(nb1, chunk_items(macs1), worth, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(most * NB);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = start[e + 1] - start[e];
      if (rows == 0) continue;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t col = b * 16, ncols = std::min<int64_t>(16, inter - col);
        block_gemm<T>(a1 + group0[e] * u1 * MR * kAW<T>, rows, u1, w13p + (e * nb1 + b) * H * NB, acc.data(),
                      per_group[e]);
        V16 bg = vzero(), bu = vzero();
        if (b13p != nullptr) {
          bg = load16(b13p + e * 2 * inter + col, static_cast<int>(ncols));
          bu = load16(b13p + e * 2 * inter + inter + col, static_cast<int>(ncols));
        }
        for (int64_t r = 0; r < rows; ++r) {
          const float* gu = acc.data() + r * NB;
          V16 v = activation(vadd(vload(gu), bg), vadd(vload(gu + 16), bu), act, a, l);
          store_packed<T>(a2 + (group0[e] + r / per_group[e]) * u2 * MR * kAW<T>, col,
                          static_cast<int>(r % per_group[e]), v);
        }
      }
    }
  });
  // phase 2: the down projection, by blocks of 32 hidden columns
  parallel_lent(nb2, chunk_items(macs2), worth, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(most * NB);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = start[e + 1] - start[e];
      if (rows == 0) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t col = c * NB;
        const int n0 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, H - col)));
        const int n1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, H - col - 16)));
        V16 bias0 = vzero(), bias1 = vzero();
        if (b2p != nullptr) {
          bias0 = load16(b2p + e * H + col, n0);
          if (n1 > 0) bias1 = load16(b2p + e * H + col + 16, n1);
        }
        block_gemm<T>(a2 + group0[e] * u2 * MR * kAW<T>, rows, u2, w2p + (e * nb2 + c) * ipad * NB, acc.data(),
                      per_group[e]);
        for (int64_t r = 0; r < rows; ++r) {
          float* y = yp + (start[e] + r) * H + col;
          const float* o = acc.data() + r * NB;
          store16(y, vadd(vload(o), bias0), n0);
          if (n1 > 0) store16(y + 16, vadd(vload(o + 16), bias1), n1);
        }
      }
    }
  });
  // phase 3: each token's pairs, in top-k order, with their routing weights
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < H; h += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, H - h));
        V16 s = vzero();
        for (int64_t j = 0; j < K; ++j) {
          const int64_t p = pair_of[t * K + j];
          if (p >= 0) s = vfmadd(vset1(wp[t * K + j]), load16(yp + p * H + h, n), s);
        }
        store16(op + t * H + h, s, n);
      }
    }
  });
  return out;
}

#endif  // AFD_VEC

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                     const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2,
                     const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& local,
                     int64_t inter, int64_t act, double alpha, double limit,
                     const c10::optional<at::Tensor>& counts) {
  TORCH_CHECK(moe_supported(x.scalar_type()), "afdserve fused_moe: no kernel for ", x.scalar_type(),
              " on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "fused_moe: x must be [T, even H], contiguous");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_moe: weights must have x's dtype");
  TORCH_CHECK(w13.dim() == 5 || w13.dim() == 4, "fused_moe: w13 must be packed (afdserve.backends.cpu.ops.pack_gate_up)");
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous() && w13.size(0) == w2.size(0), "fused_moe: bad packed weights");
  TORCH_CHECK(w13.size(1) * 16 >= inter && w2.size(1) * NB >= x.size(1), "fused_moe: packed shapes do not match");
  TORCH_CHECK(w13.numel() == w13.size(0) * w13.size(1) * x.size(1) * NB, "fused_moe: w13 does not match x's width");
  TORCH_CHECK(w2.numel() == w2.size(0) * w2.size(1) * w13.size(1) * 16 * NB, "fused_moe: w2 does not match w13");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.is_contiguous(), "fused_moe: ids must be [T, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == ids.sizes() && weights.is_contiguous(),
              "fused_moe: weights must be float32 [T, k]");
  TORCH_CHECK(local.scalar_type() == at::kLong && local.dim() == 1, "fused_moe: local must be int64 [num_experts]");
  TORCH_CHECK(!counts.has_value() || (counts->scalar_type() == at::kLong && counts->dim() == 1 &&
                                      counts->is_contiguous() && counts->device() == x.device()),
              "fused_moe: counts must be a contiguous int64 vector");
  for (const auto* b : {&b13, &b2}) {
    TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == at::kFloat && (*b)->is_contiguous()),
                "fused_moe: biases must be contiguous float32");
  }
#if defined(AFD_VEC)
  return AT_DISPATCH_SWITCH(x.scalar_type(), "fused_moe",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        return ids.scalar_type() == at::kInt
            ? fused_moe_impl<float, int32_t>(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha, limit,
                                             counts)
            : fused_moe_impl<float, int64_t>(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha, limit,
                                             counts);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        return ids.scalar_type() == at::kInt
            ? fused_moe_impl<at::BFloat16, int32_t>(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha,
                                                    limit, counts)
            : fused_moe_impl<at::BFloat16, int64_t>(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha,
                                                    limit, counts);
      }));
#else
  return x;
#endif
}

}  // namespace

bool moe_supported(c10::ScalarType dt) {
  if (dt == at::kFloat) return kHaveVec;
  if (dt == at::kBFloat16) return kHaveBf16Gemm;
  return false;
}

}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor? b13, Tensor? b2, Tensor ids, Tensor weights, "
        "Tensor local, int inter, int act, float alpha, float limit, Tensor(a!)? counts=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(afdserve_kernels, CPU, m) { m.impl("fused_moe", &afd::fused_moe); }
