// W8A8 linear with AVX-512 VNNI: y[M, N] = dequant(quantize_activations(x)) @ (q[N, K] * scale[N])^T.
//
// Activations are quantized per row and per group of 64 input features (symmetric, scale = max|x| / 127,
// round half to even; the same arithmetic as hf_accel.quant.core.quantize_activations, so the int8 values are
// bitwise equal). Each 64-feature step is one `vpdpbusd` per (activation row, weight row): weights are made
// unsigned by flipping their sign bit (q + 128) and the integer accumulator starts at -128 * sum(xq) of the
// group, so the int32 result is the exact signed dot product. That exact integer is converted to float and
// scaled by the activation group's scale; the weight row's scale is applied once at the end.
// Tiles of 4 weight rows share each activation load; activation rows go 4, 2, 1 at a time; tiles are split
// over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 64;        // activation features per scale (one zmm of int8)
constexpr int64_t kRows = 4;          // weight rows per tile
constexpr int64_t kPrefetch = 1024;   // bytes ahead in each weight row

// One row of x [K] -> xq [K] int8, scale [K / 64], base [K / 64] = -128 * sum(xq) per group.
void quantize_row(const float* x, int8_t* xq, float* scale, int32_t* base, int64_t K) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < kGroup; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xg + k)));
    const float s = _mm512_reduce_max_ps(amax) / 127.0f;
    scale[g] = s;
    int32_t total = 0;
    for (int64_t k = 0; k < kGroup; k += 16) {
      __m512i v = _mm512_setzero_si512();
      if (s > 0.0f) {  // an all-zero group quantizes to zeros
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xg + k), _mm512_set1_ps(s)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(r), lo), hi);
      }
      total += _mm512_reduce_add_epi32(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * kGroup + k), _mm512_cvtepi32_epi8(v));
    }
    base[g] = -128 * total;
  }
}

// MR activation rows x NR weight rows: y[i * ldy + r] = wscale[r] * sum_g xscale[i, g] * dot(xq[i, g], q[r, g]).
template <int MR, int NR>
void tile(const int8_t* xq, const float* xscale, const int32_t* base, const int8_t* q, const float* wscale,
          float* y, int64_t K, int64_t ldy) {
  const int64_t G = K / kGroup;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i xv[MR], start[MR];
    __m512 s[MR];
    for (int i = 0; i < MR; ++i) {
      xv[i] = _mm512_loadu_si512(xq + i * K + g * kGroup);
      s[i] = _mm512_set1_ps(xscale[i * G + g]);
      start[i] = _mm512_zextsi128_si512(_mm_cvtsi32_si128(base[i * G + g]));  // lane 0 only
    }
    for (int r = 0; r < NR; ++r) {
      const int8_t* row = q + r * K + g * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(row), flip);  // q + 128 as unsigned bytes
      for (int i = 0; i < MR; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(start[i], w, xv[i]);  // exact int32 partial dots
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[i], acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) y[i * ldy + r] = wscale[r] * _mm512_reduce_add_ps(acc[i][r]);
}

template <int NR>
void rows_of_tile(const int8_t* xq, const float* xs, const int32_t* base, const int8_t* q, const float* ws,
                  float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NR>(xq + m * K, xs + m * G, base + m * G, q, ws, y + m * N, K, N);
  for (; m + 2 <= M; m += 2) tile<2, NR>(xq + m * K, xs + m * G, base + m * G, q, ws, y + m * N, K, N);
  for (; m < M; ++m) tile<1, NR>(xq + m * K, xs + m * G, base + m * G, q, ws, y + m * N, K, N);
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % kGroup == 0, "w8a8: in_features must be a multiple of ", kGroup, ", got ", x.size(1));
}

// x [M, K] float32 -> (xq [M, K] int8, scale [M, K / 64] float32, base [M, K / 64] int32).
std::vector<torch::Tensor> quantize(const torch::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto scale = torch::empty({M, G}, x.options());
  auto base = torch::empty({M, G}, x.options().dtype(torch::kInt));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* bp = base.data_ptr<int32_t>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, qp + m * K, sp + m * G, bp + m * G, K);
  });
  return {xq, scale, base};
}

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, 1] float32 (one scale per weight row).
torch::Tensor w8a8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  check_x(x);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "w8a8: q must be int8 [N, K]");
  TORCH_CHECK(scale.dim() == 2 && scale.size(1) == 1 && scale.scalar_type() == torch::kFloat && scale.is_contiguous(),
              "w8a8: scale must be float32 [N, 1] (per-row weight scales)");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N, "w8a8: shape mismatch");
  auto parts = quantize(x);
  const int8_t* xq = parts[0].data_ptr<int8_t>();
  const float* xs = parts[1].data_ptr<float>();
  const int32_t* base = parts[2].data_ptr<int32_t>();
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      if (n0 + kRows <= N) {
        rows_of_tile<kRows>(xq, xs, base, qp + n0 * K, sp + n0, yp + n0, M, K, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_of_tile<1>(xq, xs, base, qp + n * K, sp + n, yp + n, M, K, N);
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_activations", &quantize, "x -> (int8 values, scales, -128 * group sums) per 64 features");
  m.def("w8a8_linear", &w8a8_linear, "W8A8 linear (AVX-512 VNNI)");
}
