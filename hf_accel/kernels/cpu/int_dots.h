// The integer-dot int8 linears of this build, under one set of names (hf_accel::w8a8 / hf_accel::w8a16: quantize,
// w8a8_linear, w8a16_linear, fits, kBlock, kMaxK): AVX-512 VNNI's `vpdpbusd` / `vpdpwssd` where the build has VNNI
// (w8a8_impl.h, w8a16_impl.h), else AVX2's `vpmaddubsw` / `vpmaddwd` (idot_avx2.h). Same activations, groups and
// exact group dots either way.
#pragma once
#ifdef __AVX512VNNI__
#include "w8a16_impl.h"
#include "w8a8_impl.h"
#else
#include "idot_avx2.h"
#endif
