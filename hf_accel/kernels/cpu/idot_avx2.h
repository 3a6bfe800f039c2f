// hf_accel's integer-dot int8 linears for builds without AVX-512 VNNI (the AVX2 build, and the AVX-512 build of CPUs
// without VNNI): W8A8 and W8A16 with the activation quantization, groups and results of the VNNI kernels
// (w8a8_impl.h, w8a16_impl.h: bitwise-equal int8 / int16 activations, exact int32 group dots, one float scaling), in
// AVX2 integer instructions. Include only where __AVX512VNNI__ is not defined: it defines the same names.
//
// W8A8 (groups (k % 64) / 4): 32 weight bytes q and 32 activation bytes x go through `vpmaddubsw` (unsigned x signed
// bytes, adjacent products summed in int16) as |q| (unsigned: -128 is 128) against sign(q) * x (x is in [-127, 127],
// so its negation fits): at most 2 * 128 * 127 = 32512, below int16's saturation, so every pair is exact. `vpmaddwd`
// with ones then sums adjacent pairs into int32 lanes: lane j of the 32 bytes at offset 32h of a 64-byte block holds
// bytes 4j .. 4j + 3, which is group j + 8h. Two accumulators per (activation row, weight row) keep groups 0-7 and
// 8-15 apart.
// W8A16 (groups (k % 32) / 2): 16 weights sign-extended to int16 (`vpmovsxbw`) against 16 int16 activations through
// `vpmaddwd`: lane j of the 16 features at offset 16h of a 32-feature block sums features 2j, 2j + 1, group j + 8h.
// The epilogue scales each row's 16 group dots in one order for every tile shape, so a row's result does not depend
// on the rows beside it.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>
#include "avx2_common.h"

namespace hf_accel::idot {

constexpr int64_t kLanes = 16;    // activation groups per row
constexpr int64_t kAhead = 2048;  // prefetch this far past the tile's end (int8_gemm_impl.h: kInt8Ahead)

// wscale * sum_l xscale[l] * dot_l for a row's group dots lo (groups 0-7) and hi (8-15).
inline float scaled_sum(__m256i lo, __m256i hi, const float* xscale, float wscale) {
  const __m256 f = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_loadu_ps(xscale)),
                                 _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_loadu_ps(xscale + 8)));
  return wscale * hsum(f);
}

// Group maxima -> scales: lanes[v][t] is the running max|x| of vector v, lane t, whose group is groups_of(v, t);
// scale[l] = max / top; div[v]: each lane's divisor (its group's scale, 1 for an all-zero group).
template <int NV, class GroupOf>
inline void group_scales(const __m256 (&amax)[NV], float top, float* scale, __m256 (&div)[NV], GroupOf groups_of) {
  alignas(32) float lanes[NV][8];
  for (int v = 0; v < NV; ++v) _mm256_store_ps(lanes[v], amax[v]);
  for (int l = 0; l < kLanes; ++l) scale[l] = 0.0f;
  for (int v = 0; v < NV; ++v)
    for (int t = 0; t < 8; ++t) scale[groups_of(v, t)] = std::max(scale[groups_of(v, t)], lanes[v][t]);
  for (int l = 0; l < kLanes; ++l) scale[l] /= top;
  for (int v = 0; v < NV; ++v) {
    alignas(32) float d[8];
    for (int t = 0; t < 8; ++t) {
      const float s = scale[groups_of(v, t)];
      d[t] = s > 0.0f ? s : 1.0f;
    }
    div[v] = _mm256_load_ps(d);
  }
}

// round(x / div) clamped to [-top, top], as int32 lanes (round half to even, as the reference's torch.round).
inline __m256i quantize8(const float* x, __m256 div, __m256i top) {
  const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(r), _mm256_sub_epi32(_mm256_setzero_si256(), top)), top);
}

// Running max|x| over blocks of NV * 8 floats.
template <int NV>
inline void block_maxima(const float* x, int64_t K, __m256 (&amax)[NV]) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int v = 0; v < NV; ++v) amax[v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K; b += NV * 8)
    for (int v = 0; v < NV; ++v) amax[v] = _mm256_max_ps(amax[v], _mm256_andnot_ps(sign, _mm256_loadu_ps(x + b + 8 * v)));
}

// W8A8 activations: one row x [K] (K % 64 == 0) -> xq [K] int8 in [-127, 127], scale [16].
inline void quantize_row8(const float* x, int8_t* xq, float* scale, int64_t K) {
  __m256 amax[8], div[8];  // vector v of a 64-float block: groups 2v (lanes 0-3) and 2v + 1 (lanes 4-7)
  block_maxima<8>(x, K, amax);
  group_scales<8>(amax, 127.0f, scale, div, [](int v, int t) { return 2 * v + t / 4; });
  const __m256i top = _mm256_set1_epi32(127), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K; b += 64)
    for (int v = 0; v < 8; v += 4) {
      const float* p = x + b + 8 * v;
      const __m256i lo = _mm256_packs_epi32(quantize8(p, div[v], top), quantize8(p + 8, div[v + 1], top));
      const __m256i hi = _mm256_packs_epi32(quantize8(p + 16, div[v + 2], top), quantize8(p + 24, div[v + 3], top));
      // packs interleave 4-value pieces of the two 128-bit halves: put the 32 bytes back in feature order
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b + 8 * v), bytes);
    }
}

// W8A16 activations: one row x [K] (K % 32 == 0) -> xq [K] int16 in [-32767, 32767], scale [16].
inline void quantize_row16(const float* x, int16_t* xq, float* scale, int64_t K) {
  __m256 amax[4], div[4];  // vector v of a 32-float block: groups 4v .. 4v + 3, two lanes each
  block_maxima<4>(x, K, amax);
  group_scales<4>(amax, 32767.0f, scale, div, [](int v, int t) { return 4 * v + t / 2; });
  const __m256i top = _mm256_set1_epi32(32767);
  for (int64_t b = 0; b < K; b += 32)
    for (int v = 0; v < 4; v += 2) {
      const float* p = x + b + 8 * v;
      const __m256i words = _mm256_packs_epi32(quantize8(p, div[v], top), quantize8(p + 8, div[v + 1], top));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b + 8 * v), _mm256_permute4x64_epi64(words, 0xD8));
    }
}

// W8A8 tile: MR activation rows x NR weight rows over K (a multiple of 64).
template <int MR, int NR>
inline void tile8(const int8_t* xq, const float* xscale, const int8_t* q, const float* wscale, float* y, int64_t K,
                  int64_t ldy) {
  __m256i acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const char* ahead = reinterpret_cast<const char*>(q) + NR * K + kAhead;  // the tile's rows are contiguous
  for (int64_t k = 0; k < K; k += 64) {
    for (int r = 0; r < NR; ++r) prefetch_weights(ahead + k * NR + r * 64);
    for (int h = 0; h < 2; ++h) {
      __m256i xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + k + 32 * h));
      for (int r = 0; r < NR; ++r) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k + 32 * h));
        const __m256i u = _mm256_abs_epi8(w);
        for (int i = 0; i < MR; ++i) {
          const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_sign_epi8(xv[i], w));
          acc[i][r][h] = _mm256_add_epi32(acc[i][r][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + r] = scaled_sum(acc[i][r][0], acc[i][r][1], xscale + i * kLanes, wscale[r]);
}

// W8A16 tile: MR activation rows x NR weight rows over K (a multiple of 32).
template <int MR, int NR>
inline void tile16(const int16_t* xq, const float* xscale, const int8_t* q, const float* wscale, float* y, int64_t K,
                   int64_t ldy) {
  __m256i acc[MR][NR][2];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_si256();
  const char* ahead = reinterpret_cast<const char*>(q) + NR * K + kAhead;
  for (int64_t k = 0; k < K; k += 32) {
    if (k % 64 == 0)
      for (int r = 0; r < NR; ++r) prefetch_weights(ahead + k * NR + r * 64);
    for (int h = 0; h < 2; ++h) {
      __m256i xv[MR];
      for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + k + 16 * h));
      for (int r = 0; r < NR; ++r) {
        const __m256i w =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * K + k + 16 * h)));
        for (int i = 0; i < MR; ++i) acc[i][r][h] = _mm256_add_epi32(acc[i][r][h], _mm256_madd_epi16(w, xv[i]));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + r] = scaled_sum(acc[i][r][0], acc[i][r][1], xscale + i * kLanes, wscale[r]);
}

// Tiles of up to 4 weight rows over threads; one activation row at a time against 4 weight rows (decode), else pairs
// of activation rows against pairs of weight rows (registers: 2 x 2 x 2 accumulators).
template <class Act, class Tiles>
inline torch::Tensor run(const Act* xq, const float* xs, const torch::Tensor& q, const torch::Tensor& scale, int64_t M,
                         const at::TensorOptions& options, Tiles tiles) {
  const int64_t K = q.size(1), N = q.size(0);
  auto y = torch::empty({M, N}, options);
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * 4, rows = std::min<int64_t>(4, N - n0);
      const int8_t* qt = qp + n0 * K;
      if (M == 1 && rows == 4) {
        tiles.template run<1, 4>(xq, xs, qt, sp + n0, yp + n0, K, N);
        continue;
      }
      for (int64_t r = 0; r < rows; r += 2) {
        const bool pair = r + 2 <= rows;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
          if (pair) tiles.template run<2, 2>(xq + m * K, xs + m * kLanes, qt + r * K, sp + n0 + r, yp + m * N + n0 + r, K, N);
          else tiles.template run<2, 1>(xq + m * K, xs + m * kLanes, qt + r * K, sp + n0 + r, yp + m * N + n0 + r, K, N);
        }
        if (m < M) {
          if (pair) tiles.template run<1, 2>(xq + m * K, xs + m * kLanes, qt + r * K, sp + n0 + r, yp + m * N + n0 + r, K, N);
          else tiles.template run<1, 1>(xq + m * K, xs + m * kLanes, qt + r * K, sp + n0 + r, yp + m * N + n0 + r, K, N);
        }
      }
    }
  });
  return y;
}

struct Tiles8 {
  template <int MR, int NR>
  void run(const int8_t* xq, const float* xs, const int8_t* q, const float* ws, float* y, int64_t K, int64_t ldy) const {
    tile8<MR, NR>(xq, xs, q, ws, y, K, ldy);
  }
};

struct Tiles16 {
  template <int MR, int NR>
  void run(const int16_t* xq, const float* xs, const int8_t* q, const float* ws, float* y, int64_t K, int64_t ldy) const {
    tile16<MR, NR>(xq, xs, q, ws, y, K, ldy);
  }
};

// Every row of x [M, K] through `quantize(row, xq, scale, K)`, rows split over threads.
template <class Act, class Quantize>
inline void quantize_rows(const float* x, Act* xq, float* scale, int64_t M, int64_t K, Quantize quantize) {
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize(x + m * K, xq + m * K, scale + m * kLanes, K);
  });
}

// x [M, K] float32 through `quantize` (a row -> Act values and 16 scales, in one scratch allocation), then the tiles.
template <class Act, class Quantize, class Tiles>
inline torch::Tensor quantized_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                                      Quantize quantize, Tiles tiles) {
  const int64_t M = x.size(0), K = x.size(1);
  auto scratch = torch::empty({M * (kLanes + K * static_cast<int64_t>(sizeof(Act)) / 4)}, x.options());
  float* xs = scratch.data_ptr<float>();
  Act* xq = reinterpret_cast<Act*>(xs + M * kLanes);
  quantize_rows(x.data_ptr<float>(), xq, xs, M, K, quantize);
  return run(xq, xs, q, scale, M, x.options(), tiles);
}

inline void check_weights(const char* what, const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), what, ": q must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.size(1) == 1 && scale.scalar_type() == torch::kFloat && scale.is_contiguous(),
              what, ": scale must be float32 [N, 1] (per-row weight scales)");
  TORCH_CHECK(q.size(1) == x.size(1) && scale.size(0) == q.size(0), what, ": shape mismatch");
}

}  // namespace hf_accel::idot

namespace hf_accel::w8a8 {

constexpr int64_t kBlock = 64;       // K must be a multiple
constexpr int64_t kMaxK = 1 << 19;  // as the VNNI kernel's limit (here: 4 * 128 * 127 per block and lane)

inline void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "w8a8: in_features must be a multiple of ", kBlock, ", got ", x.size(1));
  TORCH_CHECK(x.size(1) <= kMaxK, "w8a8: in_features above ", kMaxK, " could overflow the int32 sums, got ", x.size(1));
}

// x [M, K] float32 -> (xq [M, K] int8, scale [M, 16], base [M, 16] int32 = -128 * the values' sum per group: what the
// VNNI kernel starts its accumulators from; this kernel does not need it, the op returns it alike).
inline std::vector<torch::Tensor> quantize(const torch::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto scale = torch::empty({M, idot::kLanes}, x.options());
  idot::quantize_rows(x.data_ptr<float>(), xq.data_ptr<int8_t>(), scale.data_ptr<float>(), M, K, idot::quantize_row8);
  auto groups = xq.view({M, K / kBlock, idot::kLanes, 4}).to(torch::kInt).sum({1, 3});
  return {xq, scale, (groups * -128).to(torch::kInt)};
}

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, 1] float32 (one scale per weight row).
inline torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  check_x(x);
  idot::check_weights("w8a8", x, q, scale);
  return idot::quantized_linear<int8_t>(x, q, scale, idot::quantize_row8, idot::Tiles8());
}

}  // namespace hf_accel::w8a8

namespace hf_accel::w8a16 {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxK = 8192;  // 256 blocks x 2 x 128 x 32767 < 2**31, as the VNNI kernel

inline bool fits(int64_t K, int64_t groups) { return groups == 1 && K % kBlock == 0 && K <= kMaxK; }

inline torch::Tensor w8a16_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  if (x.dim() == 2 && scale.dim() == 2)  // the VNNI build's message (w8a16_impl.h) for what does not fit
    TORCH_CHECK(fits(x.size(1), scale.size(1)), "w8a16: needs one scale per weight row and in_features a multiple of ",
                kBlock, " up to ", kMaxK, ", got in_features ", x.size(1), " and ", scale.size(1), " scales per row");
  idot::check_weights("w8a16", x, q, scale);
  return idot::quantized_linear<int16_t>(x, q, scale, idot::quantize_row16, idot::Tiles16());
}

}  // namespace hf_accel::w8a16
