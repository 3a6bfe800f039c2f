// Paged attention for short query chunks (decode, speculative verification) on CPU, AVX2 + FMA.
//
// Reads K/V straight from the block pool through each sequence's block table: no contiguous copy of the
// context is ever built. A work item is (sequence, kv head, context split): it serves every query head of
// that kv group and every query of the chunk, so each K/V vector is loaded once per item. Long contexts
// are split so that even batch 1 keeps every thread busy (flash-decoding); each split keeps a running
// max / sum / weighted V (online softmax, float32 whatever the pool dtype), and the splits are merged at
// the end. Exponentials are vectorised; the next block's rows are prefetched while this one is used.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"
#include "registry.h"
#include "vexp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMinBlocksPerSplit = 4;  // below this a split costs more to merge than it saves
using hf_accel::kNegInf;

using hf_accel::exp8;
using hf_accel::hsum;

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int64_t n) {  // y += a * x
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

inline void scale_inplace(float* y, float a, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(av, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= a;
}

// p[0..n) = exp(s[i] - m); returns their sum. `s` has room for a multiple of 8 (tail padded with -inf).
inline float exp_sum(const float* s, float m, float* p, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(p + i, v);
    sum = _mm256_add_ps(sum, v);
  }
  return hsum(sum);
}

inline void prefetch_rows(const void* base, int64_t rows, int64_t row_stride_bytes, int64_t row_bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + t * row_stride_bytes + b, _MM_HINT_T0);
}

// A row of the pool as float32: float rows are used in place, other dtypes are converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

struct Geometry {
  int64_t B, Hq, Q, D, BS, Hkv, MB, G, R, splits;
};

// Scores of RB query rows (scaled, [RB][D]) against one key row: out[k * ld] = q_k . key.
template <int RB>
inline void scores_rb(const float* q, const float* key, int64_t D, float* out, int64_t ld) {
  __m256 acc[RB];
  for (int k = 0; k < RB; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 kv = _mm256_loadu_ps(key + d);
    for (int k = 0; k < RB; ++k) acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + k * D + d), kv, acc[k]);
  }
  for (int k = 0; k < RB; ++k) out[k * ld] = hsum(acc[k]);
}

// acc[k][:] += sum_t p[k * ld + t] * v_t for RB rows, holding each 8-wide slice of acc in registers.
template <int RB>
inline void accumulate_rb(float* acc, const float* p, int64_t ld, const float* const* vrows, int64_t nt, int64_t D) {
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[RB];
    for (int k = 0; k < RB; ++k) a[k] = _mm256_loadu_ps(acc + k * D + d);
    for (int64_t t = 0; t < nt; ++t) {
      const __m256 v = _mm256_loadu_ps(vrows[t] + d);
      for (int k = 0; k < RB; ++k) a[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + k * ld + t), v, a[k]);
    }
    for (int k = 0; k < RB; ++k) _mm256_storeu_ps(acc + k * D + d, a[k]);
  }
}

template <typename F>
inline void by_row_blocks(int64_t R, F&& f) {  // calls f(r0, rb) with rb in 1..4 covering 0..R
  for (int64_t r0 = 0; r0 < R; r0 += 4) f(r0, std::min<int64_t>(4, R - r0));
}

// One work item: rows r = g * Q + j of kv head `kvh` of sequence `b`, over blocks [blk0, blk1).
// Leaves unnormalised acc [R, D], running max m [R] and sum l [R].
template <typename T>
void attend_split(const Geometry& g, const float* qbuf, const int32_t* rpos, const T* kp, const T* vp,
                  const int32_t* table, int64_t kvh, int64_t blk0, int64_t blk1, int64_t ntok, int64_t window,
                  float cap, float* acc, float* m, float* l) {
  const int64_t R = g.R, D = g.D, BS = g.BS, Hkv = g.Hkv;
  const int64_t ld = (BS + 7) / 8 * 8;  // row stride of the score / weight buffers (tail padded)
  std::vector<float> s(R * ld), p(R * ld), kbuf(BS * D), vbuf(BS * D);
  std::vector<const float*> krows(BS), vrows(BS);
  std::fill(acc, acc + R * D, 0.f);
  std::fill(m, m + R, kNegInf);
  std::fill(l, l + R, 0.f);
  const int64_t row_stride = Hkv * D;  // elements between consecutive tokens of one head
  for (int64_t blk = blk0; blk < blk1; ++blk) {
    const int64_t block = table[blk], t0 = blk * BS, nt = std::min(BS, ntok - t0);
    const T* kblock = kp + (block * BS * Hkv + kvh) * D;
    const T* vblock = vp + (block * BS * Hkv + kvh) * D;
    if (blk + 1 < blk1) {
      const int64_t next = table[blk + 1];
      prefetch_rows(kp + (next * BS * Hkv + kvh) * D, BS, row_stride * sizeof(T), D * sizeof(T));
      prefetch_rows(vp + (next * BS * Hkv + kvh) * D, BS, row_stride * sizeof(T), D * sizeof(T));
    }
    for (int64_t t = 0; t < nt; ++t) {
      krows[t] = as_float(kblock + t * row_stride, kbuf.data() + t * D, D);
      vrows[t] = as_float(vblock + t * row_stride, vbuf.data() + t * D, D);
    }
    std::fill(s.begin(), s.end(), kNegInf);
    for (int64_t t = 0; t < nt; ++t) {  // scores of every row against this block's tokens
      by_row_blocks(R, [&](int64_t r0, int64_t rb) {
        float* out = s.data() + r0 * ld + t;
        const float* q = qbuf + r0 * D;
        switch (rb) {
          case 4: scores_rb<4>(q, krows[t], D, out, ld); break;
          case 3: scores_rb<3>(q, krows[t], D, out, ld); break;
          case 2: scores_rb<2>(q, krows[t], D, out, ld); break;
          default: scores_rb<1>(q, krows[t], D, out, ld); break;
        }
      });
    }
    for (int64_t r = 0; r < R; ++r) {  // masking, softcap, online softmax update
      float* sr = s.data() + r * ld;
      float* pr = p.data() + r * ld;
      float bm = kNegInf;
      for (int64_t t = 0; t < nt; ++t) {
        const int64_t tok = t0 + t;
        if (tok > rpos[r] || (window > 0 && tok <= rpos[r] - window)) {
          sr[t] = kNegInf;
          continue;
        }
        if (cap > 0.f) sr[t] = cap * std::tanh(sr[t] / cap);
        bm = std::max(bm, sr[t]);
      }
      if (bm == kNegInf) {  // nothing visible for this row in this block
        std::fill(pr, pr + ld, 0.f);
        continue;
      }
      const float mn = std::max(m[r], bm);
      const float alpha = std::exp(m[r] - mn);  // 0 on the first visible block (exp(-inf))
      if (alpha != 1.f) {
        scale_inplace(acc + r * D, alpha, D);
        l[r] *= alpha;
      }
      m[r] = mn;
      l[r] += exp_sum(sr, mn, pr, ld);
    }
    by_row_blocks(R, [&](int64_t r0, int64_t rb) {
      float* a = acc + r0 * D;
      const float* pr = p.data() + r0 * ld;
      switch (rb) {
        case 4: accumulate_rb<4>(a, pr, ld, vrows.data(), nt, D); break;
        case 3: accumulate_rb<3>(a, pr, ld, vrows.data(), nt, D); break;
        case 2: accumulate_rb<2>(a, pr, ld, vrows.data(), nt, D); break;
        default: accumulate_rb<1>(a, pr, ld, vrows.data(), nt, D); break;
      }
    });
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& block_tables, const torch::Tensor& q_pos, double scale, int64_t window,
         double softcap, const float* sinks, torch::Tensor& out) {
  // q: [B, Hq, Q, D] (any strides); pools: [NB, BS, Hkv, D] contiguous; block_tables: [B, MB] int32;
  // q_pos: [B, Q] int32 (token index of each query in its sequence, -1 = padding); sinks: [Hq] float32 logits
  // that join each head's softmax without reading a value (nullptr: none); out: [B, Q, Hq, D].
  Geometry g;
  g.B = q.size(0), g.Hq = q.size(1), g.Q = q.size(2), g.D = q.size(3);
  g.BS = k_pool.size(1), g.Hkv = k_pool.size(2), g.MB = block_tables.size(1);
  g.G = g.Hq / g.Hkv, g.R = g.G * g.Q;
  // enough items for every thread even at batch 1, but never splits shorter than kMinBlocksPerSplit blocks
  const int64_t want = 8 * at::get_num_threads();
  const int64_t by_threads = (want + g.B * g.Hkv - 1) / (g.B * g.Hkv);
  g.splits = std::max<int64_t>(1, std::min(by_threads, g.MB / kMinBlocksPerSplit));
  const int64_t R = g.R, D = g.D;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* pos = q_pos.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t groups = g.B * g.Hkv, items = groups * g.splits;
  // per item: acc [R, D], m [R], l [R]
  std::vector<float> parts(items * R * (D + 2));

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(R * D);
    std::vector<int32_t> rpos(R);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t grp = item / g.splits, split = item % g.splits;
      const int64_t b = grp / g.Hkv, kvh = grp % g.Hkv;
      int32_t last = -1;
      for (int64_t gi = 0; gi < g.G; ++gi)
        for (int64_t j = 0; j < g.Q; ++j) {
          const int64_t r = gi * g.Q + j, h = kvh * g.G + gi;
          const T* src = qp + b * qs0 + h * qs1 + j * qs2;
          for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = static_cast<float>(src[d * qs3]) * fscale;
          rpos[r] = pos[b * g.Q + j];
          last = std::max(last, rpos[r]);
        }
      const int64_t ntok = static_cast<int64_t>(last) + 1, nblocks = (ntok + g.BS - 1) / g.BS;
      const int64_t blk0 = nblocks * split / g.splits, blk1 = nblocks * (split + 1) / g.splits;
      float* base = parts.data() + item * R * (D + 2);
      attend_split<T>(g, qbuf.data(), rpos.data(), kp, vp, tables + b * g.MB, kvh, blk0, blk1, ntok, window, cap,
                      base, base + R * D, base + R * D + R);
    }
  });

  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {  // merge the splits of each group
    std::vector<float> acc(D);
    for (int64_t grp = begin; grp < end; ++grp) {
      const int64_t b = grp / g.Hkv, kvh = grp % g.Hkv;
      for (int64_t r = 0; r < R; ++r) {
        float mx = kNegInf;
        for (int64_t sp = 0; sp < g.splits; ++sp)
          mx = std::max(mx, parts[((grp * g.splits + sp) * R) * (D + 2) + R * D + r]);
        const int64_t gi = r / g.Q, j = r % g.Q, h = kvh * g.G + gi;
        std::fill(acc.begin(), acc.end(), 0.f);
        float total = 0.f;
        if (mx != kNegInf) {
          if (sinks != nullptr) {  // the sink's logit joins the softmax (a padding query stays all zeros)
            mx = std::max(mx, sinks[h]);
            total = std::exp(sinks[h] - mx);
          }
          for (int64_t sp = 0; sp < g.splits; ++sp) {
            const float* base = parts.data() + (grp * g.splits + sp) * R * (D + 2);
            const float ms = base[R * D + r];
            if (ms == kNegInf) continue;
            const float w = std::exp(ms - mx);
            total += w * base[R * D + R + r];
            axpy(acc.data(), w, base + r * D, D);
          }
        }
        T* dst = op + ((b * g.Q + j) * g.Hq + h) * D;
        const float inv = total > 0.f ? 1.f / total : 0.f;  // a padding query (no visible token) gets zeros
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

}  // namespace

namespace hf_accel::cpu {

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                              torch::Tensor q_pos, double scale, int64_t window, double softcap,
                              std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(3) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0, "head mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && q_pos.scalar_type() == torch::kInt32, "int32 tables");
  TORCH_CHECK(k_pool.size(1) <= 64, "block_size above 64 is not supported by the native kernel");
  TORCH_CHECK(q.size(3) % 8 == 0, "head_dim must be a multiple of 8 for the native kernel");
  TORCH_CHECK(q_pos.size(0) == q.size(0) && q_pos.size(1) == q.size(2), "q_pos must be [B, Q]");
  auto tables = block_tables.contiguous();
  auto pos = q_pos.contiguous();
  torch::Tensor sink;  // [Hq] float32, or undefined
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks must be [H_q]");
    sink = sinks->to(torch::kFloat).contiguous();
  }
  const float* sp = sink.defined() ? sink.data_ptr<float>() : nullptr;
  auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  switch (q.scalar_type()) {
    case torch::kFloat: run<float>(q, k_pool, v_pool, tables, pos, scale, window, softcap, sp, out); break;
    case torch::kBFloat16: run<at::BFloat16>(q, k_pool, v_pool, tables, pos, scale, window, softcap, sp, out); break;
    case torch::kHalf: run<at::Half>(q, k_pool, v_pool, tables, pos, scale, window, softcap, sp, out); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

void register_paged_attention(pybind11::module_& m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block pool (AVX2 code in every build)",
        pybind11::arg("q"), pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("block_tables"),
        pybind11::arg("q_pos"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"),
        pybind11::arg("sinks") = pybind11::none());
}

}  // namespace hf_accel::cpu
