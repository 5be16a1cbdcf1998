// DeepSeek Sparse Attention's indexer at decode, read in place from the paged index-key cache with the decode
// kernel's score tiles (score_tiles.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "score_tiles.h"

using afd_attention::kAheadRows;
using afd_attention::score_block;

// DeepSeek Sparse Attention's lightning indexer at decode: each token's top-k context positions, scored in place
// from the paged index-key cache (afd/models/sparse_attention.py says what the scores are).
//
//   q            [D, Hi, Di] float32    the tokens' index queries (rotated)
//   weights      [D, Hi] float32        per head, with every positive scale folded in
//   index_cache  [slots, Di]            the cached index keys (float32, bfloat16 or float16)
//   block_tables [D, W], context_lens [D] int64   as paged_decode_attention's
//   returns      ([D, k] int64 cache slots, valid ones first; [D] int64 how many are valid), k = min(topk, max len)
//
// score(j) = sum_h weights[h] * relu(<q_h, key_j>). The scores of a block are the decode kernel's score_block (its
// register tiles); the blocks of every token are scored in parallel, then each token's top-k is a partial sort
// (ties: the lower position first).
std::tuple<at::Tensor, at::Tensor> dsa_index_topk(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& index_cache,
                                                 const at::Tensor& block_tables, const at::Tensor& context_lens,
                                                 int64_t block_size, int64_t topk) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be a contiguous float32 [D, Hi, Di]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == q.size(0) && weights.size(1) == q.size(1),
              "weights must be a contiguous float32 [D, Hi]");
  TORCH_CHECK(index_cache.dim() == 2 && index_cache.is_contiguous() && index_cache.size(1) == q.size(2),
              "index_cache must be a contiguous [slots, Di]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  context_lens.is_contiguous() && block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "block_tables [D, W] and context_lens [D] must be contiguous int64");
  TORCH_CHECK(topk >= 1 && block_size >= 1 && index_cache.size(0) % block_size == 0, "topk and block_size must be >= 1");
  const int64_t d = q.size(0), heads = q.size(1), dim = q.size(2), width = block_tables.size(1);
  const int64_t num_blocks = index_cache.size(0) / block_size;
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  int64_t longest = 0;
  std::vector<int64_t> offset(d + 1, 0), block_offset(d + 1, 0);  // each token's scores, and its blocks, side by side
  for (int64_t i = 0; i < d; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width * block_size, "decode token ", i, ": context length ", lens[i], " out of range");
    const int64_t nb = (lens[i] + block_size - 1) / block_size;
    for (int64_t b = 0; b < nb; ++b)
      TORCH_CHECK(tables[i * width + b] >= 0 && tables[i * width + b] < num_blocks, "decode token ", i, ": block outside the cache");
    longest = std::max(longest, lens[i]);
    offset[i + 1] = offset[i] + lens[i];
    block_offset[i + 1] = block_offset[i] + nb;
  }
  const int64_t k = std::min(topk, longest);
  std::vector<float> scores(offset[d]);
  const float* qp = q.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, index_cache.scalar_type(), "dsa_index_topk", [&] {
    const scalar_t* cache = index_cache.data_ptr<scalar_t>();
    at::parallel_for(0, block_offset[d], 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tile(heads * block_size);
      std::vector<const scalar_t*> rows(block_size + kAheadRows, nullptr);
      int64_t i = std::upper_bound(block_offset.begin(), block_offset.end(), begin) - block_offset.begin() - 1;
      for (int64_t w = begin; w < end; ++w) {
        while (w >= block_offset[i + 1]) ++i;
        const int64_t b = w - block_offset[i], start = b * block_size, n = std::min(block_size, lens[i] - start);
        const int64_t base = tables[i * width + b] * block_size;
        for (int64_t j = 0; j < n; ++j) rows[j] = cache + (base + j) * dim;
        for (int64_t a = 0; a < kAheadRows; ++a) rows[n + a] = nullptr;
        score_block<scalar_t>(qp + i * heads * dim, heads, dim, rows.data(), n, 1.f, tile.data(), block_size);
        float* out = scores.data() + offset[i] + start;
        for (int64_t j = 0; j < n; ++j) {
          float s = 0.f;
          for (int64_t h = 0; h < heads; ++h) s += wp[i * heads + h] * std::max(tile[h * block_size + j], 0.f);
          out[j] = s;
        }
      }
    });
  });
  auto slots = at::zeros({d, k}, at::TensorOptions().dtype(at::kLong));
  auto valid = at::empty({d}, at::TensorOptions().dtype(at::kLong));
  int64_t* sp = slots.data_ptr<int64_t>();
  int64_t* vp = valid.data_ptr<int64_t>();
  at::parallel_for(0, d, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    for (int64_t i = begin; i < end; ++i) {
      const float* s = scores.data() + offset[i];
      const int64_t n = lens[i], take = std::min(k, n);
      order.resize(n);
      for (int64_t j = 0; j < n; ++j) order[j] = j;
      const auto better = [s](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
      std::partial_sort(order.begin(), order.begin() + take, order.end(), better);
      for (int64_t j = 0; j < take; ++j)
        sp[i * k + j] = tables[i * width + order[j] / block_size] * block_size + order[j] % block_size;
      vp[i] = take;
    }
  });
  return {slots, valid};
}
