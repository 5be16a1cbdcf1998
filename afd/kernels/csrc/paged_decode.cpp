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

#include "simd.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// The key rows past a block that decode_one lists after the block's own (the next block's first rows, or
// nullptr where there is none): what the register tiles prefetch while they score the block's last rows.
constexpr int64_t kAheadRows = 4;

// Scores of one block: scores[h * ld + j] = scale * <q_h, key_j> for G heads (q already float32) and n key rows.
template <typename T>
void score_block(const float* q, int64_t g, int64_t dk, const T* const* keys, int64_t n, float scale, float* scores, int64_t ld) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < g; ++h) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < dk; ++i) s += q[h * dk + i] * static_cast<float>(keys[j][i]);
      scores[h * ld + j] = s * scale;
    }
}

// Values of one block: acc[h * dv + c] += sum_j probs[h * ld + j] * value_j[c].
template <typename T>
void value_block(float* acc, int64_t g, int64_t dv, const T* const* values, int64_t n, const float* probs, int64_t ld) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < g; ++h) {
      const float p = probs[h * ld + j];
      float* __restrict y = acc + h * dv;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) y[c] += p * static_cast<float>(values[j][c]);
    }
}

#if defined(AFD_SIMD)
// Register tiles (simd.h: AVX-512 or AVX2), so that each vector loaded from the cache feeds several FMAs (the
// plain loops above load a query and a key per FMA and reduce every dot product on its own). The cache may be
// float32, bfloat16 or float16, widened in registers.
using afd_simd::vfloat;

// 4 heads x KJ key rows: 4 * KJ accumulators, 4 + KJ loads per 4 * KJ FMAs (KJ = 4 with AVX-512's 32
// registers, 2 with AVX2's 16). Rows past the valid ones repeat a valid pointer (the caller drops them).
// While a tile runs, the KJ key rows of the next one (`ahead`) are asked for, a cache line per row per line
// consumed: a context is read once, from memory, and without it the loads of a tile waited on memory
// latency (AVX2, 32 tokens x 1024 positions: ~3 GB/s of keys against a 10 GB/s plain read).
constexpr int kScoreRows = afd_simd::kRegisters >= 32 ? 4 : 2;
static_assert(kScoreRows <= kAheadRows, "the rows array holds kAheadRows rows past a block");

template <typename T>
inline void score_tile(const float* const* qs, const T* const* ks, const T* const* ahead, int64_t dk, float out[4][kScoreRows]) {
  constexpr int64_t kLine = 64 / sizeof(T);
  vfloat acc[4][kScoreRows];
  for (int h = 0; h < 4; ++h)
    for (int j = 0; j < kScoreRows; ++j) acc[h][j] = afd_simd::zero();
  int64_t i = 0;
  for (; i + afd_simd::kLanes <= dk; i += afd_simd::kLanes) {
    if (i % kLine == 0)
      for (int j = 0; j < kScoreRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + i), _MM_HINT_T0);
    vfloat kv[kScoreRows];
    for (int j = 0; j < kScoreRows; ++j) kv[j] = afd_simd::load(ks[j] + i);
    for (int h = 0; h < 4; ++h) {
      const vfloat qv = afd_simd::load(qs[h] + i);
      for (int j = 0; j < kScoreRows; ++j) acc[h][j] = afd_simd::fmadd(qv, kv[j], acc[h][j]);
    }
  }
  if (i < dk) {
    const auto t = afd_simd::tail(dk - i);
    vfloat kv[kScoreRows];
    for (int j = 0; j < kScoreRows; ++j) kv[j] = afd_simd::load(ks[j] + i, t);
    for (int h = 0; h < 4; ++h) {
      const vfloat qv = afd_simd::load(qs[h] + i, t);
      for (int j = 0; j < kScoreRows; ++j) acc[h][j] = afd_simd::fmadd(qv, kv[j], acc[h][j]);
    }
  }
  for (int h = 0; h < 4; ++h)
    for (int j = 0; j < kScoreRows; ++j) out[h][j] = afd_simd::reduce_add(acc[h][j]);
}

#if defined(__AVX512BF16__) && defined(AFD_SIMD_AVX512)
#define AFD_BF16_DOT 1
// A bfloat16 query against bfloat16 keys on a CPU with bf16 dot products: 32 channels per vdpbf16ps instead of two
// widenings and two FMAs per 16. Query and keys are bf16 values either way and their products exact in float32, so
// only the order of each sum differs from the float32 tile's. The same tile shape and prefetch.
inline void score_tile(const c10::BFloat16* const* qs, const c10::BFloat16* const* ks, const c10::BFloat16* const* ahead,
                       int64_t dk, float out[4][kScoreRows]) {
  __m512 acc[4][kScoreRows];
  for (int h = 0; h < 4; ++h)
    for (int j = 0; j < kScoreRows; ++j) acc[h][j] = _mm512_setzero_ps();
  const auto line = [&](int64_t i, __mmask32 mask) {
    __m512bh kv[kScoreRows];
    for (int j = 0; j < kScoreRows; ++j) kv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ks[j] + i);
    for (int h = 0; h < 4; ++h) {
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mask, qs[h] + i);
      for (int j = 0; j < kScoreRows; ++j) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], qv, kv[j]);
    }
  };
  int64_t i = 0;
  for (; i + 32 <= dk; i += 32) {
    for (int j = 0; j < kScoreRows; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + i), _MM_HINT_T0);
    line(i, ~__mmask32{0});
  }
  if (i < dk) line(i, static_cast<__mmask32>((uint64_t{1} << (dk - i)) - 1));
  for (int h = 0; h < 4; ++h)
    for (int j = 0; j < kScoreRows; ++j) out[h][j] = _mm512_reduce_add_ps(acc[h][j]);
}
#endif

// Q: the queries' type, float32 (widened once), or bfloat16 as they came where score_tile takes them on vdpbf16ps.
template <typename T, typename Q>
void score_block_simd(const Q* q, int64_t g, int64_t dk, const T* const* keys, int64_t n, float scale, float* scores,
                      int64_t ld) {
  float tile[4][kScoreRows];
  for (int64_t h0 = 0; h0 < g; h0 += 4) {
    const int64_t nh = std::min<int64_t>(4, g - h0);
    const Q* qs[4];
    for (int64_t h = 0; h < 4; ++h) qs[h] = q + (h0 + std::min(h, nh - 1)) * dk;
    for (int64_t j0 = 0; j0 < n; j0 += kScoreRows) {
      const int64_t nj = std::min<int64_t>(kScoreRows, n - j0);
      const T* ks[kScoreRows];
      const T* ahead[kScoreRows];
      for (int64_t j = 0; j < kScoreRows; ++j) {
        ks[j] = keys[j0 + std::min(j, nj - 1)];
        const T* next = keys[std::min(j0 + kScoreRows + j, n + kScoreRows - 1)];  // this block's, or the next's
        ahead[j] = next != nullptr ? next : ks[j];
      }
      score_tile(qs, ks, ahead, dk, tile);
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t j = 0; j < nj; ++j) scores[(h0 + h) * ld + j0 + j] = tile[h][j] * scale;
    }
  }
}

// NH heads x one vector of channels of the output held in registers over every row of the block.
template <int NH, typename T>
inline void value_tile(float* acc, int64_t dv, const T* const* values, int64_t n, const float* probs, int64_t ld) {
  for (int64_t c = 0; c < dv; c += afd_simd::kLanes) {
    const auto t = afd_simd::tail(dv - c);
    vfloat a[NH];
    for (int h = 0; h < NH; ++h) a[h] = afd_simd::load(acc + h * dv + c, t);
    for (int64_t j = 0; j < n; ++j) {
      const vfloat v = afd_simd::load(values[j] + c, t);
      for (int h = 0; h < NH; ++h) a[h] = afd_simd::fmadd(afd_simd::set1(probs[h * ld + j]), v, a[h]);
    }
    for (int h = 0; h < NH; ++h) afd_simd::store(acc + h * dv + c, a[h], t);
  }
}

template <typename T>
void value_block_simd(float* acc, int64_t g, int64_t dv, const T* const* values, int64_t n, const float* probs, int64_t ld) {
  int64_t h0 = 0;
  for (; h0 + 4 <= g; h0 += 4) value_tile<4>(acc + h0 * dv, dv, values, n, probs + h0 * ld, ld);
  switch (g - h0) {
    case 3: value_tile<3>(acc + h0 * dv, dv, values, n, probs + h0 * ld, ld); break;
    case 2: value_tile<2>(acc + h0 * dv, dv, values, n, probs + h0 * ld, ld); break;
    case 1: value_tile<1>(acc + h0 * dv, dv, values, n, probs + h0 * ld, ld); break;
    default: break;
  }
}

#define AFD_SIMD_TYPES(T)                                                                                            \
  template <>                                                                                                          \
  void score_block<T>(const float* q, int64_t g, int64_t dk, const T* const* keys, int64_t n, float scale, float* scores, \
                      int64_t ld) {                                                                                    \
    score_block_simd<T>(q, g, dk, keys, n, scale, scores, ld);                                                       \
  }                                                                                                                    \
  template <>                                                                                                          \
  void value_block<T>(float* acc, int64_t g, int64_t dv, const T* const* values, int64_t n, const float* probs, int64_t ld) { \
    value_block_simd<T>(acc, g, dv, values, n, probs, ld);                                                           \
  }
AFD_SIMD_TYPES(float)
AFD_SIMD_TYPES(c10::BFloat16)
AFD_SIMD_TYPES(c10::Half)
#undef AFD_SIMD_TYPES
#endif


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

// DeepSeek Sparse Attention's lightning indexer at decode: each token's top-k context positions, scored in place
// from the paged index-key cache (afd/models/sparse_attention.py says what the scores are).
//
//   q            [D, Hi, Di] float32    the tokens' index queries (rotated)
//   weights      [D, Hi] float32        per head, with every positive scale folded in
//   index_cache  [slots, Di]            the cached index keys (float32, bfloat16 or float16)
//   block_tables [D, W], context_lens [D] int64   as paged_decode_attention's
//   returns      ([D, k] int64 cache slots, valid ones first; [D] int64 how many are valid), k = min(topk, max len)
//
// score(j) = sum_h weights[h] * relu(<q_h, key_j>). The scores of a block are the decode kernel's score_block (its
// register tiles); the blocks of every token are scored in parallel, then each token's top-k is a partial sort
// (ties: the lower position first).
std::tuple<at::Tensor, at::Tensor> dsa_index_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& index_cache,
                                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                                 int64_t block_size, int64_t topk) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous float32 [D, Hi, Di]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == q.size(0) && weights.size(1) == q.size(1),
              "weights must be a contiguous float32 [D, Hi]");
  TORCH_CHECK(index_cache.dim() == 2 && index_cache.is_contiguous() && index_cache.size(1) == q.size(2),
              "index_cache must be a contiguous [slots, Di]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.is_contiguous() && block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "block_tables [D, W] and context_lens [D] must be contiguous int64");
  TORCH_CHECK(topk >= 1 && block_size >= 1 && index_cache.size(0) % block_size == 0, "topk and block_size must be >= 1");
  const int64_t d = q.size(0), heads = q.size(1), dim = q.size(2), width = block_tables.size(1);
  const int64_t num_blocks = index_cache.size(0) / block_size;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  int64_t longest = 0;
  std::vector<int64_t> offset(d + 1, 0), block_offset(d + 1, 0);  // each token's scores, and its blocks, side by side
  for (int64_t i = 0; i < d; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "decode token ", i, ": context length ", lens[i], " out of range");
    const int64_t nb = (lens[i] + block_size - 1) / block_size;
    for (int64_t b = 0; b < nb; ++b)
      TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks, "decode token ", i, ": block outside the cache");
    longest = std::max(longest, lens[i]);
    offset[i + 1] = offset[i] + lens[i];
    block_offset[i + 1] = block_offset[i] + nb;
  }
  const int64_t k = std::min(topk, longest);
  std::vector<float> scores(offset[d]);
  const float* qp = q.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, index_cache.scalar_type(), "dsa_index_topk", [&] {
    const scalar_t* cache = index_cache.data_ptr<scalar_t>();
    at::parallel_for(0, block_offset[d], 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tile(heads * block_size);
      std::vector<const scalar_t*> rows(block_size + kAheadRows, nullptr);
      int64_t i = std::upper_bound(block_offset.begin(), block_offset.end(), begin) - block_offset.begin() - 1;
      for (int64_t w = begin; w < end; ++w) {
        while (w >= block_offset[i + 1]) ++i;
        const int64_t b = w - block_offset[i], start = b * block_size, n = std::min(block_size, lens[i] - start);
        const int64_t base = tables[i * width + b] * block_size;
        for (int64_t j = 0; j < n; ++j) rows[j] = cache + (base + j) * dim;
        for (int64_t a = 0; a < kAheadRows; ++a) rows[n + a] = nullptr;
        score_block<scalar_t>(qp + i * heads * dim, heads, dim, rows.data(), n, 1.f, tile.data(), block_size);
        float* out = scores.data() + offset[i] + start;
        for (int64_t j = 0; j < n; ++j) {
          float s = 0.f;
          for (int64_t h = 0; h < heads; ++h) s += wp[i * heads + h] * std::max(tile[h * block_size + j], 0.f);
          out[j] = s;
        }
      }
    });
  });
  auto slots = at::zeros({d, k}, at::TensorOptions().dtype(at::kLong));
  auto valid = at::empty({d}, at::TensorOptions().dtype(at::kLong));
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* vp = valid.data_ptr<int64_t>();
  at::parallel_for(0, d, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    for (int64_t i = begin; i < end; ++i) {
      const float* s = scores.data() + offset[i];
      const int64_t n = lens[i], take = std::min(k, n);
      order.resize(n);
      for (int64_t j = 0; j < n; ++j) order[j] = j;
      const auto better = [s](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      std::partial_sort(order.begin(), order.begin() + take, order.end(), better);
      for (int64_t j = 0; j < take; ++j)
        sp[i * k + j] = tables[i * width + order[j] / block_size] * block_size + order[j] % block_size;
      vp[i] = take;
    }
  });
  return {slots, valid};
}
