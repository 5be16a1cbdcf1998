// Gated DeltaNet decode on the CPU: one token of each of D sequences through the gated delta rule, each
// sequence's recurrent state read and written in place in the layer's state cache.
//
// The pure-torch path (afd/models/gated_deltanet.py: recurrent_step, and the gather and scatter around it in
// GatedDeltaNet.forward) copies the D states out of the cache (state[slots]), zeroes the fresh ones (a second
// copy), decays them (a third), forms k u^T (a fourth) and adds it (a fifth), then writes them back: half a
// dozen passes over D x H x dk x dv floats, each into a new multi-MB buffer. Here each (token, head) state,
// dk x dv floats (64 KB at Qwen3.5's 128 x 128), is read once and then rewritten once in place, the second
// sweep while the first has left it in L2; during that second sweep, which leaves memory idle, the rows of
// the next state the thread will read are asked for (single thread, 32 tokens of Qwen3.5's shapes from
// memory: ~30% less time than without).
//
// Per token d and value head h, with S = state[slots[d], h] ([dk, dv], row i: key channel i) and a = exp(g):
//   sk = S^T k,  sq = S^T q          one read sweep of the old S, both sums at once
//   u  = beta (v - a sk)              (the decayed state's S^T k is a sk)
//   o  = a sq + u (k . q)             (the new S is a S + k u^T, so its S^T q is a S^T q + u (k . q))
//   S  = a S + k u^T                  one read-modify-write sweep
// A fresh token (its sequence's position 0) starts from S = 0: its slot is not read (it holds an earlier
// sequence's state, or nothing ever written), and S = k u^T is written over it.
//
// Shapes:
//   q, k    [D, H, dk] float32        normalised, q scaled by dk^-0.5, repeated to the H value heads; each
//                                     token's heads dense, tokens at any stride
//   v       [D, H, dv] float32        likewise (the layer's v is a slice of the convolved channels)
//   g, beta [D, H] float32            the log decay (<= 0) and the write strength, heads dense
//   state   [slots, H, dk, dv] float32, contiguous: the layer's state cache, updated in place
//   slots   [D] int64                 the slot of each token's sequence, distinct, in [0, slots)
//   fresh   [D] bool                  the token starts its sequence: its slot's contents are not read
//   returns [D, H, dv] float32        o
// The (token, head) pairs run in parallel (at::parallel_for); the dv channels are the vector lanes (OpenMP
// simd, no -ffast-math). A channel's sums over the dk key channels add in key order; the reference's einsum
// adds in its own order and decays the state before it multiplies, so the two agree to rounding, not bit for
// bit (tests/kernels/test_gated_deltanet.py: 1e-5 relative).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLineFloats = 64 / sizeof(float);  // a cache line

// sk += S^T k and sq += S^T q over the dk rows of one state, four rows a pass (each pass loads sk and sq once
// for four rows' FMAs; the adds of a channel stay in row order).
void read_sweep(const float* s, const float* k, const float* q, int64_t dk, int64_t dv, float* __restrict sk, float* __restrict sq) {
  std::fill(sk, sk + dv, 0.f);
  std::fill(sq, sq + dv, 0.f);
  int64_t i = 0;
  for (; i + 4 <= dk; i += 4) {
    const float* __restrict r0 = s + i * dv;
    const float* __restrict r1 = r0 + dv;
    const float* __restrict r2 = r1 + dv;
    const float* __restrict r3 = r2 + dv;
    const float k0 = k[i], k1 = k[i + 1], k2 = k[i + 2], k3 = k[i + 3];
    const float q0 = q[i], q1 = q[i + 1], q2 = q[i + 2], q3 = q[i + 3];
#pragma omp simd
    for (int64_t c = 0; c < dv; ++c) {
      float a = sk[c], b = sq[c];
      a += k0 * r0[c];
      b += q0 * r0[c];
      a += k1 * r1[c];
      b += q1 * r1[c];
      a += k2 * r2[c];
      b += q2 * r2[c];
      a += k3 * r3[c];
      b += q3 * r3[c];
      sk[c] = a;
      sq[c] = b;
    }
  }
  for (; i < dk; ++i) {
    const float* __restrict r = s + i * dv;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t c = 0; c < dv; ++c) {
      sk[c] += ki * r[c];
      sq[c] += qi * r[c];
    }
  }
}

// S = a S + k u^T in place, one row at a time (Fresh: S = k u^T, the old rows never read), asking for the rows of
// ``next`` (the state read after this one; nullptr: none) while memory would otherwise be idle.
template <bool Fresh>
void write_sweep(float* s, const float* next, const float* k, const float* u, float a, int64_t dk, int64_t dv) {
  for (int64_t i = 0; i < dk; ++i) {
    float* __restrict r = s + i * dv;
    if (next != nullptr)
      for (int64_t c = 0; c < dv; c += kLineFloats) __builtin_prefetch(next + i * dv + c, 0, 2);
    const float ki = k[i];
#pragma omp simd
    for (int64_t c = 0; c < dv; ++c) r[c] = (Fresh ? 0.f : a * r[c]) + ki * u[c];
  }
}

// One token's head: o [dv] out, s [dk, dv] updated in place. sk, sq: [dv] scratch. next: the state this thread
// reads after this one (nullptr: none, or a fresh one, not read): while the second sweep works on s from L2,
// memory would be idle, so it asks for next's rows, one for each row of s it rewrites.
void step_one(const float* q, const float* k, const float* v, float g, float beta, bool fresh, float* s, const float* next,
              int64_t dk, int64_t dv, float* __restrict o, float* __restrict sk, float* __restrict sq) {
  const float a = std::exp(g);
  float kq = 0.f;
#pragma omp simd reduction(+ : kq)
  for (int64_t i = 0; i < dk; ++i) kq += k[i] * q[i];
  if (fresh) {
    std::fill(sk, sk + dv, 0.f);
    std::fill(sq, sq + dv, 0.f);
  } else {
    read_sweep(s, k, q, dk, dv, sk, sq);
  }
  float* u = sk;  // u replaces sk channel by channel
#pragma omp simd
  for (int64_t c = 0; c < dv; ++c) {
    u[c] = beta * (v[c] - a * u[c]);
    o[c] = a * sq[c] + u[c] * kq;
  }
  if (fresh)
    write_sweep<true>(s, next, k, u, a, dk, dv);
  else
    write_sweep<false>(s, next, k, u, a, dk, dv);
}

// x [D, H, n] float32 with each token's heads dense (its rows may be apart): x's row stride.
int64_t token_stride(const at::Tensor& x, const char* name, int64_t d, int64_t h) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "gdn_decode: ", name, " must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.size(0) == d && x.size(1) == h, "gdn_decode: ", name, " must be [D=", d, ", H=", h, ", n], got ",
              x.sizes());
  TORCH_CHECK(x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == x.size(2)),
              "gdn_decode: ", name, "'s heads must be dense within each token (strides ", x.strides(), ")");
  return x.stride(0);
}

}  // namespace

at::Tensor gdn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                      const at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, &state, &slots, &fresh})
    TORCH_CHECK(t->device().is_cpu(), "gdn_decode runs on the CPU, got a tensor on ", t->device());
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              "gdn_decode: state must be a contiguous float32 [slots, H, dk, dv] (updated in place), got ", state.scalar_type(), " ",
              state.sizes());
  const int64_t num_slots = state.size(0), h = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(q.dim() == 3, "gdn_decode: q must be [D, H, dk], got ", q.sizes());
  const int64_t d = q.size(0);
  const int64_t qs = token_stride(q, "q", d, h), ks = token_stride(k, "k", d, h), vs = token_stride(v, "v", d, h);
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk, "gdn_decode: q and k must have the state's dk = ", dk, ", got ", q.size(2),
              " and ", k.size(2));
  TORCH_CHECK(v.size(2) == dv, "gdn_decode: v must have the state's dv = ", dv, ", got ", v.size(2));
  for (const at::Tensor* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == d && t->size(1) == h && (h == 1 || t->stride(1) == 1),
                "gdn_decode: g and beta must be float32 [D=", d, ", H=", h, "] with their heads dense, got ", t->scalar_type(), " ",
                t->sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == d && slots.is_contiguous(),
              "gdn_decode: slots must be a contiguous int64 [D=", d, "]");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.dim() == 1 && fresh.size(0) == d && fresh.is_contiguous(),
              "gdn_decode: fresh must be a contiguous bool [D=", d, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<char> taken(num_slots, 0);  // two tokens on one slot would write it from two threads
  for (int64_t i = 0; i < d; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "gdn_decode: token ", i, "'s slot ", sp[i], " is not in [0, ", num_slots, ")");
    TORCH_CHECK(!taken[sp[i]], "gdn_decode: slot ", sp[i], " is given to two tokens");
    taken[sp[i]] = 1;
  }
  auto out = at::empty({d, h, dv}, q.options().dtype(at::kFloat));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  const int64_t gs = g.stride(0), bs = beta.stride(0);
  const bool* fp = fresh.data_ptr<bool>();
  float* stp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, d * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * dv);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / h, j = w % h;
      const int64_t ni = (w + 1) / h, nj = (w + 1) % h;  // this thread's next (token, head)
      const float* next = w + 1 < end && !fp[ni] ? stp + (sp[ni] * h + nj) * dk * dv : nullptr;
      step_one(qp + i * qs + j * dk, kp + i * ks + j * dk, vp + i * vs + j * dv, gp[i * gs + j], bp[i * bs + j], fp[i],
               stp + (sp[i] * h + j) * dk * dv, next, dk, dv, op + w * dv, scratch.data(), scratch.data() + dv);
    }
  });
  return out;
}
