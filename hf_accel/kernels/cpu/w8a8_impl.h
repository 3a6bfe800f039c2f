// hf_accel's W8A8 kernel (AVX-512 VNNI), shared by quant/csrc/w8a8_vnni.cpp and the VNNI build of the
// speculative draft's native layers. Include only where __AVX512VNNI__ is defined.
//
// W8A8 linear: y[M, N] = dequant(quantize_activations(x)) @ (q[N, K] * scale[N])^T.
//
// Activations are quantized per row in 16 interleaved groups: feature k is in group (k % 64) / 4, the four
// bytes of a 64-byte block that one int32 lane of `vpdpbusd` sums (symmetric, scale = max|x| / 127, round half
// to even; the same arithmetic as hf_accel.quant.core.quantize_activations, so the int8 values are bitwise
// equal). Each lane of an accumulator therefore only ever sees one group: a whole row is one `vpdpbusd` per
// 64-byte block and (activation row, weight row), accumulated in int32, converted and scaled once at the end.
// `vpdpbusd` multiplies unsigned by signed bytes: the weights are made unsigned by flipping their sign bit
// (q + 128) and each accumulator starts at -128 * (the activation row's sum per group), so it ends holding the
// exact signed dot per group.
// Tiles of 4 weight rows share each activation load; activation rows go 4, 2, 1 at a time; four sums are reduced
// together; tiles are split over threads.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "avx2_common.h"
#include "avx512_common.h"
#include <algorithm>
#include <vector>

namespace hf_accel::w8a8 {

constexpr int64_t kBlock = 64;        // bytes per zmm of int8: K must be a multiple
constexpr int64_t kLanes = 16;        // activation groups per row: int32 lanes of a zmm
constexpr int64_t kMaxK = 1 << 19;   // int32 sums per group stay below 2**31 up to ~700k features
constexpr int64_t kRows = 4;          // weight rows per tile
constexpr int64_t kAhead = 2048;      // prefetch this far past the tile's end (int8_gemm_impl.h: kInt8Ahead)

// One row of x [K] -> xq [K] int8, scale [16] and base [16] = -128 * sum(xq) per group (int32).
inline void quantize_row(const float* x, int8_t* xq, float* scale, int32_t* base, int64_t K) {
  // a zmm of 16 floats at offset 16j of a block holds groups 4j .. 4j + 3, four adjacent lanes each
  __m512 amax[4];
  for (int j = 0; j < 4; ++j) amax[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K; b += kBlock)
    for (int j = 0; j < 4; ++j) amax[j] = _mm512_max_ps(amax[j], _mm512_abs_ps(_mm512_loadu_ps(x + b + 16 * j)));
  alignas(64) float lanes[4][16];
  for (int j = 0; j < 4; ++j) _mm512_store_ps(lanes[j], amax[j]);
  for (int l = 0; l < kLanes; ++l) {
    const float* m = lanes[l / 4] + 4 * (l % 4);
    scale[l] = std::max(std::max(m[0], m[1]), std::max(m[2], m[3])) / 127.0f;
  }
  // each float's divisor: its group's scale (1 for an all-zero group, whose values are zeros)
  __m512 div[4];
  for (int j = 0; j < 4; ++j) {
    alignas(64) float d[16];
    for (int t = 0; t < 16; ++t) {
      const float s = scale[4 * j + t / 4];
      d[t] = s > 0.0f ? s : 1.0f;
    }
    div[j] = _mm512_load_ps(d);
  }
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sums = _mm512_setzero_si512();
  for (int64_t b = 0; b < K; b += kBlock) {
    for (int j = 0; j < 4; ++j) {
      const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + b + 16 * j), div[j]),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b + 16 * j), _mm512_cvtepi32_epi8(v));
    }
    sums = _mm512_dpbusd_epi32(sums, ones, _mm512_loadu_si512(xq + b));  // + the block's 4-byte sums per lane
  }
  _mm512_storeu_si512(base, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-128)));
}

// MR activation rows x NR weight rows: y[i * ldy + r] = wscale[r] * sum_l xscale[i, l] * dot_l(xq[i], q[r]),
// dot_l over group l, accumulated as dot_l(xq[i], q[r] + 128) from base[i, l] = -128 * sum_l(xq[i]).
template <int MR, int NR>
inline void tile(const int8_t* xq, const float* xscale, const int32_t* base, const int8_t* q, const float* wscale,
          float* y, int64_t K, int64_t ldy) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[MR][NR];
  for (int i = 0; i < MR; ++i) {
    const __m512i b = _mm512_loadu_si512(base + i * kLanes);
    for (int r = 0; r < NR; ++r) acc[i][r] = b;
  }
  // the tile's NR rows are contiguous: prefetch in memory order past its end, 64 bytes per 64 consumed
  const char* ahead = reinterpret_cast<const char*>(q) + NR * K + kAhead;
  for (int64_t k = 0; k < K; k += kBlock) {
    __m512i xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = _mm512_loadu_si512(xq + i * K + k);
    for (int r = 0; r < NR; ++r) prefetch_weights(ahead + k * NR + r * kBlock);
    for (int r = 0; r < NR; ++r) {
      const int8_t* row = q + r * K + k;
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(row), flip);  // q + 128 as unsigned bytes
      for (int i = 0; i < MR; ++i) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], w, xv[i]);
    }
  }
  store_scaled_dots<MR, NR>(acc, xscale, kLanes, wscale, y, ldy);  // exact dots, scaled
}

template <int NR>
inline void rows_of_tile(const int8_t* xq, const float* xs, const int32_t* base, const int8_t* q, const float* ws,
                  float* y, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  if constexpr (NR % 2 == 0) {  // eight activation rows: one pass over the weights, two rows at a time
    for (; m + 8 <= M; m += 8)
      for (int r = 0; r < NR; r += 2)
        tile<8, 2>(xq + m * K, xs + m * kLanes, base + m * kLanes, q + r * K, ws + r, y + m * N + r, K, N);
  }
  for (; m + 4 <= M; m += 4)
    tile<4, NR>(xq + m * K, xs + m * kLanes, base + m * kLanes, q, ws, y + m * N, K, N);
  for (; m + 2 <= M; m += 2)
    tile<2, NR>(xq + m * K, xs + m * kLanes, base + m * kLanes, q, ws, y + m * N, K, N);
  for (; m < M; ++m) tile<1, NR>(xq + m * K, xs + m * kLanes, base + m * kLanes, q, ws, y + m * N, K, N);
}

inline void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "w8a8: in_features must be a multiple of ", kBlock, ", got ", x.size(1));
  TORCH_CHECK(x.size(1) <= kMaxK, "w8a8: in_features above ", kMaxK, " could overflow the int32 sums, got ", x.size(1));
}

// Every row of x [M, K] (see quantize_row), rows split over threads.
inline void quantize_rows(const float* x, int8_t* xq, float* scale, int32_t* base, int64_t M, int64_t K) {
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, xq + m * K, scale + m * kLanes, base + m * kLanes, K);
  });
}

// x [M, K] float32 -> (xq [M, K] int8, scale [M, 16] float32, base [M, 16] int32 = -128 * sum per group).
inline std::vector<torch::Tensor> quantize(const torch::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto scale = torch::empty({M, kLanes}, x.options());
  auto base = torch::empty({M, kLanes}, x.options().dtype(torch::kInt));
  quantize_rows(x.data_ptr<float>(), xq.data_ptr<int8_t>(), scale.data_ptr<float>(), base.data_ptr<int32_t>(), M, K);
  return {xq, scale, base};
}

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, 1] float32 (one scale per weight row).
inline torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  check_x(x);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "w8a8: q must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.size(1) == 1 && scale.scalar_type() == torch::kFloat && scale.is_contiguous(),
              "w8a8: scale must be float32 [N, 1] (per-row weight scales)");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N, "w8a8: shape mismatch");
  // one scratch allocation per call: per row 16 scales, 16 group sums (int32) and K int8 values
  auto scratch = torch::empty({M * (2 * kLanes + K / 4)}, x.options().dtype(torch::kInt));
  float* xs = reinterpret_cast<float*>(scratch.data_ptr<int32_t>());
  int32_t* base = scratch.data_ptr<int32_t>() + M * kLanes;
  int8_t* xq = reinterpret_cast<int8_t*>(base + M * kLanes);
  quantize_rows(x.data_ptr<float>(), xq, xs, base, M, K);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      if (n0 + kRows <= N) {
        rows_of_tile<kRows>(xq, xs, base, qp + n0 * K, sp + n0, yp + n0, M, K, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_of_tile<1>(xq, xs, base, qp + n * K, sp + n, yp + n, M, K, N);
      }
    }
  });
  return y;
}

}  // namespace hf_accel::w8a8
