// Weight-only int8 matmul for small M (decode): y[M, N] = x[M, K] @ (q[N, K] * scale[N, G])^T.
// AVX2 + FMA: int8 weights are sign-extended to int32, converted to float and multiplied with fp32
// activations; four output rows per tile share each activation load; prefetch runs ahead in the weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

namespace {

constexpr int64_t kRows = 4;        // output rows per tile
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each weight row

using hf_accel::hsum;

inline __m256 load_w8(const int8_t* p) {  // 8 int8 -> 8 float
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One tile: `rows` (<= kRows) weight rows times MR activation rows. Each weight vector is converted to
// float once and used for all MR activation rows.
template <int MR>
void tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t rows, int64_t K,
          int64_t group, int64_t G, int64_t ldy) {
  __m256 acc[MR][kRows];
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 part[MR][kRows];
    for (int m = 0; m < MR; ++m)
      for (int64_t r = 0; r < kRows; ++r) part[m][r] = _mm256_setzero_ps();
    const int64_t k0 = g * group;
    for (int64_t k = k0; k < k0 + group; k += 8) {
      __m256 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* row = q + r * K;
        _mm_prefetch(reinterpret_cast<const char*>(row + k + kPrefetch), _MM_HINT_T0);
        const __m256 w = load_w8(row + k);
        for (int m = 0; m < MR; ++m) part[m][r] = _mm256_fmadd_ps(xv[m], w, part[m][r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 s = _mm256_set1_ps(scale[r * G + g]);
      for (int m = 0; m < MR; ++m) acc[m][r] = _mm256_fmadd_ps(part[m][r], s, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = hsum(acc[m][r]);
}

}  // namespace

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, G] float32; returns [M, N] float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2, "int8_linear: expected 2-D x, q, scale");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && q.scalar_type() == torch::kChar &&
                  scale.scalar_type() == torch::kFloat, "int8_linear: dtypes must be float32, int8, float32");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), "int8_linear: needs contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = scale.size(1);
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N && K % G == 0, "int8_linear: shape mismatch");
  const int64_t group = K / G;
  TORCH_CHECK(group % 8 == 0, "int8_linear: group size must be a multiple of 8");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows, rows = std::min(kRows, N - n0);
      const int8_t* qt = qp + n0 * K;
      const float* st = sp + n0 * G;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(xp + m * K, qt, st, yp + m * N + n0, rows, K, group, G, N);
      for (; m + 2 <= M; m += 2) tile<2>(xp + m * K, qt, st, yp + m * N + n0, rows, K, group, G, N);
      for (; m < M; ++m) tile<1>(xp + m * K, qt, st, yp + m * N + n0, rows, K, group, G, N);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("int8_linear", &int8_linear, "weight-only int8 linear (AVX2)"); }
