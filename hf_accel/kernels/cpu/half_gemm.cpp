// Half-precision weights against few activation rows (a bfloat16 / float16 model's decode steps):
// y [M, N] float32 = x [M, K] float32 @ w [N, K]^T, w bfloat16 or float16 read in place, row-major. Each weight vector
// is widened to float32 in registers (bf16: zero-extend and shift into the high half; fp16: F16C), FMA'd into float32
// sums; a tile of kRows activation rows x 4 weight rows keeps its sums in vector lanes over K and reduces them once;
// tiles of weight rows are split over threads, so the weights stream from memory once per call. Part of every
// instruction-set build (module.cpp): AVX-512 (16 lanes) or AVX2 + F16C (8 lanes).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include "int8_traits.h"
#include "registry.h"
#ifdef __AVX512F__
#include "avx512_common.h"
#endif

namespace {

#ifdef __AVX512F__
using V = hf_accel::Avx512;
inline V::F widen_bf16(const uint16_t* p) {  // 16 bf16 -> 16 float
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V::F widen_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void reduce4(V::F a, V::F b, V::F c, V::F d, float* out) { _mm_storeu_ps(out, hf_accel::sum4(a, b, c, d)); }
#else
using V = hf_accel::Avx2;
inline V::F widen_bf16(const uint16_t* p) {  // 8 bf16 -> 8 float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V::F widen_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void reduce4(V::F a, V::F b, V::F c, V::F d, float* out) {
  out[0] = V::sum(a), out[1] = V::sum(b), out[2] = V::sum(c), out[3] = V::sum(d);
}
#endif

constexpr int kRows = V::kLanes == 16 ? 4 : 2;  // registers: 4 * kRows sums + 4 weight vectors + 1
constexpr int64_t kMaxRows = 16;

template <bool BF16>
inline V::F widen(const uint16_t* p) {
  if constexpr (BF16) {
    return widen_bf16(p);
  } else {
    return widen_f16(p);
  }
}

template <bool BF16, int MR, int NR>
inline void tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t ldy) {
  V::F acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = V::zero();
  for (int64_t k = 0; k < K; k += V::kLanes) {
    V::F wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen<BF16>(w + r * K + k);
    for (int i = 0; i < MR; ++i) {
      const V::F xv = V::load(x + i * K + k);
      for (int r = 0; r < NR; ++r) acc[i][r] = V::fma(xv, wv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], y + i * ldy);
    } else {
      for (int r = 0; r < NR; ++r) y[i * ldy + r] = V::sum(acc[i][r]);
    }
  }
}

// NR weight rows against all M activation rows.
template <bool BF16, int NR>
inline void rows(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<BF16, kRows, NR>(x + m * K, w, y + m * N, K, N);
  for (; m < M; ++m) tile<BF16, 1, NR>(x + m * K, w, y + m * N, K, N);
}

template <bool BF16>
void run(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t groups = N / 4;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) rows<BF16, 4>(x, w + g * 4 * K, y + g * 4, M, K, N);
  });
  for (int64_t n = groups * 4; n < N; ++n) rows<BF16, 1>(x, w + n * K, y + n, M, K, N);
}

// x [M <= 16, K] float32 @ weight [N, K]^T (bfloat16 or float16, contiguous), K a multiple of the lanes.
torch::Tensor half_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == torch::kHalf, "half_linear: the weight must be bfloat16 or float16");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "half_linear: needs a contiguous weight [N, K]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) == weight.size(1) && x.size(0) <= kMaxRows,
              "half_linear: needs float32 x [M <= ", kMaxRows, ", K] matching the weight's K");
  TORCH_CHECK(x.size(1) % V::kLanes == 0, "half_linear: K must be a multiple of ", V::kLanes);
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, xc.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  if (bf16) {
    run<true>(xc.data_ptr<float>(), w, y.data_ptr<float>(), M, K, N);
  } else {
    run<false>(xc.data_ptr<float>(), w, y.data_ptr<float>(), M, K, N);
  }
  return y;
}

}  // namespace

namespace hf_accel::cpu {

void register_half_gemm(pybind11::module_& m) {
  m.def("half_linear", &half_linear, "x [M <= 16, K] fp32 @ w [N, K]^T, w bfloat16 / float16: float32 sums");
  m.def("half_lanes", []() { return V::kLanes; }, "K must be a multiple of this");
}

}  // namespace hf_accel::cpu
