// The routed experts a process holds, in one call: the same ATen ops, in the same order, as
// GroupedExperts.forward's per-expert loop (afd/models/layers.py), without a Python round trip per op.
//
// At decode sizes an expert's GEMMs are a few rows, and the loop around them (sort the (token, slot) rows by
// expert, gather, two GEMMs, SwiGLU, weight, scatter: about ten ops an expert) cost more in the interpreter
// than the GEMMs did. Here the rows are grouped by a counting sort in plain C++ and each op is a direct ATen
// call. The results are the Python loop's bit for bit: every tensor op is the one it ran (its GEMMs are
// small_linear.cpp's, which the loop's ``linear`` calls too).
//
//   x          [T, H]        tokens (any float dtype)
//   local_ids  [T, k] int64  the local index (0..E-1) of each token's k-th expert, -1 where it is not held here
//   weights    [T, k]        routing weights (float32 or x's dtype)
//   gate_up    [E, 2I, H]    gate rows first, then up rows (x's dtype)
//   down       [E, H, I]
//   returns    ([T, H] in x's dtype: sum over held slots of weight * expert(x), [E] int64 rows each expert took)

#include <ATen/ATen.h>

#include <vector>

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);  // small_linear.cpp

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
  auto out = at::zeros({num_tokens * k, x.size(1)}, x.options());  // one row per (token, slot)
  const at::Tensor flat_weights = weights.reshape({-1});
  const auto index_options = at::TensorOptions().dtype(at::kLong);
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
  std::vector<int64_t> per_expert(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) per_expert[e] = count[e + 1] - count[e];
  return {out.view({num_tokens, k, -1}).sum(1), at::tensor(per_expert, index_options)};
}
