// W8A8 linear with AVX-512 VNNI (the kernel itself: hf_accel/csrc/w8a8_impl.h, also used by the speculative
// draft's native layers).
#include "w8a8_impl.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_activations", &hf_accel::w8a8::quantize,
        "x -> (int8 values [M, K], scales [M, 16], -128 * the values' sum per group [M, 16])");
  m.def("w8a8_linear", &hf_accel::w8a8::w8a8_linear, "W8A8 linear (AVX-512 VNNI)");
}
