// Half-precision linears of many rows on a CPU without half-precision dot products (no AVX512-BF16: AVX2, or AVX-512
// without it): W widened to float32 a block at a time and multiplied by the float32 BLAS.
//
// There, torch's bf16 GEMM is emulated (60 GFLOP/s on the 2-core AVX-512 VM without AVX512-BF16), and small_linear's
// register tiles widen W in registers for every row tile (73-93 GFLOP/s at 512 rows, V2-Lite's expert shapes).
// Widening W once per call costs a read and a write of it; MKL's float32 GEMM then runs at 212-257 GFLOP/s: measured
// against the tiles at V2-Lite's 2048 -> 2816 and 1408 -> 2048 (2 threads, median of 5): 0.45-0.65x at 8-16 rows,
// 0.7-0.9x at 32, 1.1-1.4x at 64, 1.45-1.55x at 128, 2.4-3.3x at 512. So small_linear hands this the rows from 64
// (kWidenRows). The AVX2 build on the same VM (MKL, oneDNN and ATen held to AVX2): 0.7-0.9x the tiles at 64 rows,
// 0.9-1.4x at 128, 1.2-1.5x at 256, 1.5-1.9x at 512: there from 128. Each float32 product of bf16 or fp16 values is exact, as in the tiles; only the order of the sums
// differs. The float32 copy of W is at most kWidenBytes at a time (a V3-sized dense MLP's would be a gigabyte), each
// block multiplied straight into its columns of the output (ldc = N).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "small_linear.h"

namespace {

constexpr int64_t kWidenBytes = int64_t{64} << 20;

}  // namespace

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "widened_linear: x [M, K] and weight [N, K], got ",
              x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0)), "widened_linear: bias [N]");
  const c10::NoGradGuard no_grad;  // an inference kernel, as the tiles' paths are (mm's out= form refuses autograd)
  const int64_t rows = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  const at::Tensor x32 = x.to(at::kFloat);
  at::Tensor out = at::empty({rows, n_len}, x.options().dtype(at::kFloat));
  const int64_t block = std::max<int64_t>(1, std::min(n_len, kWidenBytes / std::max<int64_t>(1, k_len * int64_t{sizeof(float)})));
  for (int64_t n0 = 0; n0 < n_len; n0 += block) {
    const int64_t nb = std::min(block, n_len - n0);
    at::Tensor cols = out.narrow(1, n0, nb);  // rows of stride N: the BLAS writes them in place (ldc = N; K = 0: zeros)
    at::mm_out(cols, x32, weight.narrow(0, n0, nb).to(at::kFloat).t());  // W's rows widened as they lie
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}
