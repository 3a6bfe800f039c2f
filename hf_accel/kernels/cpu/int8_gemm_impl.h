// Weight-only int8 matmul for small M (decode): y[M, N] = x[M, K] @ (q[N, K] * scale[N, G])^T.
//
// One algorithm for every vector width V (a traits struct defined by the including file, compiled for its
// instruction set): int8 weights are sign-extended to int32, converted to float in registers and FMA'd with the
// fp32 activations; four output rows per tile share each activation load, and each converted weight vector
// serves up to four activation rows; software prefetch runs ahead of the tile in the weights' memory order (one
// prefetch per 64 bytes consumed, aimed past the tile's end: see kInt8Ahead); per-group partial sums are
// scaled once per group; tiles are split over threads.
//
// V (a struct of hf_accel/csrc/int8_traits.h) provides: type F, kLanes, zero(), load(const float*),
// load_w(const int8_t*) (kLanes int8 -> float), fma(a, b, c), set1(float), sum(F), and kName.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>
#include <vector>
#include "avx2_common.h"

namespace hf_accel {

constexpr int64_t kInt8Rows = 4;        // weight (output) rows per tile
// Prefetch target: kInt8Ahead bytes past the end of the current tile (its rows are contiguous, so that is where
// the next tile of this thread reads), advancing as fast as the tile consumes. Prefetching ahead within each row
// instead mostly touched rows the tile was already reading (rows are only K bytes): 5.7 ms against 11.7 ms for
// all of SmolLM2's linears at one activation row, weights not in cache (~23 GB/s against ~12;
// benchmarks/bench_int8_kernels.py).
constexpr int64_t kInt8Ahead = 2048;

// Products of columns [k0, k1) of MR activation rows and `rows` weight rows, added into sums[m][r].
template <class V, int MR>
__attribute__((always_inline)) inline void int8_span(const float* x, const int8_t* q, int64_t rows, int64_t K,
                                                     int64_t k0, int64_t k1, const char* ahead,
                                                     typename V::F (&sums)[MR][kInt8Rows]) {
  using F = typename V::F;
  for (int64_t k = k0; k < k1; k += V::kLanes) {
    F xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = V::load(x + m * K + k);
    for (int64_t b = 0; b < rows * V::kLanes; b += 64) prefetch_weights(ahead + k * rows + b);
    for (int64_t r = 0; r < rows; ++r) {
      const F w = V::load_w(q + r * K + k);
      for (int m = 0; m < MR; ++m) sums[m][r] = V::fma(xv[m], w, sums[m][r]);
    }
  }
}

template <class V, int MR>
void int8_tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t rows, int64_t K,
               int64_t group, int64_t G, int64_t ldy) {
  using F = typename V::F;
  F acc[MR][kInt8Rows];
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < kInt8Rows; ++r) acc[m][r] = V::zero();
  const char* ahead = reinterpret_cast<const char*>(q) + rows * K + kInt8Ahead;
  if (G == 1) {
    // one scale per weight row: accumulate straight into acc and scale each output once, so a 4 x 4 tile holds
    // 16 accumulators instead of 32 (the grouped path below spilled registers there)
    int8_span<V, MR>(x, q, rows, K, 0, K, ahead, acc);
    for (int m = 0; m < MR; ++m)
      for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = V::sum(acc[m][r]) * scale[r];
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    F part[MR][kInt8Rows];
    for (int m = 0; m < MR; ++m)
      for (int64_t r = 0; r < kInt8Rows; ++r) part[m][r] = V::zero();
    int8_span<V, MR>(x, q, rows, K, g * group, (g + 1) * group, ahead, part);
    for (int64_t r = 0; r < rows; ++r) {
      const F s = V::set1(scale[r * G + g]);
      for (int m = 0; m < MR; ++m) acc[m][r] = V::fma(part[m][r], s, acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int64_t r = 0; r < rows; ++r) y[m * ldy + r] = V::sum(acc[m][r]);
}

template <class V>
std::vector<torch::Tensor> int8_linear_many(const torch::Tensor& x, const std::vector<torch::Tensor>& qs,
                                            const std::vector<torch::Tensor>& scales);

// One tile of `rows` (<= 4) weight rows qt (scales st) against every activation row: y[m, 0 .. rows).
template <class V>
inline void int8_rows(const float* xp, const int8_t* qt, const float* st, float* yp, int64_t M, int64_t K, int64_t ldy,
                      int64_t rows, int64_t group, int64_t G) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int8_tile<V, 4>(xp + m * K, qt, st, yp + m * ldy, rows, K, group, G, ldy);
  for (; m + 2 <= M; m += 2) int8_tile<V, 2>(xp + m * K, qt, st, yp + m * ldy, rows, K, group, G, ldy);
  for (; m < M; ++m) int8_tile<V, 1>(xp + m * K, qt, st, yp + m * ldy, rows, K, group, G, ldy);
}

// Checks one product's arguments; returns its group size.
template <class V>
int64_t int8_check(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2, "int8_linear: expected 2-D x, q, scale");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && q.scalar_type() == torch::kChar &&
                  scale.scalar_type() == torch::kFloat, "int8_linear: dtypes must be float32, int8, float32");
  TORCH_CHECK(x.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), "int8_linear: needs contiguous");
  const int64_t K = x.size(1), N = q.size(0), G = scale.size(1);
  TORCH_CHECK(q.size(1) == K && scale.size(0) == N && K % G == 0, "int8_linear: shape mismatch");
  TORCH_CHECK((K / G) % V::kLanes == 0, "int8_linear (", V::kName, "): group size must be a multiple of ", V::kLanes);
  return K / G;
}

// x: [M, K] float32 contiguous; q: [N, K] int8; scale: [N, G] float32; returns [M, N] float32.
template <class V>
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  return int8_linear_many<V>(x, {q}, {scale})[0];
}

// Several products of the same x [M, K] in one parallel region (a layer's q / k / v, or gate / up): one fork and join
// instead of one per product, and the threads' shares of every weight stream back to back. ys[i] = x @ (qs[i] *
// scales[i])^T, each [M, N_i]; the tiles of all products are split over threads together.
template <class V>
std::vector<torch::Tensor> int8_linear_many(const torch::Tensor& x, const std::vector<torch::Tensor>& qs,
                                            const std::vector<torch::Tensor>& scales) {
  TORCH_CHECK(!qs.empty() && qs.size() == scales.size(), "int8_linear: one scale tensor per weight");
  const size_t P = qs.size();
  struct Product {
    const int8_t* q;
    const float* scale;
    float* y;
    int64_t n, g, group, first;  // rows, scales per row, group size, first tile in the joint numbering
  };
  std::vector<Product> products(P);
  std::vector<torch::Tensor> ys(P);
  int64_t tiles = 0;
  for (size_t i = 0; i < P; ++i) {
    const int64_t group = int8_check<V>(x, qs[i], scales[i]);
    ys[i] = torch::empty({x.size(0), qs[i].size(0)}, x.options());
    products[i] = {qs[i].data_ptr<int8_t>(), scales[i].data_ptr<float>(), ys[i].data_ptr<float>(), qs[i].size(0),
                   scales[i].size(1), group, tiles};
    tiles += (qs[i].size(0) + kInt8Rows - 1) / kInt8Rows;
  }
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (i + 1 < P && t >= products[i + 1].first) ++i;
      const Product& p = products[i];
      const int64_t n0 = (t - p.first) * kInt8Rows;
      int8_rows<V>(xp, p.q + n0 * K, p.scale + n0 * p.g, p.y + n0, M, K, p.n, std::min(kInt8Rows, p.n - n0), p.group,
                   p.g);
    }
  });
  return ys;
}


// A mixture of experts' weight-only int8 linear: row r of x [R, K] float32 times the weights of each of its experts
// ids[r, :] (int64 [R, J]; an id outside [0, E) gives zeros): out[r, j] = x[r] @ (q[ids[r, j]] * scale[ids[r, j]])^T,
// q [E, N, K] int8, scale [E, N, G] float32 -> [R, J, N] float32. The rows are grouped by expert (gathered into one
// contiguous block each), and the tiles of every expert hit are split over threads together: one parallel region,
// each hit expert's weights read once.
template <class V>
torch::Tensor int8_experts_linear(torch::Tensor x, torch::Tensor ids, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && q.dim() == 3 && scale.dim() == 3,
              "int8_experts_linear: expected x [R, K], ids [R, J], q [E, N, K], scale [E, N, G]");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.size(0) == x.size(0), "int8_experts_linear: ids [R, J] int64");
  TORCH_CHECK(q.size(0) == scale.size(0) && q.size(1) == scale.size(1), "int8_experts_linear: q / scale mismatch");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous(), "int8_experts_linear: needs contiguous q, scale");
  const int64_t R = x.size(0), J = ids.size(1), E = q.size(0), N = q.size(1), K = q.size(2), G = scale.size(2);
  const int64_t group = int8_check<V>(x, q.select(0, 0), scale.select(0, 0));
  auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(E);  // expert -> its (row * J + slot) pairs, ascending
  for (int64_t p = 0; p < R * J; ++p)
    if (id[p] >= 0 && id[p] < E) pairs[id[p]].push_back(p);
  struct Hit {
    int64_t e, first, n;  // expert, first tile in the joint numbering, rows
    float* xs;            // [n, K] its gathered rows
    float* ys;            // [n, N] their products
  };
  std::vector<Hit> hits;
  std::vector<torch::Tensor> buffers;  // keep each hit's xs / ys alive
  int64_t tiles = 0;
  const float* xp = x.data_ptr<float>();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(pairs[e].size());
    if (n == 0) continue;
    buffers.push_back(torch::empty({n, K}, x.options()));
    float* xs = buffers.back().data_ptr<float>();
    buffers.push_back(torch::empty({n, N}, x.options()));
    float* ys = buffers.back().data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) std::memcpy(xs + i * K, xp + (pairs[e][i] / J) * K, K * sizeof(float));
    hits.push_back({e, tiles, n, xs, ys});
    tiles += (N + kInt8Rows - 1) / kInt8Rows;
  }
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int64_t per = (N + kInt8Rows - 1) / kInt8Rows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Hit& h = hits[t / per];
      const int64_t n0 = (t - h.first) * kInt8Rows;
      int8_rows<V>(h.xs, qp + (h.e * N + n0) * K, sp + (h.e * N + n0) * G, h.ys + n0, h.n, K, N,
                   std::min(kInt8Rows, N - n0), group, G);
    }
  });
  auto out = torch::zeros({R, J, N}, x.options());
  float* op = out.data_ptr<float>();
  for (const Hit& h : hits) {
    const auto& ps = pairs[h.e];
    for (int64_t i = 0; i < h.n; ++i) std::memcpy(op + ps[i] * N, h.ys + i * N, N * sizeof(float));
  }
  return out;
}

}  // namespace hf_accel
