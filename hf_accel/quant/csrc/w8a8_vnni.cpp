// W8A8 linear with AVX-512 VNNI: y[M, N] = dequant(quantize_activations(x)) @ (q[N, K] * scale[N])^T.
//
// Activations are quantized per row and per group of 64 input features (symmetric, scale = max|x| / 127,
// round half to even; the same arithmetic as hf_accel.quant.core.quantize_activations, so the int8 values are
// bitwise equal). Each 64-feature step is one `vpdpbusd` per (activation row, weight row): weights are made
// unsigned by flipping their sign bit (q + 128), so the int32 result is the exact dot with q + 128. It is
// converted to float and scaled by the activation group's scale; at the end the +128's share, the per-row
// offset sum_g xscale * 128 * sum(xq), is subtracted and the weight row's scale applied.
// Tiles of 4 weight rows share each activation load; activation rows go 4, 2, 1 at a time; four sums are reduced
// together; tiles are split over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 64;        // activation features per scale (one zmm of int8)
constexpr int64_t kRows = 4;          // weight rows per tile
constexpr int64_t kPrefetch = 1024;   // bytes ahead in each weight row

// One row of x [K] -> xq [K] int8, scale [K / 64], base [K / 64] = -128 * sum(xq) per group, and
// offset = -sum_g scale * base (what the unsigned weights' +128 adds to the row's scaled dots; double sum).
void quantize_row(const float* x, int8_t* xq, float* scale, int32_t* base, float* offset, int64_t K) {
  double total_offset = 0.0;
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
    total_offset += static_cast<double>(s) * 128.0 * total;
  }
  *offset = static_cast<float>(total_offset);
}

// Sums of four vectors, one per lane of the result: [sum(a), sum(b), sum(c), sum(d)].
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto half = [](__m512 v) {  // 16 -> 8 lanes
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// MR activation rows x NR weight rows:
// y[i * ldy + r] = wscale[r] * (sum_g xscale[i, g] * dot(xq[i, g], q[r, g] + 128) - offset[i]),
// where offset[i] = sum_g xscale[i, g] * 128 * sum(xq[i, g]) removes the +128 of the unsigned weights.
template <int MR, int NR>
void tile(const int8_t* xq, const float* xscale, const float* offset, const int8_t* q, const float* wscale,
          float* y, int64_t K, int64_t ldy) {
  const int64_t G = K / kGroup;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i xv[MR];
    __m512 s[MR];
    for (int i = 0; i < MR; ++i) {
      xv[i] = _mm512_loadu_si512(xq + i * K + g * kGroup);
      s[i] = _mm512_set1_ps(xscale[i * G + g]);
    }
    for (int r = 0; r < NR; ++r) {
      const int8_t* row = q + r * K + g * kGroup;
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(row), flip);  // q + 128 as unsigned bytes
      for (int i = 0; i < MR; ++i) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[i]);  // exact int32 partial dots
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s[i], acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      const __m128 sums = _mm_sub_ps(sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), _mm_set1_ps(offset[i]));
      _mm_storeu_ps(y + i * ldy, _mm_mul_ps(sums, _mm_loadu_ps(wscale)));
    } else {
      for (int r = 0; r < NR; ++r) y[i * ldy + r] = wscale[r] * (_mm512_reduce_add_ps(acc[i][r]) - offset[i]);
    }
  }
}

template <int NR>
void rows_of_tile(const int8_t* xq, const float* xs, const float* offset, const int8_t* q, const float* ws,
                  float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t G = K / kGroup;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<4, NR>(xq + m * K, xs + m * G, offset + m, q, ws, y + m * N, K, N);
  for (; m + 2 <= M; m += 2) tile<2, NR>(xq + m * K, xs + m * G, offset + m, q, ws, y + m * N, K, N);
  for (; m < M; ++m) tile<1, NR>(xq + m * K, xs + m * G, offset + m, q, ws, y + m * N, K, N);
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "w8a8: x must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % kGroup == 0, "w8a8: in_features must be a multiple of ", kGroup, ", got ", x.size(1));
}

// x [M, K] float32 -> (xq [M, K] int8, scale [M, K / 64] float32, base [M, K / 64] int32, offset [M] float32).
std::vector<torch::Tensor> quantize(const torch::Tensor& x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kChar));
  auto scale = torch::empty({M, G}, x.options());
  auto base = torch::empty({M, G}, x.options().dtype(torch::kInt));
  auto offset = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* bp = base.data_ptr<int32_t>();
  float* op = offset.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(xp + m * K, qp + m * K, sp + m * G, bp + m * G, op + m, K);
  });
  return {xq, scale, base, offset};
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
  const float* off = parts[3].data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kRows - 1) / kRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows;
      if (n0 + kRows <= N) {
        rows_of_tile<kRows>(xq, xs, off, qp + n0 * K, sp + n0, yp + n0, M, K, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_of_tile<1>(xq, xs, off, qp + n * K, sp + n, yp + n, M, K, N);
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_activations", &quantize,
        "x -> (int8 values, scales, -128 * group sums per 64 features, per-row offset of the unsigned weights)");
  m.def("w8a8_linear", &w8a8_linear, "W8A8 linear (AVX-512 VNNI)");
}
