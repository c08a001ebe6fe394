// Vector helpers shared by the CPU kernels: 16-lane float vectors loaded from and stored to
// float32, bfloat16 or float16 memory (with a mask for tails), and a vectorized exp.
//
// The kernels are compiled for the machine that builds them (-march=native). Without AVX-512
// (__AVX512F__) they are not built at all: afdserve then keeps its PyTorch paths.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace afd {

#if defined(__AVX512F__)
constexpr bool kHaveAvx512 = true;
#else
constexpr bool kHaveAvx512 = false;
#endif

#if defined(__AVX512BF16__)
constexpr bool kHaveAvx512Bf16 = true;
#else
constexpr bool kHaveAvx512Bf16 = false;
#endif

#if defined(__AVX512F__)

inline __mmask16 tail_mask(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// 16 (or n < 16, the rest 0) elements of T as floats
inline __m512 load16(const float* p, int n = 16) { return _mm512_maskz_loadu_ps(tail_mask(n), p); }
inline __m512 load16(const at::BFloat16* p, int n = 16) {
  __m256i h = _mm256_maskz_loadu_epi16(tail_mask(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p, int n = 16) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail_mask(n), p));
}

// float -> bfloat16 rounded to nearest even (NaN kept a NaN), as at::BFloat16 does
inline __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline void store16(float* p, __m512 v, int n = 16) { _mm512_mask_storeu_ps(p, tail_mask(n), v); }
inline void store16(at::BFloat16* p, __m512 v, int n = 16) { _mm256_mask_storeu_epi16(p, tail_mask(n), to_bf16(v)); }
inline void store16(at::Half* p, __m512 v, int n = 16) {
  _mm256_mask_storeu_epi16(p, tail_mask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for 16 floats: exp(r) * 2^n with x = n ln2 + r, |r| <= ln2/2, r's exp by its Taylor
// series to degree 7 (relative error below 1e-8, under float32's half ulp); overflows to inf,
// underflows through the denormals to 0, NaN stays NaN.
inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.7228f), lo = _mm512_set1_ps(-104.0f);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512 y = _mm512_scalef_ps(p, n);
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(y, nan, x);
}

inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

#endif  // __AVX512F__

}  // namespace afd
