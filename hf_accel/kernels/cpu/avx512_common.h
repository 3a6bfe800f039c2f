// Small AVX-512 helpers shared by hf_accel's native kernels (include where __AVX512F__ is defined).
#pragma once
#include <immintrin.h>

namespace hf_accel {

// The lane sums of four vectors, in that order, in one xmm: [sum(a), sum(b), sum(c), sum(d)].
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto half = [](__m512 v) {  // 16 -> 8 lanes
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The epilogue of an integer-dot tile (W8A8 / W8A16): acc[i][r] holds 16 exact int32 group dots of activation row i
// and weight row r; y[i * ldy + r] = wscale[r] * sum_l xscale[i, l] * acc[i][r][l]. One reduction order for every
// tile shape, so a row's result does not depend on the rows beside it.
template <int MR, int NR>
inline void store_scaled_dots(const __m512i (&acc)[MR][NR], const float* xscale, int64_t lanes, const float* wscale,
                              float* y, int64_t ldy) {
  for (int i = 0; i < MR; ++i) {
    const __m512 s = _mm512_loadu_ps(xscale + i * lanes);
    __m512 f[4];
    for (int r = 0; r < 4; ++r) f[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][r % NR]), s);
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(f[0], f[1], f[2], f[3]));
    for (int r = 0; r < NR; ++r) y[i * ldy + r] = wscale[r] * sums[r];
  }
}

}  // namespace hf_accel
