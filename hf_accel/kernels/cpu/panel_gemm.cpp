// fp32 y = x @ W^T (+ b) for a weight packed in panels of 16 output features: AVX-512 (one zmm per panel step) or
// AVX2 (two ymm).
//
// Layout: W [N, K] becomes P = N / 16 panels, each [K, 16] contiguous ([P, K, 16] in all): step k of a panel is
// 64 bytes holding W[16p .. 16p + 15, k]. A tile of NP panels (16 * NP outputs) is computed for MT activation rows
// at a time in MT * NP * kVecs vector accumulators: per k, the panels' weight vectors are loaded once and FMA'd
// against MT broadcast activations. Tiles are split over threads; every row chunk of a tile reuses its panels
// from L1/L2, so the weights stream from memory once per call whatever the number of rows.
//
// Decode (1-4 rows) is bound by how fast the weights are read: wide tiles (NP = 8 / 6 / 6) keep enough
// independent accumulators in flight to hide FMA latency (AVX2, 16 registers: 6 / 2 panels, or 1 panel x 4 rows).
// Summation over k is sequential per output, so results differ from other GEMMs only by rounding order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int8_traits.h"
#include "registry.h"

namespace {

// The build's widest vectors (int8_traits.h); a 16-wide panel step is kVecs of them.
using Panel = hf_accel::Widest;
constexpr int kVecs = 16 / Panel::kLanes;

template <int MT, int NP>
inline void tile(const float* __restrict x, int64_t K, const float* const* w, const float* bias,
                 float* __restrict y, int64_t N) {
  constexpr int V = NP * kVecs;  // vectors per row of the tile
  Panel::F acc[MT][V];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < V; ++j) acc[m][j] = Panel::zero();
  for (int64_t k = 0; k < K; ++k) {
    Panel::F wv[V];
    for (int j = 0; j < V; ++j) wv[j] = Panel::load(w[j / kVecs] + k * 16 + (j % kVecs) * Panel::kLanes);
    for (int m = 0; m < MT; ++m) {
      const Panel::F xb = Panel::set1(x[m * K + k]);
      for (int j = 0; j < V; ++j) acc[m][j] = Panel::fma(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < V; ++j) {
      Panel::F v = acc[m][j];
      if (bias != nullptr) v = Panel::add(v, Panel::load(bias + j * Panel::kLanes));
      Panel::store(y + m * N + j * Panel::kLanes, v);
    }
}

// All M rows against one tile of NP panels, MT rows at a time (the remainder with a smaller MT).
template <int NP, int MT>
void rows(const float* x, int64_t M, int64_t K, const float* const* w, const float* bias, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<MT, NP>(x + m * K, K, w, bias, y + m * N, N);
  const int64_t r = M - m;
  if constexpr (MT > 1) if (r == 1) tile<1, NP>(x + m * K, K, w, bias, y + m * N, N);
  if constexpr (MT > 2) if (r == 2) tile<2, NP>(x + m * K, K, w, bias, y + m * N, N);
  if constexpr (MT > 3) if (r == 3) tile<3, NP>(x + m * K, K, w, bias, y + m * N, N);
}

template <int NP, int MT>
void run_panels(const float* x, int64_t M, int64_t K, const float* wp, int64_t panels, const float* bias, float* y) {
  const int64_t N = panels * 16;
  const int64_t tiles = panels / NP;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* w[NP];
      for (int j = 0; j < NP; ++j) w[j] = wp + (t * NP + j) * K * 16;
      rows<NP, MT>(x, M, K, w, bias ? bias + t * NP * 16 : nullptr, y + t * NP * 16, N);
    }
  });
  for (int64_t p = tiles * NP; p < panels; ++p) {  // panels left over: one at a time
    const float* w[1] = {wp + p * K * 16};
    rows<1, MT>(x, M, K, w, bias ? bias + p * 16 : nullptr, y + p * 16, N);
  }
}

}  // namespace

namespace hf_accel::cpu {

// W [N, K] -> [N / 16, K, 16] (N a multiple of 16).
torch::Tensor panel_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 16 == 0, "panel_pack: need a [N, K] weight with N a multiple of 16");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "panel_pack: float32 only");
  const auto N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

// x [M, K] contiguous float32, packed [N / 16, K, 16], bias [N] or None -> [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 16, "panel_linear: bad shapes");
  TORCH_CHECK(x.size(1) == packed.size(1), "panel_linear: in_features mismatch");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && packed.scalar_type() == torch::kFloat32, "panel_linear: float32 only");
  TORCH_CHECK(packed.is_contiguous(), "panel_linear: packed weight must be contiguous");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0);
  auto y = torch::empty({M, panels * 16}, xc.options());
  const float* b = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == panels * 16 && bc.scalar_type() == torch::kFloat32, "panel_linear: bad bias");
    b = bc.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX512F__
  if (M == 1) run_panels<8, 1>(xp, M, K, wp, panels, b, yp);
  else if (M == 2) run_panels<6, 2>(xp, M, K, wp, panels, b, yp);
  else run_panels<6, 4>(xp, M, K, wp, panels, b, yp);
#else
  if (M == 1) run_panels<6, 1>(xp, M, K, wp, panels, b, yp);
  else if (M == 2) run_panels<2, 2>(xp, M, K, wp, panels, b, yp);
  else run_panels<1, 4>(xp, M, K, wp, panels, b, yp);
#endif
  return y;
}

void register_panel_gemm(pybind11::module_& m) {
  m.def("panel_pack", &panel_pack, "pack a [N, K] float32 weight into [N/16, K, 16] panels");
  m.def("panel_linear", &panel_linear, "x @ W^T + b with a panel-packed weight");
}

}  // namespace hf_accel::cpu
