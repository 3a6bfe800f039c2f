// Weight-only int8 linear (int8_gemm_impl.h): the widest vector lanes this build has (AVX-512: groups of 16+,
// AVX2: groups of 8+). Part of every instruction-set build of hf_accel's CPU extension (module.cpp).
#include "int8_traits.h"
#include "int8_gemm_impl.h"
#include "registry.h"

namespace hf_accel::cpu {

using Lanes = hf_accel::Widest;

void register_int8(pybind11::module_& m) {
  m.def("int8_linear", &hf_accel::int8_linear<Lanes>, "weight-only int8 linear: x [M, K] fp32 @ (q [N, K] * scale)^T");
  m.def("int8_experts_linear", &hf_accel::int8_experts_linear<Lanes>,
        "a mixture of experts' weight-only int8 linear: x [R, K] fp32, ids [R, J] -> [R, J, N]");
  m.def("int8_group_lanes", []() { return Lanes::kLanes; }, "the int8 group size must be a multiple of this");
}

}  // namespace hf_accel::cpu
