// The score and value tiles of a KV block, shared by paged_decode.cpp (decode attention) and dsa_index.cpp (DeepSeek
// Sparse Attention's indexer, which scores its index keys with the same tiles).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "simd.h"

namespace afd_attention {

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
  inline void score_block<T>(const float* q, int64_t g, int64_t dk, const T* const* keys, int64_t n, float scale, float* scores, \
                      int64_t ld) {                                                                                    \
    score_block_simd<T>(q, g, dk, keys, n, scale, scores, ld);                                                       \
  }                                                                                                                    \
  template <>                                                                                                          \
  inline void value_block<T>(float* acc, int64_t g, int64_t dv, const T* const* values, int64_t n, const float* probs, int64_t ld) { \
    value_block_simd<T>(acc, g, dv, values, n, probs, ld);                                                           \
  }
AFD_SIMD_TYPES(float)
AFD_SIMD_TYPES(c10::BFloat16)
AFD_SIMD_TYPES(c10::Half)
#undef AFD_SIMD_TYPES
#endif

}  // namespace afd_attention
