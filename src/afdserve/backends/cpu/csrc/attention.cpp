// Paged attention for the CPU over a varlen batch: every sequence's new tokens (one for a decode,
// many for a prefill or a chunk of one) attend to its keys in the paged KV cache, read in place
// through its block table. One call per layer and step, decodes and prefills together.
//
// q [T, nh, hd]; k_cache / v_cache [num_slots, nkv, hd] (slot = block * block_size + offset);
// block_tables [S, max_blocks] int32 (logical block -> cache block, -1 where released);
// kv_lens [S] int32 (context length after this step); cu_q [S + 1] int32 (sequence s owns query rows
// cu_q[s] .. cu_q[s+1]-1: its last tokens). A query at position p attends keys
// [max(0, p - window + 1), p] (window 0: [0, p]). With sinks [nh] float32 (gpt-oss) every head's
// softmax has one more logit, sinks[head], that takes weight and adds no value.
//
// Work items are tiles of up to 16 query vectors (tokens x heads of one key head) over one
// sequence, taken dynamically by the threads. A tile's keys are read in chunks of 16 and transposed,
// so its scores are 16 keys wide: bfloat16 keys with AVX512-BF16 as they are, in pairs of dimensions
// (vdpbf16ps), others converted to float32 (FMAs); with AVX2 a tile of one vector (a decode's, one
// query head per key head) transposes its keys 8 x 8 in registers and uses them at once. The
// softmax takes two passes over the tile's scores (their maximum first); values are accumulated per
// query vector over the probabilities.
#include "attention_vec.h"
#include "calls.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

namespace afd {

bool attention_supported(c10::ScalarType dt) {
  return kHaveVec && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
}

namespace {

#if defined(AFD_VEC)

using namespace attn;

struct Tile {
  int32_t seq, kv_head, token0, ntok, head0, nheads;
};

struct Batch {
  int64_t nh, nkv, hd, window;
  float scale;
  const int32_t* kv_lens;
  const int32_t* cu_q;
  const int64_t* slot0;  // [S + 1]: where each sequence's slots start in `slots`
  const int64_t* slots;  // every sequence's cache slot per position (-1: released)
  const float* sinks;
};

// Asks for the key and value rows of positions [c0, c1) of one key head ahead of their use: a
// tile's rows are scattered over the cache (one per slot), so loaded one by one they miss one after
// the other; prefetched together the misses overlap.
template <typename T>
inline void prefetch_rows(const int64_t* slots, int64_t c0, int64_t c1, const T* kc, const T* vc, int64_t nkv,
                          int64_t g, int64_t hd) {
  const int64_t bytes = hd * static_cast<int64_t>(sizeof(T));
  for (int64_t j = c0; j < c1; ++j) {
    if (slots[j] < 0) continue;
    const char* kr = reinterpret_cast<const char*>(kc + (slots[j] * nkv + g) * hd);
    const char* vr = reinterpret_cast<const char*>(vc + (slots[j] * nkv + g) * hd);
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(kr + b, _MM_HINT_T0);
      _mm_prefetch(vr + b, _MM_HINT_T0);
    }
  }
}

// chunks of keys (and values) a tile asks for ahead of their use
constexpr int64_t kAhead = 2;

// The first key position a tile reads (aligned to 16), as attend_tile computes it.
inline int64_t first_key(const Tile& tl, const Batch& bt) {
  if (bt.window <= 0) return 0;
  const int64_t qlen = bt.cu_q[tl.seq + 1] - bt.cu_q[tl.seq], kvlen = bt.kv_lens[tl.seq];
  const int64_t k0 = std::max<int64_t>(0, kvlen - qlen + (tl.token0 - bt.cu_q[tl.seq]) - bt.window + 1);
  return k0 - k0 % 16;
}

// Scores of R query vectors (rows of `qf`, stride `ld`) against one chunk of 16 keys (`kt`:
// [dim][16] float32): s[r] = sum_d qf[r][d] * kt[d]
template <int R>
AFD_INLINE void chunk_scores(const float* qf, int64_t ld, const float* kt, int64_t hd, V16* s) {
  V16 c[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) c[r] = vzero();
  for (int64_t d = 0; d < hd; ++d) {
    const V16 k = vload(kt + d * 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) c[r] = vfmadd(vset1(qf[r * ld + d]), k, c[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) s[r] = c[r];
}

#if defined(AFD_AVX2)
// The scores of one query vector (`qf`, float32) against 8 keys (rows `kr`, nullptr: none, 0):
// lane j is sum_d qf[d] * k_j[d] in the order of d, as chunk_scores<1> gives it. The keys are
// transposed 8 dimensions at a time in registers and used at once (a tile of one vector uses each
// transposed key once: nothing to keep for other vectors). hd: a multiple of 8.
template <typename T>
AFD_INLINE __m256 one_scores8(const float* qf, const T* const* kr, int64_t hd) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d0 = 0; d0 < hd; d0 += 8) {
    __m256 k[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) k[j] = kr[j] == nullptr ? _mm256_setzero_ps() : load8(kr[j] + d0);
    transpose8(k);  // k[d]: dimension d0 + d of the 8 keys
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) acc = _mm256_fmadd_ps(_mm256_set1_ps(qf[d0 + d]), k[d], acc);
  }
  return acc;
}
#endif

// acc[r] += sum_j p[r][j] * v_j over the chunk's nk keys, for RB query vectors, 32 dimensions at
// a time (each value row is read once for all of them)
template <typename T, int RB>
AFD_INLINE void chunk_values(const float* p, int nk, const int64_t* slots, const T* vc, int64_t nkv, int64_t g,
                         int64_t hd, float* acc, int64_t ld) {
  for (int64_t d0 = 0; d0 < hd; d0 += 32) {
    const int n0 = static_cast<int>(std::min<int64_t>(16, hd - d0));
    const int n1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, hd - d0 - 16)));
    V16 a0[RB], a1[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      a0[r] = vload(acc + r * ld + d0);
      a1[r] = vload(acc + r * ld + d0 + 16);
    }
    for (int j = 0; j < nk; ++j) {
      if (slots[j] < 0) continue;
      const T* vr = vc + (slots[j] * nkv + g) * hd + d0;
      const V16 v0 = load16(vr, n0);
      const V16 v1 = n1 > 0 ? load16(vr + 16, n1) : vzero();
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const V16 pj = vset1(p[r * 16 + j]);
        a0[r] = vfmadd(pj, v0, a0[r]);
        a1[r] = vfmadd(pj, v1, a1[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      vstore(acc + r * ld + d0, a0[r]);
      vstore(acc + r * ld + d0 + 16, a1[r]);
    }
  }
}

template <typename T>
inline void chunk_values_rows(int rb, const float* p, int nk, const int64_t* slots, const T* vc, int64_t nkv,
                              int64_t g, int64_t hd, float* acc, int64_t ld) {
  switch (rb) {
    case 1: chunk_values<T, 1>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 2: chunk_values<T, 2>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 3: chunk_values<T, 3>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 4: chunk_values<T, 4>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 5: chunk_values<T, 5>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 6: chunk_values<T, 6>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    case 7: chunk_values<T, 7>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
    default: chunk_values<T, 8>(p, nk, slots, vc, nkv, g, hd, acc, ld); break;
  }
}

// One tile: R query vectors (tokens x heads of one key head, R in {1, 2, 4, 8, 16}: the tile's
// real vectors padded with ones that attend nothing) of one sequence, over the keys any of them
// attends, 16 at a time. The softmax takes two passes over the tile's scores (kept in `sb`): the
// exact maximum first, then the probabilities, each chunk's values accumulated as its
// probabilities are known (no running rescale of the accumulators).
template <typename T, int R>
void attend_tile(const Tile& tl, const Batch& bt, const T* q, const T* kc, const T* vc, T* out, float* kt,
                 float* qf, float* acc, std::vector<float>& sb) {
  const int64_t nh = bt.nh, nkv = bt.nkv, hd = bt.hd, G = nh / nkv, nd = (hd + 15) / 16;
  const int64_t ld = (hd + 31) / 32 * 32;  // row stride of qf and acc
  const int real = tl.ntok * tl.nheads;
  const int64_t qlen = bt.cu_q[tl.seq + 1] - bt.cu_q[tl.seq], kvlen = bt.kv_lens[tl.seq];
  const int64_t* slots = bt.slots + bt.slot0[tl.seq];
  // bfloat16 with AVX512-BF16: scores from the bfloat16 rows by vdpbf16ps, scaled after
  constexpr bool pairs = kPairScores && std::is_same_v<T, at::BFloat16>;
  const bool by_pairs = pairs && hd % 2 == 0;
  int64_t lo[R], hi[R];  // key range [lo, hi] of each query vector (empty for padding)
  const T* qrow[R];
  for (int r = 0; r < R; ++r) {
    for (int64_t i = 0; i < ld; ++i) acc[r * ld + i] = 0.0f;
    if (r >= real) {
      lo[r] = 1;
      hi[r] = 0;
      qrow[r] = qrow[0];
      if (!by_pairs) for (int64_t i = 0; i < ld; ++i) qf[r * ld + i] = 0.0f;
      continue;
    }
    const int64_t tok = tl.token0 + r / tl.nheads, head = tl.kv_head * G + tl.head0 + r % tl.nheads;
    hi[r] = kvlen - qlen + (tok - bt.cu_q[tl.seq]);
    lo[r] = bt.window > 0 ? std::max<int64_t>(0, hi[r] - bt.window + 1) : 0;
    qrow[r] = q + (tok * nh + head) * hd;
    if (by_pairs) continue;
    for (int64_t d = 0; d < ld; d += 16) {
      const int n = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, hd - d)));
      vstore(qf + r * ld + d, n > 0 ? vmul(load16(qrow[r] + d, n), vset1(bt.scale)) : vzero());
    }
  }
  int64_t k0 = lo[0], k1 = hi[0];
  for (int r = 1; r < real; ++r) { k0 = std::min(k0, lo[r]); k1 = std::max(k1, hi[r]); }
  k0 -= k0 % 16;  // chunks aligned to 16 positions
  const int64_t nchunks = (k1 - k0) / 16 + 1, row = nchunks * 16;  // sb: [real][row]
  if (static_cast<int64_t>(sb.size()) < real * row) sb.resize(real * row);
  V16 s[R], top[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) top[r] = vset1(-INFINITY);
  // pass 1: every chunk's scores (-inf where a vector does not attend), and each vector's maximum
  prefetch_rows(slots, k0, std::min(k0 + 16 * kAhead, k1 + 1), kc, vc, nkv, tl.kv_head, hd);
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t c0 = k0 + 16 * c;
    const int nk = static_cast<int>(std::min<int64_t>(16, k1 + 1 - c0));
    prefetch_rows(slots, c0 + 16 * kAhead, std::min(c0 + 16 * (kAhead + 1), k1 + 1), kc, vc, nkv, tl.kv_head, hd);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if constexpr (pairs) {
      if (by_pairs) {
        pair_scores<R>(reinterpret_cast<const at::BFloat16* const*>(qrow), slots, c0, nk,
                       reinterpret_cast<const at::BFloat16*>(kc), nkv, tl.kv_head, hd, s);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) s[r] = vmul(s[r], vset1(bt.scale));
      }
    }
#endif
#if defined(AFD_AVX2)
    if (R == 1 && hd % 8 == 0) {  // one vector: its keys transposed and used in registers
      const T* kr[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t sl = j < nk ? slots[c0 + j] : -1;
        kr[j] = sl < 0 ? nullptr : kc + (sl * nkv + tl.kv_head) * hd;
      }
      s[0] = {one_scores8<T>(qf, kr, hd), one_scores8<T>(qf, kr + 8, hd)};
    } else
#endif
    if (!by_pairs) {
      for (int64_t d = 0; d < nd; ++d) {  // the chunk's keys as float32, transposed: kt[dim][key]
        V16 rows[16];
        const int n = static_cast<int>(std::min<int64_t>(16, hd - 16 * d));
        for (int j = 0; j < 16; ++j) {
          const int64_t sl = j < nk ? slots[c0 + j] : -1;
          rows[j] = sl < 0 ? vzero() : load16(kc + (sl * nkv + tl.kv_head) * hd + 16 * d, n);
        }
        transpose16(rows);
        for (int j = 0; j < 16; ++j) vstore(kt + (16 * d + j) * 16, rows[j]);
      }
      chunk_scores<R>(qf, ld, kt, hd, s);
    }
    for (int r = 0; r < real; ++r) {
      const V16 v = keep_or_minf(keep_range(c0, lo[r], hi[r]), s[r]);
      vstore(sb.data() + r * row + 16 * c, v);
      top[r] = vmax(top[r], v);
    }
  }
  // pass 2: probabilities (unnormalized) and the values
  float m[R];
  V16 sum[R];
  for (int r = 0; r < real; ++r) {
    m[r] = vhmax(top[r]);
    sum[r] = vzero();
  }
  alignas(64) float p[R * 16];
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t c0 = k0 + 16 * c;
    const int nk = static_cast<int>(std::min<int64_t>(16, k1 + 1 - c0));
    for (int r = 0; r < real; ++r) {
      const V16 e = m[r] == -INFINITY ? vzero() : exp16(vsub(vload(sb.data() + r * row + 16 * c), vset1(m[r])));
      vstore(p + r * 16, e);
      sum[r] = vadd(sum[r], e);
    }
    for (int r0 = 0; r0 < real; r0 += 8) {
      chunk_values_rows<T>(std::min(8, real - r0), p + r0 * 16, nk, slots + c0, vc, nkv, tl.kv_head, hd,
                           acc + r0 * ld, ld);
    }
  }
  for (int r = 0; r < real; ++r) {
    const int64_t tok = tl.token0 + r / tl.nheads, head = tl.kv_head * G + tl.head0 + r % tl.nheads;
    float l = vsum(sum[r]), scale = 0.0f;
    if (bt.sinks != nullptr) {  // the sink's logit joins the softmax
      const float sink = bt.sinks[head], mnew = std::max(m[r], sink);
      const float corr = std::exp(m[r] - mnew);
      l = l * corr + std::exp(sink - mnew);
      scale = corr / l;
    } else if (l > 0.0f) {
      scale = 1.0f / l;
    }
    T* dst = out + (tok * nh + head) * hd;
    for (int64_t d = 0; d < nd; ++d) {
      store16(dst + 16 * d, vmul(vload(acc + r * ld + 16 * d), vset1(scale)),
              static_cast<int>(std::min<int64_t>(16, hd - 16 * d)));
    }
  }
}

template <typename T>
inline void attend(const Tile& tl, const Batch& bt, const T* q, const T* kc, const T* vc, T* out, float* kt,
                   float* qf, float* acc, std::vector<float>& sb) {
  const int real = tl.ntok * tl.nheads;
  if (real <= 1) attend_tile<T, 1>(tl, bt, q, kc, vc, out, kt, qf, acc, sb);
  else if (real <= 2) attend_tile<T, 2>(tl, bt, q, kc, vc, out, kt, qf, acc, sb);
  else if (real <= 4) attend_tile<T, 4>(tl, bt, q, kc, vc, out, kt, qf, acc, sb);
  else if (real <= 8) attend_tile<T, 8>(tl, bt, q, kc, vc, out, kt, qf, acc, sb);
  else attend_tile<T, 16>(tl, bt, q, kc, vc, out, kt, qf, acc, sb);
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
                          const at::Tensor& tables, const at::Tensor& kv_lens, const at::Tensor& cu_q, int64_t bs,
                          int64_t window, double scale, const c10::optional<at::Tensor>& sinks) {
  const int64_t S = kv_lens.size(0), nh = q.size(1), hd = q.size(2), nkv = kc.size(1), G = nh / nkv;
  const int64_t max_blocks = tables.size(1);
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  // every sequence's slots, from its block table (rounded up to whole blocks)
  std::vector<int64_t> slot0(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= cq[s + 1] - cq[s] && (lens[s] + bs - 1) / bs <= max_blocks,
                "paged_attention: sequence ", s, " has more queries or keys than its context or block table");
    slot0[s + 1] = slot0[s] + (lens[s] + bs - 1) / bs * bs + 16;  // + 16: chunk overrun, never attended
  }
  std::vector<int64_t> slots(slot0[S], -1);
  at::parallel_for(0, S, 16, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      int64_t* dst = slots.data() + slot0[s];
      for (int64_t b = 0; b < (lens[s] + bs - 1) / bs; ++b) {
        const int64_t blk = tab[s * max_blocks + b];
        for (int64_t o = 0; o < bs; ++o) dst[b * bs + o] = blk < 0 ? -1 : blk * bs + o;
      }
    }
  });
  const int64_t nheads = std::min<int64_t>(G, 16), ntok = std::max<int64_t>(1, 16 / nheads);
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t t = cq[s]; t < cq[s + 1]; t += ntok) {
        for (int64_t h = 0; h < G; h += nheads) {
          tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(g), static_cast<int32_t>(t),
                           static_cast<int32_t>(std::min<int64_t>(ntok, cq[s + 1] - t)), static_cast<int32_t>(h),
                           static_cast<int32_t>(std::min<int64_t>(nheads, G - h))});
        }
      }
    }
  }
  const Batch bt{nh, nkv, hd, window, static_cast<float>(scale), lens, cq, slot0.data(), slots.data(),
                 sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    const int64_t ld = (hd + 31) / 32 * 32;
    std::vector<float> kt(ld * 16), qf(16 * ld), acc(16 * ld), sb;
    for (int64_t i = next++; i < n; i = next++) {
      if (i + 1 < n) {  // the first keys of the tile that comes next (likely this thread's)
        const Tile& nt = tiles[i + 1];
        const int64_t c0 = first_key(nt, bt);
        prefetch_rows(bt.slots + bt.slot0[nt.seq], c0, std::min<int64_t>(c0 + 16 * kAhead, bt.kv_lens[nt.seq]),
                      kc.data_ptr<T>(), vc.data_ptr<T>(), nkv, nt.kv_head, hd);
      }
      attend<T>(tiles[i], bt, q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), out.data_ptr<T>(), kt.data(),
                qf.data(), acc.data(), sb);
    }
  });
}

#endif  // AFD_VEC

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& cu_q,
                           int64_t block_size, int64_t window, double scale, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(attention_supported(q.scalar_type()), "afdserve paged_attention: no kernel for ", q.scalar_type(),
              " on this CPU (needs AVX-512, or AVX2 with FMA and F16C)");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_attention: q must be contiguous [T, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "paged_attention: caches must be contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention: q and the caches must have one dtype");
  TORCH_CHECK(k_cache.size(2) == q.size(2) && q.size(1) % k_cache.size(1) == 0,
              "paged_attention: head_dim differs or heads are not a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && kv_lens.scalar_type() == at::kInt && cu_q.scalar_type() == at::kInt,
              "paged_attention: block_tables, kv_lens and cu_q must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && kv_lens.is_contiguous() && cu_q.is_contiguous()
              && block_tables.size(0) == kv_lens.size(0) && cu_q.size(0) == kv_lens.size(0) + 1,
              "paged_attention: block_tables [S, B], kv_lens [S] and cu_q [S + 1] do not match");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->numel() == q.size(1)),
              "paged_attention: sinks must be float32 [heads]");
  TORCH_CHECK(block_size >= 1, "paged_attention: block_size below 1");
  at::Tensor out = at::empty_like(q);
#if defined(AFD_VEC)
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_attention",
      AT_DISPATCH_CASE(at::kFloat, [&] { paged_attention_impl<float>(q, k_cache, v_cache, out, block_tables, kv_lens, cu_q, block_size, window, scale, sinks); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { paged_attention_impl<at::BFloat16>(q, k_cache, v_cache, out, block_tables, kv_lens, cu_q, block_size, window, scale, sinks); })
      AT_DISPATCH_CASE(at::kHalf, [&] { paged_attention_impl<at::Half>(q, k_cache, v_cache, out, block_tables, kv_lens, cu_q, block_size, window, scale, sinks); }));
#endif
  return out;
}

}  // namespace

at::Tensor call_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& kv_lens, const at::Tensor& cu_q,
                                int64_t block_size, int64_t window, double scale, const c10::optional<at::Tensor>& sinks) {
  return paged_attention(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale, sinks);
}

}  // namespace afd

TORCH_LIBRARY_FRAGMENT(afdserve_kernels, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor kv_lens, "
        "Tensor cu_q, int block_size, int window, float scale, Tensor? sinks) -> Tensor");
}
TORCH_LIBRARY_IMPL(afdserve_kernels, CPU, m) { m.impl("paged_attention", &afd::paged_attention); }
