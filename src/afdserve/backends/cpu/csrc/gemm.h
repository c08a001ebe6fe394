// The GEMM micro-kernel of the CPU kernels: rows of activations times a packed weight matrix.
//
// Weights are packed once (afdserve.backends.cpu.ops.blocks) into column blocks of NB = 32 outputs:
//   bfloat16: [N/32][K/2][32][2]  (consecutive k in pairs: the operands of vdpbf16ps)
//   float32:  [N/32][K][32]
// A unit is 4 bytes of one row's input: a pair of bfloat16 k, or one float32 k. Activations enter
// packed by groups of up to MR rows, unit i of every row of the group side by side ([units][MR]),
// so one base pointer addresses every broadcast. Where bfloat16 is widened to float32 (AVX2), a
// packed unit is the pair already widened, two float32 ([units][MR][2]: kAW words per unit), so a
// tile widens only the weights.
//
// block_gemm computes one column block for every group of rows, over K in chunks of KC units, so
// that the chunk of the weight block stays in L1 while every group uses it (the first group reads
// it from memory, with software prefetch ahead).
#pragma once

#include "vec.h"

#include <utility>

namespace afd {

constexpr int NB = 32;     // outputs per column block
// rows per packed group: a tile of up to MR rows keeps 2 accumulators per row (AVX-512: 24 of the
// 32 registers, beside the two weight vectors), so one pass over a weight chunk serves all of them
constexpr int MR = 12;
constexpr int64_t KC = 128;  // units per K chunk (a 16 KB chunk of a bfloat16 weight block)

template <typename T>
constexpr int64_t kPerUnit = std::is_same_v<T, at::BFloat16> ? 2 : 1;

// 32-bit words per unit of packed activations (see above)
template <typename T>
constexpr int64_t kAW =
#if defined(AFD_AVX2)
    std::is_same_v<T, at::BFloat16> ? 2 : 1;
#else
    1;
#endif

#if defined(__AVX512F__)

// out[r][0:32] (+)= sum over `units` units of packed rows `a` times the weight chunk `w`
template <typename T, int R>
inline void tile(const uint32_t* a, const T* w, int64_t units, float* out, bool accumulate, bool prefetch) {
  __m512 c[2 * R];
#pragma GCC unroll 32
  for (int r = 0; r < 2 * R; ++r) c[r] = accumulate ? _mm512_loadu_ps(out + 16 * r) : _mm512_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  for (int64_t i = 0; i < units; ++i) {
    const uint32_t* ai = a + i * MR;
    if (prefetch) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
      const int16_t* wp = reinterpret_cast<const int16_t*>(w) + i * 64;
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(ai[r]));
        c[2 * r] = _mm512_dpbf16_ps(c[2 * r], x, w0);
        c[2 * r + 1] = _mm512_dpbf16_ps(c[2 * r + 1], x, w1);
      }
#endif
    } else {
      __m512 w0 = _mm512_loadu_ps(w + i * NB), w1 = _mm512_loadu_ps(w + i * NB + 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        __m512 x = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(ai[r])));
        c[2 * r] = _mm512_fmadd_ps(x, w0, c[2 * r]);
        c[2 * r + 1] = _mm512_fmadd_ps(x, w1, c[2 * r + 1]);
      }
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < 2 * R; ++r) _mm512_storeu_ps(out + 16 * r, c[r]);
}

#elif defined(AFD_AVX2)

// float32 weights: R <= 2 rows at a time over the block's 32 outputs (16 registers); prefetches
// units [pf0, pf1) of the next chunk
template <int R>
inline void tile_f32(const uint32_t* a, const float* w, int64_t units, float* out, bool accumulate, int64_t pf0,
                     int64_t pf1) {
  __m256 c[4 * R];
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) c[r] = accumulate ? _mm256_loadu_ps(out + 8 * r) : _mm256_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  for (int64_t i = 0; i < units; ++i) {
    const uint32_t* ai = a + i * MR;
    if (i >= pf0 && i < pf1) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256 wq = _mm256_loadu_ps(w + i * NB + 8 * q);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        c[4 * r + q] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(ai[r]))), wq,
                                       c[4 * r + q]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) _mm256_storeu_ps(out + 8 * r, c[r]);
}

// bfloat16 weights: R <= 4 rows times half `h` (16 outputs) of the block, activations widened
// already ([units][MR][2] float32); each unit's 16 weight pairs are widened to float32 once for the
// R rows (the even k by a shift, the odd one by a mask), then two FMAs per row and 8 outputs
template <int R>
inline void tile_bf16(const float* a, const at::BFloat16* w, int h, int64_t units, float* out, bool accumulate,
                      int64_t pf0, int64_t pf1) {
  __m256 c[2 * R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < 2; ++q) {
      c[2 * r + q] = accumulate ? _mm256_loadu_ps(out + r * NB + 16 * h + 8 * q) : _mm256_setzero_ps();
    }
  }
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < units; ++i) {
    if (i >= pf0 && i < pf1) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
    const __m256i* wp = reinterpret_cast<const __m256i*>(reinterpret_cast<const int16_t*>(w) + i * 64) + 2 * h;
    const __m256i v0 = _mm256_loadu_si256(wp), v1 = _mm256_loadu_si256(wp + 1);
    const __m256 w00 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 w01 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd));
    const __m256 w10 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
    const __m256 w11 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd));
    const float* ai = a + i * MR * 2;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(ai + 2 * r), x1 = _mm256_broadcast_ss(ai + 2 * r + 1);
      c[2 * r] = _mm256_fmadd_ps(x0, w00, c[2 * r]);
      c[2 * r] = _mm256_fmadd_ps(x1, w01, c[2 * r]);
      c[2 * r + 1] = _mm256_fmadd_ps(x0, w10, c[2 * r + 1]);
      c[2 * r + 1] = _mm256_fmadd_ps(x1, w11, c[2 * r + 1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < 2; ++q) _mm256_storeu_ps(out + r * NB + 16 * h + 8 * q, c[2 * r + q]);
  }
}

// bfloat16 weights, R <= 2 rows over all 32 outputs of the block, activations widened already: as
// tile_bf16, with 4R accumulators instead of 2R (fewer rows would leave the FMAs waiting on each other)
template <int R>
inline void tile_bf16_full(const float* a, const at::BFloat16* w, int64_t units, float* out, bool accumulate,
                           int64_t pf0, int64_t pf1) {
  __m256 c[4 * R];
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) c[r] = accumulate ? _mm256_loadu_ps(out + 8 * r) : _mm256_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < units; ++i) {
    if (i >= pf0 && i < pf1) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
    const float* ai = a + i * MR * 2;
    __m256 x0[R], x1[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) x0[r] = _mm256_broadcast_ss(ai + 2 * r), x1[r] = _mm256_broadcast_ss(ai + 2 * r + 1);
    const __m256i* wp = reinterpret_cast<const __m256i*>(reinterpret_cast<const int16_t*>(w) + i * 64);
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256i wv = _mm256_loadu_si256(wp + q);
      const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, odd));
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        c[4 * r + q] = _mm256_fmadd_ps(x0[r], w0, c[4 * r + q]);
        c[4 * r + q] = _mm256_fmadd_ps(x1[r], w1, c[4 * r + q]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) _mm256_storeu_ps(out + 8 * r, c[r]);
}

// the units [first, second) of the next chunk that pass p of `passes` prefetches (none without pf)
inline std::pair<int64_t, int64_t> prefetch_share(bool pf, int64_t units, int p, int passes) {
  if (!pf) return {0, 0};
  return {units * p / passes, units * (p + 1) / passes};
}

// the rows of a group in passes (float32: pairs of rows; bfloat16: fours and a last three of rows
// times the two halves of the block, a last one or two over the whole block); with `pf`, each pass
// prefetches its even share of the next chunk
template <typename T>
inline void tile_rows(int n, const uint32_t* a, const T* w, int64_t units, float* out, bool acc, bool pf) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const float* af = reinterpret_cast<const float*>(a);
    const int last = n % 4 == 1 || n % 4 == 2 ? n % 4 : 0;  // rows of the last, whole-block pass
    const int passes = (n - last + 3) / 4 * 2 + (last > 0);
    int p = 0;
    for (int r = 0; r < n - last; r += 4) {
      for (int h = 0; h < 2; ++h) {
        const auto [pf0, pf1] = prefetch_share(pf, units, p++, passes);
        if (n - last - r >= 4) {
          tile_bf16<4>(af + 2 * r, w, h, units, out + r * NB, acc, pf0, pf1);
        } else {
          tile_bf16<3>(af + 2 * r, w, h, units, out + r * NB, acc, pf0, pf1);
        }
      }
    }
    if (last > 0) {
      const auto [pf0, pf1] = prefetch_share(pf, units, p, passes);
      const int r = n - last;
      if (last == 2) {
        tile_bf16_full<2>(af + 2 * r, w, units, out + r * NB, acc, pf0, pf1);
      } else {
        tile_bf16_full<1>(af + 2 * r, w, units, out + r * NB, acc, pf0, pf1);
      }
    }
  } else {
    const int passes = (n + 1) / 2;
    for (int r = 0, p = 0; r < n; r += 2, ++p) {
      const auto [pf0, pf1] = prefetch_share(pf, units, p, passes);
      if (n - r >= 2) {
        tile_f32<2>(a + r, w, units, out + r * NB, acc, pf0, pf1);
      } else {
        tile_f32<1>(a + r, w, units, out + r * NB, acc, pf0, pf1);
      }
    }
  }
}

#endif

#if defined(__AVX512F__)

template <typename T>
inline void tile_rows(int n, const uint32_t* a, const T* w, int64_t units, float* out, bool acc, bool pf) {
  switch (n) {
    case 1: tile<T, 1>(a, w, units, out, acc, pf); break;
    case 2: tile<T, 2>(a, w, units, out, acc, pf); break;
    case 3: tile<T, 3>(a, w, units, out, acc, pf); break;
    case 4: tile<T, 4>(a, w, units, out, acc, pf); break;
    case 5: tile<T, 5>(a, w, units, out, acc, pf); break;
    case 6: tile<T, 6>(a, w, units, out, acc, pf); break;
    case 7: tile<T, 7>(a, w, units, out, acc, pf); break;
    case 8: tile<T, 8>(a, w, units, out, acc, pf); break;
    case 9: tile<T, 9>(a, w, units, out, acc, pf); break;
    case 10: tile<T, 10>(a, w, units, out, acc, pf); break;
    case 11: tile<T, 11>(a, w, units, out, acc, pf); break;
    default: tile<T, 12>(a, w, units, out, acc, pf); break;
  }
}

#endif  // __AVX512F__

#if defined(AFD_VEC)

// Rows per group for `rows` rows: as few groups as MR allows, the rows spread evenly over them, so
// no group is left with a row or two (a tile of few rows waits on its few accumulators' latency
// and streams the weight chunk for little work): 13 rows are groups of 7 and 6, not 12 and 1
inline int64_t group_rows(int64_t rows) {
  const int64_t groups = std::max<int64_t>(1, (rows + MR - 1) / MR);
  return std::max<int64_t>(1, (rows + groups - 1) / groups);
}

// One column block `w` ([units][32] units) for `rows` rows packed in groups of `per_group` rows at
// `a` ([groups][units][MR]): out[row][0:32] float32 (row-major, 32 per row)
template <typename T>
inline void block_gemm(const uint32_t* a, int64_t rows, int64_t units, const T* w, float* out, int64_t per_group) {
  const int64_t groups = (rows + per_group - 1) / per_group;
  for (int64_t k0 = 0; k0 < units; k0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, units - k0);
    const T* wc = w + k0 * NB * kPerUnit<T>;
    for (int64_t g = 0; g < groups; ++g) {
      const int n = static_cast<int>(std::min<int64_t>(per_group, rows - g * per_group));
      tile_rows<T>(n, a + (g * units + k0) * MR * kAW<T>, wc, kc, out + g * per_group * NB, k0 > 0, g == 0);
    }
  }
}

// Unit i of row r into its group's place: group base `g` ([units][MR], or [units][MR][2] widened
// where kAW<T> is 2)
template <typename T>
inline void put_unit(uint32_t* g, int64_t i, int r, uint32_t unit) {
  if constexpr (kAW<T> == 2) {
    g[(i * MR + r) * 2] = unit << 16;             // the even k
    g[(i * MR + r) * 2 + 1] = unit & 0xffff0000u;  // the odd k
  } else {
    g[i * MR + r] = unit;
  }
}

// Packs row r (units `row`) into its group's place
template <typename T>
inline void pack_row(const uint32_t* row, int64_t units, int r, uint32_t* g) {
  for (int64_t i = 0; i < units; ++i) put_unit<T>(g, i, r, row[i]);
}

#endif  // AFD_VEC

}  // namespace afd
