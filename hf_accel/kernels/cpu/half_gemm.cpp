// Half-precision weights against few activation rows (a bfloat16 / float16 model's decode steps):
// y [M, N] float32 = x [M, K] float32 @ w [N, K]^T, w bfloat16 or float16 read in place, row-major. Each weight vector
// is widened to float32 in registers (bf16: zero-extend and shift into the high half; fp16: F16C) and FMA'd into
// float32 sums, in the tiles of dot_tile.h (shared with float_linear). Part of every instruction-set build
// (module.cpp): AVX-512 (16 lanes) or AVX2 + F16C (8 lanes).
#include <torch/extension.h>
#include <cstdint>
#include "dot_tile.h"
#include "registry.h"

namespace {

using V = hf_accel::dot::V;
constexpr int64_t kMaxRows = 16;

#ifdef __AVX512F__
inline V::F widen_bf16(const uint16_t* p) {  // 16 bf16 -> 16 float: zero-extend, shift into the high half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline V::F widen_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
inline V::F widen_bf16(const uint16_t* p) {  // 8 bf16 -> 8 float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V::F widen_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

}  // namespace

namespace hf_accel::cpu {

// x [M <= 16, K] float32 @ weight [N, K]^T (bfloat16 or float16, contiguous), K a multiple of the lanes. Also the
// native layers' projection for half-precision weights (decoder_layers.cpp).
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
    hf_accel::dot::linear(xc.data_ptr<float>(), w, y.data_ptr<float>(), M, K, N, 16,
                          [](const uint16_t* p) { return widen_bf16(p); });  // a lambda: inlined
  } else {
    hf_accel::dot::linear(xc.data_ptr<float>(), w, y.data_ptr<float>(), M, K, N, 16,
                          [](const uint16_t* p) { return widen_f16(p); });
  }
  return y;
}

void register_half_gemm(pybind11::module_& m) {
  m.def("half_linear", &half_linear, "x [M <= 16, K] fp32 @ w [N, K]^T, w bfloat16 / float16: float32 sums");
  m.def("half_lanes", []() { return V::kLanes; }, "K must be a multiple of this");
}

}  // namespace hf_accel::cpu
