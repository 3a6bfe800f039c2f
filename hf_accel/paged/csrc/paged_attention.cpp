// Paged attention for short query chunks (decode, speculative verification) on CPU, AVX2 + FMA.
// Reads K/V straight from the block pool through each sequence's block table: no contiguous copy of the
// context is ever built. One work item = one (sequence, kv head); it serves every query head of that
// group and every query of the chunk, so each K/V vector is loaded once. Softmax is computed online
// block by block (running max and sum), in float32 whatever the pool dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
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

// A row of the pool as float32: float rows are used in place, other dtypes are converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
         const torch::Tensor& block_tables, const torch::Tensor& q_pos, double scale, int64_t window,
         double softcap, torch::Tensor& out) {
  // q: [B, Hq, Q, D] (any strides); pools: [NB, BS, Hkv, D] contiguous; block_tables: [B, MB] int32;
  // q_pos: [B, Q] int32 (token index of each query in its sequence, -1 = padding); out: [B, Q, Hq, D].
  const int64_t B = q.size(0), Hq = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t BS = k_pool.size(1), Hkv = k_pool.size(2), MB = block_tables.size(1);
  const int64_t G = Hq / Hkv, R = G * Q;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_pool.data_ptr<T>();
  const T* vp = v_pool.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* pos = q_pos.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(R * D), acc(R * D), m(R), l(R), s(R * BS), kbuf(D), vbuf(BS * D);
    std::vector<int32_t> rpos(R);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, kvh = item % Hkv;
      int32_t last = -1;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < Q; ++j) {
          const int64_t r = g * Q + j, h = kvh * G + g;
          const T* src = qp + b * qs0 + h * qs1 + j * qs2;
          for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = static_cast<float>(src[d * qs3]) * fscale;
          rpos[r] = pos[b * Q + j];
          last = std::max(last, rpos[r]);
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t ntok = static_cast<int64_t>(last) + 1;
      for (int64_t blk = 0; blk * BS < ntok; ++blk) {
        const int64_t block = tables[b * MB + blk], t0 = blk * BS, nt = std::min(BS, ntok - t0);
        // scores of every row against the block's tokens
        for (int64_t t = 0; t < nt; ++t) {
          const float* kv = as_float(kp + ((block * BS + t) * Hkv + kvh) * D, kbuf.data(), D);
          for (int64_t r = 0; r < R; ++r) {
            const int64_t tok = t0 + t;
            const bool visible = tok <= rpos[r] && (window <= 0 || tok > rpos[r] - window);
            float sc = visible ? dot(qbuf.data() + r * D, kv, D) : neg_inf;
            if (visible && cap > 0.f) sc = cap * std::tanh(sc / cap);
            s[r * BS + t] = sc;
          }
        }
        for (int64_t t = 0; t < nt; ++t) as_float(vp + ((block * BS + t) * Hkv + kvh) * D, vbuf.data() + t * D, D);
        for (int64_t r = 0; r < R; ++r) {
          float bm = neg_inf;
          for (int64_t t = 0; t < nt; ++t) bm = std::max(bm, s[r * BS + t]);
          if (bm == neg_inf) continue;
          const float mn = std::max(m[r], bm);
          const float alpha = std::exp(m[r] - mn);  // exp(-inf) = 0 on the first visible block
          if (alpha != 1.f) {
            scale_inplace(acc.data() + r * D, alpha, D);
            l[r] *= alpha;
          }
          m[r] = mn;
          for (int64_t t = 0; t < nt; ++t) {
            const float sc = s[r * BS + t];
            if (sc == neg_inf) continue;
            const float p = std::exp(sc - mn);
            l[r] += p;
            const T* vrow = vp + ((block * BS + t) * Hkv + kvh) * D;
            const float* vf = std::is_same<T, float>::value ? reinterpret_cast<const float*>(vrow) : vbuf.data() + t * D;
            axpy(acc.data() + r * D, p, vf, D);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < Q; ++j) {
          const int64_t r = g * Q + j, h = kvh * G + g;
          T* dst = op + ((b * Q + j) * Hq + h) * D;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // a padding query (no visible token) gets zeros
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
        }
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                              torch::Tensor q_pos, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "bad shapes");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(3) == k_pool.size(3) && q.size(1) % k_pool.size(2) == 0, "head mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && q_pos.scalar_type() == torch::kInt32, "int32 tables");
  auto tables = block_tables.contiguous();
  auto pos = q_pos.contiguous();
  auto out = torch::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  switch (q.scalar_type()) {
    case torch::kFloat: run<float>(q, k_pool, v_pool, tables, pos, scale, window, softcap, out); break;
    case torch::kBFloat16: run<at::BFloat16>(q, k_pool, v_pool, tables, pos, scale, window, softcap, out); break;
    case torch::kHalf: run<at::Half>(q, k_pool, v_pool, tables, pos, scale, window, softcap, out); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a block pool (AVX2)");
}
