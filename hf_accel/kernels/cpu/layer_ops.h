// The per-layer operations of the native decoder layers (decoder_layers.cpp, the only includer): the build's vector
// type and maths, the layer parameter order, and the projections (float, half-precision and int8 weights, one at a
// time or several in one parallel region), RMSNorm, the rotary embedding and the SiLU-gated product.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <initializer_list>
#include <vector>
#include "int8_traits.h"
#ifdef __AVX512F__
#include "avx512_common.h"
#endif
#include "vexp.h"
#include "int8_gemm_impl.h"
#include "dot_tile.h"
#include "int_dots.h"
#include "coded_gemm_impl.h"

namespace hf_accel::cpu {
torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& weight);  // half_gemm.cpp
}

namespace {

using V = hf_accel::Widest;
using hf_accel::dot::sum4;  // [sum(a), sum(b), sum(c), sum(d)] stored at out

// Per-layer parameters, in this order (an absent one is an empty tensor).
enum Param : size_t {
  kLn1, kLn2,                        // RMSNorm weights [E]
  kQ, kQs, kQb, kK, kKs, kKb,        // projection: weight ([N, K] int8 or float), int8 row/group scales, bias
  kV, kVs, kVb, kO, kOs, kOb,
  kGate, kGates, kGateb,             // gate, or the fused [gate; up] projection when kUp is empty
  kUp, kUps, kUpb, kDown, kDowns, kDownb,
  kQn, kKn,                          // per-head RMSNorm weights [D] (qwen3), or empty
  kParams
};

// How the int8 projections run: weight-only, or with quantized activations (int_dots.h: VNNI or AVX2 integer dots).
enum Mode : int64_t { kWeightOnly = 0, kW8A16 = 1, kW8A8 = 2 };

#ifdef __AVX512F__
inline V::F vexp(V::F x) { return hf_accel::exp16(x); }
inline V::F vmax(V::F a, V::F b) { return _mm512_max_ps(a, b); }
inline V::F vadd(V::F a, V::F b) { return _mm512_add_ps(a, b); }
inline V::F vsub(V::F a, V::F b) { return _mm512_sub_ps(a, b); }
inline V::F vmul(V::F a, V::F b) { return _mm512_mul_ps(a, b); }
inline float hmax(V::F v) { return _mm512_reduce_max_ps(v); }
// sigmoid(x) from e = exp(-|x|) in (0, 1] (exp16 needs a non-positive argument): 1 / (1 + e) for x >= 0, else
// e / (1 + e)
inline V::F vsigmoid(V::F x) {
  const V::F neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const V::F e = vexp(neg_abs), den = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_mask_blend_ps(positive, _mm512_div_ps(e, den), _mm512_div_ps(_mm512_set1_ps(1.f), den));
}
#else
inline V::F vexp(V::F x) { return hf_accel::exp8(x); }
inline V::F vmax(V::F a, V::F b) { return _mm256_max_ps(a, b); }
inline V::F vadd(V::F a, V::F b) { return _mm256_add_ps(a, b); }
inline V::F vsub(V::F a, V::F b) { return _mm256_sub_ps(a, b); }
inline V::F vmul(V::F a, V::F b) { return _mm256_mul_ps(a, b); }
inline float hmax(V::F v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline V::F vsigmoid(V::F x) {  // as the AVX-512 one
  const V::F neg_abs = _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)));
  const V::F e = vexp(neg_abs), den = _mm256_add_ps(_mm256_set1_ps(1.f), e);
  const V::F positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_blendv_ps(_mm256_div_ps(e, den), _mm256_div_ps(_mm256_set1_ps(1.f), den), positive);
}
#endif

// Float projections of narrow chunks (a target's verification of one row, the last chunks of a batch, a float draft):
// y [M, N] = x [M, K] @ w [N, K]^T with w read in place, row-major (the tiles of dot_tile.h, shared with
// half_linear). at::linear hands MKL the same weight to re-pack on every
// call: one-off, SmolLM2's 30 layers of fp32 projections at 13 rows took ~28 ms here against ~43 ms (AVX-512 host);
// from ~40 rows on MKL's packed GEMM is as fast or faster (kDotMaxRows leaves those to it).
constexpr int64_t kDotMaxRows = 32;

// Whether float_linear takes x [M, K] against a weight: float32, contiguous, K a multiple of the lanes, few rows.
bool dot_fits(const torch::Tensor& x, const torch::Tensor& weight) {
  return weight.scalar_type() == torch::kFloat && weight.is_contiguous() && x.scalar_type() == torch::kFloat &&
         x.dim() == 2 && x.size(0) <= kDotMaxRows && x.size(1) % V::kLanes == 0 && weight.dim() == 2 &&
         weight.size(1) == x.size(1);
}

// x [M, K] float32 @ weight [N, K]^T (see kDotMaxRows); K a multiple of the lanes.
torch::Tensor float_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(dot_fits(x, weight), "float_linear: needs float32 x [M <= ", kDotMaxRows,
              ", K] and a contiguous float32 weight [N, K], K a multiple of ", V::kLanes);
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, xc.options());
  hf_accel::dot::linear(xc.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, K, N, 8,
                        [](const float* p) { return V::load(p); });
  return y;
}

// Up to this many rows half-precision projections run half_linear (its limit); a prompt's rows run the half GEMM.
constexpr int64_t kHalfMaxRows = 16;

// x [M, K] -> [M, N]: a bfloat16 / float16 weight through half_linear (few rows) or the half GEMM; an int8 weight
// (with scales) through the int8 kernel of `mode` (W8A8: row scales, K % 64 == 0, as checked by the caller; W8A16
// where hf_accel::w8a16::fits, else weight-only), else float_linear where it fits, else at::linear; plus bias.
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& p, size_t w, int64_t mode) {
  const torch::Tensor& weight = p[w];
  const torch::Tensor& scale = p[w + 1];
  const torch::Tensor& bias = p[w + 2];
  torch::Tensor y;
  const auto dtype = weight.scalar_type();
  if (dtype == torch::kBFloat16 || dtype == torch::kHalf) {  // a half-precision model: float32 activations
    if (x.size(0) <= kHalfMaxRows && x.size(1) % V::kLanes == 0) {
      y = hf_accel::cpu::half_linear(x, weight);  // weights widened in registers, float32 sums
    } else {
      y = at::linear(x.to(dtype), weight).to(torch::kFloat);  // a prompt: the half GEMM (AMX where the CPU has it)
    }
    if (bias.numel()) y.add_(bias);
    return y;
  }
  if (scale.dim() == 3) {  // exact codes of a float weight (coded_gemm_impl.h): the caller keeps x's rows few
    y = hf_accel::coded::coded_linear(x, weight, scale);
    if (bias.numel()) y.add_(bias);
    return y;
  }
  if (dtype != torch::kChar) {
    if (!dot_fits(x, weight)) return at::linear(x, weight, bias.numel() ? bias : torch::Tensor());
    y = float_linear(x, weight);
    if (bias.numel()) y.add_(bias);
    return y;
  }
  if (mode == kW8A8) y = hf_accel::w8a8::w8a8_linear(x, weight, scale);
  if (mode == kW8A16 && hf_accel::w8a16::fits(weight.size(1), scale.size(1)))
    y = hf_accel::w8a16::w8a16_linear(x, weight, scale);
  if (!y.defined()) y = hf_accel::int8_linear<V>(x, weight, scale);
  if (bias.numel()) y.add_(bias);
  return y;
}

// The projections `which` of x (a layer's q / k / v, or gate / up) in one parallel region where they are all exact
// codes (coded_linear_many) or all weight-only int8 (int8_linear_many): one fork and join, not one per projection;
// else one by one (project).
std::vector<torch::Tensor> project_many(const torch::Tensor& x, const std::vector<torch::Tensor>& p,
                                        std::initializer_list<size_t> which, int64_t mode) {
  const auto all = [&](auto pred) { return std::all_of(which.begin(), which.end(), pred); };
  const bool coded = all([&](size_t w) { return p[w + 1].dim() == 3; });
  const bool int8 = mode == kWeightOnly && all([&](size_t w) { return p[w].scalar_type() == torch::kChar; });
  std::vector<torch::Tensor> out;
  if (!coded && !int8) {
    for (size_t w : which) out.push_back(project(x, p, w, mode));
    return out;
  }
  std::vector<torch::Tensor> weights, scales;
  for (size_t w : which) {
    weights.push_back(p[w]);
    scales.push_back(p[w + 1]);
  }
  out = coded ? hf_accel::coded::coded_linear_many(x, weights, scales)
              : hf_accel::int8_linear_many<V>(x, weights, scales);
  size_t i = 0;
  for (size_t w : which) {
    if (p[w + 2].numel()) out[i].add_(p[w + 2]);
    ++i;
  }
  return out;
}

// Rows per thread at least for the row-wise passes (norms, rotations): a step's few rows stay on the calling thread, a
// prompt's thousands are split.
constexpr int64_t kRowGrain = 64;

// y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) over rows of length n (in place allowed); the sum of squares in
// vector lanes (a serial scalar sum is a 4-cycle chain per element: ~2 ms of a 52-row chunk's 60 norms).
template <typename W>
void rms_norm(const float* x, const W* w, float* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * n;
      float* yr = y + r * n;
      typename V::F acc = V::zero();
      int64_t i = 0;
      for (; i + V::kLanes <= n; i += V::kLanes) {
        const typename V::F v = V::load(xr + i);
        acc = V::fma(v, v, acc);
      }
      float ss = V::sum(acc);
      for (; i < n; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (i = 0; i < n; ++i) yr[i] = static_cast<float>(w[i]) * (xr[i] * inv);
    }
  });
}

// The same with the norm's weight as stored: float32, or bfloat16 / float16 (a half-precision model's, read in place).
void rms_norm(const float* x, const torch::Tensor& w, float* y, int64_t rows, int64_t n, float eps) {
  switch (w.scalar_type()) {
    case torch::kBFloat16: return rms_norm(x, w.data_ptr<at::BFloat16>(), y, rows, n, eps);
    case torch::kHalf: return rms_norm(x, w.data_ptr<at::Half>(), y, rows, n, eps);
    default: return rms_norm(x, w.data_ptr<float>(), y, rows, n, eps);
  }
}

// Half-split rotary embedding of every head of x [M, heads, D] in place; cos / sin [M, D].
void rotate(float* x, const float* cos, const float* sin, int64_t M, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (m * heads + h) * D;
        const float* c = cos + m * D;
        const float* s = sin + m * D;
        for (int64_t d = 0; d < half; ++d) tmp[d] = v[d] * c[d] - v[d + half] * s[d];
        for (int64_t d = half; d < D; ++d) tmp[d] = v[d] * c[d] + v[d - half] * s[d];
        std::copy(tmp.begin(), tmp.end(), v);
      }
  });
}

// act [M, I] = silu(gate) * up, rows of gate / up strided by ld_gate / ld_up; vectorised, and split over threads for
// a wide chunk (a target's verification chunk: ~80k values a layer, which the scalar loop ran on one thread).
void silu_mul(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, float* act, int64_t M, int64_t I) {
  constexpr int64_t kGrain = 16384;  // values per thread at least
  at::parallel_for(0, M, std::max<int64_t>(1, kGrain / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = gate + m * ld_gate;
      const float* u = up + m * ld_up;
      float* a = act + m * I;
      int64_t i = 0;
      for (; i + V::kLanes <= I; i += V::kLanes) {
        const V::F x = V::load(g + i);
        V::store(a + i, vmul(vmul(x, vsigmoid(x)), V::load(u + i)));
      }
      for (; i < I; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
}

}  // namespace
