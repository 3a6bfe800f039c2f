// Integer-dot int8 linears with quantized activations (AVX-512 VNNI builds only): W8A8 (w8a8_impl.h: int8
// activations per row and 16 interleaved feature groups) and W8A16 (w8a16_impl.h: int16 activations). Other builds
// register nothing from this file.
#include "registry.h"
#ifdef __AVX512VNNI__
#include "w8a16_impl.h"
#include "w8a8_impl.h"
#endif

namespace hf_accel::cpu {

void register_w8a8(pybind11::module_& m) {
#ifdef __AVX512VNNI__
  m.def("quantize_activations", &hf_accel::w8a8::quantize,
        "x -> (int8 values [M, K], scales [M, 16], -128 * the values' sum per group [M, 16])");
  m.def("w8a8_linear", &hf_accel::w8a8::w8a8_linear, "W8A8 linear (AVX-512 VNNI)");
  m.def("w8a16_linear", &hf_accel::w8a16::w8a16_linear, "W8A16 linear (AVX-512 VNNI)");
  m.def("w8a16_fits", &hf_accel::w8a16::fits, "whether (in_features, scales per row) suit W8A16");
#else
  (void)m;
#endif
}

}  // namespace hf_accel::cpu
