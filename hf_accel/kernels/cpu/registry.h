// How the translation units of hf_accel's CPU extension add their functions to the one module of a build
// (module.cpp): each defines one register_* function. kernels/build.py compiles every source as one translation unit,
// so names at file scope (anonymous namespaces too) must be unique across the sources.
#pragma once
#include <torch/extension.h>

namespace hf_accel::cpu {

void register_int8(pybind11::module_& m);
void register_w8a8(pybind11::module_& m);
void register_paged_attention(pybind11::module_& m);
void register_panel_gemm(pybind11::module_& m);
void register_decoder_layers(pybind11::module_& m);
void register_half_gemm(pybind11::module_& m);
void register_coded_gemm(pybind11::module_& m);

}  // namespace hf_accel::cpu
