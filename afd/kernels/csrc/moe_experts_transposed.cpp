// float32 routed experts past decode sizes (a prefill step's few dozen rows an expert), computed transposed end to end;
// bfloat16 ones too where the CPU has no AMX-BF16 (below).
//
// broadcast_linear.cpp computes an expert's GEMM as y^T = W . x^T, W read once in place. Called per GEMM from the
// ATen loop it transposes x in and y out each time, and the loop around it (a gather, silu, mul, the weighting, the
// scatter into one row per (token, slot), their sum) is a dozen ATen ops an expert on fresh tensors: ~20 % of a
// V2-Lite-shaped prefill's expert time at 512 tokens. Kept transposed, one expert's rows are
//
//   x^T  [H, ld]   its tokens' rows gathered as columns (ld: the rows rounded up to a vector; the padding zeros)
//   g^T  [2I, ld]  = gate_up . x^T       (gate rows, then up rows: each a contiguous block of I x ld)
//   a^T  [I, ld]   = act(gate^T, up^T)   elementwise over the two blocks (moe_experts.h's activation)
//   y^T  [H, ld]   = down . a^T          a^T is already the down GEMM's x^T: nothing is transposed between them
//
// and each column i of y^T, weighted, is added into its token's output row. The buffers are the call's own, reused by
// every expert (~3 MB at V2-Lite's shapes: in the caches). An expert takes this where broadcast_linear would take its
// rows (past small_linear's register tiles, up to 96, or 64 where H or I is under 1,024, x^T within 1 MB: V3's
// 7,168-wide rows up to 32); the others run
// the same loop row-major, their GEMMs on the register tiles (a few rows) or the BLAS (past 96, or 64, where MKL's
// packing pays), as small_linear gives them. Where H or I is under 1,024 (the built-in model; Qwen3-MoE's I of 768),
// float32 calls past 16 rows an expert took the ATen loop before; this loop, alternated with it in one process (2
// threads, AMD EPYC): the built-in model's 8 experts at 512-4,096 tokens 1.24-1.31x, 32 experts of H 2,048 and I 768
// (top-8) at 256 and 1,024 tokens 1.06x and 1.11x, of I 512 (top-10) at 512 tokens 1.09x.
//
// Each step is split over the threads (W's tiles, the activation's channels or rows, the output's columns), one expert
// at a time in expert order, so every output element sums its token's experts in the same order whatever the thread
// count: the result does not depend on it, but for the BLAS's own sums (its experts' rows past what x^T may hold:
// MKL's differ between 1 and 2 threads, as they do in the ATen loop). It is not the ATen loop's bit for bit (that one sums a token's slots in
// slot order and takes ATen's silu): it agrees with GroupedExperts.reference to float32's rounding, as the decode
// path does. Taken for float32 x and contiguous float32 experts where x^T of H and of I rows can hold a vector of
// columns or more (broadcast_gemm_max_cols: H and I from 128 to 16,384, in AVX-512 builds); other float32 experts
// past decode sizes keep the ATen loop.
//
// bfloat16 without AMX-BF16 (whose tiles take bf16 experts themselves). Where bf16 is emulated (no bf16 dot products):
// x's rows widened to float32 as they are gathered, W widened in L1 a block at a time by broadcast_gemm_t, the
// activation and the sums in float32. On bf16 dot products (AVX512-BF16): x^T gathered as pairs of rows and W read as
// it is, two steps of k per vdpbf16ps (broadcast_gemm_t_pairs), the activation computed in float32 and rounded to bf16
// once as the down GEMM's pairs. Either way the output is rounded to bf16 once (the ATen loop and its Python twin
// round after every op, so this is the closer to float64 of the two, not their bits). No BLAS: an expert past what x^T
// holds goes through in pieces of whole vectors of columns (V2-Lite's 97-192 rows: two), each transposed, and the
// result does not depend on the thread count at all. V2-Lite's 64 experts, emulated, 512 / 1,024 tokens, 1 thread:
// 520 -> 433 ms, 919 -> 830 ms a call; on vdpbf16ps (AMD EPYC, 2 threads, against the ATen loop's oneDNN GEMMs and
// the 32-row decode path) 1.15-1.43x at 160-384 tokens, 1.19x at 512, 1.18x at 1,024, 1.09x at 2,048.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "moe_experts.h"
#include "small_linear.h"

namespace afd_moe {

namespace {

#if defined(AFD_SIMD)
constexpr int64_t kLanes = afd_simd::kLanes;  // x^T's columns come in whole vectors
#else
constexpr int64_t kLanes = 1;  // never taken: broadcast_gemm_max_cols is 0
#endif
constexpr int64_t kBlockCols = 64;  // a gather's / scatter's block of H: its x^T or y^T rows stay in L1 across the rows

int64_t max_cols(at::ScalarType dtype, int64_t hidden, int64_t inter) {
  return std::min(broadcast_gemm_max_cols(dtype, hidden), broadcast_gemm_max_cols(dtype, inter));
}

// two bfloat16 values in one 32-bit element, the first in the lower half (vdpbf16ps multiplies element halves pairwise)
inline uint32_t pair_of(c10::BFloat16 lo, c10::BFloat16 hi) { return uint32_t{lo.x} | (uint32_t{hi.x} << 16); }

// The rows of an expert past what x^T holds (most_cols), in as few pieces of at most most_cols as there can be: whole
// vectors of columns spread evenly, the last taking the rest (100 rows as 64 + 36 computes 112 columns where 50 + 50
// computed 128), or equal pieces where that rest would fall to the row-major tiles (x^T of 32 columns, V3's 7,168-wide
// rows: 40 rows as 20 + 20, not 32 + 8). A column computed transposed does not depend on its piece: the same bits.
std::vector<int64_t> pieces(int64_t rows, int64_t most_cols) {
  const int64_t parts = (rows + most_cols - 1) / most_cols, vectors = (rows + kLanes - 1) / kLanes;
  std::vector<int64_t> out;
  if (rows - (vectors - vectors / parts) * kLanes > small_linear_max_rows()) {  // the last piece's vectors: vectors / parts
    for (int64_t p = 0, first = 0; p < parts; first += out.back(), ++p)
      out.push_back(std::min(rows - first, (vectors / parts + (p < vectors % parts ? 1 : 0)) * kLanes));
  } else {
    for (int64_t p = 0; p < parts; ++p) out.push_back(rows / parts + (p < rows % parts ? 1 : 0));
  }
  return out;
}

}  // namespace

bool experts_take_transposed(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const ExpertMath& math) {
  const auto dtype = x.scalar_type();
  const bool even = x.dim() == 2 && down.dim() == 3 && x.size(1) % 2 == 0 && down.size(2) % 2 == 0;  // whole pairs of K
  return (dtype == at::kFloat || (dtype == at::kBFloat16 && (bf16_emulated() || (broadcast_gemm_pairs() && even)))) &&
         gate_up.scalar_type() == dtype && down.scalar_type() == dtype && gate_up.is_contiguous() && down.is_contiguous() &&
         !math.gate_up_scales && x.dim() == 2 && down.dim() == 3 && max_cols(dtype, x.size(1), down.size(2)) > 0;
}

namespace {

// T: float32, or bfloat16 without AMX-BF16 (emulated: W widened in L1 by broadcast_gemm_t, x as it is gathered; on
// bf16 dot products: x^T and the activation as pairs of rows for broadcast_gemm_t_pairs)
template <typename T>
at::Tensor experts_loop(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                        const Grouped& grouped, int64_t k, const ExpertMath& math) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const int64_t hidden = x.size(1), inter = down.size(2), num_experts = gate_up.size(0);
  const int64_t most_cols = max_cols(x.scalar_type(), hidden, inter);
  const at::Tensor xc = x.contiguous(), w32 = weights.to(at::kFloat).contiguous();
  const T* xs = xc.data_ptr<T>();
  const float* ws = w32.data_ptr<float>();
  at::Tensor b1, b2;  // the biases in float32, or undefined
  if (math.gate_up_bias) b1 = math.gate_up_bias->to(at::kFloat).contiguous();
  if (math.down_bias) b2 = math.down_bias->to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({x.size(0), hidden}, x.options().dtype(at::kFloat));  // bf16's rounded once, at the end
  if (grouped.most == 0) return kFloat ? out : out.to(x.scalar_type());  // no row held here
  float* os = out.data_ptr<float>();
  // an expert's rows: x^T (or x), gate and up, the activation, y^T (or y); [H, ld] transposed, [rows, H] row-major;
  // every element read is written first (the padding columns included)
  const int64_t cap = kFloat ? std::max(most_cols, grouped.most) : most_cols;
  const auto buffer = [](int64_t n) { return std::unique_ptr<float[]>(new float[n]); };
  const auto xt = buffer(hidden * cap), gt = buffer(2 * inter * cap), act = buffer(inter * cap), yt = buffer(hidden * cap);
  const bool pairs = !kFloat && broadcast_gemm_pairs();  // transposed products on bf16 dot products: x^T and a^T as pairs of rows
  const auto pair_buffer = [&](int64_t n) { return std::unique_ptr<uint32_t[]>(pairs ? new uint32_t[n] : nullptr); };
  const auto xt2 = pair_buffer(hidden / 2 * cap), act2 = pair_buffer(inter / 2 * cap);
  const auto blocks = [&](const std::function<void(int64_t, int64_t)>& run) {  // H in blocks of kBlockCols, over the threads
    at::parallel_for(0, (hidden + kBlockCols - 1) / kBlockCols, 1, [&](int64_t b0, int64_t b1_) {
      for (int64_t b = b0; b < b1_; ++b) run(b * kBlockCols, std::min(hidden, (b + 1) * kBlockCols));
    });
  };
  // an expert's rows in pieces: one, but for bfloat16 past what x^T holds (no BLAS for it: pieces())
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows_e = grouped.count[e + 1] - grouped.count[e];
    const std::vector<int64_t> sizes = kFloat || rows_e <= most_cols ? std::vector<int64_t>{rows_e} : pieces(rows_e, most_cols);
    for (int64_t p = 0, first = 0; p < static_cast<int64_t>(sizes.size()); first += sizes[p++]) {
      const int64_t n = sizes[p];
      if (n == 0) continue;
      const int64_t* slot_rows = grouped.rows.data() + grouped.count[e] + first;
      // transposed where broadcast_linear would take the rows (past the register tiles, x^T within its bound); else
      // row-major (ld = 1), on the register tiles or (float32 only) the BLAS, as small_linear gives them
      const bool transposed = n > small_linear_max_rows() && n <= most_cols;
      const int64_t ld = transposed ? (n + kLanes - 1) / kLanes * kLanes : 1, rs = transposed ? 1 : hidden;  // x^T[h][i] at h * ld + i * rs
      const bool in_pairs = pairs && transposed;
      blocks([&](int64_t h0, int64_t h1) {  // the rows gathered (as columns, the padding zeros); h0, h1 even
        if constexpr (!kFloat) {
          if (in_pairs) {
            for (int64_t i = 0; i < n; ++i) {
              const T* src = xs + (slot_rows[i] / k) * hidden;
              for (int64_t h = h0; h < h1; h += 2) xt2[h / 2 * ld + i] = pair_of(src[h], src[h + 1]);
            }
            for (int64_t h = h0; h < h1; h += 2) std::fill(xt2.get() + h / 2 * ld + n, xt2.get() + (h / 2 + 1) * ld, 0u);
            return;
          }
        }
        for (int64_t i = 0; i < n; ++i) {
          const T* src = xs + (slot_rows[i] / k) * hidden;
          for (int64_t h = h0; h < h1; ++h) xt[h * ld + i * rs] = static_cast<float>(src[h]);
        }
        if (transposed)
          for (int64_t h = h0; h < h1; ++h) std::fill(xt.get() + h * ld + n, xt.get() + (h + 1) * ld, 0.f);
      });
      const at::Tensor w1 = gate_up[e], w2 = down[e];
      const auto product = [&](const at::Tensor& w, const float* in, const uint32_t* in2, int64_t k_len, float* dst) {
        const int64_t n_len = w.size(0);
        if constexpr (!kFloat) {
          if (in_pairs) return broadcast_gemm_t_pairs(w.data_ptr<T>(), n_len, k_len, in2, ld, dst);
        }
        if (transposed) {
          broadcast_gemm_t(w.data_ptr<T>(), n_len, k_len, in, ld, dst);
        } else if (!small_linear_takes(at::kFloat, n) || !small_gemm(in, n, k_len, w, dst)) {
          TORCH_CHECK(kFloat, "experts_transposed: bfloat16 rows for the BLAS");  // never: its pieces fit x^T
          const auto f32 = at::TensorOptions().dtype(at::kFloat);
          at::Tensor o = at::from_blob(dst, {n, n_len}, f32);
          at::mm_out(o, at::from_blob(const_cast<float*>(in), {n, k_len}, f32), w.t());
        }
      };
      product(w1, xt.get(), xt2.get(), hidden, gt.get());
      // the activation: gate and up of channel r lie I x ld apart (transposed) or I apart in a row (row-major)
      const int64_t units = transposed ? inter : n;
      at::parallel_for(0, units, transposed ? 64 : 4, [&](int64_t u0, int64_t u1) {
        if (b1.defined()) {  // the gate_up bias first
          const float* b = b1.data_ptr<float>() + e * 2 * inter;
          if (transposed) {
            for (int64_t r = u0; r < u1; ++r)
              for (const int64_t row : {r, inter + r})
                for (int64_t i = 0; i < ld; ++i) gt[row * ld + i] += b[row];
          } else {
            for (int64_t i = u0; i < u1; ++i)
              for (int64_t c = 0; c < 2 * inter; ++c) gt[i * 2 * inter + c] += b[c];
          }
        }
        if (transposed)
          activation(gt.get() + u0 * ld, gt.get() + (inter + u0) * ld, act.get() + u0 * ld, (u1 - u0) * ld, math);
        else
          for (int64_t i = u0; i < u1; ++i) activation(gt.get() + i * 2 * inter, act.get() + i * inter, inter, math);
      });
      if (in_pairs)  // a^T as pairs of rows: the activation rounded to bf16 once, as the down GEMM's input
        at::parallel_for(0, inter / 2, 32, [&](int64_t j0, int64_t j1) {
          for (int64_t j = j0; j < j1; ++j) {
            const float *lo = act.get() + 2 * j * ld, *hi = lo + ld;
            for (int64_t i = 0; i < ld; ++i) act2[j * ld + i] = pair_of(c10::BFloat16(lo[i]), c10::BFloat16(hi[i]));
          }
        });
      product(w2, act.get(), act2.get(), inter, yt.get());
      const float* bias = b2.defined() ? b2.data_ptr<float>() + e * hidden : nullptr;
      blocks([&](int64_t h0, int64_t h1) {  // each row, weighted, into its token's
        for (int64_t i = 0; i < n; ++i) {
          const float w = ws[slot_rows[i]];
          float* o = os + (slot_rows[i] / k) * hidden;
          if (bias != nullptr)  // the expert's bias, then its weight
            for (int64_t h = h0; h < h1; ++h) o[h] += w * (yt[h * ld + i * rs] + bias[h]);
          else
            for (int64_t h = h0; h < h1; ++h) o[h] += w * yt[h * ld + i * rs];
        }
      });
    }
  }
  return kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

at::Tensor experts_transposed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                              const Grouped& grouped, int64_t k, const ExpertMath& math) {
  const c10::NoGradGuard no_grad;  // the BLAS's out= form refuses weights that require grad (nn.Parameter's default)
  if (x.scalar_type() == at::kBFloat16) return experts_loop<c10::BFloat16>(x, weights, gate_up, down, grouped, k, math);
  return experts_loop<float>(x, weights, gate_up, down, grouped, k, math);
}

}  // namespace afd_moe
