// Paged decode attention on the CPU: each decode token's query against its context read in place from the
// paged KV cache, once, with an online softmax (no gathered copy of the context, no score matrix).
//
// The pure-torch path (afd/models/paged_attention.py: decode_attention) gathers every context into a new
// tensor, then reads it twice with two batched matmuls. On CPU that copy is most of a decode step's
// attention: a fresh multi-MB buffer per layer (page faults) plus three passes over memory. Here a KV block
// (block_size rows) is read from the cache, scored for every query head that shares it, and folded into the
// running output while it is still in L1/L2.
//
// Shapes (all contiguous):
//   q            [D, Hq, Dk]          one query per decode token (float32, bfloat16 or float16)
//   k_cache      [slots, Hk, Dk]      the layer's keys, slot = block * block_size + offset (q's dtype)
//   v_cache      [slots, Hk, Dv]      the layer's values, or an empty tensor when the values are the first
//                                     Dv channels of the keys (MLA's absorbed form: one latent per token)
//   block_tables [D, W] int64         each token's KV blocks, in order
//   context_lens [D] int64            each token's context length (positions 0..len-1, its own included)
//   window       0, or W > 0: a token sees only its context's last W positions (gpt-oss's sliding layers);
//                                     reading starts at the block that holds the first of them
//   sinks        [Hq] float32, or an empty tensor: one more logit per query head in the softmax, with no
//                                     value (gpt-oss's attention sinks)
//   returns      [D, Hq, Dv]          in q's dtype; scores, softmax and sums in float32
// Query head h reads key head h / (Hq / Hk) (grouped heads; MLA's absorbed form is Hk = 1).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "score_tiles.h"
#include "simd.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace afd_attention;

inline void scale_inplace(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

template <typename T>
void decode_one(const T* q,             // [G, Dk]: the query heads sharing key head kh
                const T* k_cache, const T* v_cache, int64_t hk, int64_t kh, int64_t dk, int64_t dv,
                bool values_in_keys, const int64_t* table, int64_t length, int64_t first, int64_t block_size, float scale,
                const float* sinks,     // [G] this group's sink logits, or nullptr
                int64_t g, T* out,      // [G, Dv] (rows Hq apart are contiguous here: heads kh*G .. kh*G+G-1)
                float* acc,             // [G, Dv] scratch
                float* scores,          // [G, block_size] scratch
                float* qf,              // [G, Dk] scratch: the queries in float32, widened once
                const T** rows,         // [block_size + kAheadRows] scratch: the block's key rows, then the next block's first
                const T** values)       // [block_size] scratch: the block's value rows
{
#if defined(AFD_BF16_DOT)
  constexpr bool kDot = std::is_same_v<T, c10::BFloat16>;  // bf16 queries scored as they came (score_tile on vdpbf16ps)
#else
  constexpr bool kDot = false;
#endif
  if constexpr (!kDot)
    for (int64_t i = 0; i < g * dk; ++i) qf[i] = static_cast<float>(q[i]);
  std::vector<float> m(g, -std::numeric_limits<float>::infinity()), l(g, 0.f);
  std::fill(acc, acc + g * dv, 0.f);
  for (int64_t start = first / block_size * block_size; start < length; start += block_size) {
    const int64_t n = std::min(block_size, length - start);
    const int64_t skip = std::max<int64_t>(0, first - start);  // the first block's rows before the window
    const int64_t base = table[start / block_size] * block_size;
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = k_cache + ((base + j) * hk + kh) * dk;
      values[j] = values_in_keys ? rows[j] : v_cache + ((base + j) * hk + kh) * dv;
    }
    const int64_t next = start + block_size, next_base = next < length ? table[next / block_size] * block_size : 0;
    for (int64_t a = 0; a < kAheadRows; ++a)
      rows[n + a] = a < block_size && next + a < length ? k_cache + ((next_base + a) * hk + kh) * dk : nullptr;
#if defined(AFD_BF16_DOT)
    if constexpr (kDot)
      score_block_simd<T>(q, g, dk, rows, n, scale, scores, block_size);
    else
#endif
      score_block<T>(qf, g, dk, rows, n, scale, scores, block_size);
    for (int64_t h = 0; h < g; ++h) {
      float* s = scores + h * block_size;
      for (int64_t j = 0; j < skip; ++j) s[j] = -std::numeric_limits<float>::infinity();
      float top = m[h];
      for (int64_t j = skip; j < n; ++j) top = std::max(top, s[j]);
      const float rescale = std::exp(m[h] - top);  // exp(-inf) = 0 on the first block
      l[h] *= rescale;
      if (rescale != 1.f) scale_inplace(acc + h * dv, rescale, dv);
      for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - top);
        l[h] += s[j];
      }
      m[h] = top;
    }
    value_block<T>(acc, g, dv, values, n, scores, block_size);
  }
  for (int64_t h = 0; h < g; ++h) {
    if (sinks != nullptr) {  // the sink joins the softmax's sum, with no value
      const float top = std::max(m[h], sinks[h]), rescale = std::exp(m[h] - top);
      l[h] = l[h] * rescale + std::exp(sinks[h] - top);
      if (rescale != 1.f) scale_inplace(acc + h * dv, rescale, dv);
    }
    const float inv = 1.f / l[h];
    for (int64_t i = 0; i < dv; ++i) out[h * dv + i] = static_cast<T>(acc[h * dv + i] * inv);
  }
}

}  // namespace

// Whether the register-tiled path was compiled (an AVX-512 or AVX2 machine). Without it, half-precision caches
// go through scalar conversions, slower than torch's batched matmuls: the caller keeps those on the torch path.
bool paged_decode_vectorized() {
#if defined(AFD_SIMD)
  return true;
#else
  return false;
#endif
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_tables, const at::Tensor& context_lens,
                                     int64_t block_size, double scale, int64_t value_dim, int64_t window,
                                     const at::Tensor& sinks) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on the CPU, got q on ", q.device());
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "q must be [D, Hq, Dk] and k_cache [slots, Hk, Dk]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous(), "q and k_cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "k_cache dtype ", k_cache.scalar_type(), " != q dtype ", q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous(), "block_tables and context_lens must be contiguous");
  const int64_t d = q.size(0), hq = q.size(1), dk = q.size(2), hk = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dk, "k_cache head size ", k_cache.size(2), " != q head size ", dk);
  TORCH_CHECK(hk >= 1 && hq % hk == 0, "query heads ", hq, " must be a multiple of key heads ", hk);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == d && context_lens.numel() == d,
              "block_tables must be [D, W] and context_lens [D] for D = ", d, " decode tokens");
  TORCH_CHECK(k_cache.size(0) % block_size == 0, "cache slots ", k_cache.size(0), " are not whole blocks of ", block_size);
  const bool values_in_keys = v_cache.numel() == 0;
  const int64_t dv = values_in_keys ? value_dim : v_cache.size(2);
  if (values_in_keys) {
    TORCH_CHECK(dv >= 1 && dv <= dk, "value_dim ", dv, " must be in [1, ", dk, "] when the values are the keys' first channels");
  } else {
    TORCH_CHECK(v_cache.is_contiguous() && v_cache.scalar_type() == q.scalar_type() && v_cache.dim() == 3 &&
                    v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == hk,
                "v_cache must be a contiguous [slots, Hk, Dv] tensor of q's dtype, beside k_cache");
  }
  TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
  const bool has_sinks = sinks.numel() > 0;
  if (has_sinks)
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == hq,
                "sinks must be a contiguous float32 [Hq] tensor, Hq = ", hq);
  const float* sp = has_sinks ? sinks.data_ptr<float>() : nullptr;
  const int64_t width = block_tables.size(1), num_blocks = k_cache.size(0) / block_size;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < d; ++i) {  // a bad table reads outside the cache: refuse it here, not as a crash
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "decode token ", i, ": context length ", lens[i],
                " is not in [1, ", width * block_size, "]");
    for (int64_t b = window ? std::max<int64_t>(0, lens[i] - window) / block_size : 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[i * width + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "decode token ", i, ": block ", block, " is outside the cache's ", num_blocks);
    }
  }
  auto out = at::empty({d, hq, dv}, q.options());
  const int64_t g = hq / hk;
  // A task is a (token, key head) pair; where there are fewer pairs than threads (one token of MLA's absorbed form,
  // Hk = 1, took one thread while the others waited at the region's end: 0.7 ms a layer of V2-Lite's b=1 step) a
  // pair's query heads are split in parts of whole score tiles (4 heads), each part reading the context on its own.
  const int64_t tiles = (g + 3) / 4, pairs = d * hk;
  const int64_t parts = std::min(tiles, (at::get_num_threads() + pairs - 1) / pairs), per_part = (tiles + parts - 1) / parts * 4;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = values_in_keys ? nullptr : v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, pairs * parts, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(g * dv), scores(g * block_size), qf(g * dk);
      std::vector<const scalar_t*> rows(block_size + kAheadRows), values(block_size);
      for (int64_t w = begin; w < end; ++w) {
        const int64_t i = w / parts / hk, kh = w / parts % hk, h0 = w % parts * per_part, heads = std::min(per_part, g - h0);
        if (heads <= 0) continue;
        const int64_t first = window ? std::max<int64_t>(0, lens[i] - window) : 0;
        const int64_t head = kh * g + h0;  // the part's first query head
        decode_one<scalar_t>(qp + (i * hq + head) * dk, kp, vp, hk, kh, dk, dv, values_in_keys, tables + i * width,
                             lens[i], first, block_size, static_cast<float>(scale), sp ? sp + head : nullptr, heads,
                             op + (i * hq + head) * dv, acc.data(),
                             scores.data(), qf.data(), rows.data(), values.data());
      }
    });
  });
  return out;
}
