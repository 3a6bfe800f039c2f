// hf_accel's CPU extension: one module per instruction-set build (kernels/build.py compiles every source of this
// folder with that build's flags). Which functions a build has depends on the instruction set: see each file.
#include "registry.h"

#if defined(__AVX512VNNI__)
constexpr const char* kIsa = "avx512vnni";
#elif defined(__AVX512F__)
constexpr const char* kIsa = "avx512";
#else
constexpr const char* kIsa = "avx2";
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", []() { return std::string(kIsa); }, "the instruction set this build was compiled for");
  hf_accel::cpu::register_int8(m);
  hf_accel::cpu::register_w8a8(m);
  hf_accel::cpu::register_paged_attention(m);
  hf_accel::cpu::register_panel_gemm(m);
  hf_accel::cpu::register_decoder_layers(m);
  hf_accel::cpu::register_half_gemm(m);
  hf_accel::cpu::register_coded_gemm(m);
}
