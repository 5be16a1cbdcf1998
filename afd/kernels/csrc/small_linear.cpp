// Linear layers at decode sizes: y = x W^T (+ b) for a few rows of x, reading W once, as it lies.
//
// A decode step multiplies a handful of rows (one per sequence, or the few rows routed to one expert) by
// every weight of the model. That is a stream over the weights with a few FMAs per weight loaded, and its
// speed is the speed of that stream. The BLAS path (torch's F.linear: MKL for float32) first packs W into
// its own layout, which reads W and writes a copy per call; measured here on one thread with W out of
// cache, an 8-row product ran at 4-6 GB/s of weights while a plain read of memory runs at ~21 GB/s
// (docs/benchmarks.md, "Kernels"). Here each W row is read once, in place, a vector (16 or 8 values) at a time, and meets
// every row of x while it is in registers: MT rows of x by NT rows of W per tile, MT * NT accumulators.
//
//   x       [M, K]   float32 (M <= 16), bfloat16 or float16 (M <= 6 with bf16 dot products, any M without; bf16 to
//                    128 on AMX tiles); more rows go to at::linear, half precision padded to linear_rows_bucket rows
//   weight  [N, K]   x's dtype, contiguous (nn.Linear's layout)
//   bias    [N]      optional, x's dtype
//   returns [M, N]   x's dtype; products and sums in float32, rounded once (as torch's CPU linear does); with
//                    bfloat16 weights on a CPU with AVX512-BF16, x's float32 rows are rounded to bfloat16 for
//                    vdpbf16ps (exact for a bfloat16 model's activations; the float32 activations the expert loop
//                    hands its down projection lose what torch's bf16 path loses by keeping them in bfloat16)
//
// Work is split over torch's threads by blocks of W rows. The sums run in a different order from the BLAS
// path's, so results agree with at::linear to float32 rounding, not bit for bit; every caller that must
// agree bit for bit with another path (GroupedExperts' reference, moe_experts.cpp) calls this same function.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "small_linear.h"

namespace {

// The most rows of x taken here (afd bench kernels compares both paths around them), past which the BLAS
// path's packing pays for itself. float32: 16 rows with AVX-512 (1.0x MKL at 32 rows), 32 with AVX2, whose
// MKL kernels are slower at these sizes (measured, one thread, this repo's shapes: 1.2-2.2x MKL at 8-16 rows,
// 1.0-1.2x at 32, 0.8-1.0x at 48-64). Half precision: with bfloat16 dot-product instructions (AVX512_BF16)
// 6 rows: with vdpbf16ps (tile_dot) 1.1-1.25x oneDNN at 6 rows, 0.78-1.06x at 8, 0.55-0.85x at 12-16 (AMD EPYC, two
// threads, V2-Lite's shapes; it was 4 when this kernel widened bf16 weights to float32 FMAs). Without them
// torch's half-precision GEMM is emulated and this kernel is faster at every size (AVX2: 4.5-6x at 4-512
// rows, bfloat16 and float16 alike), but from 64 rows with AVX-512 (128 with AVX2, whose float32 BLAS is half as
// wide) W widened to float32 once for the float32 BLAS is faster still (widened_linear.cpp), so it takes up to 63
// (127).
#if defined(__AVX512F__)
constexpr int64_t kMaxRows = 16;
#else
constexpr int64_t kMaxRows = 32;
#endif
#if defined(__AVX512BF16__)
constexpr int64_t kMaxHalfRows = 6;
#elif defined(__AVX512F__)
constexpr int64_t kWidenRows = 64;
constexpr int64_t kMaxHalfRows = kWidenRows - 1;
#else
constexpr int64_t kWidenRows = 128;
constexpr int64_t kMaxHalfRows = kWidenRows - 1;
#endif
constexpr int64_t kBucketExactRows = 16;  // linear_rows_bucket keeps up to this many rows as they are
constexpr int64_t kPrefetchRows = 8;  // 4-16 measured alike; none at all: 1.1-1.4x MKL at 8 rows, not 1.6-1.9x

#if defined(AFD_SIMD)
using afd_simd::vfloat;

// MT rows of x (float32) against NT rows of W: out[m * ldo + n] = <x_m, w_n>. While it runs, the NT rows
// kPrefetchRows further on are asked for, a cache line per row per line of W consumed: with several FMAs per
// weight the hardware prefetcher alone falls behind (an 8-row product ran at 5 GB/s from memory, 70 GFLOP/s
// from L1, AVX-512).
template <int MT, int NT, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t k_len, float* out, int64_t ldo) {
  constexpr int64_t kLine = 64 / sizeof(W), kSteps = kLine / afd_simd::kLanes;  // vectors of W per cache line
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * ldw);
  vfloat acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = afd_simd::zero();
  const auto step = [&](int64_t k) {
    vfloat wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = afd_simd::load(w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const vfloat xv = afd_simd::load(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = afd_simd::fmadd(xv, wv[n], acc[m][n]);
    }
  };
  int64_t k = 0;
  for (; k + kLine <= k_len; k += kLine) {
    for (int n = 0; n < NT; ++n) _mm_prefetch(ahead + (n * ldw + k) * sizeof(W), _MM_HINT_T0);
    for (int64_t s = 0; s < kSteps; ++s) step(k + s * afd_simd::kLanes);
  }
  for (; k + afd_simd::kLanes <= k_len; k += afd_simd::kLanes) step(k);
  if (k < k_len) {
    const auto t = afd_simd::tail(k_len - k);
    vfloat wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = afd_simd::load(w + n * ldw + k, t);
    for (int m = 0; m < MT; ++m) {
      const vfloat xv = afd_simd::load(x + m * ldx + k, t);
      for (int n = 0; n < NT; ++n) acc[m][n] = afd_simd::fmadd(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = afd_simd::reduce_add(acc[m][n]);
}

#if defined(__AVX512BF16__) && defined(AFD_SIMD_AVX512)
#define AFD_BF16_DOT 1
// bfloat16 W on a CPU with bf16 dot products (vdpbf16ps): MT rows of x, already rounded to bfloat16 (rows ldx apart,
// zero past k_len up to a whole line), against NT rows of W. A cache line of W (32 values) is one load and one
// instruction per row of x, instead of two widenings and two FMAs. (x is a bfloat16 model's activation: rounding it
// is what torch's bf16 linear does; the float32 activations the expert loop hands its down projection lose what
// torch's bf16 path loses by keeping them in bfloat16.) W's rows kPrefetchRows on are asked for as in tile.
template <int MT, int NT>
inline void tile_dot(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t ldw, int64_t k_len, float* out, int64_t ldo) {
  constexpr int64_t kLine = 32;
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchRows * ldw);
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const auto line = [&](int64_t k, __mmask32 mask) {
    __m512bh wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  };
  int64_t k = 0;
  for (; k + kLine <= k_len; k += kLine) {
    for (int n = 0; n < NT; ++n) _mm_prefetch(ahead + (n * ldw + k) * sizeof(c10::BFloat16), _MM_HINT_T0);
    line(k, ~__mmask32{0});
  }
  if (k < k_len) line(k, static_cast<__mmask32>((uint64_t{1} << (k_len - k)) - 1));
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]);
}

// x [rows, K] float32 rounded to bfloat16 once per call, rows `ld` apart, zero-padded to whole lines of 32.
std::vector<c10::BFloat16> rounded_rows(const float* x, int64_t rows, int64_t k_len, int64_t ld) {
  std::vector<c10::BFloat16> xb(rows * ld, c10::BFloat16(0.f));
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * k_len;
    c10::BFloat16* bm = xb.data() + m * ld;
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(bm + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xm + k)));
    for (; k < k_len; ++k) bm[k] = c10::BFloat16(xm[k]);
  }
  return xb;
}
#endif

// One tile: x float32 against any W (tile), or x bfloat16 against bfloat16 W (tile_dot).
template <int MT, int NT, typename X, typename W>
inline void any_tile(const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t k_len, float* out, int64_t ldo) {
  if constexpr (std::is_same_v<X, float>) {
    tile<MT, NT>(x, ldx, w, ldw, k_len, out, ldo);
  } else {
#if defined(AFD_BF16_DOT)
    tile_dot<MT, NT>(x, ldx, w, ldw, k_len, out, ldo);
#endif
  }
}

// mt (1..MAX_MT) rows of x against NT rows of W.
template <int NT, int MAX_MT, typename X, typename W>
inline void tile_rows(int64_t mt, const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t k_len, float* out, int64_t ldo) {
  switch (mt) {
#define AFD_TILE_CASE(R) \
  case R:                \
    if constexpr (R <= MAX_MT) any_tile<R, NT>(x, ldx, w, ldw, k_len, out, ldo); \
    break;
    AFD_TILE_CASE(1)
    AFD_TILE_CASE(2)
    AFD_TILE_CASE(3)
    AFD_TILE_CASE(4)
    AFD_TILE_CASE(5)
    AFD_TILE_CASE(6)
    AFD_TILE_CASE(7)
    AFD_TILE_CASE(8)
#undef AFD_TILE_CASE
    default: TORCH_CHECK(false, "small_linear: a tile of ", mt, " rows");
  }
}

// Tiles: MT rows of x by NT rows of W, MT * NT accumulators + NT weight vectors + one x vector within the
// registers (32 with AVX-512, 16 with AVX2). One row of x takes the widest NT; a few rows a square tile; more
// rows the narrowest NT with the most rows per tile, the W tile staying in L1 while row tiles pass over it.
struct TileShape {
  int nt, mt;
};
constexpr bool kWide = afd_simd::kRegisters >= 32;
constexpr TileShape kOneRow = kWide ? TileShape{8, 1} : TileShape{4, 1};
constexpr TileShape kFewRows = kWide ? TileShape{4, 4} : TileShape{4, 2};
constexpr TileShape kManyRows = kWide ? TileShape{2, 8} : TileShape{2, 6};
static_assert(kManyRows.mt * kManyRows.nt + kManyRows.nt + 1 <= afd_simd::kRegisters, "a tile that spills");
static_assert(kFewRows.mt * kFewRows.nt + kFewRows.nt + 1 <= afd_simd::kRegisters, "a tile that spills");

template <int NT, int MT, typename X, typename W>
void gemm_tiles(const X* x, int64_t ldx, int64_t rows, int64_t k_len, const W* w, int64_t n_len, float* out) {
  constexpr int64_t nt = NT;
  const int64_t blocks = (n_len + nt - 1) / nt;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (nt * k_len * static_cast<int64_t>(sizeof(W))));  // >= 64 KB of W a task
  // Several row tiles: the W tiles of ~16 KB of W stay in L1 while every row tile passes over them (each row
  // tile then meets its W from L1, and itself stays there over the W tiles), instead of all of x passing
  // over each W tile from L2.
  const int64_t chunk = std::max<int64_t>(1, (16 << 10) / (nt * k_len * static_cast<int64_t>(sizeof(W))));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
      const int64_t c1 = std::min(b1, c0 + chunk);
      for (int64_t m0 = 0; m0 < rows; m0 += MT) {
        const int64_t mt = std::min<int64_t>(MT, rows - m0);
        const X* xm = x + m0 * ldx;
        for (int64_t b = c0; b < c1; ++b) {
          const int64_t n0 = b * nt, nn = std::min(nt, n_len - n0);
          float* om = out + m0 * n_len + n0;
          if (nn == nt) {
            tile_rows<NT, MT>(mt, xm, ldx, w + n0 * k_len, k_len, k_len, om, n_len);
          } else {
            for (int64_t n = n0; n < n0 + nn; ++n) tile_rows<1, MT>(mt, xm, ldx, w + n * k_len, k_len, k_len, om + (n - n0), n_len);
          }
        }
      }
    }
  });
}

#if defined(AFD_BF16_DOT)
// One row of x against bfloat16 W with vdpbf16ps: W's rows one after another, each read front to back, so a thread
// streams one sequential run of memory (the tiles read NT rows side by side and ask for NT more ahead: on the AMD
// EPYC VM that ran at 19-21 GB/s where this runs at 26-27 against a plain read's 25-26, median of 10 interleaved
// rounds, 2 threads, 460 MB of W; float32 W showed no difference, so it keeps the tiles). x rounded to bfloat16
// (rounded_rows: one row, zero-padded to whole lines); two accumulators hide the instruction's latency.
void gemv_bf16(const c10::BFloat16* xp, int64_t k_len, const c10::BFloat16* w, int64_t n_len, float* out) {
  constexpr int64_t kLine = 32;  // bfloat16 values per cache line and per vdpbf16ps
  const int64_t full = k_len / kLine * kLine, tail = k_len - full;
  const __mmask32 mask = tail ? static_cast<__mmask32>((uint64_t{1} << tail) - 1) : 0;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (k_len * static_cast<int64_t>(sizeof(c10::BFloat16))));  // >= 64 KB a task
  at::parallel_for(0, n_len, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const c10::BFloat16* wn = w + n * k_len;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 2 * kLine <= full; k += 2 * kLine) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xp + k), (__m512bh)_mm512_loadu_si512(wn + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xp + k + kLine), (__m512bh)_mm512_loadu_si512(wn + k + kLine));
      }
      if (k < full) a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(xp + k), (__m512bh)_mm512_loadu_si512(wn + k));
      if (tail)
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(xp + full), (__m512bh)_mm512_maskz_loadu_epi16(mask, wn + full));
      out[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
  });
}
#endif

// out [M, N] float32 = x [M, K] float32 . W [N, K]^T.
template <typename W>
void gemm(const float* x, int64_t rows, int64_t k_len, const W* w, int64_t n_len, float* out) {
#if defined(AFD_BF16_DOT)
  if constexpr (std::is_same_v<W, c10::BFloat16>) {  // x rounded to bfloat16 once, for vdpbf16ps
    const int64_t ld = (k_len + 31) / 32 * 32;
    const std::vector<c10::BFloat16> xb = rounded_rows(x, rows, k_len, ld);
    if (rows == 1) {
      gemv_bf16(xb.data(), k_len, w, n_len, out);
    } else if (rows <= kFewRows.mt) {
      gemm_tiles<kFewRows.nt, kFewRows.mt>(xb.data(), ld, rows, k_len, w, n_len, out);
    } else {
      gemm_tiles<kManyRows.nt, kManyRows.mt>(xb.data(), ld, rows, k_len, w, n_len, out);
    }
    return;
  }
#endif
  if (rows <= kOneRow.mt) {
    gemm_tiles<kOneRow.nt, kOneRow.mt>(x, k_len, rows, k_len, w, n_len, out);
  } else if (rows <= kFewRows.mt) {
    gemm_tiles<kFewRows.nt, kFewRows.mt>(x, k_len, rows, k_len, w, n_len, out);
  } else {
    gemm_tiles<kManyRows.nt, kManyRows.mt>(x, k_len, rows, k_len, w, n_len, out);
  }
}
#endif

}  // namespace

bool small_linear_takes(at::ScalarType dtype, int64_t rows) {
#if defined(AFD_SIMD)
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  return (dtype == at::kFloat || half) && rows >= 1 && rows <= (half ? kMaxHalfRows : kMaxRows);
#else
  return false;
#endif
}

bool small_gemm(const float* x, int64_t rows, int64_t k_len, const at::Tensor& weight, float* out) {
#if defined(AFD_SIMD)
  const auto dtype = weight.scalar_type();
  if (weight.dim() != 2 || weight.size(1) != k_len || !weight.is_contiguous()) return false;
  if (dtype == at::kFloat) {
    gemm(x, rows, k_len, weight.data_ptr<float>(), weight.size(0), out);
  } else if (dtype == at::kBFloat16) {
    gemm(x, rows, k_len, weight.data_ptr<c10::BFloat16>(), weight.size(0), out);
  } else if (dtype == at::kHalf) {
    gemm(x, rows, k_len, weight.data_ptr<c10::Half>(), weight.size(0), out);
  } else {
    return false;
  }
  return true;
#else
  return false;
#endif
}

bool small_linear_vectorized() {
#if defined(AFD_SIMD)
  return true;
#else
  return false;
#endif
}

bool small_linear_bf16_dot() {
#if defined(AFD_BF16_DOT)
  return true;
#else
  return false;
#endif
}

bool bf16_emulated() { return !small_linear_bf16_dot() && !amx_bf16_usable(); }

int64_t small_linear_max_rows() { return kMaxRows; }

int64_t small_linear_max_half_rows() { return kMaxHalfRows; }

int64_t small_linear_widen_rows() {
#if defined(AFD_SIMD) && !defined(__AVX512BF16__)
  return kWidenRows;
#else
  return 0;
#endif
}

bool small_linear_widens(at::ScalarType dtype, int64_t rows) {
  const int64_t from = small_linear_widen_rows();
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && from > 0 && rows >= from;
}

int64_t small_linear_max_bf16_rows() {
  return std::max(small_linear_takes(at::kBFloat16, 1) ? kMaxHalfRows : 0, amx_bf16_usable() ? amx_bf16_max_rows() : 0);
}

namespace {

// at::linear, with half-precision rows padded to linear_rows_bucket's count: torch's bf16/fp16 linear on the CPU is
// oneDNN's, which builds (JIT-compiles) a kernel for every new shape and caches it; a serving step's row counts (its
// tokens, each expert's share of them) are new all the time, and the build cost more than the product (one thread,
// bf16, a new M: 384 x 256 0.96 vs 0.12 ms, 2816 x 2048 15.7 vs 5.2 ms; the built-in model's 32 x 64-token prefill,
// experts 23-50 ms a layer with new shapes, 6 ms with known ones). Rows are independent in a GEMM: the zero rows added
// change no other row's result, and are dropped.
at::Tensor bucketed_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  if (!(half && x.device().is_cpu() && x.dim() == 2)) return at::linear(x, weight, bias);
  const int64_t rows = x.size(0), padded = linear_rows_bucket(rows);
  if (padded == rows) return at::linear(x, weight, bias);
  at::Tensor xp = at::empty({padded, x.size(1)}, x.options());
  xp.narrow(0, 0, rows).copy_(x);
  xp.narrow(0, rows, padded - rows).zero_();
  return at::linear(xp, weight, bias).narrow(0, 0, rows);
}

}  // namespace

int64_t linear_rows_bucket(int64_t rows) {
  if (rows <= kBucketExactRows) return rows;
  const int64_t step = int64_t{1} << (63 - __builtin_clzll(static_cast<uint64_t>(rows)) - 2);  // a quarter of rows' power of two
  return (rows + step - 1) / step * step;
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (x.dim() == 2 && x.scalar_type() == at::kBFloat16 && !small_linear_takes(at::kBFloat16, x.size(0))) {
    at::Tensor out = amx_linear(x, weight, bias);
    if (out.defined()) return out;
  }
#if defined(AFD_SIMD)
  const auto dtype = x.scalar_type();
  if (x.device().is_cpu() && weight.device().is_cpu() && x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == dtype &&
      weight.is_contiguous() && x.size(1) == weight.size(1) && broadcast_linear_takes(dtype, x.size(0), x.size(1)))
    return broadcast_linear(x, weight, bias);  // before the tiles: emulated bf16's tiles take up to 63 rows
  const bool applies = x.device().is_cpu() && x.dim() == 2 && weight.dim() == 2 && small_linear_takes(dtype, x.size(0)) &&
                       x.size(1) == weight.size(1) && weight.scalar_type() == dtype && weight.is_contiguous() &&
                       (!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0)));
  if (!applies) {
    const bool cpu = x.device().is_cpu() && weight.device().is_cpu() && x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == dtype;
    return cpu && small_linear_widens(dtype, x.size(0)) ? widened_linear(x, weight, bias) : bucketed_linear(x, weight, bias);
  }
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  at::Tensor out = at::empty({rows, n_len}, x.options().dtype(at::kFloat));
  small_gemm(x32.data_ptr<float>(), rows, k_len, weight, out.data_ptr<float>());
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return dtype == at::kFloat ? out : out.to(dtype);
#else
  return bucketed_linear(x, weight, bias);
#endif
}
