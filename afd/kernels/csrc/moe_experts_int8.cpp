// The routed W8A8 experts a process holds, in one call (ops.cpp: ``moe_experts_int8``; moe_experts.cpp has the
// bf16/float loops).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "int8_linear.h"
#include "moe_experts.h"

using namespace afd_moe;

// W8A8 experts (afd/models/int8.py; GroupedExperts.hold_int8): int8 weights with per-row float32 scales, activations
// quantised per token. Per expert that has rows: its tokens' int8 rows (quantised once per token here, or as they
// were sent: ``q``, ``q_scale`` from an int8 dispatch, read without a round trip through x), the int8 gate/up
// GEMM (int8_linear.cpp's tiles at decode sizes, oneDNN's past them), the epilogue acc * s_x * s_w (+ b), the
// activation, its rows quantised, the int8 down GEMM, its epilogue, each row weighted into its token's float32
// output. The op order is GroupedExperts.reference's with ``int8_linear`` (the Python loop it replaces); what
// differs is float32 kept between the ops in half precision, and libm's exp in the activation, so it agrees with
// the loop to the rounding of an activation quantum, not bit for bit.
//
//   x [T, H] float; q [T, H] int8 and q_scale [T, 1] float32, optional (both or neither)
//   gate_up [E, 2I, H], down [E, H, I] int8; gate_up_scale [E, 2I], down_scale [E, H] float32
//   gate_up_row_bias [E, 2I], down_row_bias [E, H] int32: int8_row_bias of each, for the VNNI tiles (optional)
//   the rest as moe_experts
std::tuple<at::Tensor, at::Tensor> moe_experts_int8(const at::Tensor& x, const c10::optional<at::Tensor>& q,
                                                    const c10::optional<at::Tensor>& q_scale, const at::Tensor& local_ids,
                                                    const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                                                    const at::Tensor& gate_up_scale, const at::Tensor& down_scale,
                                                    const c10::optional<at::Tensor>& gate_up_row_bias,
                                                    const c10::optional<at::Tensor>& down_row_bias,
                                                    const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias,
                                                    c10::optional<double> swiglu_limit, double swiglu_alpha, double swiglu_offset) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && local_ids.dim() == 2 && local_ids.size(0) == x.size(0) && local_ids.scalar_type() == at::kLong &&
                  weights.sizes() == local_ids.sizes(),
              "x must be [T, H] on the CPU, local_ids [T, k] int64, weights [T, k]");
  TORCH_CHECK(q.has_value() == q_scale.has_value(), "int8 rows need their scales");
  const int64_t num_tokens = x.size(0), hidden = x.size(1), k = local_ids.size(1), num_experts = gate_up.size(0);
  TORCH_CHECK(gate_up.scalar_type() == at::kChar && down.scalar_type() == at::kChar && gate_up.dim() == 3 && down.dim() == 3 &&
                  gate_up.is_contiguous() && down.is_contiguous() && down.size(0) == num_experts && gate_up.size(2) == hidden &&
                  down.size(1) == hidden && gate_up.size(1) == 2 * down.size(2),
              "int8 expert weights must be contiguous gate_up [E, 2I, H] and down [E, H, I], got ", gate_up.sizes(), ", ", down.sizes());
  const int64_t inter = down.size(2);
  TORCH_CHECK(gate_up_scale.scalar_type() == at::kFloat && down_scale.scalar_type() == at::kFloat &&
                  gate_up_scale.sizes() == gate_up.sizes().slice(0, 2) && down_scale.sizes() == down.sizes().slice(0, 2),
              "int8 expert scales must be float32 [E, 2I] and [E, H]");
  if (q) TORCH_CHECK(q->scalar_type() == at::kChar && q->sizes() == x.sizes() && q_scale->scalar_type() == at::kFloat && q_scale->numel() == num_tokens,
                     "q must be int8 [T, H] like x, q_scale float32 [T, 1]");
  const bool vnni = int8_needs_row_bias();
  const at::Tensor rb1 = vnni && gate_up_row_bias ? gate_up_row_bias->contiguous() : at::Tensor();
  const at::Tensor rb2 = vnni && down_row_bias ? down_row_bias->contiguous() : at::Tensor();
  const ExpertMath math{gate_up_bias, down_bias, swiglu_limit, swiglu_alpha, swiglu_offset, c10::nullopt, c10::nullopt, x.scalar_type()};
  const Grouped grouped = group_by_expert(local_ids, num_experts);
  // every token's int8 row and scale, once: as sent, or quantised here
  at::Tensor xq, xs;
  if (q) {
    xq = q->contiguous(), xs = q_scale->reshape({-1}).contiguous();
  } else {
    const at::Tensor x32 = x.to(at::kFloat).contiguous();
    xq = at::empty({num_tokens, hidden}, x.options().dtype(at::kChar)), xs = at::empty({num_tokens}, x.options().dtype(at::kFloat));
    at::parallel_for(0, num_tokens, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        xs.data_ptr<float>()[t] = quantize_row(x32.data_ptr<float>() + t * hidden, hidden, xq.data_ptr<int8_t>() + t * hidden);
    });
  }
  const at::Tensor w32 = weights.to(at::kFloat).contiguous();
  at::Tensor b1, b2;
  if (gate_up_bias) b1 = gate_up_bias->to(at::kFloat).contiguous();
  if (down_bias) b2 = down_bias->to(at::kFloat).contiguous();
  at::Tensor out = at::zeros({num_tokens, hidden}, x.options().dtype(at::kFloat));
  float* os = out.data_ptr<float>();
  const int64_t most = grouped.most;
  std::vector<int8_t> qe(most * hidden), qa(most * inter);
  std::vector<float> se(most), sa(most), gate_and_up(most * 2 * inter), act(most * inter);
  std::vector<int32_t> acc(most * std::max(2 * inter, hidden));
  // acc [n, N] = a [n, K] . w [N, K]^T in int32
  const auto gemm = [&](const int8_t* a, int64_t n, int64_t k_len, const int8_t* w, const at::Tensor& row_bias, int64_t e, int64_t n_len) {
    const int32_t* bias = row_bias.defined() ? row_bias.data_ptr<int32_t>() + e * n_len : nullptr;
    if (int8_gemm(a, n, k_len, w, bias, n_len, acc.data())) return;
    const auto int8 = at::TensorOptions().dtype(at::kChar);
    const at::Tensor product = at::_int_mm(at::from_blob(const_cast<int8_t*>(a), {n, k_len}, int8),
                                           at::from_blob(const_cast<int8_t*>(w), {n_len, k_len}, int8).t());
    std::memcpy(acc.data(), product.data_ptr<int32_t>(), n * n_len * sizeof(int32_t));
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = grouped.per_expert[e];
    if (n == 0) continue;
    const int64_t* slot_rows = grouped.rows.data() + grouped.count[e];
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = slot_rows[i] / k;
      std::memcpy(qe.data() + i * hidden, xq.data_ptr<int8_t>() + t * hidden, hidden);
      se[i] = xs.data_ptr<float>()[t];
    }
    gemm(qe.data(), n, hidden, gate_up.data_ptr<int8_t>() + e * 2 * inter * hidden, rb1, e, 2 * inter);
    const float* gs = gate_up_scale.data_ptr<float>() + e * 2 * inter;
    for (int64_t i = 0; i < n; ++i) {  // as int8.py: (acc * s_x) * s_w (+ b)
      float* g = gate_and_up.data() + i * 2 * inter;
      for (int64_t c = 0; c < 2 * inter; ++c) g[c] = static_cast<float>(acc[i * 2 * inter + c]) * se[i] * gs[c];
      if (b1.defined())
        for (int64_t c = 0; c < 2 * inter; ++c) g[c] += b1.data_ptr<float>()[e * 2 * inter + c];
      activation(g, act.data() + i * inter, inter, math);
      sa[i] = quantize_row(act.data() + i * inter, inter, qa.data() + i * inter);
    }
    gemm(qa.data(), n, inter, down.data_ptr<int8_t>() + e * hidden * inter, rb2, e, hidden);
    const float* ds = down_scale.data_ptr<float>() + e * hidden;
    const float* bias = b2.defined() ? b2.data_ptr<float>() + e * hidden : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const float w = w32.data_ptr<float>()[slot_rows[i]];
      const int32_t* a = acc.data() + i * hidden;
      float* o = os + (slot_rows[i] / k) * hidden;
      for (int64_t c = 0; c < hidden; ++c) {
        const float y = static_cast<float>(a[c]) * sa[i] * ds[c];
        o[c] += w * (bias != nullptr ? y + bias[c] : y);
      }
    }
  }
  return {x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type()), at::tensor(grouped.per_expert, at::TensorOptions().dtype(at::kLong))};
}
