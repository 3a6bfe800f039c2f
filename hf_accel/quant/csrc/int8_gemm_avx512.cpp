// Weight-only int8 matmul for small M (decode), AVX-512: y[M, N] = x[M, K] @ (q[N, K] * scale[N, G])^T.
// The AVX2 kernel (int8_gemm.cpp) with 16 lanes: 16 int8 weights are sign-extended to int32, converted to
// float and multiplied with fp32 activations; four weight rows per tile share each activation load, and each
// converted weight vector serves every activation row of the tile. Groups must be multiples of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kRows = 4;        // weight (output) rows per tile
constexpr int64_t kPrefetch = 1024;  // bytes ahead in each weight row

inline __m512 load_w16(const int8_t* p) {  // 16 int8 -> 16 float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int MR>
void tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t rows, int64_t K,
          int64_t group, int64_t G, int64_t ldy) {
  __m512 acc[MR][kRows];
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[MR][kRows];
    for (int m = 0; m < MR; ++m)
      for (int64_t r = 0; r < kRows; ++r) part[m][r] = _mm512_setzero_ps();
    const int64_t k0 = g * group;
    for (int64_t k = k0; k < k0 + group; k += 16) {
      __m512 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* row = q + r * K;
        _mm_prefetch(reinterpret_cast<const char*>(row + k + kPrefetch), _MM_HINT_T0);
        const __m512 w = load_w16(row + k);
        for (int m = 0; m < MR; ++m) part[m][r] = _mm512_fmadd_ps(xv[m], w, part[m][r]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 s = _mm512_set1_ps(scale[r * G + g]);
      for (int m = 0; m < MR; ++m) acc[m][r] = _mm512_fmadd_ps(part[m][r], s, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
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
  TORCH_CHECK(group % 16 == 0, "int8_linear (AVX-512): group size must be a multiple of 16");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "weight-only int8 linear (AVX-512)");
}
