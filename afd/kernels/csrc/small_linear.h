// small_linear.cpp's entry points: F.linear at decode sizes, and its float32 product for other kernels.
#pragma once

#include <ATen/ATen.h>

// y = x W^T + b: a few rows of x read W once, in place; other inputs go to at::linear.
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// Whether small_linear takes `rows` rows of `dtype` itself (a build with simd.h's register tiles, float32 and
// half precision up to their row limits) rather than passing them on to at::linear.
bool small_linear_takes(at::ScalarType dtype, int64_t rows);

// out [rows, N] float32 = x [rows, K] float32 . weight [N, K]^T, weight contiguous in weight's dtype; for rows
// that small_linear_takes. False where it cannot (no register tiles built, another layout or dtype).
bool small_gemm(const float* x, int64_t rows, int64_t k_len, const at::Tensor& weight, float* out);

// Whether small_linear hands `rows` rows of `dtype` to widened_linear: half precision from 64 rows (AVX-512; 128 with AVX2), in a build with the
// register tiles and without half-precision dot products (no AVX512-BF16), where torch's own GEMM is emulated.
bool small_linear_widens(at::ScalarType dtype, int64_t rows);
int64_t small_linear_widen_rows();  // the fewest half-precision rows it widens (0: it never does)

// widened_linear.cpp: y = x W^T + b for half-precision x and W: W widened to float32 a block at a time, the float32
// BLAS's product, rounded once to x's dtype.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// broadcast_linear.cpp: float32 (or bfloat16, W widened a block at a time) y = x W^T + b computed transposed (y^T = W x^T,
// W's values broadcast, W read once in place), for the few dozen rows an expert gets in a prefill step.
at::Tensor broadcast_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
// Rows past small_linear's whose x^T fits broadcast_gemm_max_cols(dtype, K): float32 up to broadcast_linear_max_rows()
// with K of at least 1024, up to 64 with K of 128-1023; bfloat16 with K of at least 1024 where bf16 is emulated (no bf16
// dot products, no AMX-BF16), W widened in L1 a block at a time, and on bf16 dot products without AMX-BF16 from
// broadcast_linear_min_pair_rows() (K even), x^T as pairs of rows
bool broadcast_linear_takes(at::ScalarType dtype, int64_t rows, int64_t k_len);
int64_t broadcast_linear_max_rows();  // 96 (0: not built)
int64_t broadcast_linear_min_pair_rows();  // bfloat16 on vdpbf16ps from this many rows (21; 0: not on this CPU's build)
// Its product on buffers, kept transposed: yt [N, ld] = weight [N, K] (float32, contiguous) . xt [K, ld], ld a multiple
// of the vector width up to broadcast_gemm_max_cols(W's dtype, K): 96 from K = 1024 (bfloat16: 0 below it), 64 for
// float32 K of 128-1023, fewer where xt would pass 1 MB, 0 where the kernel is not built.
void broadcast_gemm_t(const float* weight, int64_t n_len, int64_t k_len, const float* xt, int64_t ld, float* yt);
void broadcast_gemm_t(const c10::BFloat16* weight, int64_t n_len, int64_t k_len, const float* xt, int64_t ld, float* yt);  // W widened in L1
int64_t broadcast_gemm_max_cols(at::ScalarType dtype, int64_t k_len);
// bfloat16 W . x^T on bf16 dot products (vdpbf16ps), x^T held as pairs of its rows: [K/2, ld] 32-bit elements, element
// (j, c) = (x^T[2j][c], x^T[2j+1][c]) as two bfloat16 values, the lower first; K even; the same columns as above
bool broadcast_gemm_pairs();  // built for AVX512-BF16 (the build is this machine's), and no AMX-BF16 takes bf16 instead
void broadcast_gemm_t_pairs(const c10::BFloat16* weight, int64_t n_len, int64_t k_len, const uint32_t* xt2, int64_t ld, float* yt);

// The rows at::linear is called with for `rows` half-precision rows (small_linear pads them): `rows` up to 16, else
// rounded up to a multiple of a quarter of its power of two (at most 25 % more; four sizes an octave), so that
// oneDNN's per-shape kernels are built for few shapes and then found in its cache.
int64_t linear_rows_bucket(int64_t rows);

bool small_linear_vectorized();  // built with simd.h's register tiles (AVX-512 or AVX2)
bool small_linear_bf16_dot();    // its tiles take bfloat16 weights with vdpbf16ps (built for AVX512-BF16)
bool bf16_emulated();            // neither bf16 dot products nor AMX-BF16: bf16 products are float32's on widened values
int64_t small_linear_max_rows();       // the most float32 rows it takes
int64_t small_linear_max_half_rows();  // the most bfloat16 / float16 rows its register tiles take
int64_t small_linear_max_bf16_rows();  // the most bfloat16 rows small_linear computes itself (register or AMX tiles)

// amx.cpp: bfloat16 on AMX-BF16 tiles, W read in place, 1..amx_bf16_gemm_max_rows() rows, K a multiple of 32; out float32.
// False where the tiles do not take the call (not built, the OS refuses the tile state, the shape).
bool amx_bf16_usable();
int64_t amx_bf16_max_rows();       // the rows small_linear gives the tiles (128)
int64_t amx_bf16_gemm_max_rows();  // the most rows bf16_gemm_amx takes at once (512: moe_experts' chunks)
at::Tensor bf16_matmul_amx(const at::Tensor& x, const at::Tensor& weight);  // float32 x W^T on the tiles, or an error
// bf16 x W^T + b on the tiles, rounded to bf16 once; an undefined tensor where they do not take the call (past
// amx_bf16_max_rows() rows, the shape, no tiles): small_linear's path past its register tiles
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
bool bf16_gemm_amx(const c10::BFloat16* x, int64_t rows, int64_t k_len, const c10::BFloat16* w, int64_t n_len, float* out);
