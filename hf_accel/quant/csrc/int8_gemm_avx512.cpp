// The int8 decode kernel (hf_accel/csrc/int8_gemm_impl.h) on 16 lanes: AVX-512 (groups of 16+).
#include "int8_gemm_impl.h"

namespace {

struct Avx512 {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr const char* kName = "AVX-512";
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load_w(const int8_t* p) {  // 16 int8 -> 16 float
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &hf_accel::int8_linear<Avx512>, "weight-only int8 linear (AVX-512)");
}
