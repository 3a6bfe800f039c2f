// y [M, N] = x [M, K] float32 @ w [N, K]^T for few activation rows, w row-major and read in place: the loop shared by
// float_linear (decoder_layers.cpp: float32 weights) and half_linear (half_gemm.cpp: bfloat16 / float16 weights,
// widened in registers). Each tile of kRows activation rows x 4 weight rows keeps its 4 * kRows sums in vector lanes
// over K and reduces them once; tiles of weight rows are split over threads, so the weights stream from memory once
// per call. Uses the build's widest lanes (AVX-512: 16, else AVX2: 8); K must be a multiple of them.
#pragma once
#include <ATen/Parallel.h>
#include <cstdint>
#include "int8_traits.h"
#ifdef __AVX512F__
#include "avx512_common.h"
#endif

namespace hf_accel::dot {

using V = hf_accel::Widest;
#ifdef __AVX512F__
inline void sum4(V::F a, V::F b, V::F c, V::F d, float* out) { _mm_storeu_ps(out, hf_accel::sum4(a, b, c, d)); }
#else
inline void sum4(V::F a, V::F b, V::F c, V::F d, float* out) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

constexpr int kRows = V::kLanes == 16 ? 4 : 2;  // registers: 4 * kRows sums + 4 weight vectors + 1
// Half-precision weights are prefetched this many bytes past the end of the tile (where this thread reads next), one
// prefetch per 64 bytes consumed, as the int8 kernel does: a tile of 4 bfloat16 rows is only ~4.6 KB at K = 576, too
// short for the hardware prefetcher to ramp up (SmolLM2 bf16 decode: 60% of the bandwidth limit without it, 72% 2 KB
// ahead, 79% 4 KB ahead, 79% 8 KB ahead).
// float32 tiles are twice as long and run at ~95% without it.
constexpr int64_t kHalfAhead = 4096;

// MR activation rows x NR weight rows; widen(p) loads V::kLanes weights at p as float32.
template <int MR, int NR, class W, class Widen>
inline void tile(const float* x, const W* w, float* y, int64_t K, int64_t ldy, Widen widen) {
  V::F acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = V::zero();
  [[maybe_unused]] const char* ahead = reinterpret_cast<const char*>(w + NR * K) + kHalfAhead;
  for (int64_t k = 0; k < K; k += V::kLanes) {
    if constexpr (sizeof(W) == 2) {
      for (int64_t b = 0; b < NR * V::kLanes * 2; b += 64) prefetch_weights(ahead + k * NR * 2 + b);
    }
    V::F wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen(w + r * K + k);
    for (int i = 0; i < MR; ++i) {
      const V::F xv = V::load(x + i * K + k);
      for (int r = 0; r < NR; ++r) acc[i][r] = V::fma(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y + i * ldy);
    } else {
      for (int r = 0; r < NR; ++r) y[i * ldy + r] = V::sum(acc[i][r]);
    }
  }
}

// NR weight rows against all M activation rows.
template <int NR, class W, class Widen>
inline void rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, Widen widen) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NR>(x + m * K, w, y + m * N, K, N, widen);
  for (; m < M; ++m) tile<1, NR>(x + m * K, w, y + m * N, K, N, widen);
}

// The whole product: groups of 4 weight rows over threads (grain: groups per task), then the rows left over.
template <class W, class Widen>
void linear(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t grain, Widen widen) {
  const int64_t groups = N / 4;
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) rows<4>(x, w + g * 4 * K, y + g * 4, M, K, N, widen);
  });
  for (int64_t n = groups * 4; n < N; ++n) rows<1>(x, w + n * K, y + n, M, K, N, widen);
}

}  // namespace hf_accel::dot
