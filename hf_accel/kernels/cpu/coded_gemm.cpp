// Exact-code linears (coded_gemm_impl.h): float weights held as the 4-bit / 8-bit codes of a de-quantized checkpoint
// (hf_accel/quant/codes.py), for few activation rows. Part of every instruction-set build (module.cpp); the native
// decoder layers run the same kernel for their coded projections (layer_ops.h).
#include "coded_gemm_impl.h"
#include "registry.h"

namespace hf_accel::cpu {

void register_coded_gemm(pybind11::module_& m) {
  m.def("coded_linear", &hf_accel::coded::coded_linear,
        "x [M <= 32, K] fp32 @ W^T, W held as exact codes: codes [N, K/2] uint8 (4-bit) or [N, K] int8, params "
        "[N, K/32, 2] (scale, offset)");
  m.def("coded_linear_max_rows", []() { return hf_accel::coded::kMaxRows; }, "coded_linear takes this many rows");
}

}  // namespace hf_accel::cpu
