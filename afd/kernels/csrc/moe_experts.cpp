// The routed experts a process holds, in one call, in one of two ways:
//
// * Decode sizes (every expert's rows within small_linear.cpp's reach, AVX-512 or AVX2): the whole expert loop in
//   plain C++ over float32 scratch buffers. Per expert: gather its rows, the gate/up product, SwiGLU, the
//   down product, each row weighted and added into its token's output, with no ATen op between. At decode
//   an expert gets 1-8 rows, and the ~8 ATen ops around its two GEMMs (gather, silu, mul, weighting, scatter,
//   the final sum over slots) had cost as much as the GEMMs. Intermediates stay in float32, so in half
//   precision this path rounds once, at the end (the Python loop rounds after every op): it agrees with the
//   loop to the loop's own rounding, not bit for bit.
// * Otherwise (prefill, or neither instruction set): the same ATen ops, in the same order, as GroupedExperts.reference's
//   per-expert loop (afd/models/layers.py), without a Python round trip per op, so bit for bit its output
//   (its GEMMs are small_linear's, which the loop's ``linear`` calls too).
//
// Both group the (token, slot) rows by expert with a counting sort in plain C++.
//
//   x          [T, H]        tokens (any float dtype)
//   local_ids  [T, k] int64  the local index (0..E-1) of each token's k-th expert, -1 where it is not held here
//   weights    [T, k]        routing weights (float32 or x's dtype)
//   gate_up    [E, 2I, H]    gate rows first, then up rows (x's dtype)
//   down       [E, H, I]
//   returns    ([T, H] in x's dtype: sum over held slots of weight * expert(x), [E] int64 rows each expert took)

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "small_linear.h"

namespace {

// The decode path (see the top): out [T, H] float32 += weight * expert(x row) for every held (token, slot) row.
at::Tensor experts_in_place(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                            const std::vector<int64_t>& count, const std::vector<int64_t>& rows, int64_t k, int64_t most) {
  const int64_t hidden = x.size(1), inter = down.size(2), num_experts = gate_up.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const at::Tensor w32 = weights.to(at::kFloat).contiguous();
  const float* xs = x32.data_ptr<float>();
  const float* ws = w32.data_ptr<float>();
  at::Tensor out = at::zeros({x.size(0), hidden}, x.options().dtype(at::kFloat));
  float* os = out.data_ptr<float>();
  std::vector<float> xe(most * hidden), gate_and_up(most * 2 * inter), act(most * inter), ye(most * hidden);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    const int64_t* slot_rows = rows.data() + count[e];
    for (int64_t i = 0; i < n; ++i) std::memcpy(xe.data() + i * hidden, xs + (slot_rows[i] / k) * hidden, hidden * sizeof(float));
    TORCH_CHECK(small_gemm(xe.data(), n, hidden, gate_up[e], gate_and_up.data()), "moe_experts: gate_up is not contiguous");
    for (int64_t i = 0; i < n; ++i) {
      const float* g = gate_and_up.data() + i * 2 * inter;
      float* a = act.data() + i * inter;
      for (int64_t c = 0; c < inter; ++c) a[c] = g[c] / (1.f + std::exp(-g[c])) * g[inter + c];  // silu(gate) * up
    }
    TORCH_CHECK(small_gemm(act.data(), n, inter, down[e], ye.data()), "moe_experts: down is not contiguous");
    for (int64_t i = 0; i < n; ++i) {
      const float w = ws[slot_rows[i]];
      const float* y = ye.data() + i * hidden;
      float* o = os + (slot_rows[i] / k) * hidden;
#pragma omp simd
      for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
    }
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                                               const at::Tensor& gate_up, const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && local_ids.dim() == 2 && local_ids.size(0) == x.size(0), "x must be [T, H], local_ids [T, k]");
  TORCH_CHECK(local_ids.scalar_type() == at::kLong, "local_ids must be int64");
  TORCH_CHECK(weights.sizes() == local_ids.sizes(), "weights must be [T, k] like local_ids");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0), "gate_up must be [E, 2I, H], down [E, H, I]");
  const int64_t num_tokens = x.size(0), k = local_ids.size(1), num_experts = gate_up.size(0);
  const int64_t inter = down.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && gate_up.size(2) == x.size(1) && down.size(1) == x.size(1),
              "expert weights do not match: gate_up ", gate_up.sizes(), ", down ", down.sizes(), ", x ", x.sizes());
  const at::Tensor ids = local_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(num_experts + 1, 0);  // counting sort of the (token, slot) rows by expert
  for (int64_t r = 0; r < num_tokens * k; ++r) {
    TORCH_CHECK(id[r] >= -1 && id[r] < num_experts, "local expert id ", id[r], " is not in [-1, ", num_experts, ")");
    if (id[r] >= 0) ++count[id[r] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> rows(count[num_experts]), fill(count.begin(), count.end() - 1);
  for (int64_t r = 0; r < num_tokens * k; ++r)
    if (id[r] >= 0) rows[fill[id[r]]++] = r;  // in row order within an expert, as a stable sort gives
  std::vector<int64_t> per_expert(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) per_expert[e] = count[e + 1] - count[e];
  const auto index_options = at::TensorOptions().dtype(at::kLong);
  const int64_t most = per_expert.empty() ? 0 : *std::max_element(per_expert.begin(), per_expert.end());
  const auto dtype = x.scalar_type();
  if (small_linear_takes(dtype, most) && gate_up.scalar_type() == dtype && down.scalar_type() == dtype &&
      gate_up.is_contiguous() && down.is_contiguous())
    return {experts_in_place(x, weights, gate_up, down, count, rows, k, most), at::tensor(per_expert, index_options)};
  auto out = at::zeros({num_tokens * k, x.size(1)}, x.options());  // one row per (token, slot)
  const at::Tensor flat_weights = weights.reshape({-1});
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    at::Tensor row_index = at::from_blob(rows.data() + count[e], {n}, index_options).clone();  // [n] (token, slot) rows
    at::Tensor xe = x.index_select(0, at::div(row_index, k, "floor"));  // [n, H]
    at::Tensor gate_and_up = small_linear(xe, gate_up[e], c10::nullopt);  // [n, 2I]
    at::Tensor act = at::silu(gate_and_up.narrow(1, 0, inter)) * gate_and_up.narrow(1, inter, inter);
    at::Tensor ye = small_linear(act, down[e], c10::nullopt);  // [n, H]
    out.index_put_({row_index}, (ye * flat_weights.index_select(0, row_index).unsqueeze(1)).to(out.scalar_type()));
  }
  return {out.view({num_tokens, k, -1}).sum(1), at::tensor(per_expert, index_options)};
}
