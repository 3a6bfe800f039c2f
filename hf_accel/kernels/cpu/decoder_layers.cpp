// The decoder layers of a Llama-family model in one native call: the native executor (hf_accel/native/), which runs
// plain decoding steps and prompts, speculative drafts' steps and catch-ups, and targets' verification chunks.
//
// A draft step at SmolLM2's size is mostly per-operator overhead when each layer runs as ~25 PyTorch calls
// (~250 us per layer against ~200 us of int8 maths). Here every layer runs in C++: RMSNorm, the q/k/v/o and
// MLP projections (int8 weights through hf_accel's int8 kernel; float weights through float_linear (layer_ops.h) for
// narrow chunks, at::linear for wide ones), optional per-head q/k norms (qwen3), the half-split rotary embedding,
// the K/V write into the cache's spare capacity (float32, or float16 to halve what later steps read back),
// attention over the ragged mask (grouped heads read their shared K/V head in place; PyTorch's fused attention for a
// prompt-wide chunk) and SiLU-gated MLP. Same maths as the layers' modules in fp32 (float32 K/V, weight-only int8);
// only the rounding order differs.
//
// Part of every instruction-set build of the CPU extension (module.cpp): int8 weights use the widest
// weight-only int8 kernel of the build, or with quantized activations and integer dot products (int_dots.h: AVX-512
// VNNI, else AVX2): W8A16 (int16 activations, for steps and catch-ups, where the weight-only kernel's conversions and
// FMAs rather than the weight bytes set the pace) or W8A8 (int8 activations, cheaper still, for chunks of many rows:
// a draft's guess checks; and every chunk of a W8A8 model).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>
#include "registry.h"
#include "layer_ops.h"

namespace {

using hf_accel::kNegInf;

// K/V elements: float32, or float16 (the draft's cache; half the bytes a step streams). One vector / one value as
// float32.
inline typename V::F load_kv(const float* p) { return V::load(p); }
inline float kv_value(float x) { return x; }
#ifdef __AVX512F__
inline V::F load_kv(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
inline V::F load_kv(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
inline float kv_value(at::Half x) { return static_cast<float>(x); }

// K/V stored from float32: float16 saturates at its largest finite value instead of overflowing to inf.
inline void store_kv(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }
inline void store_kv(const float* src, at::Half* dst, int64_t n) {
  constexpr float kMax = 65504.f;
  for (int64_t i = 0; i < n; ++i) dst[i] = at::Half(std::min(kMax, std::max(-kMax, src[i])));
}

// s[t] = scaling * (q . K[t]) where allow[t], else -inf, for t in [0, T); four keys at a time share one reduction.
template <typename T>
void scores(const float* q, const T* K, const bool* allow, float* s, int64_t T_, int64_t D, float scaling) {
  int64_t t = 0;
  if (D % V::kLanes == 0) {
    for (; t + 4 <= T_; t += 4) {
      typename V::F acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
      for (int64_t d = 0; d < D; d += V::kLanes) {
        const typename V::F qv = V::load(q + d);
        for (int j = 0; j < 4; ++j) acc[j] = V::fma(qv, load_kv(K + (t + j) * D + d), acc[j]);
      }
      float out[4];
      sum4(acc[0], acc[1], acc[2], acc[3], out);
      for (int j = 0; j < 4; ++j) s[t + j] = allow[t + j] ? out[j] * scaling : kNegInf;
    }
  }
  for (; t < T_; ++t) {
    if (!allow[t]) {
      s[t] = kNegInf;
      continue;
    }
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * kv_value(K[t * D + d]);
    s[t] = dot * scaling;
  }
}

// o[0..D) = sum_t p[t] * Vv[t] * inv over t in [0, T), the output held in registers 4 vectors at a time.
template <typename T>
void weighted_values(const float* p, const T* Vv, float* o, int64_t T_, int64_t D, float inv) {
  if (D % V::kLanes) {
    std::fill(o, o + D, 0.f);
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t d = 0; d < D; ++d) o[d] += p[t] * kv_value(Vv[t * D + d]);
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    return;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 4 * V::kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(4, (D - d0) / V::kLanes));
    typename V::F acc[4] = {V::zero(), V::zero(), V::zero(), V::zero()};
    for (int64_t t = 0; t < T_; ++t) {
      if (p[t] == 0.f) continue;  // masked (or negligible) keys
      const typename V::F pv = V::set1(p[t]);
      for (int j = 0; j < n; ++j) acc[j] = V::fma(pv, load_kv(Vv + t * D + d0 + j * V::kLanes), acc[j]);
    }
    const typename V::F iv = V::set1(inv);
    for (int j = 0; j < n; ++j) V::store(o + d0 + j * V::kLanes, vmul(acc[j], iv));
  }
}

// Attention of each query (row b, column c, head h) over its row's allowed cache columns: scores four keys at a
// time, a vectorised softmax, the weighted values accumulated in registers (K/V of a head group stay in L1/L2 for
// its query heads).
// q [B*C, H*D]; keys / values [B, H_kv, cap, D]; allowed [B, C, T]; out [B*C, H*D].
template <typename KV>
void attend(const float* q, const KV* keys, const KV* values, const bool* allowed, float* out, int64_t B, int64_t C,
            int64_t T, int64_t cap, int64_t H, int64_t Hkv, int64_t D, float scaling) {
  const int64_t groups = H / Hkv;
  const int64_t padded = (T + V::kLanes - 1) / V::kLanes * V::kLanes;
  at::parallel_for(0, B * H * C, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score(padded, kNegInf);  // tail stays -inf: exp gives 0 there
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (H * C), h = (item / C) % H, c = item % C;
      const int64_t row = b * C + c;
      const KV* K = keys + (b * Hkv + h / groups) * cap * D;
      const KV* Vv = values + (b * Hkv + h / groups) * cap * D;
      float* o = out + (row * H + h) * D;
      float* s = score.data();
      scores(q + (row * H + h) * D, K, allowed + row * T, s, T, D, scaling);
      typename V::F top = V::set1(kNegInf);
      for (int64_t t = 0; t < padded; t += V::kLanes) top = vmax(top, V::load(s + t));
      const float m = hmax(top);
      if (m == kNegInf) {  // a hole with nothing to see: zeros
        std::fill(o, o + D, 0.f);
        continue;
      }
      const typename V::F mv = V::set1(m);
      typename V::F total = V::zero();
      for (int64_t t = 0; t < padded; t += V::kLanes) {  // s becomes the unnormalised weights
        const typename V::F e = vexp(vsub(V::load(s + t), mv));
        V::store(s + t, e);
        total = vadd(total, e);
      }
      weighted_values(s, Vv, o, T, D, 1.f / V::sum(total));
      std::fill(s + T, s + padded, kNegInf);  // the exp pass made the -inf tail zeros: restore it
    }
  });
}

// From this chunk width on (a prompt) attention runs PyTorch's fused CPU attention: `attend` computes every query
// against every column, one query at a time, which suits the few columns of a step or a verification only.
constexpr int64_t kWideChunk = 64;

// Left padding of each row where `mask` [B, C, T] is exactly a prompt's layout on an empty cache (row b: padding in
// its first pads[b] columns, causal over the rest), else empty: such a prompt's attention runs per row over its real
// columns with PyTorch's causal kernel, which skips the masked half (an explicit mask makes it compute every block).
std::vector<int64_t> left_pads(const torch::Tensor& mask, int64_t used) {
  const int64_t B = mask.size(0), C = mask.size(1), T = mask.size(2);
  if (used != 0 || C != T) return {};
  const auto pads = T - mask.select(1, C - 1).sum(-1);  // [B] the last query sees every real column
  const auto cols = torch::arange(T, pads.options());
  const auto causal = cols.unsqueeze(0) <= cols.unsqueeze(1);  // [C, T]
  const auto real = cols.unsqueeze(0) >= pads.unsqueeze(1);  // [B, T]
  if (!torch::equal(mask, causal.unsqueeze(0).logical_and(real.unsqueeze(1)))) return {};
  const auto p = pads.contiguous();
  return std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + B);
}

// How a wide chunk's attention sees its columns, the same in every layer (worked out once per call): `pads`
// (left_pads) where the chunk is a plain left-padded prompt, else `allowed` [B, 1, C, T], the mask in which a query
// that may see no column (a left-padding position) sees its own: its output is never read (nothing attends to a
// padding column) but must stay finite, as a fully masked query's is not.
struct WideMask {
  std::vector<int64_t> pads;
  torch::Tensor allowed;
  torch::ScalarType compute = torch::kFloat;  // the dtype attention computes in (a half model's: see attend_wide)
};

WideMask wide_mask(const torch::Tensor& mask, int64_t used) {
  WideMask wide{left_pads(mask, used), torch::Tensor()};
  if (!wide.pads.empty()) return wide;
  auto allowed = mask;  // [B, C, T]
  const auto blind = allowed.any(-1).logical_not();  // [B, C] queries with nothing to see
  if (blind.any().item<bool>()) {
    const auto where = blind.nonzero();  // [n, 2] (row, column)
    allowed = allowed.clone();
    allowed.index_put_({where.select(1, 0), where.select(1, 1), where.select(1, 1) + used}, true);
  }
  wide.allowed = allowed.unsqueeze(1);
  return wide;
}

// attend() for a wide chunk: at::scaled_dot_product_attention over the buffers' first T columns (float16 K/V read as
// float32), in `wide.compute`: float32, or a half-precision model's own dtype, where the prompt's products round to
// it anyway (its flash attention is ~2x faster: 25 ms against 54 for SmolLM2's 30 layers over 388 tokens). With
// `wide.pads` each row runs causally over its real columns, its padding queries get zeros; otherwise one call masked
// by `wide.allowed`.
// q [B*C, H*D]; kp / vp [B, H_kv, cap, D]; attn [B*C, H*D].
template <typename KV>
void attend_wide(const torch::Tensor& q, KV* kp, KV* vp, const WideMask& wide, torch::Tensor& attn, int64_t B,
                 int64_t C, int64_t T, int64_t cap, int64_t heads, int64_t kv_heads, int64_t D, float scaling) {
  const auto options = q.options().dtype(std::is_same_v<KV, float> ? torch::kFloat : torch::kHalf);
  // [B, H_kv, T, D] each
  auto keys = torch::from_blob(kp, {B, kv_heads, cap, D}, options).narrow(2, 0, T).to(wide.compute);
  auto values = torch::from_blob(vp, {B, kv_heads, cap, D}, options).narrow(2, 0, T).to(wide.compute);
  const auto queries = q.view({B, C, heads, D}).transpose(1, 2).to(wide.compute);  // [B, H, C, D]
  auto out = attn.view({B, C, heads, D});
  const bool gqa = heads != kv_heads;
  if (!wide.pads.empty()) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t p = wide.pads[b];
      out[b].narrow(0, 0, p).zero_();
      if (p == T) continue;
      const auto row = [&](const torch::Tensor& t) { return t.narrow(0, b, 1).narrow(2, p, T - p); };
      const auto o = at::scaled_dot_product_attention(row(queries), row(keys), row(values), {}, 0.0, true, scaling,
                                                      gqa);  // [1, H, C - p, D]
      out[b].narrow(0, p, T - p).copy_(o[0].transpose(0, 1));
    }
    return;
  }
  const auto o = at::scaled_dot_product_attention(queries, keys, values, wide.allowed, 0.0, false, scaling,
                                                  gqa);  // [B, H, C, D]
  out.copy_(o.transpose(1, 2));
}

// The chunk's K/V (k / v [M, H_kv*D] float32) into columns [used, used + C) of the layer's buffers kp / vp
// [B, H_kv, cap, D], then attention of q [M, H*D] over them into attn [M, H*D]: `attend` over `mask`, or for a chunk
// of kWideChunk columns or more attend_wide over `wide` (wide_mask of the same mask).
template <typename KV>
void write_and_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, KV* kp, KV* vp,
                      const torch::Tensor& mask, const WideMask& wide, torch::Tensor& attn, int64_t B, int64_t C,
                      int64_t T, int64_t used, int64_t cap, int64_t heads, int64_t kv_heads, int64_t D, float scaling) {
  const int64_t M = B * C;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t b = m / C, col = used + m % C;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t at = ((b * kv_heads + g) * cap + col) * D;
      store_kv(k.data_ptr<float>() + (m * kv_heads + g) * D, kp + at, D);
      store_kv(v.data_ptr<float>() + (m * kv_heads + g) * D, vp + at, D);
    }
  }
  if (C >= kWideChunk) {
    attend_wide(q, kp, vp, wide, attn, B, C, T, cap, heads, kv_heads, D, scaling);
    return;
  }
  attend(q.data_ptr<float>(), kp, vp, mask.data_ptr<bool>(), attn.data_ptr<float>(), B, C, T, cap, heads, kv_heads, D,
         scaling);
}

}  // namespace

namespace hf_accel::cpu {

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                              torch::Tensor q_pos, double scale, int64_t window, double softcap,
                              std::optional<torch::Tensor> sinks);

namespace {

// Every layer on the residual stream x [M, E] (rows b-major). `attend(l, q, k, v, attn)` stores layer l's new K/V
// (q [M, H*D], k / v [M, H_kv*D], rotated) and fills attn [M, H*D] with the attention output.
template <typename Attend>
torch::Tensor run_layers(torch::Tensor h, const std::vector<torch::Tensor>& flat, size_t layers, const torch::Tensor& cs,
                         const torch::Tensor& sn, int64_t heads, int64_t kv_heads, double eps, int64_t mode,
                         const Attend& attend) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat, "lean layers: h must be [M, E] float32");
  TORCH_CHECK(mode == kWeightOnly || mode == kW8A16 || mode == kW8A8, "lean layers: unknown int8 mode ", mode);
  TORCH_CHECK(flat.size() == layers * kParams, "lean layers: ", kParams, " parameters per layer");
  const int64_t M = h.size(0), E = h.size(1), D = cs.size(1);
  TORCH_CHECK(cs.dim() == 2 && cs.size(0) == M && sn.sizes() == cs.sizes(), "lean layers: cos / sin must be [M, D]");
  auto x = h.contiguous().clone();  // [M, E] the residual stream
  auto normed = torch::empty_like(x);
  auto attn = torch::empty({M, heads * D}, x.options());
  for (size_t l = 0; l < layers; ++l) {
    const std::vector<torch::Tensor> p(flat.begin() + l * kParams, flat.begin() + (l + 1) * kParams);
    rms_norm(x.data_ptr<float>(), p[kLn1], normed.data_ptr<float>(), M, E, eps);
    auto qkv = project_many(normed, p, {kQ, kK, kV}, mode);
    auto q = qkv[0].contiguous();  // [M, H*D]
    auto k = qkv[1].contiguous();  // [M, H_kv*D]
    auto v = qkv[2].contiguous();  // [M, H_kv*D]
    if (p[kQn].numel()) {
      rms_norm(q.data_ptr<float>(), p[kQn], q.data_ptr<float>(), M * heads, D, eps);
      rms_norm(k.data_ptr<float>(), p[kKn], k.data_ptr<float>(), M * kv_heads, D, eps);
    }
    rotate(q.data_ptr<float>(), cs.data_ptr<float>(), sn.data_ptr<float>(), M, heads, D);
    rotate(k.data_ptr<float>(), cs.data_ptr<float>(), sn.data_ptr<float>(), M, kv_heads, D);
    attend(l, q, k, v, attn);
    x.add_(project(attn, p, kO, mode));
    rms_norm(x.data_ptr<float>(), p[kLn2], normed.data_ptr<float>(), M, E, eps);
    torch::Tensor gate, up;
    if (p[kUp].numel()) {
      auto both = project_many(normed, p, {kGate, kUp}, mode);
      gate = both[0];
      up = both[1];
    } else {
      auto both = project(normed, p, kGate, mode);  // [M, 2I]
      const int64_t I = both.size(1) / 2;
      gate = both.narrow(1, 0, I);
      up = both.narrow(1, I, I);
    }
    const int64_t I = up.size(1);
    auto act = torch::empty({M, I}, x.options());  // [M, I]
    silu_mul(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), act.data_ptr<float>(), M, I);
    x.add_(project(act, p, kDown, mode));
  }
  return x;
}

}  // namespace

// h [B*C, E] fp32 (rows ordered b-major) through every layer; returns the new hidden states [B*C, E]. `mode`: how the
// int8 projections run (Mode). `flat`: kParams tensors per layer.
// keys / values: per layer [B, H_kv, cap, D] contiguous buffers (float32, or float16: saturated at +-65504) holding
// `used` columns; the chunk's C columns are written at [used, used + C). allowed [B, C, used + C] bool; cos / sin [B*C, D].
torch::Tensor decoder_layers(torch::Tensor h, const std::vector<torch::Tensor>& flat,
                             const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                             int64_t used, torch::Tensor allowed, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                             int64_t kv_heads, double eps, double scaling, int64_t mode) {
  TORCH_CHECK(allowed.dim() == 3 && allowed.scalar_type() == torch::kBool, "lean layers: allowed must be [B, C, T]");
  TORCH_CHECK(keys.size() == values.size(), "lean layers: one K/V buffer pair per layer");
  const int64_t B = allowed.size(0), C = allowed.size(1), T = allowed.size(2);
  TORCH_CHECK(h.size(0) == B * C && T == used + C, "lean layers: shapes of h, allowed and used disagree");
  const auto mask = allowed.contiguous();
  const auto cs = cos.contiguous(), sn = sin.contiguous();
  const int64_t D = cs.size(1);
  WideMask wide;
  if (C >= kWideChunk) {
    wide = wide_mask(mask, used);
    for (const auto& t : flat) {  // a half-precision model (its weights or norms): its prompts attend in its dtype
      if (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kHalf) {
        wide.compute = t.scalar_type();
        break;
      }
    }
  }
  const float scale = static_cast<float>(scaling);
  auto attend = [&](size_t l, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    torch::Tensor& attn) {
    const auto& kb = keys[l];
    const auto& vb = values[l];
    TORCH_CHECK(kb.is_contiguous() && vb.is_contiguous() && kb.dim() == 4 && kb.size(0) == B &&
                    kb.size(1) == kv_heads && kb.size(3) == D && kb.size(2) >= T && vb.sizes() == kb.sizes(),
                "lean layers: layer ", l, ": bad K/V buffer");
    const int64_t cap = kb.size(2);
    const bool half = kb.scalar_type() == torch::kHalf;
    TORCH_CHECK((half || kb.scalar_type() == torch::kFloat) && vb.scalar_type() == kb.scalar_type(),
                "lean layers: layer ", l, ": K/V buffers must both be float32 or both float16");
    if (half)
      write_and_attend(q, k, v, kb.data_ptr<at::Half>(), vb.data_ptr<at::Half>(), mask, wide, attn, B, C, T, used, cap,
                       heads, kv_heads, D, scale);
    else
      write_and_attend(q, k, v, kb.data_ptr<float>(), vb.data_ptr<float>(), mask, wide, attn, B, C, T, used, cap,
                       heads, kv_heads, D, scale);
  };
  return run_layers(h, flat, keys.size(), cs, sn, heads, kv_heads, eps, mode, attend);
}

// As decoder_layers, over a paged pool: per layer k_pools / v_pools [NB, BS, H_kv, D] float32; the chunk's token m is
// stored at slot slots[m] ([B*C] int64, -1: not stored); attention through block_tables [B, MB] int32 with q_pos
// [B, C] int32 (each query's index in its sequence; -1: a padding query, which gets zeros). Copy-on-write block copies
// are the caller's, before the call.
torch::Tensor decoder_layers_paged(torch::Tensor h, const std::vector<torch::Tensor>& flat,
                                   const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                   torch::Tensor slots, torch::Tensor block_tables, torch::Tensor q_pos,
                                   torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads, double eps,
                                   double scaling, int64_t mode) {
  TORCH_CHECK(k_pools.size() == v_pools.size(), "paged lean layers: one K/V pool pair per layer");
  TORCH_CHECK(q_pos.dim() == 2 && q_pos.scalar_type() == torch::kInt && slots.scalar_type() == torch::kLong,
              "paged lean layers: q_pos must be [B, C] int32 and slots int64");
  const int64_t B = q_pos.size(0), C = q_pos.size(1);
  TORCH_CHECK(h.size(0) == B * C && slots.numel() == B * C, "paged lean layers: shapes of h, q_pos and slots disagree");
  const auto cs = cos.contiguous(), sn = sin.contiguous();
  const int64_t D = cs.size(1);
  const auto stored = slots.ge(0).nonzero().flatten();  // rows of the chunk that are stored
  const auto targets = slots.index_select(0, stored);  // their slots
  const bool all = stored.numel() == B * C;
  auto attend = [&](size_t l, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    torch::Tensor& attn) {
    const auto& kp = k_pools[l];
    const auto& vp = v_pools[l];
    TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous() && kp.dim() == 4 && kp.size(2) == kv_heads &&
                    kp.size(3) == D && kp.scalar_type() == torch::kFloat && vp.sizes() == kp.sizes() &&
                    vp.scalar_type() == torch::kFloat,
                "paged lean layers: layer ", l, ": pools must be contiguous float32 [NB, BS, H_kv, D]");
    const auto flat_k = kp.view({-1, kv_heads * D}), flat_v = vp.view({-1, kv_heads * D});
    flat_k.index_copy_(0, targets, all ? k : k.index_select(0, stored));
    flat_v.index_copy_(0, targets, all ? v : v.index_select(0, stored));
    const auto queries = q.view({B, C, heads, D}).permute({0, 2, 1, 3});  // [B, H, C, D] strided
    attn.copy_(paged_attention(queries, kp, vp, block_tables, q_pos, scaling, 0, 0.0, std::nullopt).view({B * C, heads * D}));
  };
  return run_layers(h, flat, k_pools.size(), cs, sn, heads, kv_heads, eps, mode, attend);
}

void register_decoder_layers(pybind11::module_& m) {
  m.def("decoder_layers", &decoder_layers, "Llama-family decoder layers over a chunk (int8 or float weights)");
  m.def("decoder_layers_paged", &decoder_layers_paged, "the same layers over a paged K/V pool (float32)");
  m.def("float_linear", &float_linear, "x @ W^T of a narrow chunk, W float32 [N, K] read in place (float projections)");
  m.def("float_linear_fits", &dot_fits, "whether float_linear takes (x, weight)");
  m.def("float_linear_max_rows", []() { return kDotMaxRows; }, "float_linear takes at most this many rows");
}

}  // namespace hf_accel::cpu
