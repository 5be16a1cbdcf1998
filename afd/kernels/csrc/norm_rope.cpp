// RMSNorm and rotary embedding, one pass over a row each. Their torch forms (afd/models/layers.py: RMSNorm,
// RotaryEmbedding.apply) are 8 and ~12 small ops: at decode sizes (a few rows of a few hundred values) the
// ops' dispatch costs more than the arithmetic, and a step runs each of them a dozen times.
//
// Both keep the torch forms' dtype rules (the Hugging Face conventions): statistics and rotation in float32,
// rounded to the input dtype where the torch form rounds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = out + r * dim;
      // weight * (x * inv).to(dtype): the normalised value is rounded to T before the weight multiplies it
      for (int64_t i = 0; i < dim; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

template <typename T>
void rope_rows(const T* x, const float* cos, const float* sin, T* out, int64_t tokens, int64_t heads, int64_t dim,
               bool interleaved) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + (t * heads + h) * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < half; ++i) {
          // interleaved: pairs (x0, x1), (x2, x3), ...; halves: (x_i, x_{i + dim/2})
          const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
          const float x0 = static_cast<float>(xr[a]), x1 = static_cast<float>(xr[b]);
          o[a] = static_cast<T>(x0 * c[i] - x1 * s[i]);
          o[b] = static_cast<T>(x0 * s[i] + x1 * c[i]);
        }
      }
    }
  });
}

}  // namespace

// x [..., D] (contiguous), weight [D] of x's dtype -> [..., D]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: x and weight must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight must be [", x.size(-1), "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype ", weight.scalar_type(), " != x dtype ", x.scalar_type());
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim, eps);
  });
  return out;
}

// x [T, heads, D] (contiguous), cos and sin [T, D / 2] float32 -> rotated x, x's dtype
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), "rotary: x must be a contiguous [T, heads, D]");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary: the rotated dimension must be even, got ", x.size(2));
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos and sin must be contiguous float32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary: cos and sin must be [", x.size(0), ", ", x.size(2) / 2, "], got ", cos.sizes());
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<scalar_t>(), x.size(0),
                        x.size(1), x.size(2), interleaved);
  });
  return out;
}
