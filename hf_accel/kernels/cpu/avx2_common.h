// Small AVX2 helpers shared by hf_accel's native kernels.
#pragma once
#include <immintrin.h>

namespace hf_accel {

// Software prefetch of weights streamed from memory (the int8, integer-dot and half-precision GEMV tiles), into L2:
// hinted into L1 (T0) each prefetch holds one of the core's few L1 miss buffers until its line arrives, which capped
// the int8 GEMV at ~17.5 GB/s of weights from DRAM on 2 cores of the Xeon host against 22.4 GB/s into L2 (T1) and
// 24.5 GB/s for torch.sum over the same 850 MB (docs/log/2026-12-06-avx2-int-dots.md); 4 and 8 KB ahead as 2 KB.
// Always inlined: a call in a tile's inner loop would spill its accumulators (11 GB/s instead of 17 when it was not).
__attribute__((always_inline)) inline void prefetch_weights(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// Sum of the 8 lanes of v.
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

}  // namespace hf_accel
