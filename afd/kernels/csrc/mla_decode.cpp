// DeepSeek MLA's absorbed decode in one call (afd/models/deepseek_v2.py, MLAttention.forward's decode rows):
//
//   query[d, h] = (q_nope[d, h] . W_UK[h], q_pe[d, h])        [R + dr]   W_UK folded into the query
//   latent[d, h] = attention over the cached latents             [R]        paged_decode.cpp, read in place
//   out[d, h] = W_UV[h] . latent[d, h]                          [dv]       W_UV applied after the softmax
//
// Both weights are read in place from kv_b_proj's weight ([nh, dn + dv, R]: head h's dn rows of W_UK, then its dv
// rows of W_UV), each row once per call, widened to float32 in registers. In torch ops this was two bf16 `bmm`s,
// a concatenation, transposes and copies around the attention: on the V2-Lite shapes (16 heads, dn = dv = 128,
// R = 512, one token) the two bmm took 0.4 and 0.26 ms a layer for 4 MB of weights, and on the built-in model's
// 32-token decode every op is its dispatch cost.
//
//   q_nope       [D, nh, dn]   any strides (a view of q_proj's output)
//   q_pe         [D, nh, dr]   rotated, any strides
//   w_kv_b       [nh, dn + dv, R] contiguous, the cache's dtype
//   cache        [slots, R + dr] contiguous: each token's latent and rotated shared key
//   block_tables, context_lens, block_size, scale, window: as paged_decode_attention's
//   returns      [D, nh, dv] in the cache's dtype; the query is rounded to it once (as the bmm did), the products
//                accumulate in float32

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"
#include "small_linear.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale,
                                  int64_t value_dim, int64_t window, const at::Tensor& sinks);

namespace {

#if defined(AFD_SIMD)
constexpr int kVecs = 4;                                       // a tile's columns: 4 vectors of R
constexpr int kTileRows = afd_simd::kRegisters >= 32 ? 6 : 2;  // and its query rows: 24 (8) accumulators
static_assert(kTileRows * kVecs + kVecs + 1 <= afd_simd::kRegisters, "a tile that spills");

// acc[i, 0 .. 4 kLanes) = sum_n q[i, n] w[n, 0 .. 4 kLanes) for DT rows of q (float32, rows of dn), W's rows
// `ld` apart: every W value read once for the DT rows, in registers.
template <int DT, typename T>
inline void nn_tile(const float* q, int64_t dn, const T* w, int64_t ld, float* acc) {
  using namespace afd_simd;
  vfloat c[DT][kVecs];
  for (int i = 0; i < DT; ++i)
    for (int j = 0; j < kVecs; ++j) c[i][j] = zero();
  for (int64_t n = 0; n < dn; ++n) {
    vfloat b[kVecs];
    for (int j = 0; j < kVecs; ++j) b[j] = load(w + n * ld + j * kLanes);
    for (int i = 0; i < DT; ++i) {
      const vfloat a = set1(q[i * dn + n]);
      for (int j = 0; j < kVecs; ++j) c[i][j] = fmadd(a, b[j], c[i][j]);
    }
  }
  for (int i = 0; i < DT; ++i)
    for (int j = 0; j < kVecs; ++j) store(acc + i * ld + j * kLanes, c[i][j]);
}
#endif

// acc [D, R] = q [D, dn] (float32) . w [dn, R] (W_UK of one head, rows contiguous).
template <typename T>
void query_product(const float* q, int64_t d_len, int64_t dn, const T* w, int64_t r_len, float* acc) {
#if defined(AFD_SIMD)
  constexpr int64_t cols = kVecs * afd_simd::kLanes;
  if (r_len % cols == 0) {
    for (int64_t r0 = 0; r0 < r_len; r0 += cols)
      for (int64_t d0 = 0; d0 < d_len; d0 += kTileRows) {
        const float* qd = q + d0 * dn;
        float* ad = acc + d0 * r_len + r0;
        switch (std::min<int64_t>(kTileRows, d_len - d0)) {
          case 1: nn_tile<1>(qd, dn, w + r0, r_len, ad); break;
          case 2: nn_tile<2>(qd, dn, w + r0, r_len, ad); break;
#if defined(__AVX512F__)
          case 3: nn_tile<3>(qd, dn, w + r0, r_len, ad); break;
          case 4: nn_tile<4>(qd, dn, w + r0, r_len, ad); break;
          case 5: nn_tile<5>(qd, dn, w + r0, r_len, ad); break;
          case 6: nn_tile<6>(qd, dn, w + r0, r_len, ad); break;
#endif
        }
      }
    return;
  }
#endif
  std::fill(acc, acc + d_len * r_len, 0.f);
  for (int64_t n = 0; n < dn; ++n)
    for (int64_t d = 0; d < d_len; ++d) {
      const float a = q[d * dn + n];
      for (int64_t r = 0; r < r_len; ++r) acc[d * r_len + r] += a * static_cast<float>(w[n * r_len + r]);
    }
}

}  // namespace

namespace {

// query[d, h] = (q_nope[d, h] . W_UK[h], q_pe[d, h]), rounded to T once.
template <typename T>
void absorb_queries(const at::Tensor& q_nope, const at::Tensor& q_pe, const T* w, int64_t dv, at::Tensor& query) {
  const int64_t d_len = q_nope.size(0), nh = q_nope.size(1), dn = q_nope.size(2), dr = q_pe.size(2), r_len = query.size(2) - dr;
  const auto qn = q_nope.accessor<T, 3>();
  const auto qp = q_pe.accessor<T, 3>();
  T* qs = query.data_ptr<T>();
  at::parallel_for(0, nh, 1, [&](int64_t h0, int64_t h1) {  // a head's W_UK read once for every token's query
    std::vector<float> q(d_len * dn), acc(d_len * r_len);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t d = 0; d < d_len; ++d)
        for (int64_t n = 0; n < dn; ++n) q[d * dn + n] = static_cast<float>(qn[d][h][n]);
      query_product(q.data(), d_len, dn, w + h * (dn + dv) * r_len, r_len, acc.data());
      for (int64_t d = 0; d < d_len; ++d) {
        T* qd = qs + (d * nh + h) * (r_len + dr);
        for (int64_t r = 0; r < r_len; ++r) qd[r] = static_cast<T>(acc[d * r_len + r]);
        for (int64_t c = 0; c < dr; ++c) qd[r_len + c] = qp[d][h][c];
      }
    }
  });
}

// out[d, h, v] = W_UV[h, v] . latent[d, h]: small_linear.cpp's register tiles per head (x W^T, W's rows in place),
// plain loops without them.
template <typename T>
void apply_values(const at::Tensor& latent, const at::Tensor& w_kv_b, int64_t dn, at::Tensor& out) {
  const int64_t d_len = out.size(0), nh = out.size(1), dv = out.size(2), r_len = latent.size(2);
  const T* lat = latent.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, nh, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> x(d_len * r_len), y(d_len * dv);
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t d = 0; d < d_len; ++d)
        for (int64_t r = 0; r < r_len; ++r) x[d * r_len + r] = static_cast<float>(lat[(d * nh + h) * r_len + r]);
      const at::Tensor w_uv = w_kv_b[h].narrow(0, dn, dv);  // [dv, R], contiguous
      if (!small_gemm(x.data(), d_len, r_len, w_uv, y.data())) {
        const T* w = w_uv.data_ptr<T>();
        for (int64_t d = 0; d < d_len; ++d)
          for (int64_t v = 0; v < dv; ++v) {
            float sum = 0.f;
            for (int64_t r = 0; r < r_len; ++r) sum += x[d * r_len + r] * static_cast<float>(w[v * r_len + r]);
            y[d * dv + v] = sum;
          }
      }
      for (int64_t d = 0; d < d_len; ++d)
        for (int64_t v = 0; v < dv; ++v) os[(d * nh + h) * dv + v] = static_cast<T>(y[d * dv + v]);
    }
  });
}

template <typename T>
at::Tensor run(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_kv_b, const at::Tensor& cache,
               const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window) {
  const int64_t d_len = q_nope.size(0), nh = q_nope.size(1), dn = q_nope.size(2), dr = q_pe.size(2), r_len = w_kv_b.size(2);
  const int64_t dv = w_kv_b.size(1) - dn;
  const T* w = w_kv_b.data_ptr<T>();
  at::Tensor query = at::empty({d_len, nh, r_len + dr}, cache.options());
  absorb_queries<T>(q_nope, q_pe, w, dv, query);
  const at::Tensor none = cache.new_empty(0);
  const at::Tensor latent = paged_decode_attention(query, cache.view({cache.size(0), 1, r_len + dr}), none, block_tables, context_lens,
                                                   block_size, scale, r_len, window, none.to(at::kFloat));  // [D, nh, R]
  at::Tensor out = at::empty({d_len, nh, dv}, cache.options());
  apply_values<T>(latent, w_kv_b, dn, out);
  return out;
}

}  // namespace

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_kv_b, const at::Tensor& cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q_nope.device().is_cpu() && q_nope.dim() == 3 && q_pe.dim() == 3 && w_kv_b.dim() == 3 && cache.dim() == 2,
              "mla_decode: q_nope [D, nh, dn], q_pe [D, nh, dr], w_kv_b [nh, dn + dv, R] and cache [slots, R + dr] on the CPU");
  const int64_t d_len = q_nope.size(0), nh = q_nope.size(1), dn = q_nope.size(2), dr = q_pe.size(2), r_len = w_kv_b.size(2);
  TORCH_CHECK(q_pe.size(0) == d_len && q_pe.size(1) == nh && w_kv_b.size(0) == nh && w_kv_b.size(1) > dn && cache.size(1) == r_len + dr,
              "mla_decode: shapes disagree: q_nope ", q_nope.sizes(), ", q_pe ", q_pe.sizes(), ", w_kv_b ", w_kv_b.sizes(), ", cache ",
              cache.sizes());
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(q_nope.scalar_type() == dtype && q_pe.scalar_type() == dtype && w_kv_b.scalar_type() == dtype,
              "mla_decode: q_nope, q_pe and w_kv_b must have the cache's dtype ", dtype);
  TORCH_CHECK(w_kv_b.is_contiguous() && cache.is_contiguous(), "mla_decode: w_kv_b and cache must be contiguous");
  switch (dtype) {
    case at::kFloat: return run<float>(q_nope, q_pe, w_kv_b, cache, block_tables, context_lens, block_size, scale, window);
    case at::kBFloat16: return run<c10::BFloat16>(q_nope, q_pe, w_kv_b, cache, block_tables, context_lens, block_size, scale, window);
    case at::kHalf: return run<c10::Half>(q_nope, q_pe, w_kv_b, cache, block_tables, context_lens, block_size, scale, window);
    default: TORCH_CHECK(false, "mla_decode: float32, bfloat16 or float16, got ", dtype);
  }
}
