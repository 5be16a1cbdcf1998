// What moe_experts.cpp's expert loops share (the bf16/float one there, the W8A8 one in moe_experts_int8.cpp): the
// experts' math besides their GEMMs, MXFP4 decoding, and the rows grouped by expert.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace afd_moe {

// One expert's MXFP4 weight decoded: blocks [R, G, 16] uint8, scales [R, G] uint8 -> [R, 32 G] in dtype.
at::Tensor decode_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype);

// What the experts compute besides their two GEMMs: biases and the activation.
struct ExpertMath {
  c10::optional<at::Tensor> gate_up_bias, down_bias;  // [E, 2I], [E, H]
  c10::optional<double> limit;                         // the clamped SwiGLU (gpt-oss, DeepSeek-V4)
  double alpha, offset;
  c10::optional<at::Tensor> gate_up_scales, down_scales;  // MXFP4: the weights are blocks
  at::ScalarType dtype;                                    // what MXFP4 weights decode into

  // Expert e's weights, as the GEMMs take them.
  at::Tensor gate_up(const at::Tensor& w, int64_t e) const { return gate_up_scales ? decode_mxfp4(w[e], (*gate_up_scales)[e], dtype) : w[e]; }
  at::Tensor down(const at::Tensor& w, int64_t e) const { return down_scales ? decode_mxfp4(w[e], (*down_scales)[e], dtype) : w[e]; }
};

// silu(gate) * up, or the clamped form, over n channels (gate's and up's); vectorised with simd.h's exp where the build
// has it (a scalar std::exp per channel had been most of a prefill's expert time: 1,024 rows x 192).
inline void activation(const float* gate_in, const float* up_in, float* a, int64_t n, const ExpertMath& math) {
  const bool clamped = math.limit.has_value();
  const float limit = clamped ? static_cast<float>(*math.limit) : 0.f;
  const float alpha = clamped ? static_cast<float>(math.alpha) : 1.f, offset = clamped ? static_cast<float>(math.offset) : 0.f;
  int64_t c = 0;
#if defined(AFD_SIMD)
  using namespace afd_simd;
  const vfloat one = set1(1.f);
  for (; c + kLanes <= n; c += kLanes) {
    vfloat gate = load(gate_in + c), up = load(up_in + c);
    if (clamped) {
      gate = min(gate, set1(limit));
      up = add(min(max(up, set1(-limit)), set1(limit)), set1(offset));
    }
    store(a + c, div(mul(up, gate), add(one, afd_simd::exp(mul(gate, set1(-alpha))))));
  }
#endif
  for (; c < n; ++c) {
    float gate = gate_in[c], up = up_in[c];
    if (clamped) {
      gate = std::min(gate, limit);
      up = std::min(std::max(up, -limit), limit) + offset;
    }
    a[c] = up * gate / (1.f + std::exp(-alpha * gate));
  }
}

// The same over one row of I channels, gate then up in g.
inline void activation(const float* g, float* a, int64_t inter, const ExpertMath& math) { activation(g, g + inter, a, inter, math); }

// The (token, slot) rows grouped by expert with a counting sort: expert e's rows are rows[count[e] .. count[e + 1]),
// in row order (as a stable sort gives).
struct Grouped {
  std::vector<int64_t> count, rows, per_expert;
  int64_t most = 0;  // the most rows one expert took
};

Grouped group_by_expert(const at::Tensor& local_ids, int64_t num_experts);

// moe_experts_transposed.cpp: float32 experts past decode sizes in one loop (bfloat16 without AMX-BF16), an expert
// of a few dozen rows kept transposed end to end (its top says how); whether it takes x and experts of H -> I -> H, and
// the loop.
bool experts_take_transposed(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down, const ExpertMath& math);
at::Tensor experts_transposed(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                              const Grouped& grouped, int64_t k, const ExpertMath& math);

}  // namespace afd_moe
