// The GEMM micro-kernel of the CPU kernels: rows of activations times a packed weight matrix.
//
// Weights are packed once (afdserve.kernels.moe._blocks) into column blocks of NB = 32 outputs:
//   bfloat16: [N/32][K/2][32][2]  (consecutive k in pairs: the operands of vdpbf16ps)
//   float32:  [N/32][K][32]
// A unit is 4 bytes of one row's input: a pair of bfloat16 k, or one float32 k. Activations enter
// packed by groups of up to MR rows, unit i of every row of the group side by side ([units][MR]),
// so one base pointer addresses every broadcast.
//
// block_gemm computes one column block for every group of rows, over K in chunks of KC units, so
// that the chunk of the weight block stays in L1 while every group uses it (the first group reads
// it from memory, with software prefetch ahead).
#pragma once

#include "vec.h"

namespace afd {

constexpr int NB = 32;     // outputs per column block
constexpr int MR = 8;      // rows per group
constexpr int64_t KC = 128;  // units per K chunk (a 16 KB chunk of a bfloat16 weight block)

template <typename T>
constexpr int64_t kPerUnit = std::is_same_v<T, at::BFloat16> ? 2 : 1;

#if defined(__AVX512F__)

// out[r][0:32] (+)= sum over `units` units of packed rows `a` times the weight chunk `w`
template <typename T, int R>
inline void tile(const uint32_t* a, const T* w, int64_t units, float* out, bool accumulate, bool prefetch) {
  __m512 c[2 * R];
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r) c[r] = accumulate ? _mm512_loadu_ps(out + 16 * r) : _mm512_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  for (int64_t i = 0; i < units; ++i) {
    const uint32_t* ai = a + i * MR;
    if (prefetch) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
      const int16_t* wp = reinterpret_cast<const int16_t*>(w) + i * 64;
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(ai[r]));
        c[2 * r] = _mm512_dpbf16_ps(c[2 * r], x, w0);
        c[2 * r + 1] = _mm512_dpbf16_ps(c[2 * r + 1], x, w1);
      }
#endif
    } else {
      __m512 w0 = _mm512_loadu_ps(w + i * NB), w1 = _mm512_loadu_ps(w + i * NB + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512 x = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(ai[r])));
        c[2 * r] = _mm512_fmadd_ps(x, w0, c[2 * r]);
        c[2 * r + 1] = _mm512_fmadd_ps(x, w1, c[2 * r + 1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r) _mm512_storeu_ps(out + 16 * r, c[r]);
}

#elif defined(AFD_AVX2)

// the same tile with 8-float vectors, R <= 2 rows at a time (16 registers): a bfloat16 unit's pair
// of weights is widened to float32 (the even k by a shift, the odd one by a mask), two FMAs
template <typename T, int R>
inline void tile(const uint32_t* a, const T* w, int64_t units, float* out, bool accumulate, bool prefetch) {
  __m256 c[4 * R];
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) c[r] = accumulate ? _mm256_loadu_ps(out + 8 * r) : _mm256_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(w) + units * NB * 4;  // the next chunk
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t i = 0; i < units; ++i) {
    const uint32_t* ai = a + i * MR;
    if (prefetch) _mm_prefetch(pf + i * 128, _MM_HINT_T0), _mm_prefetch(pf + i * 128 + 64, _MM_HINT_T0);
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      __m256 x0[R], x1[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_set1_epi32(static_cast<int32_t>(ai[r]));
        x0[r] = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
        x1[r] = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));
      }
      const __m256i* wp = reinterpret_cast<const __m256i*>(reinterpret_cast<const int16_t*>(w) + i * 64);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {  // 8 outputs each: [8][2] bfloat16
        const __m256i wv = _mm256_loadu_si256(wp + q);
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, odd));
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) {
          c[4 * r + q] = _mm256_fmadd_ps(x0[r], w0, c[4 * r + q]);
          c[4 * r + q] = _mm256_fmadd_ps(x1[r], w1, c[4 * r + q]);
        }
      }
    } else {
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
  }
#pragma GCC unroll 8
  for (int r = 0; r < 4 * R; ++r) _mm256_storeu_ps(out + 8 * r, c[r]);
}

// rows of a group two at a time (the first pair prefetches the next chunk)
template <typename T>
inline void tile_rows(int n, const uint32_t* a, const T* w, int64_t units, float* out, bool acc, bool pf) {
  for (int r = 0; r < n; r += 2) {
    if (n - r >= 2) {
      tile<T, 2>(a + r, w, units, out + r * NB, acc, pf && r == 0);
    } else {
      tile<T, 1>(a + r, w, units, out + r * NB, acc, pf && r == 0);
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
    default: tile<T, 8>(a, w, units, out, acc, pf); break;
  }
}

#endif  // __AVX512F__

#if defined(AFD_VEC)

// One column block `w` ([units][32] units) for `rows` rows packed in groups at `a` ([groups][units][MR]):
// out[row][0:32] float32 (row-major, 32 per row)
template <typename T>
inline void block_gemm(const uint32_t* a, int64_t rows, int64_t units, const T* w, float* out) {
  const int64_t groups = (rows + MR - 1) / MR;
  for (int64_t k0 = 0; k0 < units; k0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, units - k0);
    const T* wc = w + k0 * NB * kPerUnit<T>;
    for (int64_t g = 0; g < groups; ++g) {
      const int n = static_cast<int>(std::min<int64_t>(MR, rows - g * MR));
      tile_rows<T>(n, a + (g * units + k0) * MR, wc, kc, out + g * MR * NB, k0 > 0, g == 0);
    }
  }
}

// Packs row r (units `row`) into its group's place: group base `g` ([units][MR])
inline void pack_row(const uint32_t* row, int64_t units, int r, uint32_t* g) {
  for (int64_t i = 0; i < units; ++i) g[i * MR + r] = row[i];
}

#endif  // AFD_VEC

}  // namespace afd
