// Vector traits for the int8 kernels (hf_accel/csrc/int8_gemm_impl.h): one struct per instruction set.
// Avx2 needs -mavx2 -mfma; Avx512 exists only where the file is compiled with -mavx512f (and -mavx512bw).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include "avx2_common.h"

namespace hf_accel {

struct Avx2 {
  using F = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr const char* kName = "AVX2";
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_w(const int8_t* p) {  // 8 int8 -> 8 float
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static float sum(F v) { return hsum(v); }
};

#ifdef __AVX512F__
struct Avx512 {
  using F = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr const char* kName = "AVX-512";
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F load_w(const int8_t* p) {  // 16 int8 -> 16 float
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
#endif

// The widest lanes this build has (AVX-512 builds: 16, the AVX2 build: 8).
#ifdef __AVX512F__
using Widest = Avx512;
#else
using Widest = Avx2;
#endif

}  // namespace hf_accel
