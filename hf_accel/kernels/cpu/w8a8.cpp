// Integer-dot int8 linears with quantized activations: W8A8 (int8 activations per row and 16 interleaved feature
// groups) and W8A16 (int16 activations), through AVX-512 VNNI where the build has it, else AVX2 (int_dots.h).
#include "registry.h"
#include "int_dots.h"

namespace hf_accel::cpu {

void register_w8a8(pybind11::module_& m) {
#ifdef __AVX512VNNI__
  constexpr const char* kHow = " (AVX-512 VNNI)";
#else
  constexpr const char* kHow = " (AVX2 vpmaddubsw / vpmaddwd)";
#endif
  m.def("quantize_activations", &hf_accel::w8a8::quantize,
        "x -> (int8 values [M, K], scales [M, 16], -128 * the values' sum per group [M, 16])");
  m.def("w8a8_linear", &hf_accel::w8a8::w8a8_linear, (std::string("W8A8 linear") + kHow).c_str());
  m.def("w8a16_linear", &hf_accel::w8a16::w8a16_linear, (std::string("W8A16 linear") + kHow).c_str());
  m.def("w8a16_fits", &hf_accel::w8a16::fits, "whether (in_features, scales per row) suit W8A16");
}

}  // namespace hf_accel::cpu
