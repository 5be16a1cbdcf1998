// W8A8 linear layers at decode sizes: acc = q W^T in int32 for a few rows of int8 activations q, reading the int8
// weight W once, as it lies ([N, K], nn.Linear's layout) (afd/models/int8.py says what W8A8 is).
//
// oneDNN's int8 GEMM (torch._int_mm) packs W into its own layout per call: at 1-32 rows it moved 3-11 GB/s of
// weights here, a third or less of what memory gives (docs/benchmarks.md, "W8A8"). Here each run of a W row is
// loaded once and meets every row of q while it is in a register. Two sets of register tiles:
//
// * AVX512-VNNI: VPDPBUSD multiplies unsigned bytes by signed ones, 64 a register, so q is biased to unsigned
//   (q ^ 0x80 = q + 128 as an unsigned byte, once per call) and the bias taken back out with the W row's sum
//   (``int8_row_bias``: computed once where the weight is loaded):  sum_k q_k w_k = sum_k (q_k + 128) w_k - 128 sum_k w_k
// * AVX2 (no VNNI): VPMADDUBSW would saturate its 16-bit pair sums (255 * 127 * 2 > 32767), so both operands are
//   widened to int16 instead (q once per call, W per load) and VPMADDWD sums pairs into int32, exactly: 16 bytes
//   of W a load, half VNNI's rate, still faster than the stream of weights at decode sizes.
//
// Both are exact (as torch._int_mm). Where the CPU has AMX-INT8, amx.cpp's tiles take 5-256 rows (int8_gemm).
// ``int8_linear`` adds W8A8's two other steps around the GEMM in the same call: each row quantised per token, and
// the epilogue y = acc * s_x * s_w (+ b), op for op as afd/models/int8.py's int8_linear, so bit for bit its result.
// Work is split over torch's threads by blocks of W rows; tails of K are masked loads (VNNI) or a scalar loop (AVX2).

#include "int8_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define AFD_VNNI 1
#endif
#if defined(__AVX2__)
#define AFD_INT8_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // measured: 1.5-2x torch._int_mm at 4-16 rows, 0.75x at 32 (afd bench kernels)
constexpr int64_t kPrefetchRows = 32;
// where AMX-INT8 runs too, the VNNI tiles still take up to 4 rows: 0.7x AMX's time at 1-4 rows, 1.2x at 8
// (2816 x 2048 and 2048 x 1408, weights from memory; amx.cpp)
constexpr int64_t kVnniFirstRows = 4;

#if defined(AFD_VNNI)
// MT rows of u (= q + 128, unsigned) against NT rows of W: out[m][n] = <u_m, w_n> - bias[n], bias = 128 * sum_k w_n.
template <int MT, int NT>
inline void tile_vnni(const uint8_t* u, const int8_t* w, int64_t k_len, const int32_t* bias, int32_t* out, int64_t ldo, bool prefetch) {
  __m512i acc[MT][NT];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) acc[m][n] = _mm512_setzero_si512();
  for (int64_t k = 0; k < k_len; k += 64) {
    const __mmask64 mask = k + 64 <= k_len ? ~__mmask64(0) : (__mmask64(1) << (k_len - k)) - 1;
    __m512i wv[NT];
    for (int n = 0; n < NT; ++n) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (n + kPrefetchRows) * k_len + k), _MM_HINT_T0);
      wv[n] = _mm512_maskz_loadu_epi8(mask, w + n * k_len + k);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i uv = _mm512_maskz_loadu_epi8(mask, u + m * k_len + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], uv, wv[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_epi32(acc[m][n]) - bias[n];
}
#endif

#if defined(AFD_INT8_AVX2)
inline int32_t reduce_add(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// MT rows of q16 (q widened to int16) against NT rows of W: out[m][n] = <q_m, w_n>.
template <int MT, int NT>
inline void tile_avx2(const int16_t* q16, const int8_t* w, int64_t k_len, int32_t* out, int64_t ldo, bool prefetch) {
  __m256i acc[MT][NT];
  for (int n = 0; n < NT; ++n)
    for (int m = 0; m < MT; ++m) acc[m][n] = _mm256_setzero_si256();
  const int64_t body = k_len / 16 * 16;
  for (int64_t k = 0; k < body; k += 16) {
    __m256i wv[NT];
    for (int n = 0; n < NT; ++n) {
      if (prefetch && k % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (n + kPrefetchRows) * k_len + k), _MM_HINT_T0);
      wv[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * k_len + k)));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q16 + m * k_len + k));
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_add_epi32(acc[m][n], _mm256_madd_epi16(qv, wv[n]));
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      int32_t sum = reduce_add(acc[m][n]);
      for (int64_t k = body; k < k_len; ++k) sum += int32_t(q16[m * k_len + k]) * int32_t(w[n * k_len + k]);
      out[m * ldo + n] = sum;
    }
}
#endif

// Every row tile of the activations against every NT-row block of W, the blocks split over torch's threads; T runs
// one tile (``tile(mt, nt, m0, n, prefetch)``, mt <= MT rows, nt = NT or 1 at the end of W).
template <int NT, int MT, typename Tile>
void over_tiles(int64_t rows, int64_t k_len, int64_t n_len, const Tile& tile) {
  const int64_t blocks = (n_len + NT - 1) / NT;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (NT * k_len));  // >= 64 KB of W a task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NT;
      const bool whole = n0 + NT <= n_len;
      for (int64_t m0 = 0; m0 < rows; m0 += MT)  // the NT rows of W stay in L1 while the row tiles pass
        for (int64_t n = n0; n < std::min(n_len, n0 + NT); n += whole ? NT : 1)
          tile(std::min<int64_t>(MT, rows - m0), whole ? NT : 1, m0, n, m0 == 0 && n + NT + kPrefetchRows <= n_len);
    }
  });
}

// Dispatches a runtime row count (1..4) and column count (NT or 1) to the compile-time tile F<R, C>.
#define AFD_TILE_SWITCH(NT, CALL)                                          \
  switch (mt * 8 + (nt == NT)) {                                           \
    case 8 + 1: CALL(1, NT); break;  case 8: CALL(1, 1); break;            \
    case 16 + 1: CALL(2, NT); break; case 16: CALL(2, 1); break;           \
    case 24 + 1: CALL(3, NT); break; case 24: CALL(3, 1); break;           \
    case 32 + 1: CALL(4, NT); break; case 32: CALL(4, 1); break;           \
    default: TORCH_CHECK(false, "int8_gemm: a tile of ", mt, " rows"); \
  }

#if defined(AFD_VNNI)
template <int NT, int MT>
void gemm_vnni(const uint8_t* u, int64_t rows, int64_t k_len, const int8_t* w, const int32_t* bias, int64_t n_len, int32_t* out) {
  over_tiles<NT, MT>(rows, k_len, n_len, [&](int64_t mt, int64_t nt, int64_t m0, int64_t n, bool prefetch) {
#define AFD_CALL(R, C) tile_vnni<R, C>(u + m0 * k_len, w + n * k_len, k_len, bias + n, out + m0 * n_len + n, n_len, prefetch)
    AFD_TILE_SWITCH(NT, AFD_CALL)
#undef AFD_CALL
  });
}
#endif

#if defined(AFD_INT8_AVX2)
template <int NT, int MT>
void gemm_avx2(const int16_t* q16, int64_t rows, int64_t k_len, const int8_t* w, int64_t n_len, int32_t* out) {
  over_tiles<NT, MT>(rows, k_len, n_len, [&](int64_t mt, int64_t nt, int64_t m0, int64_t n, bool prefetch) {
#define AFD_CALL(R, C) tile_avx2<R, C>(q16 + m0 * k_len, w + n * k_len, k_len, out + m0 * n_len + n, n_len, prefetch)
    AFD_TILE_SWITCH(NT, AFD_CALL)
#undef AFD_CALL
  });
}
#endif

// acc [M, N] int32 of q [M, K] against W: the tiles where they take the call, oneDNN's GEMM elsewhere.
at::Tensor int32_product(const at::Tensor& q, const at::Tensor& weight, const int32_t* bias, Int8Path path) {
  const int64_t rows = q.size(0), n_len = weight.size(0);
  if (rows >= 1) {
    at::Tensor out = at::empty({rows, n_len}, q.options().dtype(at::kInt));
    if (int8_gemm(q.data_ptr<int8_t>(), rows, q.size(1), weight.data_ptr<int8_t>(), bias, n_len, out.data_ptr<int32_t>(), path)) return out;
  }
  return at::_int_mm(q, weight.t());
}

}  // namespace

bool int8_path_runs(Int8Path path) {
  switch (path) {
    case Int8Path::kBest: return true;
    case Int8Path::kAmx: return amx_int8_usable();
#if defined(AFD_VNNI)
    case Int8Path::kVnni: return true;
#endif
#if defined(AFD_INT8_AVX2)
    case Int8Path::kAvx2: return true;
#endif
    default: return false;
  }
}

bool int8_gemm(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, const int32_t* row_bias, int64_t n_len, int32_t* out,
               Int8Path path) {
  const bool amx_first = path == Int8Path::kAmx || (path == Int8Path::kBest && (rows > kVnniFirstRows || !int8_needs_row_bias()));
  if (amx_first && int8_gemm_amx(q, rows, k_len, w, n_len, out)) return true;
  if (path == Int8Path::kAmx || rows > kMaxRows) return false;
#if defined(AFD_VNNI)
  if (path != Int8Path::kAvx2) {
    std::vector<uint8_t> u(rows * k_len);  // q + 128 as unsigned bytes, once
    for (int64_t i = 0; i < rows * k_len; ++i) u[i] = static_cast<uint8_t>(q[i]) ^ 0x80;
    std::vector<int32_t> own;
    if (row_bias == nullptr) {
      own.assign(n_len, 0);
      for (int64_t n = 0; n < n_len; ++n)
        for (int64_t k = 0; k < k_len; ++k) own[n] += 128 * int32_t(w[n * k_len + k]);
      row_bias = own.data();
    }
    if (rows == 1) gemm_vnni<8, 1>(u.data(), rows, k_len, w, row_bias, n_len, out);
    else gemm_vnni<4, 4>(u.data(), rows, k_len, w, row_bias, n_len, out);
    return true;
  }
#endif
#if defined(AFD_INT8_AVX2)
  if (path != Int8Path::kVnni) {
    std::vector<int16_t> q16(q, q + rows * k_len);  // widened once
    if (rows == 1) gemm_avx2<4, 1>(q16.data(), rows, k_len, w, n_len, out);
    else gemm_avx2<2, 4>(q16.data(), rows, k_len, w, n_len, out);
    return true;
  }
#endif
  (void)row_bias;
  return false;
}

bool int8_needs_row_bias() {
#if defined(AFD_VNNI)
  return true;
#else
  return false;
#endif
}

const char* int8_tiles() {
  if (amx_int8_usable()) return "amx_int8";
#if defined(AFD_VNNI)
  return "avx512_vnni";
#elif defined(AFD_INT8_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

float quantize_row(const float* x, int64_t k_len, int8_t* q) {
  float amax = 0.f;
  for (int64_t k = 0; k < k_len; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  for (int64_t k = 0; k < k_len; ++k) q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / scale))));
  return scale;
}

at::Tensor int8_row_bias(const at::Tensor& weight) {
  // 128 * sum_k w[n, k]: what the unsigned bias of q adds to each output (int32, exact for K < 2^16)
  return weight.sum(1, /*keepdim=*/false, at::kInt).mul_(128);
}

at::Tensor int8_matmul(const at::Tensor& q, const at::Tensor& weight, const c10::optional<at::Tensor>& row_bias, const std::string& path) {
  TORCH_CHECK(q.scalar_type() == at::kChar && weight.scalar_type() == at::kChar && q.dim() == 2 && weight.dim() == 2 &&
                  q.size(1) == weight.size(1),
              "int8_matmul: int8 q [M, K] and weight [N, K]");
  if (!q.device().is_cpu()) return at::_int_mm(q, weight.t());
  const Int8Path p = path == "best" ? Int8Path::kBest : path == "amx" ? Int8Path::kAmx : path == "vnni" ? Int8Path::kVnni
                     : path == "avx2" ? Int8Path::kAvx2
                                      : throw std::invalid_argument("int8_matmul: path is best, amx, vnni or avx2, not " + path);
  TORCH_CHECK(int8_path_runs(p), "int8_matmul: the ", path, " tiles do not run here (int8_tiles: ", int8_tiles(), ")");
  const at::Tensor bias = row_bias.has_value() ? row_bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kInt && bias.numel() == weight.size(0)), "int8_matmul: row_bias [N] int32");
  return int32_product(q.contiguous(), weight.contiguous(), bias.defined() ? bias.data_ptr<int32_t>() : nullptr,
                       p);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& row_bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && weight.scalar_type() == at::kChar && weight.dim() == 2 && x.size(1) == weight.size(1) &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.numel() == weight.size(0),
              "int8_linear: x [M, K] on the CPU, int8 weight [N, K], float32 weight_scale [N]");
  const int64_t rows = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({rows, k_len}, x.options().dtype(at::kChar));
  std::vector<float> s(rows);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) s[r] = quantize_row(x32.data_ptr<float>() + r * k_len, k_len, q.data_ptr<int8_t>() + r * k_len);
  });
  const at::Tensor rb = row_bias.has_value() ? row_bias->contiguous() : at::Tensor();
  const at::Tensor acc = int32_product(q, weight.contiguous(), rb.defined() ? rb.data_ptr<int32_t>() : nullptr, Int8Path::kBest);
  const at::Tensor ws = weight_scale.contiguous();
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({rows, n_len}, x.options().dtype(at::kFloat));
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* wsp = ws.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (16 << 10) / n_len), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // as int8.py: (acc * s_x) * s_w, then + b, in float32
      const int32_t* ar = a + r * n_len;
      float* yr = yp + r * n_len;
      const float sr = s[r];
#pragma omp simd
      for (int64_t n = 0; n < n_len; ++n) yr[n] = static_cast<float>(ar[n]) * sr * wsp[n];
      if (bp != nullptr)  // a pass of its own: fused into the product, GCC contracts it to an FMA (not the twin's rounding)
#pragma omp simd
        for (int64_t n = 0; n < n_len; ++n) yr[n] += bp[n];
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
