// The int8 decode kernel (hf_accel/csrc/int8_gemm_impl.h) on 16 lanes: AVX-512 (groups of 16+).
#include "int8_traits.h"
#include "int8_gemm_impl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &hf_accel::int8_linear<hf_accel::Avx512>, "weight-only int8 linear (AVX-512)");
}
