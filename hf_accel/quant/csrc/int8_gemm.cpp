// The int8 decode kernel (hf_accel/csrc/int8_gemm_impl.h) on 8 lanes: AVX2 + FMA.
#include "int8_traits.h"
#include "int8_gemm_impl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &hf_accel::int8_linear<hf_accel::Avx2>, "weight-only int8 linear (AVX2)");
}
