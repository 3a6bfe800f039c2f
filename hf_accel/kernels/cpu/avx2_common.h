// Small AVX2 helpers shared by hf_accel's native kernels.
#pragma once
#include <immintrin.h>

namespace hf_accel {

// Sum of the 8 lanes of v.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

}  // namespace hf_accel
