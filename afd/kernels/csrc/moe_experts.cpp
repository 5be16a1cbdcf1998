// The routed experts a process holds, in one call, in one of two ways:
//
// * Decode sizes (every expert's rows within small_linear.cpp's reach, AVX-512 or AVX2): the whole expert loop in
//   plain C++ over float32 scratch buffers. Per expert: gather its rows, the gate/up product, SwiGLU, the
//   down product, each row weighted and added into its token's output, with no ATen op between. At decode
//   an expert gets 1-8 rows, and the ~8 ATen ops around its two GEMMs (gather, silu, mul, weighting, scatter,
//   the final sum over slots) had cost as much as the GEMMs. Intermediates stay in float32, so in half
//   precision this path rounds once, at the end (the Python loop rounds after every op): it agrees with the
//   loop to the loop's own rounding, not bit for bit. bf16 experts of more than small_linear's rows each take this loop
//   too, at any size, where the CPU has AMX-BF16 (amx.cpp's tiles; H and I multiples of 32): x's rows gathered as bf16,
//   float32 products in chunks of up to 512 rows, the activation rounded to bf16 once for the down GEMM (the built-in
//   model's 32-row decode: 0.51 -> 0.25 ms a layer); without AMX, up to 32 rows an expert on vdpbf16ps (small_linear's
//   tile_dot: V2-Lite's shapes 1.0x the ATen loop at 128 tokens, 1.7x at 32; the built-in model's 4.6-11x at 8-64).
//   The experts run side by side on the threads where their rows are spread (AMX: V2-Lite's 64 experts 1.13x at 48
//   tokens, the built-in model's 8 1.3-2.8x; register tiles: one parallel region a call instead of two a GEMM, the
//   built-in model's 32-token decode 1.08 -> 0.24 ms a layer).
// * float32 experts past decode sizes whose H and I are at least 128 (AVX-512 builds; up to 64 rows an expert where H
//   or I is under 1,024, 96 from it), and bfloat16 ones (H and I from 1,024) where bf16
//   is emulated (no bf16 dot products, no AMX-BF16): one C++ loop over scratch buffers, an expert's rows kept
//   transposed from x^T to its weighted output (moe_experts_transposed.cpp). Taken first once an expert has more rows
//   than small_linear's float32 tiles (16), though emulated bf16's tiles would take up to 63.
// * Otherwise (prefill, or neither instruction set): the same ATen ops, in the same order, as GroupedExperts.reference's
//   per-expert loop (afd/models/layers.py), without a Python round trip per op, so bit for bit its output
//   (its GEMMs are small_linear's, which the loop's ``linear`` calls too).
//
// Both group the (token, slot) rows by expert with a counting sort in plain C++ (moe_experts.h; the W8A8 experts'
// loop, moe_experts_int8.cpp, too).
//
//   x          [T, H]        tokens (any float dtype)
//   local_ids  [T, k] int64  the local index (0..E-1) of each token's k-th expert, -1 where it is not held here
//   weights    [T, k]        routing weights (float32 or x's dtype)
//   gate_up    [E, 2I, H]    gate rows first, then up rows (x's dtype)
//   down       [E, H, I]
//   gate_up_bias [E, 2I], down_bias [E, H]   optional (gpt-oss): each expert's biases, the down bias added
//              before the routing weight
//   gate_up_scales, down_scales  optional (gpt-oss's MXFP4, ``--mxfp4-weights keep``): gate_up and down are then
//              uint8 blocks [E, 2I, H/32, 16] and [E, H, I/32, 16] (e2m1 pairs, the even value in the low nibble)
//              with these e8m0 scales [E, 2I, H/32] and [E, H, I/32]; each expert that has rows is decoded here
//              into a scratch weight in x's dtype (a lookup of 16 values and an exponent), then runs as above
//   swiglu_limit optional: the clamped activation (clamp(up, -l, l) + offset) * g * sigmoid(alpha * g),
//              g = min(gate, l), instead of silu(gate) * up; gpt-oss: offset 1, alpha 1.702; DeepSeek-V4: offset 0,
//              alpha 1 (silu(min(gate, l)) * clamp(up, -l, l))
//   returns    ([T, H] in x's dtype: sum over held slots of weight * expert(x), [E] int64 rows each expert took)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "moe_experts.h"
#include "small_linear.h"


namespace afd_moe {

// One expert's MXFP4 weight decoded: blocks [R, G, 16] uint8, scales [R, G] uint8 -> [R, 32 G] in dtype.
at::Tensor decode_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  static const float kFp4[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  const int64_t rows = blocks.size(0), groups = blocks.size(1);
  const at::Tensor b = blocks.contiguous(), sc = scales.contiguous();
  const uint8_t* bp = b.data_ptr<uint8_t>();
  const uint8_t* sp = sc.data_ptr<uint8_t>();
  at::Tensor out = at::empty({rows, groups * 32}, blocks.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "decode_mxfp4", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const float factor = std::ldexp(1.f, static_cast<int>(sp[r * groups + g]) - 127);
          const uint8_t* byte = bp + (r * groups + g) * 16;
          scalar_t* o = op + r * groups * 32 + g * 32;
          for (int j = 0; j < 16; ++j) {
            o[2 * j] = static_cast<scalar_t>(kFp4[byte[j] & 0x0F] * factor);
            o[2 * j + 1] = static_cast<scalar_t>(kFp4[byte[j] >> 4] * factor);
          }
        }
    });
  });
  return out;
}

Grouped group_by_expert(const at::Tensor& local_ids, int64_t num_experts) {
  const at::Tensor ids = local_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  Grouped g;
  g.count.assign(num_experts + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(id[r] >= -1 && id[r] < num_experts, "local expert id ", id[r], " is not in [-1, ", num_experts, ")");
    if (id[r] >= 0) ++g.count[id[r] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.count[e + 1] += g.count[e];
  g.rows.resize(g.count[num_experts]);
  std::vector<int64_t> fill(g.count.begin(), g.count.end() - 1);
  for (int64_t r = 0; r < n; ++r)
    if (id[r] >= 0) g.rows[fill[id[r]]++] = r;
  g.per_expert.resize(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) g.most = std::max(g.most, g.per_expert[e] = g.count[e + 1] - g.count[e]);
  return g;
}

}  // namespace afd_moe

using namespace afd_moe;

namespace {

// Whether the decode path takes bf16 experts on AMX-BF16 tiles (any number of rows, in chunks): both GEMMs' K (H, then
// I) a multiple of 32 and N at least 32 (ops.cpp: ``moe_experts_bf16_tiles``).
bool experts_take_tiles(at::ScalarType dtype, int64_t most, int64_t hidden, int64_t inter) {
  return dtype == at::kBFloat16 && amx_bf16_usable() && most > 0 && hidden % 32 == 0 && inter % 32 == 0 && hidden >= 32 && inter >= 32;
}

// The most bytes of float32 rows the register tiles' side-by-side run keeps (one per held (token, slot)); past them
// (V3's 7,168-wide rows at hundreds of tokens) one expert at a time, split over the threads.
constexpr int64_t kExactRowBytes = int64_t{16} << 20;

}  // namespace

// The most rows an expert of bf16 experts takes the decode path with on a CPU with bf16 dot products and no AMX-BF16
// (small_linear.cpp's tile_dot), past small_linear's own limit: 32, past which the ATen loop's oneDNN GEMMs are
// faster; 0 elsewhere.
int64_t moe_experts_bf16_dot_rows() { return small_linear_bf16_dot() && !amx_bf16_usable() ? 32 : 0; }

// bf16 experts past 16 rows on vdpbf16ps (moe_experts_transposed.cpp): where broadcast_linear's pairs run
bool moe_experts_bf16_pairs() { return broadcast_gemm_pairs(); }

namespace {

bool experts_take_dot(at::ScalarType dtype, int64_t most) {
  return dtype == at::kBFloat16 && most > 0 && most <= moe_experts_bf16_dot_rows();
}

// The decode path (see the top): out [T, H] float32 += weight * expert(x row) for every held (token, slot) row. With
// `tiles` (bfloat16 on AMX-BF16, amx.cpp; H and I multiples of 32) the GEMMs take bf16 rows and return float32: x's
// rows are gathered as they are, the activation rounded to bf16 once for the down GEMM, and an expert's rows go
// through in chunks of up to amx_bf16_gemm_max_rows() (each chunk reads the expert's W once). The chunks run side by
// side, each thread taking the next (largest first) with its own scratch, where no expert holds more than a thread's
// share of the rows: no barrier between an expert's steps. Each (token, slot) row's weighted output is then written
// once, in bf16 as the Python loop keeps it, and a token's slots are summed at the end in slot order, so the result
// does not depend on which thread took what. Otherwise one chunk at a time, each GEMM and the rows between them split
// over the threads.
at::Tensor experts_in_place(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& gate_up, const at::Tensor& down,
                            const std::vector<int64_t>& count, const std::vector<int64_t>& rows, int64_t k, int64_t most,
                            const ExpertMath& math, int64_t inter, bool tiles = false) {
  const int64_t hidden = x.size(1), num_experts = gate_up.size(0);
  const int64_t chunk = tiles ? std::min(most, amx_bf16_gemm_max_rows()) : most;  // rows a GEMM takes at once
  const at::Tensor x32 = tiles ? at::Tensor() : x.to(at::kFloat).contiguous();
  const at::Tensor x16 = tiles ? x.contiguous() : at::Tensor();
  const at::Tensor w32 = weights.to(at::kFloat).contiguous();
  const float* xs = tiles ? nullptr : x32.data_ptr<float>();
  const float* ws = w32.data_ptr<float>();
  at::Tensor out = at::zeros({x.size(0), hidden}, x.options().dtype(at::kFloat));
  struct Scratch {  // one chunk's rows through the expert
    std::vector<float> xe, gate_and_up, act, ye;
    std::vector<c10::BFloat16> xe16, act16;
  };
  const auto scratch = [&] {
    return Scratch{std::vector<float>(tiles ? 0 : chunk * hidden), std::vector<float>(chunk * 2 * inter), std::vector<float>(chunk * inter),
                   std::vector<float>(chunk * hidden), std::vector<c10::BFloat16>(tiles ? chunk * hidden : 0),
                   std::vector<c10::BFloat16>(tiles ? chunk * inter : 0)};
  };
  const auto product = [&](Scratch& s, bool first, int64_t e, int64_t n) {  // the gate/up (first) or the down GEMM of expert e's n rows
    const at::Tensor w = first ? math.gate_up(gate_up, e) : math.down(down, e);
    const int64_t k_len = first ? hidden : inter, n_len = first ? 2 * inter : hidden;
    float* dst = first ? s.gate_and_up.data() : s.ye.data();
    const bool done = tiles ? (w.is_contiguous() && bf16_gemm_amx(first ? s.xe16.data() : s.act16.data(), n, k_len,
                                                                   w.data_ptr<c10::BFloat16>(), n_len, dst))
                            : small_gemm(first ? s.xe.data() : s.act.data(), n, k_len, w, dst);
    TORCH_CHECK(done, "moe_experts: ", first ? "gate_up" : "down", " is not contiguous");
  };
  const auto rows_in_parallel = [&](int64_t n, const std::function<void(int64_t)>& row) {  // decode sizes, or side by side: this thread
    if (n < 32) {
      for (int64_t i = 0; i < n; ++i) row(i);
    } else {
      at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) row(i);
      });
    }
  };
  at::Tensor b1, b2;  // the biases in float32, or undefined
  if (math.gate_up_bias) b1 = math.gate_up_bias->to(at::kFloat).contiguous();
  if (math.down_bias) b2 = math.down_bias->to(at::kFloat).contiguous();
  // expert e's rows c0 .. c0 + n through it, each weighted into its token's row of os
  // (or, with `slots`, each weighted row into its own (token, slot) row of slots, in bf16, as the Python loop keeps them)
  // (or, with `exact`, each unweighted row, its bias added, into exact's row c0 + i: rows in `rows`' order, float32)
  const auto run_chunk = [&](Scratch& s, float* os, int64_t e, int64_t c0, int64_t n, c10::BFloat16* slots = nullptr,
                             float* exact = nullptr) {
    const int64_t* slot_rows = rows.data() + c0;
    rows_in_parallel(n, [&](int64_t i) {
      if (tiles)
        std::memcpy(s.xe16.data() + i * hidden, x16.data_ptr<c10::BFloat16>() + (slot_rows[i] / k) * hidden, hidden * sizeof(c10::BFloat16));
      else
        std::memcpy(s.xe.data() + i * hidden, xs + (slot_rows[i] / k) * hidden, hidden * sizeof(float));
    });
    product(s, true, e, n);
    rows_in_parallel(n, [&](int64_t i) {
      float* g = s.gate_and_up.data() + i * 2 * inter;
      if (b1.defined()) {
        const float* b = b1.data_ptr<float>() + e * 2 * inter;
        for (int64_t c = 0; c < 2 * inter; ++c) g[c] += b[c];
      }
      float* a = s.act.data() + i * inter;
      activation(g, a, inter, math);
      if (tiles)
        for (int64_t c = 0; c < inter; ++c) s.act16[i * inter + c] = c10::BFloat16(a[c]);
    });
    product(s, false, e, n);
    const float* bias = b2.defined() ? b2.data_ptr<float>() + e * hidden : nullptr;
    rows_in_parallel(n, [&](int64_t i) {
      const float w = ws[slot_rows[i]];
      const float* y = s.ye.data() + i * hidden;
      if (exact != nullptr) {
        float* o = exact + (c0 + i) * hidden;
        if (bias != nullptr) {
#pragma omp simd
          for (int64_t c = 0; c < hidden; ++c) o[c] = y[c] + bias[c];
        } else {
          std::memcpy(o, y, hidden * sizeof(float));
        }
        return;
      }
      if (slots != nullptr) {
        c10::BFloat16* o = slots + slot_rows[i] * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] = c10::BFloat16(w * (bias != nullptr ? y[c] + bias[c] : y[c]));
        return;
      }
      float* o = os + (slot_rows[i] / k) * hidden;
      if (bias != nullptr) {  // the expert's bias, then its weight
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * (y[c] + bias[c]);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
      }
    });
  };
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (expert, first row) of every chunk
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t c0 = count[e]; c0 < count[e + 1]; c0 += chunk) chunks.emplace_back(e, c0);
  const auto rows_of = [&](const std::pair<int64_t, int64_t>& c) { return std::min(chunk, count[c.first + 1] - c.second); };
  // side by side: two threads or more, a chunk each at least, and no expert holding more than a thread's share of the
  // rows (one that does runs alone, split over the threads, instead of keeping one busy while the others wait)
  const int64_t threads = at::get_num_threads();
  // every thread takes the next chunk while there is one, largest first (the last ones taken are the short ones), with
  // scratch of its own
  const auto side_by_side = [&](const std::function<void(Scratch&, const std::pair<int64_t, int64_t>&)>& run) {
    std::vector<int64_t> order(chunks.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows_of(chunks[a]) > rows_of(chunks[b]); });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      Scratch s = scratch();
      for (int64_t j; (j = next++) < static_cast<int64_t>(order.size());) run(s, chunks[order[j]]);
    });
  };
  const bool spread = threads > 1 && static_cast<int64_t>(chunks.size()) >= threads && most * threads <= count[num_experts];
  // the register tiles: and whole experts a thread keep every thread busy to within a quarter (3 experts on 2 threads
  // would leave one idle half the time: split each GEMM over the threads instead)
  const int64_t n_chunks = static_cast<int64_t>(chunks.size()), rounds = (n_chunks + threads - 1) / threads;
  if (spread && !tiles && 4 * rounds * threads <= 5 * n_chunks &&
      count[num_experts] * hidden * static_cast<int64_t>(sizeof(float)) <= kExactRowBytes) {
    // the register tiles side by side (one parallel region a call, not two a GEMM's: the built-in model's 32-token
    // decode ran 16 regions a layer for ~40 us of products each), each held (token, slot) row's output kept in
    // float32 and added into its token's row at the end in expert order, as one thread adds them: the same bits
    // whatever the thread count
    std::vector<float> exact(count[num_experts] * hidden);
    std::vector<int64_t> at_row(x.size(0) * k, -1);  // (token, slot) -> its row in exact; rows are in expert order
    for (int64_t r = 0; r < count[num_experts]; ++r) at_row[rows[r]] = r;
    side_by_side([&](Scratch& s, const std::pair<int64_t, int64_t>& c) {
      run_chunk(s, nullptr, c.first, c.second, rows_of(c), nullptr, exact.data());
    });
    float* os = out.data_ptr<float>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t t0, int64_t t1) {
      std::vector<int64_t> held;
      for (int64_t t = t0; t < t1; ++t) {
        held.clear();
        for (int64_t j = 0; j < k; ++j)
          if (at_row[t * k + j] >= 0) held.push_back(at_row[t * k + j]);
        std::sort(held.begin(), held.end());  // expert order
        float* o = os + t * hidden;
        for (const int64_t r : held) {
          const float w = ws[rows[r]];
          const float* y = exact.data() + r * hidden;
#pragma omp simd
          for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[c];
        }
      }
    });
  } else if (spread && tiles) {
    // whichever thread is free takes the next chunk (a busy server's other threads take a core now and then: a fixed
    // split would leave one thread spinning at the end while the other finishes), and each (token, slot) row is
    // written once, so the sum over a token's slots, taken at the end in slot order, does not depend on who did what
    at::Tensor slots = at::empty({x.size(0) * k, hidden}, x.options().dtype(at::kBFloat16));
    std::vector<char> held(x.size(0) * k, 0);  // the (token, slot) rows an expert here writes
    for (const int64_t r : rows) held[r] = 1;
    side_by_side([&](Scratch& s, const std::pair<int64_t, int64_t>& c) {
      run_chunk(s, nullptr, c.first, c.second, rows_of(c), slots.data_ptr<c10::BFloat16>());
    });
    const c10::BFloat16* sp = slots.data_ptr<c10::BFloat16>();
    float* os = out.data_ptr<float>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t j = 0; j < k; ++j) {
          if (!held[t * k + j]) continue;
          const c10::BFloat16* row = sp + (t * k + j) * hidden;
          float* o = os + t * hidden;
#pragma omp simd
          for (int64_t c = 0; c < hidden; ++c) o[c] += static_cast<float>(row[c]);
        }
    });
  } else {
    Scratch s = scratch();
    for (const auto& c : chunks) run_chunk(s, out.data_ptr<float>(), c.first, c.second, rows_of(c));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_experts(const at::Tensor& x, const at::Tensor& local_ids, const at::Tensor& weights,
                                               const at::Tensor& gate_up, const at::Tensor& down,
                                               const c10::optional<at::Tensor>& gate_up_bias,
                                               const c10::optional<at::Tensor>& down_bias, c10::optional<double> swiglu_limit,
                                               double swiglu_alpha, const c10::optional<at::Tensor>& gate_up_scales,
                                               const c10::optional<at::Tensor>& down_scales, double swiglu_offset) {
  TORCH_CHECK(x.dim() == 2 && local_ids.dim() == 2 && local_ids.size(0) == x.size(0), "x must be [T, H], local_ids [T, k]");
  TORCH_CHECK(local_ids.scalar_type() == at::kLong, "local_ids must be int64");
  TORCH_CHECK(weights.sizes() == local_ids.sizes(), "weights must be [T, k] like local_ids");
  const bool mxfp4 = gate_up_scales.has_value();
  TORCH_CHECK(mxfp4 == down_scales.has_value(), "MXFP4 needs the scales of gate_up and down");
  const int64_t dims = mxfp4 ? 4 : 3;  // MXFP4 blocks: [E, rows, groups, 16]
  TORCH_CHECK(gate_up.dim() == dims && down.dim() == dims && gate_up.size(0) == down.size(0),
              mxfp4 ? "MXFP4 gate_up must be [E, 2I, H/32, 16], down [E, H, I/32, 16]" : "gate_up must be [E, 2I, H], down [E, H, I]");
  const int64_t num_tokens = x.size(0), k = local_ids.size(1), num_experts = gate_up.size(0);
  const int64_t inter = mxfp4 ? down.size(2) * 32 : down.size(2), hidden_in = mxfp4 ? gate_up.size(2) * 32 : gate_up.size(2);
  TORCH_CHECK(gate_up.size(1) == 2 * inter && hidden_in == x.size(1) && down.size(1) == x.size(1),
              "expert weights do not match: gate_up ", gate_up.sizes(), ", down ", down.sizes(), ", x ", x.sizes());
  if (mxfp4)
    TORCH_CHECK(gate_up.scalar_type() == at::kByte && down.scalar_type() == at::kByte && gate_up_scales->scalar_type() == at::kByte &&
                    down_scales->scalar_type() == at::kByte && gate_up_scales->sizes() == gate_up.sizes().slice(0, 3) &&
                    down_scales->sizes() == down.sizes().slice(0, 3),
                "MXFP4 blocks and scales must be uint8, the scales one per group of the blocks");
  if (gate_up_bias)
    TORCH_CHECK(gate_up_bias->dim() == 2 && gate_up_bias->size(0) == num_experts && gate_up_bias->size(1) == 2 * inter,
                "gate_up_bias must be [E, 2I], got ", gate_up_bias->sizes());
  if (down_bias)
    TORCH_CHECK(down_bias->dim() == 2 && down_bias->size(0) == num_experts && down_bias->size(1) == x.size(1),
                "down_bias must be [E, H], got ", down_bias->sizes());
  const auto decoded = x.scalar_type() == at::kFloat ? at::kFloat : at::kBFloat16;  // MXFP4 values are exact in either
  const ExpertMath math{gate_up_bias, down_bias, swiglu_limit, swiglu_alpha, swiglu_offset, gate_up_scales, down_scales,
                        x.scalar_type() == at::kHalf ? at::kHalf : decoded};
  const Grouped grouped = group_by_expert(local_ids, num_experts);
  const std::vector<int64_t>& count = grouped.count;
  const std::vector<int64_t>& rows = grouped.rows;
  const std::vector<int64_t>& per_expert = grouped.per_expert;
  const auto index_options = at::TensorOptions().dtype(at::kLong);
  const int64_t most = grouped.most;
  const auto dtype = x.scalar_type();
  const bool in_dtype = mxfp4 || (gate_up.scalar_type() == dtype && down.scalar_type() == dtype && gate_up.is_contiguous() && down.is_contiguous());
  // past the register tiles' float32 rows the transposed loop first: emulated bf16's tiles reach 63 rows, where its
  // experts with 17-63 rows at most ran 1.3-2.1x slower in place (V2-Lite's 64 experts at 128-512 balanced tokens);
  // on vdpbf16ps the decode path's 32 rows, 1.15-1.4x slower at 160-256 tokens
  if (most > small_linear_max_rows() && experts_take_transposed(x, gate_up, down, math))
    return {experts_transposed(x, weights, gate_up, down, grouped, k, math), at::tensor(per_expert, index_options)};
  if ((small_linear_takes(dtype, most) || experts_take_dot(dtype, most)) && in_dtype)
    return {experts_in_place(x, weights, gate_up, down, count, rows, k, most, math, inter), at::tensor(per_expert, index_options)};
  if (experts_take_tiles(dtype, most, x.size(1), inter) && in_dtype)
    return {experts_in_place(x, weights, gate_up, down, count, rows, k, most, math, inter, true), at::tensor(per_expert, index_options)};
  auto out = at::zeros({num_tokens * k, x.size(1)}, x.options());  // one row per (token, slot)
  const at::Tensor flat_weights = weights.reshape({-1});
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    at::Tensor row_index = at::from_blob(const_cast<int64_t*>(rows.data()) + count[e], {n}, index_options).clone();  // [n] (token, slot) rows
    at::Tensor xe = x.index_select(0, at::div(row_index, k, "floor"));  // [n, H]
    const auto bias = [e](const c10::optional<at::Tensor>& b) { return b ? c10::optional<at::Tensor>((*b)[e]) : c10::nullopt; };
    at::Tensor gate_and_up = small_linear(xe, math.gate_up(gate_up, e).to(x.scalar_type()), bias(gate_up_bias));  // [n, 2I]
    at::Tensor gate = gate_and_up.narrow(1, 0, inter), up = gate_and_up.narrow(1, inter, inter), act;
    if (swiglu_limit) {  // as afd/models/layers.py: clamped_swiglu, op for op
      gate = gate.clamp_max(*swiglu_limit);
      act = (up.clamp(-*swiglu_limit, *swiglu_limit) + swiglu_offset) * gate * at::sigmoid(gate * swiglu_alpha);
    } else {
      act = at::silu(gate) * up;
    }
    at::Tensor ye = small_linear(act, math.down(down, e).to(x.scalar_type()), bias(down_bias));  // [n, H], the expert's bias before its weight
    out.index_put_({row_index}, (ye * flat_weights.index_select(0, row_index).unsqueeze(1)).to(out.scalar_type()));
  }
  return {out.view({num_tokens, k, -1}).sum(1), at::tensor(per_expert, index_options)};
}
