// The decoder layers of a Llama-family draft for a short chunk, in one native call (hf_accel/speculative/lean.py).
//
// A draft step at SmolLM2's size is mostly per-operator overhead when each layer runs as ~25 PyTorch calls
// (~250 us per layer against ~200 us of int8 maths). Here every layer runs in C++: RMSNorm, the q/k/v/o and
// MLP projections (int8 weights through hf_accel's int8 kernel, float weights through at::linear), optional
// per-head q/k norms (qwen3), the half-split rotary embedding, the K/V write into the cache's spare capacity,
// attention over the ragged mask (grouped heads read their shared K/V head in place) and SiLU-gated MLP.
// Same maths as the layers' modules in fp32; only the rounding order differs.
//
// Compiled three times (lean_layers / lean_layers_avx512 / lean_layers_vnni): int8 weights use the widest
// weight-only int8 kernel of the build; the VNNI build can also run them as W8A8 (activations quantized per row,
// integer dot products: hf_accel/csrc/w8a8_impl.h), which pays for chunks of many rows (a draft's guess checks).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#include "int8_traits.h"
#include "int8_gemm_impl.h"
#ifdef __AVX512VNNI__
#include "w8a8_impl.h"
constexpr bool kW8A8 = true;
#else
constexpr bool kW8A8 = false;
#endif

namespace {

#ifdef __AVX512F__
using V = hf_accel::Avx512;
#else
using V = hf_accel::Avx2;
#endif

// Per-layer parameters, in this order (an absent one is an empty tensor).
enum Param : size_t {
  kLn1, kLn2,                        // RMSNorm weights [E]
  kQ, kQs, kQb, kK, kKs, kKb,        // projection: weight ([N, K] int8 or float), int8 row/group scales, bias
  kV, kVs, kVb, kO, kOs, kOb,
  kGate, kGates, kGateb,             // gate, or the fused [gate; up] projection when kUp is empty
  kUp, kUps, kUpb, kDown, kDowns, kDownb,
  kQn, kKn,                          // per-head RMSNorm weights [D] (qwen3), or empty
  kParams
};

// x [M, K] -> [M, N]: int8 weight (with scales) through the int8 kernel (W8A8 with `w8a8`: row scales, K % 64 == 0,
// VNNI build only), else at::linear; plus bias.
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& p, size_t w, bool w8a8) {
  const torch::Tensor& weight = p[w];
  const torch::Tensor& scale = p[w + 1];
  const torch::Tensor& bias = p[w + 2];
  if (weight.scalar_type() != torch::kChar) return at::linear(x, weight, bias.numel() ? bias : torch::Tensor());
  torch::Tensor y;
#ifdef __AVX512VNNI__
  if (w8a8) y = hf_accel::w8a8::w8a8_linear(x, weight, scale);
#endif
  if (!y.defined()) y = hf_accel::int8_linear<V>(x, weight, scale);
  if (bias.numel()) y.add_(bias);
  return y;
}

// y[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) over rows of length n (in place allowed).
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

// Half-split rotary embedding of every head of x [M, heads, D] in place; cos / sin [M, D].
void rotate(float* x, const float* cos, const float* sin, int64_t M, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  std::vector<float> tmp(D);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + (m * heads + h) * D;
      const float* c = cos + m * D;
      const float* s = sin + m * D;
      for (int64_t d = 0; d < half; ++d) tmp[d] = v[d] * c[d] - v[d + half] * s[d];
      for (int64_t d = half; d < D; ++d) tmp[d] = v[d] * c[d] + v[d - half] * s[d];
      std::copy(tmp.begin(), tmp.end(), v);
    }
}

float dot(const float* a, const float* b, int64_t D) {
  if (D % V::kLanes) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
  }
  typename V::F acc = V::zero();
  for (int64_t d = 0; d < D; d += V::kLanes) acc = V::fma(V::load(a + d), V::load(b + d), acc);
  return V::sum(acc);
}

void axpy(float p, const float* x, float* y, int64_t D) {  // y += p * x
  if (D % V::kLanes) {
    for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
    return;
  }
  const typename V::F pv = V::set1(p);
  for (int64_t d = 0; d < D; d += V::kLanes) V::store(y + d, V::fma(pv, V::load(x + d), V::load(y + d)));
}

// Attention of each query (row b, column c, head h) over its row's allowed cache columns.
// q [B*C, H*D]; keys / values [B, H_kv, cap, D]; allowed [B, C, T]; out [B*C, H*D].
void attend(const float* q, const float* keys, const float* values, const bool* allowed, float* out, int64_t B,
            int64_t C, int64_t T, int64_t cap, int64_t H, int64_t Hkv, int64_t D, float scaling) {
  const int64_t groups = H / Hkv;
  at::parallel_for(0, B * H * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(T);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * C), h = (item / C) % H, c = item % C;
      const int64_t row = b * C + c;
      const float* qv = q + (row * H + h) * D;
      const float* K = keys + (b * Hkv + h / groups) * cap * D;
      const float* Vv = values + (b * Hkv + h / groups) * cap * D;
      const bool* allow = allowed + row * T;
      float* o = out + (row * H + h) * D;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < T; ++t)
        if (allow[t]) {
          score[t] = dot(qv, K + t * D, D) * scaling;
          top = std::max(top, score[t]);
        }
      std::fill(o, o + D, 0.f);
      if (top == -std::numeric_limits<float>::infinity()) continue;  // a hole with nothing to see: zeros
      float total = 0.f;
      for (int64_t t = 0; t < T; ++t)
        if (allow[t]) {
          const float p = std::exp(score[t] - top);
          total += p;
          axpy(p, Vv + t * D, o, D);
        }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  });
}

}  // namespace

// h [B*C, E] fp32 (rows ordered b-major) through every layer; returns the new hidden states [B*C, E]. With `w8a8`
// (VNNI build) the int8 projections run W8A8.
// keys / values: per layer [B, H_kv, cap, D] contiguous buffers holding `used` columns; the chunk's C columns
// are written at [used, used + C). allowed [B, C, used + C] bool; cos / sin [B*C, D].
torch::Tensor layers(torch::Tensor h, const std::vector<std::vector<torch::Tensor>>& params,
                     const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values, int64_t used,
                     torch::Tensor allowed, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                     double eps, double scaling, bool w8a8) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat, "lean layers: h must be [M, E] float32");
  TORCH_CHECK(!w8a8 || kW8A8, "lean layers: W8A8 needs the VNNI build");
  TORCH_CHECK(allowed.dim() == 3 && allowed.scalar_type() == torch::kBool, "lean layers: allowed must be [B, C, T]");
  TORCH_CHECK(params.size() == keys.size() && keys.size() == values.size(), "lean layers: one cache per layer");
  const int64_t B = allowed.size(0), C = allowed.size(1), T = allowed.size(2), M = h.size(0), E = h.size(1);
  TORCH_CHECK(M == B * C && T == used + C, "lean layers: shapes of h, allowed and used disagree");
  auto x = h.contiguous().clone();  // [M, E] the residual stream
  auto mask = allowed.contiguous();
  auto cs = cos.contiguous(), sn = sin.contiguous();
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == M && sn.sizes() == cs.sizes(), "lean layers: cos / sin must be [M, D]");
  const int64_t D = cs.size(1);
  auto normed = torch::empty_like(x);
  auto attn = torch::empty({M, heads * D}, x.options());
  for (size_t l = 0; l < params.size(); ++l) {
    const auto& p = params[l];
    TORCH_CHECK(p.size() == kParams, "lean layers: layer ", l, " has ", p.size(), " parameters, expected ", kParams);
    const auto& kb = keys[l];
    const auto& vb = values[l];
    TORCH_CHECK(kb.is_contiguous() && vb.is_contiguous() && kb.dim() == 4 && kb.size(0) == B &&
                    kb.size(1) == kv_heads && kb.size(3) == D && kb.size(2) >= T && vb.sizes() == kb.sizes(),
                "lean layers: layer ", l, ": bad K/V buffer");
    const int64_t cap = kb.size(2);
    rms_norm(x.data_ptr<float>(), p[kLn1].data_ptr<float>(), normed.data_ptr<float>(), M, E, eps);
    auto q = project(normed, p, kQ, w8a8).contiguous();  // [M, H*D]
    auto k = project(normed, p, kK, w8a8).contiguous();  // [M, H_kv*D]
    auto v = project(normed, p, kV, w8a8).contiguous();  // [M, H_kv*D]
    if (p[kQn].numel()) {
      rms_norm(q.data_ptr<float>(), p[kQn].data_ptr<float>(), q.data_ptr<float>(), M * heads, D, eps);
      rms_norm(k.data_ptr<float>(), p[kKn].data_ptr<float>(), k.data_ptr<float>(), M * kv_heads, D, eps);
    }
    rotate(q.data_ptr<float>(), cs.data_ptr<float>(), sn.data_ptr<float>(), M, heads, D);
    rotate(k.data_ptr<float>(), cs.data_ptr<float>(), sn.data_ptr<float>(), M, kv_heads, D);
    float* kp = kb.data_ptr<float>();
    float* vp = vb.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {  // the chunk's K/V into columns [used, used + C)
      const int64_t b = m / C, col = used + m % C;
      for (int64_t g = 0; g < kv_heads; ++g) {
        const int64_t at = ((b * kv_heads + g) * cap + col) * D;
        std::copy_n(k.data_ptr<float>() + (m * kv_heads + g) * D, D, kp + at);
        std::copy_n(v.data_ptr<float>() + (m * kv_heads + g) * D, D, vp + at);
      }
    }
    attend(q.data_ptr<float>(), kp, vp, mask.data_ptr<bool>(), attn.data_ptr<float>(), B, C, T, cap, heads,
           kv_heads, D, static_cast<float>(scaling));
    x.add_(project(attn, p, kO, w8a8));
    rms_norm(x.data_ptr<float>(), p[kLn2].data_ptr<float>(), normed.data_ptr<float>(), M, E, eps);
    torch::Tensor gate, up;
    if (p[kUp].numel()) {
      gate = project(normed, p, kGate, w8a8);
      up = project(normed, p, kUp, w8a8);
    } else {
      auto both = project(normed, p, kGate, w8a8);  // [M, 2I]
      const int64_t I = both.size(1) / 2;
      gate = both.narrow(1, 0, I);
      up = both.narrow(1, I, I);
    }
    const int64_t I = up.size(1);
    auto act = torch::empty({M, I}, x.options());  // [M, I]
    for (int64_t m = 0; m < M; ++m) {
      const float* g = gate.data_ptr<float>() + m * gate.stride(0);
      const float* u = up.data_ptr<float>() + m * up.stride(0);
      float* a = act.data_ptr<float>() + m * I;
      for (int64_t i = 0; i < I; ++i) a[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
    x.add_(project(act, p, kDown, w8a8));
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layers", &layers, "Llama-family decoder layers of a draft over a short chunk (int8 or float weights)");
  m.def("isa", []() { return std::string(V::kName); });
  m.def("w8a8", []() { return kW8A8; }, "whether this build can run the int8 projections as W8A8");
#ifdef __AVX512VNNI__
  m.def("w8a8_linear", &hf_accel::w8a8::w8a8_linear, "W8A8 linear (a wide chunk's LM head)");
#endif
}
