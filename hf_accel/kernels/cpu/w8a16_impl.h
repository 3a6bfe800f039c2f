// hf_accel's W8A16 kernel (AVX-512 VNNI): int8 weights against activations quantized to int16, for the speculative
// draft's narrow steps. Include only where __AVX512VNNI__ is defined.
//
// y[M, N] = dequant(quantize16(x)) @ (q[N, K] * scale[N])^T.
//
// Why: a weight-only int8 product converts every weight to float (sign-extend, convert) and spends one FMA per
// weight and activation row, so at 2-4 rows the conversions and FMAs, not the weight bytes, set the pace. Here 32
// weights are sign-extended to int16 once (one `vpmovsxbw`) and each activation row takes one `vpdpwssd` (32
// multiply-adds into 16 int32 lanes) per block.
//
// Activations are quantized per row in 16 interleaved groups: feature k is in group (k % 32) / 2, the two int16
// values one int32 lane of `vpdpwssd` sums (symmetric, scale = max|x| / 32767, round half to even). Relative to a
// group's largest value that is a rounding error of 2**-16: far below what int8 weights already cost a draft,
// unlike W8A8's 2**-8 (w8a8_impl.h), which measurably lowered a draft's acceptance. Each lane accumulates one
// group's exact integer dot in int32 (|q| <= 128, |x| <= 32767: below 2**23 per block and lane, hence K <=
// kMaxK), converted and scaled once at the end.
// Tiles of 4 weight rows share each activation load; activation rows go 4, 2, 1 at a time; tiles are split over
// threads; software prefetch runs past the tile's end as in the other int8 kernels.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "avx2_common.h"
#include "avx512_common.h"
#include <algorithm>

namespace hf_accel::w8a16 {

constexpr int64_t kBlock = 32;      // features per zmm of int16: K must be a multiple
constexpr int64_t kLanes = 16;      // activation groups per row: int32 lanes of a zmm
constexpr int64_t kMaxK = 8192;     // 256 blocks x 2 x 128 x 32767 < 2**31: the int32 lane sums cannot overflow
constexpr int64_t kRows = 4;        // weight rows per tile
constexpr int64_t kAhead = 2048;    // prefetch this far past the tile's end (int8_gemm_impl.h: kInt8Ahead)

// One row of x [K] -> xq [K] int16 and scale [16] (one per group).
inline void quantize_row(const float* x, int16_t* xq, float* scale, int64_t K) {
  // the zmm of 16 floats at offset 16j of a block holds groups 8j .. 8j + 7, two adjacent lanes each
  __m512 amax[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < K; b += kBlock)
    for (int j = 0; j < 2; ++j) amax[j] = _mm512_max_ps(amax[j], _mm512_abs_ps(_mm512_loadu_ps(x + b + 16 * j)));
  alignas(64) float lanes[2][16];
  for (int j = 0; j < 2; ++j) _mm512_store_ps(lanes[j], amax[j]);
  __m512 div[2];
  for (int l = 0; l < kLanes; ++l) {
    const float* m = lanes[l / 8] + 2 * (l % 8);
    scale[l] = std::max(m[0], m[1]) / 32767.0f;
  }
  for (int j = 0; j < 2; ++j) {
    alignas(64) float d[16];
    for (int t = 0; t < 16; ++t) {
      const float s = scale[8 * j + t / 2];
      d[t] = s > 0.0f ? s : 1.0f;  // an all-zero group's values are zeros
    }
    div[j] = _mm512_load_ps(d);
  }
  const __m512i lo = _mm512_set1_epi32(-32767), hi = _mm512_set1_epi32(32767);
  for (int64_t b = 0; b < K; b += kBlock)
    for (int j = 0; j < 2; ++j) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + b + 16 * j), div[j]),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b + 16 * j), _mm512_cvtepi32_epi16(v));
    }
}

// MR activation rows x NR weight rows: y[i * ldy + r] = wscale[r] * sum_l xscale[i, l] * dot_l(xq[i], q[r]).
template <int MR, int NR>
inline void tile(const int16_t* xq, const float* xscale, const int8_t* q, const float* wscale, float* y, int64_t K,
                 int64_t ldy) {
  __m512i acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_si512();
  const char* ahead = reinterpret_cast<const char*>(q) + NR * K + kAhead;  // the tile's rows are contiguous
  for (int64_t k = 0; k < K; k += kBlock) {
    __m512i xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_si512(xq + i * K + k);
    if (k % 64 == 0)
      for (int r = 0; r < NR; ++r) prefetch_weights(ahead + k * NR + r * 64);
    for (int r = 0; r < NR; ++r) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k)));
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpwssd_epi32(acc[i][r], w, xv[i]);
    }
  }
  store_scaled_dots<MR, NR>(acc, xscale, kLanes, wscale, y, ldy);  // exact dots, scaled
}

template <int NR>
inline void rows_of_tile(const int16_t* xq, const float* xs, const int8_t* q, const float* ws, float* y, int64_t M,
                         int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NR>(xq + m * K, xs + m * kLanes, q, ws, y + m * N, K, N);
  for (; m + 2 <= M; m += 2) tile<2, NR>(xq + m * K, xs + m * kLanes, q, ws, y + m * N, K, N);
  for (; m < M; ++m) tile<1, NR>(xq + m * K, xs + m * kLanes, q, ws, y + m * N, K, N);
}

// Whether a product with K input features and `groups` weight scales per row can run here.
inline bool fits(int64_t K, int64_t groups) { return groups == 1 && K % kBlock == 0 && K <= kMaxK; }

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, 1] float32 (one scale per weight row).
inline torch::Tensor w8a16_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "w8a16: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "w8a16: q must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == torch::kFloat && scale.is_contiguous(),
              "w8a16: scale must be float32 [N, 1]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N, "w8a16: shape mismatch");
  TORCH_CHECK(fits(K, scale.size(1)), "w8a16: needs one scale per weight row and in_features a multiple of ", kBlock,
              " up to ", kMaxK, ", got in_features ", K, " and ", scale.size(1), " scales per row");
  // one scratch allocation per call: per row 16 scales and K int16 values
  auto scratch = torch::empty({M * (kLanes + K / 2)}, x.options());
  float* xs = scratch.data_ptr<float>();
  int16_t* xq = reinterpret_cast<int16_t*>(xs + M * kLanes);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, xq + m * K, xs + m * kLanes, K);
  });
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      if (n0 + kRows <= N) {
        rows_of_tile<kRows>(xq, xs, qp + n0 * K, sp + n0, yp + n0, M, K, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_of_tile<1>(xq, xs, qp + n * K, sp + n, yp + n, M, K, N);
      }
    }
  });
  return y;
}

}  // namespace hf_accel::w8a16
