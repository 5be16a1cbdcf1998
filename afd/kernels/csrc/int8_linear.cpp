// W8A8 linear layers at decode sizes: acc = q W^T in int32 for a few rows of int8 activations q, reading the int8
// weight W once, as it lies ([N, K], nn.Linear's layout), with AVX512-VNNI dot products (afd/models/int8.py).
//
// oneDNN's int8 GEMM (torch._int_mm) packs W into its own layout per call: at 1-32 rows it moved 3-11 GB/s of
// weights here, a third or less of what memory gives (docs/benchmarks.md, "W8A8"). Here each 64-byte run of a W
// row is loaded once and meets every row of q while it is in a register. VPDPBUSD multiplies unsigned bytes by
// signed ones, so q is biased to unsigned (q ^ 0x80 = q + 128 as an unsigned byte, once per call) and the bias taken
// back out with the W row's sum (``int8_row_bias``: computed once where the weight is loaded, afd/models/int8.py):
//
//   sum_k q_k w_k = sum_k (q_k + 128) w_k - 128 sum_k w_k
//
//   q       [M, K]  int8 (M <= kMaxRows), contiguous
//   weight  [N, K]  int8, contiguous
//   row_bias [N]    int32, 128 * each W row's sum (optional: computed here when absent)
//   returns [M, N]  int32, exact (as torch._int_mm's)
//
// Work is split over torch's threads by blocks of W rows; tails of K are masked loads (zero bytes add nothing).
// Built where the CPU has AVX512-VNNI; elsewhere int8_linear_vectorized() is false and afd uses torch._int_mm.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define AFD_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 16;  // measured: 1.5-2x torch._int_mm at 4-16 rows, 0.75x at 32 (afd bench kernels)

#if defined(AFD_VNNI)
constexpr int64_t kPrefetchRows = 32;

// MT rows of u (= q + 128, unsigned) against NT rows of W: out[m][n] = <u_m, w_n> - bias[n], bias = 128 * sum_k w_n.
template <int MT, int NT>
inline void tile(const uint8_t* u, int64_t ldu, const int8_t* w, int64_t k_len, const int32_t* bias, int32_t* out, int64_t ldo,
                 bool prefetch) {
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
      const __m512i uv = _mm512_maskz_loadu_epi8(mask, u + m * ldu + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbusd_epi32(acc[m][n], uv, wv[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_epi32(acc[m][n]) - bias[n];
}

template <int NT, int MT>
void gemm_tiles(const uint8_t* u, int64_t rows, int64_t k_len, const int8_t* w, const int32_t* bias, int64_t n_len, int32_t* out) {
  const int64_t blocks = (n_len + NT - 1) / NT;
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (NT * k_len));  // >= 64 KB of W a task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NT;
      const bool whole = n0 + NT <= n_len;
      for (int64_t m0 = 0; m0 < rows; m0 += MT) {  // the NT rows of W stay in L1 while the row tiles pass
        const int64_t mt = std::min<int64_t>(MT, rows - m0);
        for (int64_t n = n0; n < std::min(n_len, n0 + NT); n += whole ? NT : 1) {
          const int8_t* wn = w + n * k_len;
          int32_t* o = out + m0 * n_len + n;
          const bool prefetch = m0 == 0 && n + NT + kPrefetchRows <= n_len;
#define AFD_ROWS(R)                                                                          \
  case R:                                                                                    \
    if (whole) tile<R, NT>(u + m0 * k_len, k_len, wn, k_len, bias + n, o, n_len, prefetch); \
    else tile<R, 1>(u + m0 * k_len, k_len, wn, k_len, bias + n, o, n_len, false);          \
    break;
          switch (mt) {
            AFD_ROWS(1)
            AFD_ROWS(2)
            AFD_ROWS(3)
            AFD_ROWS(4)
            default: TORCH_CHECK(false, "int8_linear: a tile of ", mt, " rows");
          }
#undef AFD_ROWS
        }
      }
    }
  });
}
#endif

}  // namespace

bool int8_linear_vectorized() {
#if defined(AFD_VNNI)
  return true;
#else
  return false;
#endif
}

int64_t int8_linear_max_rows() { return kMaxRows; }

at::Tensor int8_row_bias(const at::Tensor& weight) {
  // 128 * sum_k w[n, k]: what the unsigned bias of q adds to each output (int32, exact for K < 2^16)
  return weight.sum(1, /*keepdim=*/false, at::kInt).mul_(128);
}

at::Tensor int8_matmul(const at::Tensor& q, const at::Tensor& weight, const c10::optional<at::Tensor>& row_bias) {
  TORCH_CHECK(q.scalar_type() == at::kChar && weight.scalar_type() == at::kChar && q.dim() == 2 && weight.dim() == 2 &&
                  q.size(1) == weight.size(1),
              "int8_matmul: int8 q [M, K] and weight [N, K]");
#if defined(AFD_VNNI)
  if (q.size(0) >= 1 && q.size(0) <= kMaxRows && q.device().is_cpu()) {
    const at::Tensor u = q.contiguous().view(at::kByte).bitwise_xor(128);  // q + 128 as unsigned bytes, once
    const at::Tensor wc = weight.contiguous();
    const at::Tensor bias = row_bias.has_value() ? row_bias->contiguous() : int8_row_bias(wc);
    TORCH_CHECK(bias.scalar_type() == at::kInt && bias.numel() == weight.size(0), "int8_matmul: row_bias [N] int32");
    const int64_t rows = q.size(0), k_len = q.size(1), n_len = weight.size(0);
    at::Tensor out = at::empty({rows, n_len}, q.options().dtype(at::kInt));
    if (rows == 1) {
      gemm_tiles<8, 1>(u.data_ptr<uint8_t>(), rows, k_len, wc.data_ptr<int8_t>(), bias.data_ptr<int32_t>(), n_len, out.data_ptr<int32_t>());
    } else {
      gemm_tiles<4, 4>(u.data_ptr<uint8_t>(), rows, k_len, wc.data_ptr<int8_t>(), bias.data_ptr<int32_t>(), n_len, out.data_ptr<int32_t>());
    }
    return out;
  }
#endif
  return at::_int_mm(q, weight.t());
}
