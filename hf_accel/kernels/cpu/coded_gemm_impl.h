// Exact-code linears for few activation rows: y [M, N] = x [M, K] @ W^T where the float32 weight W is held as the
// codes of a de-quantized low-bit checkpoint (hf_accel/quant/codes.py): W[n, 32 g + j] = fl(fl(d * c) + m), (d, m) =
// params[n, g] (float32, or float16 where both are float16 values, as GGUF stores them: 4 bytes a group less), c a
// 4-bit code (two per byte: byte j of a group holds elements j and j + 16) or an 8-bit one.
//
// Each group's weights are rebuilt in registers with the same two roundings (a float32 product, then a float32 sum;
// an empty asm statement keeps the compiler from contracting them into one FMA, which rounds once; with float16
// params every product is exact, so one FMA gives the same value) and FMA'd with the float32 activations: the
// products of the float weights from 4-6x fewer bytes, different only in summation order.
// AVX-512 builds the 16 values of a 4-bit group's scale and offset once per group and looks the codes up with
// vpermps; AVX2 converts each code. Tiles of kCodedRows weight rows share each activation load, up to four activation
// rows share each rebuilt weight vector, prefetches run ahead of the tile in both streams, and the tiles of several
// products of one x (a layer's q / k / v) are split over threads in one parallel region.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "avx2_common.h"
#include "int8_traits.h"

namespace hf_accel::coded {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 32;   // activation rows a call takes (a prompt runs the float weights)
constexpr int64_t kAhead = 2048;   // prefetch distance past the tile, bytes of codes
using V = hf_accel::Widest;
using F = V::F;
constexpr int kParts = kGroup / V::kLanes;  // vectors per group

// A group's (d, m).
struct Pair {
  float d, m;
};
__attribute__((always_inline)) inline Pair load_pair(const float* p) { return {p[0], p[1]}; }

// The value of v, opaque to the optimiser: a product stored here is rounded before the following sum.
__attribute__((always_inline)) inline F opaque(F v) {
  asm("" : "+v"(v));
  return v;
}

// fl(fl(d * c) + m). kFused: one FMA, the same value where every product d * c is exact in float32: d a float16
// value (11 significant bits) times a code of at most 8 bits, as with float16 params.
template <bool kFused>
__attribute__((always_inline)) inline F mul_add(F d, F c, F m) {
#ifdef __AVX512F__
  return kFused ? _mm512_fmadd_ps(d, c, m) : _mm512_add_ps(opaque(_mm512_mul_ps(d, c)), m);
#else
  return kFused ? _mm256_fmadd_ps(d, c, m) : _mm256_add_ps(opaque(_mm256_mul_ps(d, c)), m);
#endif
}

#ifdef __AVX512F__
// 4-bit: the group's 16 values once (0..15 times d, plus m), then one lookup per 16 codes. The high nibbles are
// shifted down as bytes (a 128-bit shift, off the two ports 512-bit work shares) before widening.
template <bool kFused>
__attribute__((always_inline)) inline void decode(const uint8_t* c, Pair dm, F (&w)[kParts]) {
  const F levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const F table = mul_add<kFused>(_mm512_set1_ps(dm.d), levels, _mm512_set1_ps(dm.m));
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(bytes), table);  // the low 4 bits of each index select
  w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(bytes, 4)), table);
}
template <bool kFused>
__attribute__((always_inline)) inline void decode(const int8_t* c, Pair dm, F (&w)[kParts]) {
  const F d = _mm512_set1_ps(dm.d), m = _mm512_set1_ps(dm.m);
  for (int p = 0; p < kParts; ++p) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * p)));
    w[p] = mul_add<kFused>(d, _mm512_cvtepi32_ps(q), m);
  }
}
#else
// 4-bit: bytes 0..7 hold elements 0..7 (low nibbles) and 16..23 (high), bytes 8..15 elements 8..15 and 24..31.
template <bool kFused>
__attribute__((always_inline)) inline void decode(const uint8_t* c, Pair dm, F (&w)[kParts]) {
  const F d = _mm256_set1_ps(dm.d), m = _mm256_set1_ps(dm.m);
  const __m256i nib = _mm256_set1_epi32(15);
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * h)));
    w[h] = mul_add<kFused>(d, _mm256_cvtepi32_ps(_mm256_and_si256(b, nib)), m);
    w[2 + h] = mul_add<kFused>(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), m);
  }
}
template <bool kFused>
__attribute__((always_inline)) inline void decode(const int8_t* c, Pair dm, F (&w)[kParts]) {
  const F d = _mm256_set1_ps(dm.d), m = _mm256_set1_ps(dm.m);
  for (int p = 0; p < kParts; ++p) {
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * p)));
    w[p] = mul_add<kFused>(d, _mm256_cvtepi32_ps(q), m);
  }
}
#endif

#ifdef __AVX512F__
constexpr int64_t kCodedRows = 4;  // weight rows per tile
#else
constexpr int64_t kCodedRows = 2;  // 16 ymm: 4 x 2 sums, 4 weight vectors, activations
#endif

// Code bytes per group of 32: 16 (4-bit) or 32 (8-bit).
template <typename C>
constexpr int64_t group_bytes() { return std::is_same_v<C, uint8_t> ? kGroup / 2 : kGroup; }

// Where a tile prefetches its params' stream: `at` for group 0, advancing `step` bytes a group.
struct Ahead {
  const char* at;
  int64_t step;
};

// MR activation rows x `rows` (<= kCodedRows) weight rows: y[m * ldy + r]; params as float32 (params_ahead: where
// the stored ones stream).
template <typename C, int MR, bool kFused>
void tile(const float* x, const C* codes, const float* params, Ahead params_ahead, float* y, int64_t rows, int64_t K,
          int64_t ldy) {
  constexpr int64_t kBytes = group_bytes<C>();
  const int64_t G = K / kGroup, row_bytes = G * kBytes;
  F acc[MR][kCodedRows];
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < kCodedRows; ++r) acc[m][r] = V::zero();
  const char* ahead = reinterpret_cast<const char*>(codes) + rows * row_bytes + kAhead;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < rows * kBytes; b += 64) prefetch_weights(ahead + g * rows * kBytes + b);
    prefetch_weights(params_ahead.at + g * params_ahead.step);
    for (int64_t r = 0; r < rows; ++r) {
      F w[kParts];
      decode<kFused>(codes + r * row_bytes + g * kBytes, load_pair(params + (r * G + g) * 2), w);
      for (int m = 0; m < MR; ++m)
        for (int p = 0; p < kParts; ++p)
          acc[m][r] = V::fma(V::load(x + m * K + g * kGroup + p * V::kLanes), w[p], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = V::sum(acc[m][r]);
}

// One tile of weight rows against every activation row, four at a time.
template <typename C, bool kFused>
void rows_tile(const float* x, const C* codes, const float* params, Ahead ahead, float* y, int64_t M, int64_t K,
               int64_t ldy, int64_t rows) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<C, 4, kFused>(x + m * K, codes, params, ahead, y + m * ldy, rows, K, ldy);
  for (; m + 2 <= M; m += 2) tile<C, 2, kFused>(x + m * K, codes, params, ahead, y + m * ldy, rows, K, ldy);
  for (; m < M; ++m) tile<C, 1, kFused>(x + m * K, codes, params, ahead, y + m * ldy, rows, K, ldy);
}

// n float16 values as float32 (a tile's params, widened once: a scalar conversion per group and row cost more than
// the codes' decoding).
inline void widen(const at::Half* src, float* dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i))));
#endif
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(bits[i]);
}

// One tile of rows [n0, n0 + rows) of a product: the codes' width and the params' dtype picked at run time.
template <typename P>
void product_tile(const float* x, const void* codes, bool four, const P* params, float* y, int64_t M, int64_t K,
                  int64_t N, int64_t n0, int64_t rows) {
  const int64_t G = K / kGroup;
  const P* source = params + n0 * G * 2;
  const Ahead ahead{reinterpret_cast<const char*>(source + rows * G * 2) + kAhead / 2,
                    rows * 2 * static_cast<int64_t>(sizeof(P))};
  const float* pp;
  if constexpr (std::is_same_v<P, float>) {
    pp = source;
  } else {
    thread_local std::vector<float> wide;  // this tile's params as float32
    wide.resize(rows * G * 2);
    widen(source, wide.data(), static_cast<int64_t>(wide.size()));
    pp = wide.data();
  }
  constexpr bool kFused = !std::is_same_v<P, float>;  // float16 scales: every product d * c is exact
  if (four)
    rows_tile<uint8_t, kFused>(x, static_cast<const uint8_t*>(codes) + n0 * K / 2, pp, ahead, y + n0, M, K, N, rows);
  else
    rows_tile<int8_t, kFused>(x, static_cast<const int8_t*>(codes) + n0 * K, pp, ahead, y + n0, M, K, N, rows);
}

// Whether x [M, K] and codes / params make a product coded_linear takes.
inline bool fits(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& params) {
  const bool four = codes.scalar_type() == torch::kByte;
  return x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(0) <= kMaxRows && codes.dim() == 2 &&
         (four || codes.scalar_type() == torch::kChar) && codes.is_contiguous() && params.dim() == 3 &&
         (params.scalar_type() == torch::kFloat || params.scalar_type() == torch::kHalf) && params.is_contiguous() &&
         params.size(2) == 2 && params.size(0) == codes.size(0) && x.size(1) == params.size(1) * kGroup &&
         codes.size(1) * (four ? 2 : 1) == x.size(1);
}

// Several products of one x [M, K] (M <= kMaxRows) in one parallel region: ys[i] = x @ W_i^T, [M, N_i].
inline std::vector<torch::Tensor> coded_linear_many(const torch::Tensor& x, const std::vector<torch::Tensor>& codes,
                                                    const std::vector<torch::Tensor>& params) {
  TORCH_CHECK(!codes.empty() && codes.size() == params.size(), "coded_linear: one params tensor per codes tensor");
  struct Product {
    const void* codes;
    const void* params;
    float* y;
    int64_t n, first;  // weight rows, first tile in the joint numbering
    bool four, half;  // 4-bit codes; float16 params
  };
  const auto xc = x.contiguous();
  std::vector<Product> products;
  std::vector<torch::Tensor> ys;
  int64_t tiles = 0;
  for (size_t i = 0; i < codes.size(); ++i) {
    TORCH_CHECK(fits(xc, codes[i], params[i]), "coded_linear: needs float32 x [M <= ", kMaxRows,
                ", K], codes [N, K / 2] uint8 or [N, K] int8 and float32 / float16 params [N, K / 32, 2], contiguous");
    ys.push_back(torch::empty({xc.size(0), codes[i].size(0)}, xc.options()));
    products.push_back({codes[i].data_ptr(), params[i].data_ptr(), ys.back().data_ptr<float>(), codes[i].size(0), tiles,
                        codes[i].scalar_type() == torch::kByte, params[i].scalar_type() == torch::kHalf});
    tiles += (codes[i].size(0) + kCodedRows - 1) / kCodedRows;
  }
  const int64_t M = xc.size(0), K = xc.size(1);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (i + 1 < products.size() && t >= products[i + 1].first) ++i;
      const Product& p = products[i];
      const int64_t n0 = (t - p.first) * kCodedRows, rows = std::min(kCodedRows, p.n - n0);
      if (p.half)
        product_tile(xp, p.codes, p.four, static_cast<const at::Half*>(p.params), p.y, M, K, p.n, n0, rows);
      else
        product_tile(xp, p.codes, p.four, static_cast<const float*>(p.params), p.y, M, K, p.n, n0, rows);
    }
  });
  return ys;
}

// x [M <= kMaxRows, K] float32 @ W^T with W as codes (see the file comment) -> [M, N] float32.
inline torch::Tensor coded_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& params) {
  return coded_linear_many(x, {codes}, {params})[0];
}

}  // namespace hf_accel::coded
