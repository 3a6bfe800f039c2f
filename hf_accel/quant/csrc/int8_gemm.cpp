// The int8 decode kernel (hf_accel/csrc/int8_gemm_impl.h) on 8 lanes: AVX2 + FMA.
#include "avx2_common.h"
#include "int8_gemm_impl.h"

namespace {

struct Avx2 {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr const char* kName = "AVX2";
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load_w(const int8_t* p) {  // 8 int8 -> 8 float
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static float sum(F v) { return hf_accel::hsum(v); }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &hf_accel::int8_linear<Avx2>, "weight-only int8 linear (AVX2)");
}
