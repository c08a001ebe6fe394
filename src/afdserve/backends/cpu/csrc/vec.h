// Vector helpers shared by the CPU kernels: 16-lane float vectors (V16) loaded from and stored to
// float32, bfloat16 or float16 memory (with a count for tails), and a vectorized exp.
//
// The kernels are compiled for the machine that builds them (-march=native). With AVX-512 a V16 is
// one __m512; with AVX2, FMA and F16C (AFD_AVX2) it is a pair of __m256 halves, and the kernels
// written with these helpers (the GEMMs, the fused MoE, the norms) run too. Without either they are
// not built at all: the torch backends serve then (ops.cpp: supported).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AFD_AVX2 1
#endif
#if defined(__AVX512F__) || defined(AFD_AVX2)
#define AFD_VEC 1
#endif

// helpers that take or return vectors are always inlined (with AVX2 a V16, two __m256, crosses a
// call through memory: exp16 and the attention kernel's chunk helpers were calls)
#define AFD_INLINE inline __attribute__((always_inline))

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

// the V16 helpers (and the GEMM, MoE, linear and norm kernels) are built
#if defined(AFD_VEC)
constexpr bool kHaveVec = true;
#else
constexpr bool kHaveVec = false;
#endif
// bfloat16 GEMMs: with AVX512-BF16 (vdpbf16ps), or with AVX2 (bfloat16 widened to float32)
constexpr bool kHaveBf16Gemm = (kHaveAvx512 && kHaveAvx512Bf16) || !kHaveAvx512 && kHaveVec;

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

using V16 = __m512;
inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset1(float f) { return _mm512_set1_ps(f); }
inline V16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V16 v) { _mm512_storeu_ps(p, v); }
// past the caches (p 64-byte aligned): an output that is not read again soon costs no line fill
inline void vstream(float* p, V16 v) { _mm512_stream_ps(p, v); }
constexpr int64_t kStreamAlign = 64;
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 vmin(V16 a, V16 b) { return _mm512_min_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline float vsum(V16 v) { return _mm512_reduce_add_ps(v); }
// the first n lanes of `take`, the others of `keep`
inline V16 vfirst(V16 keep, V16 take, int n) { return _mm512_mask_mov_ps(keep, tail_mask(n), take); }
// lanes where v is not <= t (larger, or a NaN), equal to t, or NaN, as bits; the largest lane (no NaN)
inline uint32_t vexceeds(V16 v, float t) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_NLE_UQ); }
inline uint32_t vequal(V16 v, float t) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_EQ_OQ); }
inline uint32_t visnan(V16 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline float vhmax(V16 v) { return _mm512_reduce_max_ps(v); }

#elif defined(AFD_AVX2)

struct V16 {
  __m256 lo, hi;
};
AFD_INLINE V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AFD_INLINE V16 vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
AFD_INLINE V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AFD_INLINE void vstore(float* p, V16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
AFD_INLINE void vstream(float* p, V16 v) { _mm256_stream_ps(p, v.lo), _mm256_stream_ps(p + 8, v.hi); }
constexpr int64_t kStreamAlign = 32;
AFD_INLINE V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
AFD_INLINE V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
AFD_INLINE V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
AFD_INLINE V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
AFD_INLINE V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
AFD_INLINE V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
AFD_INLINE float vsum(V16 v) {
  __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// lanes where v is not <= t (larger, or a NaN), equal to t, or NaN, as bits; the largest lane (no NaN)
template <int kCmp>
AFD_INLINE uint32_t vbits(V16 v, __m256 t) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v.lo, t, kCmp)))
         | static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v.hi, t, kCmp))) << 8;
}
AFD_INLINE uint32_t vexceeds(V16 v, float t) { return vbits<_CMP_NLE_UQ>(v, _mm256_set1_ps(t)); }
AFD_INLINE uint32_t vequal(V16 v, float t) { return vbits<_CMP_EQ_OQ>(v, _mm256_set1_ps(t)); }
AFD_INLINE uint32_t visnan(V16 v) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v.lo, v.lo, _CMP_UNORD_Q)))
         | static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(v.hi, v.hi, _CMP_UNORD_Q))) << 8;
}
AFD_INLINE float vhmax(V16 v) {
  const __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

// the first n lanes of `take`, the others of `keep`
AFD_INLINE V16 vfirst(V16 keep, V16 take, int n) {
  const __m256i n8 = _mm256_set1_epi32(n), iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n8, iota));
  const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n8, _mm256_add_epi32(iota, _mm256_set1_epi32(8))));
  return {_mm256_blendv_ps(keep.lo, take.lo, lo), _mm256_blendv_ps(keep.hi, take.hi, hi)};
}

// 8 elements of T as floats
AFD_INLINE __m256 bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
AFD_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
AFD_INLINE __m256 load8(const at::BFloat16* p) { return bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
AFD_INLINE __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 16 (or n < 16, the rest 0) elements of T as floats
template <typename T>
AFD_INLINE V16 load16(const T* p, int n = 16) {
  if (n >= 16) return {load8(p), load8(p + 8)};
  alignas(32) T t[16] = {};
  std::memcpy(t, p, sizeof(T) * (n > 0 ? n : 0));
  return {load8(t), load8(t + 8)};
}

// float -> bfloat16 rounded to nearest even (NaN kept a NaN), as at::BFloat16 does: 16 values
AFD_INLINE __m256i bf16_bits(__m256 v) {  // 8 values in the low halves of 32-bit lanes
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
  return _mm256_srli_epi32(r, 16);
}
AFD_INLINE __m256i to_bf16(V16 v) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v.lo), bf16_bits(v.hi)), 0xd8);
}

AFD_INLINE void store16(float* p, V16 v, int n = 16) {
  if (n >= 16) return vstore(p, v);
  alignas(32) float t[16];
  vstore(t, v);
  std::memcpy(p, t, sizeof(float) * (n > 0 ? n : 0));
}
AFD_INLINE void store16(at::BFloat16* p, V16 v, int n = 16) {
  alignas(32) uint16_t t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), to_bf16(v));
  std::memcpy(p, t, sizeof(uint16_t) * (n < 16 ? (n > 0 ? n : 0) : 16));
}
AFD_INLINE void store16(at::Half* p, V16 v, int n = 16) {
  alignas(32) uint16_t t[16];
  constexpr int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_store_si128(reinterpret_cast<__m128i*>(t), _mm256_cvtps_ph(v.lo, rnd));
  _mm_store_si128(reinterpret_cast<__m128i*>(t + 8), _mm256_cvtps_ph(v.hi, rnd));
  std::memcpy(p, t, sizeof(uint16_t) * (n < 16 ? (n > 0 ? n : 0) : 16));
}

// exp of 8 floats, as exp16 of the AVX-512 build: 2^n applied in two factors (each a normal
// float), so that results down through the denormals come out as scalef gives them
AFD_INLINE __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-104.0f);
  __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  auto pow2 = [](__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); };
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(n2));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
AFD_INLINE V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }
AFD_INLINE V16 sigmoid16(V16 x) {
  const V16 one = vset1(1.0f);
  V16 d = vadd(one, exp16(vsub(vzero(), x)));
  return {_mm256_div_ps(one.lo, d.lo), _mm256_div_ps(one.hi, d.hi)};
}

#endif  // __AVX512F__ / AFD_AVX2

}  // namespace afd
