// int8_linear.cpp's entry points for other kernels (moe_experts.cpp's W8A8 loop): the int8 GEMM at decode sizes
// on raw pointers, and the per-token quantisation of W8A8's activations.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Which register tiles int8_gemm runs: the CPU's best (AVX512-VNNI, else AVX2), or AVX2's even where VNNI is
// there (so a VNNI machine's tests cover the AVX2 path too).
enum class Int8Path { kBest, kAvx2 };

// out [rows, N] int32 = q [rows, K] . w [N, K]^T, exact, for rows <= int8_gemm_max_rows(), q and w contiguous.
// row_bias [N]: int8_row_bias(w), which the VNNI path needs (nullptr: computed here); the AVX2 path ignores it.
// False where no int8 tiles were built (neither AVX512-VNNI nor AVX2): the caller then uses at::_int_mm.
bool int8_gemm(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, const int32_t* row_bias, int64_t n_len,
               int32_t* out, Int8Path path = Int8Path::kBest);
int64_t int8_gemm_max_rows();

// One row of W8A8's activations, symmetric per token (afd/models/int8.py: quantize_per_token): scale = max|x| / 127
// (1 for a zero row), q = round-half-even(x / scale) clamped to [-127, 127]. Returns the scale.
float quantize_row(const float* x, int64_t k_len, int8_t* q);

at::Tensor int8_row_bias(const at::Tensor& weight);
