// The Python module of afd's CPU kernels: one binding per op, each op in a file of its own.
#include <torch/extension.h>

#include "simd.h"

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale, int64_t value_dim, int64_t window, const at::Tensor& sinks);

std::tuple<at::Tensor, at::Tensor> moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                                               const at::Tensor& gate_up, const at::Tensor& down,
                                               const c10::optional<at::Tensor>& gate_up_bias,
                                               const c10::optional<at::Tensor>& down_bias, c10::optional<double> swiglu_limit,
                                               double swiglu_alpha, const c10::optional<at::Tensor>& gate_up_scales,
                                               const c10::optional<at::Tensor>& down_scales, double swiglu_offset);

bool paged_decode_vectorized();
int64_t moe_experts_bf16_dot_rows();
bool moe_experts_bf16_pairs();
at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_kv_b, const at::Tensor& cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale, int64_t window);

std::tuple<at::Tensor, at::Tensor> dsa_index_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& index_cache,
                                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                                 int64_t block_size, int64_t topk);

#include "int8_linear.h"
#include "small_linear.h"

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);

at::Tensor gdn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                      const at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh);

at::Tensor int8_matmul(const at::Tensor& q, const at::Tensor& weight, const c10::optional<at::Tensor>& row_bias, const std::string& path);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& row_bias);

std::tuple<at::Tensor, at::Tensor> moe_experts_int8(const at::Tensor& x, const c10::optional<at::Tensor>& q,
                                                    const c10::optional<at::Tensor>& q_scale, const at::Tensor& local_ids,
                                                    const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                                                    const at::Tensor& gate_up_scale, const at::Tensor& down_scale,
                                                    const c10::optional<at::Tensor>& gate_up_row_bias,
                                                    const c10::optional<at::Tensor>& down_row_bias,
                                                    const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                                                    c10::optional<double> swiglu_limit, double swiglu_alpha, double swiglu_offset);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("simd") = pybind11::str(AFD_SIMD_NAME);  // the register tiles built here: "avx512", "avx2" or "none" (simd.h)
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention read in place from the paged KV cache (paged_decode.cpp)");
  m.attr("paged_decode_vectorized") = pybind11::bool_(paged_decode_vectorized());
  m.def("mla_decode", &mla_decode, "DeepSeek MLA's absorbed decode in one call: W_UK into the query, attention over the cached "
        "latents, W_UV after it, kv_b_proj's weight read in place (mla_decode.cpp)");
  m.def("dsa_index_topk", &dsa_index_topk, "DeepSeek Sparse Attention's indexer at decode, read in place (dsa_index.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm in one pass, the Hugging Face dtype rules (norm_rope.cpp)");
  m.def("rotary", &rotary, "rotary embedding in one pass, interleaved or halves (norm_rope.cpp)");
  m.def("linear", &small_linear, "y = x W^T + b; a few rows of x read W once in place (small_linear.cpp), bf16 up to 128 rows on AMX-BF16 tiles "
        "(amx.cpp); without half-precision dot products, bf16/fp16 from 64 rows (128 with AVX2) widen W to float32 for the float32 BLAS "
        "(widened_linear.cpp); other rows go to at::linear (bf16/fp16 rows padded to linear_rows_bucket)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("broadcast_linear", &broadcast_linear, "float32 (or bfloat16, W widened a block at a time) y = x W^T + b computed transposed, "
        "W's values broadcast and W read once in place: the routed experts' few dozen rows a prefill step (broadcast_linear.cpp)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  // linear gives float32 rows past small_linear_max_rows and up to this to broadcast_linear, and bf16 ones where bf16 is
  // emulated (0: never)
  m.attr("broadcast_linear_max_rows") = pybind11::int_(broadcast_linear_max_rows());
  // bf16 rows from this many on vdpbf16ps (x^T as pairs of rows; 0: no bf16 dot products, or AMX-BF16's tiles instead)
  m.attr("broadcast_linear_min_pair_rows") = pybind11::int_(broadcast_linear_min_pair_rows());
  m.def("broadcast_linear_takes", &broadcast_linear_takes, "whether `linear` gives x [rows, K] of this dtype to broadcast_linear "
        "(for a fixed dtype and K, the rows it takes are one interval)", pybind11::arg("dtype"), pybind11::arg("rows"), pybind11::arg("k"));
  m.def("linear_rows_bucket", &linear_rows_bucket, "the rows `linear` gives at::linear for this many bf16/fp16 rows it does "
        "not compute itself: padded so that oneDNN builds a kernel for few shapes (small_linear.cpp)");
  m.attr("small_linear_vectorized") = pybind11::bool_(small_linear_vectorized());
  m.attr("small_linear_max_rows") = pybind11::int_(small_linear_max_rows());
  m.attr("small_linear_max_half_rows") = pybind11::int_(small_linear_max_half_rows());
  m.attr("small_linear_widen_rows") = pybind11::int_(small_linear_widen_rows());  // 0: never
  // the most bfloat16 rows `linear` computes itself: the register tiles', or AMX-BF16's 128 where the OS grants them
  m.attr("small_linear_max_bf16_rows") = pybind11::int_(small_linear_max_bf16_rows());
  m.def("bf16_matmul_amx", &bf16_matmul_amx, "bf16 x [M, K] . W [N, K]^T -> float32 on AMX-BF16 tiles, W read in place "
        "(amx.cpp; an error where they do not run or take the shape)");
  m.attr("bf16_tiles") = pybind11::str(amx_bf16_usable() ? "amx_bf16" : "none");
  m.attr("bf16_dot") = pybind11::bool_(small_linear_bf16_dot());  // the register tiles' bf16 weights on vdpbf16ps
  m.def("int8_matmul", &int8_matmul, "int8 q [M, K] . int8 W [N, K]^T -> int32, W read in place: AMX-INT8 tiles at 5-256 rows "
        "(amx.cpp), else a few rows in VNNI or AVX2 register tiles (int8_linear.cpp), more to torch._int_mm; path: best, "
        "or amx, vnni, avx2 forced (an error where it does not run)",
        pybind11::arg("q"), pybind11::arg("weight"), pybind11::arg("row_bias") = pybind11::none(), pybind11::arg("path") = "best");
  m.def("int8_linear", &int8_linear, "W8A8 y = dequant(quant_per_token(x) . W^T) (+ b) in one call (int8_linear.cpp)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("weight_scale"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("row_bias") = pybind11::none());
  m.def("int8_row_bias", &int8_row_bias, "128 * each int8 weight row's sum, int32: what the VNNI tiles subtract (int8_linear.cpp)");
  m.attr("int8_tiles") = pybind11::str(int8_tiles());  // "amx_int8", "avx512_vnni", "avx2" or "none"
  m.attr("int8_needs_row_bias") = pybind11::bool_(int8_needs_row_bias());
  m.def("gdn_decode", &gdn_decode,
        "Gated DeltaNet decode: one token per sequence, its recurrent state read and written in place in the slots (gated_deltanet.cpp)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("g"), pybind11::arg("beta"), pybind11::arg("state"),
        pybind11::arg("slots"), pybind11::arg("fresh"));
  // bf16 experts (H and I multiples of 32) run moe_experts' C++ loop on AMX-BF16 tiles, any rows, past the register tiles'
  m.attr("moe_experts_bf16_tiles") = pybind11::bool_(amx_bf16_usable());
  // without AMX, on vdpbf16ps: the C++ loop takes bf16 experts of up to this many rows each (0: no bf16 dot products)
  m.attr("moe_experts_bf16_dot_rows") = pybind11::int_(moe_experts_bf16_dot_rows());
  // past 16 rows an expert, bf16 experts computed transposed on vdpbf16ps (moe_experts_transposed.cpp; without AMX-BF16)
  m.attr("moe_experts_bf16_pairs") = pybind11::bool_(moe_experts_bf16_pairs());
  m.def("moe_experts", &moe_experts, "the routed experts held here, one GEMM pair per expert (moe_experts.cpp)",
        pybind11::arg("x"), pybind11::arg("local_ids"), pybind11::arg("weights"), pybind11::arg("gate_up"), pybind11::arg("down"),
        pybind11::arg("gate_up_bias") = pybind11::none(), pybind11::arg("down_bias") = pybind11::none(),
        pybind11::arg("swiglu_limit") = pybind11::none(), pybind11::arg("swiglu_alpha") = 1.702,
        pybind11::arg("gate_up_scales") = pybind11::none(), pybind11::arg("down_scales") = pybind11::none(),
        pybind11::arg("swiglu_offset") = 1.0);
  m.def("moe_experts_int8", &moe_experts_int8, "the routed W8A8 experts held here: per expert, quantise, int8 GEMM, epilogue, "
        "activation, again for down, in one call (moe_experts.cpp)",
        pybind11::arg("x"), pybind11::arg("q"), pybind11::arg("q_scale"), pybind11::arg("local_ids"), pybind11::arg("weights"),
        pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("gate_up_scale"), pybind11::arg("down_scale"),
        pybind11::arg("gate_up_row_bias") = pybind11::none(), pybind11::arg("down_row_bias") = pybind11::none(),
        pybind11::arg("gate_up_bias") = pybind11::none(), pybind11::arg("down_bias") = pybind11::none(),
        pybind11::arg("swiglu_limit") = pybind11::none(), pybind11::arg("swiglu_alpha") = 1.702, pybind11::arg("swiglu_offset") = 1.0);
}
