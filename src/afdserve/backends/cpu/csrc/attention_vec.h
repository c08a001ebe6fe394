// The paged attention kernel's vector helpers (attention.cpp): 16 x 16 transposes, the lanes of a
// chunk of keys a query attends (Keep), and bfloat16 scores by vdpbf16ps with AVX512-BF16.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cstdint>

#if defined(AFD_VEC)

namespace afd {
namespace attn {

#if defined(__AVX512F__)

inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// the lanes j of a chunk of keys from position c0 whose position c0 + j is in [lo, hi]
using Keep = __mmask16;
inline Keep keep_range(int64_t c0, int64_t lo, int64_t hi) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)), lanes);
  return _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(lo)), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(hi)), _MM_CMPINT_LE);
}
// the kept lanes of v, -inf in the others
inline V16 keep_or_minf(Keep k, V16 v) { return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), k, v); }

#else  // AFD_AVX2

AFD_INLINE void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// 16 rows of 16 floats transposed, as four 8x8 blocks
AFD_INLINE void transpose16(V16 r[16]) {
  __m256 a[8], b[8], c[8], d[8];
  for (int i = 0; i < 8; ++i) a[i] = r[i].lo, b[i] = r[i + 8].lo, c[i] = r[i].hi, d[i] = r[i + 8].hi;
  transpose8(a), transpose8(b), transpose8(c), transpose8(d);
  for (int i = 0; i < 8; ++i) r[i] = {a[i], b[i]}, r[i + 8] = {c[i], d[i]};
}

using Keep = uint32_t;  // a bit per lane
AFD_INLINE Keep keep_range(int64_t c0, int64_t lo, int64_t hi) {
  const int64_t j0 = std::max<int64_t>(0, lo - c0), j1 = std::min<int64_t>(15, hi - c0);
  return j0 > j1 ? 0u : ((2u << j1) - 1u) & ~((1u << j0) - 1u);
}
AFD_INLINE V16 keep_or_minf(Keep k, V16 v) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lo = _mm256_set1_epi32(static_cast<int32_t>(k & 0xffu)), hi = _mm256_set1_epi32(static_cast<int32_t>(k >> 8));
  const __m256 ml = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(lo, bit), bit));
  const __m256 mh = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(hi, bit), bit));
  const __m256 minf = _mm256_set1_ps(-INFINITY);
  return {_mm256_blendv_ps(minf, v.lo, ml), _mm256_blendv_ps(minf, v.hi, mh)};
}

#endif  // __AVX512F__ / AFD_AVX2

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bfloat16 scores by vdpbf16ps: s[r] = sum_d q_r[d] k_j[d] for the chunk's 16 keys j, over the keys'
// dimensions in pairs (a pair is one 32-bit word: the chunk's rows of 16 words are transposed as
// they are, with no widening to float32). `qrow[r]`: query vector r's row (bfloat16, hd even).
template <int R>
inline void pair_scores(const at::BFloat16* const* qrow, const int64_t* slots, int64_t c0, int nk,
                        const at::BFloat16* kc, int64_t nkv, int64_t g, int64_t hd, V16* s) {
  const int64_t words = hd / 2;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) s[r] = vzero();
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    const int nw = static_cast<int>(std::min<int64_t>(16, words - w0));
    V16 rows[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t sl = j < nk ? slots[c0 + j] : -1;
      rows[j] = sl < 0 ? vzero() : _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
          tail_mask(nw), reinterpret_cast<const int32_t*>(kc + (sl * nkv + g) * hd) + w0));
    }
    transpose16(rows);  // rows[w]: word w0 + w of the 16 keys
    for (int w = 0; w < nw; ++w) {
      const __m512bh k = (__m512bh)_mm512_castps_si512(rows[w]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh qw = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(qrow[r])[w0 + w]);
        s[r] = _mm512_dpbf16_ps(s[r], qw, k);
      }
    }
  }
}
constexpr bool kPairScores = true;
#else
constexpr bool kPairScores = false;
#endif

}  // namespace attn
}  // namespace afd

#endif  // AFD_VEC
