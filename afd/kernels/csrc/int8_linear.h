// int8_linear.cpp's entry points for other kernels (moe_experts.cpp's W8A8 loop): the int8 GEMM at decode sizes
// on raw pointers, and the per-token quantisation of W8A8's activations.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Which tiles int8_gemm runs: the CPU's best (AMX-INT8 at 5-256 rows where the OS grants its tile state and K is a
// multiple of 64; else AVX512-VNNI's register tiles, else AVX2's, up to 16 rows), or one set forced (so one
// machine's tests cover every set it can run).
enum class Int8Path { kBest, kAmx, kVnni, kAvx2 };

// out [rows, N] int32 = q [rows, K] . w [N, K]^T, exact, q and w contiguous. row_bias [N]: int8_row_bias(w), which
// the VNNI tiles need (nullptr: computed here); the others ignore it. False where the path cannot take the call
// (not built, more rows than register tiles take, AMX refused): the caller then uses at::_int_mm.
bool int8_gemm(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, const int32_t* row_bias, int64_t n_len,
               int32_t* out, Int8Path path = Int8Path::kBest);
// Whether a path's tiles were built and (AMX) the OS grants their state.
bool int8_path_runs(Int8Path path);
// The best tiles that run here: "amx_int8", "avx512_vnni", "avx2" or "none".
const char* int8_tiles();
// Whether callers should hold int8_row_bias(w) beside each weight (the VNNI tiles are built: they serve what AMX's
// do not take).
bool int8_needs_row_bias();

// amx.cpp
bool amx_int8_usable();
bool int8_gemm_amx(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, int64_t n_len, int32_t* out);

// One row of W8A8's activations, symmetric per token (afd/models/int8.py: quantize_per_token): scale = max|x| / 127
// (1 for a zero row), q = round-half-even(x / scale) clamped to [-127, 127]. Returns the scale.
float quantize_row(const float* x, int64_t k_len, int8_t* q);

at::Tensor int8_row_bias(const at::Tensor& weight);
