// float32 linears of a few dozen rows, computed transposed: y^T [N, M] = W [N, K] . x^T [K, M], W's values broadcast
// (and bfloat16 ones where the CPU emulates bf16: W widened a block at a time; and bf16 on vdpbf16ps, below).
//
// The routed experts of a prefill step get a few dozen rows each (V2-Lite at 512 tokens: ~48), and so does every
// linear of a small model's decode step at a few dozen sequences (the built-in model's K of 128-768). There MKL's GEMM
// runs at half its peak on W [N, K] (the weight as nn.Linear keeps it): to multiply it as the B operand it packs and
// transposes W on every call, and a few dozen rows cannot pay for that (x @ W^T at 48 rows: 86-93 GFLOP/s a thread,
// the same product with W stored [K, N]: 148, the 2-thread peak 338). small_linear's register tiles read W in place
// but take x's rows in tiles that reread all of x from L2 for every two W rows, which bounds them at ~115.
//
// Transposed, W needs no packing: a tile of NR rows of W against V vectors of x^T's columns keeps NR x V
// accumulators; each step of k loads V vectors of x^T's row k (x^T lives in L2: K x M floats) and broadcasts one
// value from each of W's NR rows (each row read front to back, once per call: NR streams). V x NR FMAs for V + NR
// loads, no horizontal sums. Measured on the 2-core AVX-512 VM without
// AVX512-BF16 (V2-Lite's 2048 -> 2816 and 1408 -> 2048, 2 threads, W in cache): 1.0-1.9x MKL at 24-96 rows, up to
// 0.9x of the fp32 peak; in the experts' loop, where W comes from memory, 1.2x (the next tile's W prefetched).
//
// x^T's columns are padded to whole vectors with zeros (their outputs are computed and not read). Up to 96 columns
// are one panel (below), so W is read once per call.
//
// On a CPU with bf16 dot products (AVX512-BF16), bfloat16 W against bfloat16 x^T runs on vdpbf16ps: x^T is kept as
// pairs of rows, [K/2, ld] 32-bit elements (x^T[2j][c], x^T[2j+1][c]), and each step broadcasts a pair of one W row's
// values, W[n][2j], W[n][2j+1] (adjacent in memory: one 32-bit load), so one instruction does two steps of k on 16
// columns: half the instructions of float32's for the same tile. Sums in float32 as before.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"
#include "small_linear.h"

#if defined(__AVX512BF16__) && defined(AFD_SIMD_AVX512)
#define AFD_BROADCAST_DOT 1  // bf16 W against pairs of x^T's rows on vdpbf16ps (built for a CPU that has it)
#endif

#if defined(AFD_SIMD)

namespace {

using afd_simd::kLanes;
using afd_simd::vfloat;
namespace simd = afd_simd;

// A panel's vectors of columns (V, up to kVMax) and a tile's rows of W (NR), for 32 registers (AVX-512) or 16 (AVX2):
// V x NR accumulators + V vectors of x^T + one broadcast. Every panel width takes the most rows its registers hold
// (AVX-512: 2 x 9, 3 x 9, 4 x 6, 5 x 5, 6 x 4), so up to 96 columns are one panel and W is read once, into
// registers, per call: V2-Lite's 2816 x 2048 at 49-64 rows took 1.55x the time of 33-48 as two panels of 2 x 9 (W's
// tile read twice, each broadcast feeding two FMAs), where the work is 1.33x.
constexpr int kVMax = afd_simd::kRegisters >= 32 ? 6 : 3;
constexpr int kNRMax = 9;  // W's rows streamed at once (and prefetched ahead): 14 at 2 vectors was slower (1.2-1.4x)
constexpr int nr_for(int v) { return std::min(kNRMax, (afd_simd::kRegisters - 1 - v) / v); }
static_assert(nr_for(kVMax) >= 1, "a panel of kVMax vectors that leaves no register for W");
constexpr int64_t kBlock = 256;            // steps of k an accumulator sums before it is added into the tile's sums
// past 96 rows MKL's packing pays for itself (V2-Lite's shapes: 0.9-1.1x at 128). With AVX2's 16 registers (panels of
// at most 3 x 4) it was 0.76-0.98x MKL at 48-96 rows (the same VM with MKL held to AVX2): built there, not taken.
constexpr int64_t kMaxRows = afd_simd::kRegisters >= 32 ? 96 : 0;
constexpr int64_t kMinK = 1024;            // bfloat16: shorter rows do not pay for x^T and y^T (on vdpbf16ps, K = 192-768,
                                           // W from memory: 0.78-1.63x oneDNN at 17-96 rows, no clear side)
// float32 rows of K from kMinShortK up to kMinK, up to kMaxShortKRows. With W in cache MKL is ahead at these K (the
// built-in model's K = 256: 0.75-0.95x MKL), but a decode step reads every W from memory, and MKL then packs W per call
// as it first reads it: with W cycled over 64 MB (afd bench kernels, 2 threads, AMD EPYC) this ran 1.06-1.97x MKL at
// 24-64 rows of K = 128-768 (17 rows: 0.95-1.78x) and 0.85-1.14x at 96; the built-in model's decode step at 32 and 64
// sequences 1.2-1.7x.
constexpr int64_t kMinShortK = 128;
constexpr int64_t kMaxShortKRows = std::min<int64_t>(64, kMaxRows);
constexpr int64_t kMinPairRows = 21;      // bf16 linears on vdpbf16ps (below): fewer rows keep oneDNN; 21 starts a
                                          // linear_rows_bucket (21-24), so a bucket is wholly ours or oneDNN's
constexpr int64_t kMaxXtBytes = 1 << 20;   // x^T stays in L2 (half of a 2 MB one) while W streams past it

// y^T's rows [0, NR) of its columns [0, cols) = W rows [0, NR) . x^T's columns [0, cols): V x NR accumulators, each
// summing a block of kBlock steps of k and then added into the tile's sums (one accumulator over the whole of K
// would add K products in a row: at K = 12,000 ten times MKL's error), then written out, y^T's row r and column c at
// y[r * rs + c * cs] (y [M, N]: rs 1, cs N; y^T [N, ld] as it is: rs ld, cs 1; a few hundred stores against
// NR x V x K FMAs).
//
// A bfloat16 W (T) against float32 x^T (X): each block of its NR rows is widened to float32 in L1 first (16 values a
// load), and the block's products read the widened copy: W's bytes from memory halve and the inner loop stays
// float32's. Against bf16 pairs of x^T (X = Pair: vdpbf16ps, above) W is read as it is, a pair of values a step.
struct Pair {  // two bfloat16 values of x^T's rows 2j and 2j + 1 in one 32-bit element
  uint32_t bits;
};

template <int NR, int V, typename T, typename X>
inline void tile(const T* w, int64_t k_len, const X* xt, int64_t ld, float* y, int64_t rs, int64_t cs, int64_t cols) {
  constexpr bool kPairs = std::is_same_v<X, Pair>;
  constexpr bool kWiden = !std::is_same_v<T, float> && !kPairs;
  alignas(64) float sums[NR][V * kLanes] = {};
  alignas(64) float widened[kWiden ? NR * kBlock : 1];
  for (int64_t k0 = 0; k0 < k_len; k0 += kBlock) {
    const int64_t k1 = std::min(k_len, k0 + kBlock);
    const float* wb;  // W's rows from this block's first step: wb[r * wld + (k - k0)] for k in [k0, k1)
    int64_t wld;
    if constexpr (kPairs) {
      wb = nullptr, wld = 0;
    } else if constexpr (kWiden) {
      for (int r = 0; r < NR; ++r) {
        const T* src = w + r * k_len + k0;
        float* dst = widened + r * kBlock;
        int64_t j = 0;
        for (; j + kLanes <= k1 - k0; j += kLanes) simd::store(dst + j, simd::load(src + j));
        for (; j < k1 - k0; ++j) dst[j] = static_cast<float>(src[j]);
      }
      wb = widened, wld = kBlock;
    } else {
      wb = w + k0, wld = k_len;
    }
    vfloat acc[NR][V];
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < V; ++v) acc[r][v] = simd::zero();
    if constexpr (kPairs) {
#if defined(AFD_BROADCAST_DOT)
      for (int64_t k = k0; k < k1; k += 2) {  // k_len even: whole pairs
        if ((k & 31) == 0)  // the next tile's W rows into L2 (a cache line of bf16 every 32 steps)
          for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * k_len + k), _MM_HINT_T1);
        __m512i xv[V];
        for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_si512(xt + (k / 2) * ld + v * kLanes);
        for (int r = 0; r < NR; ++r) {
          uint32_t pair;
          std::memcpy(&pair, w + r * k_len + k, sizeof(pair));
          const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
          for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b, (__m512bh)xv[v]);
        }
      }
#endif
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        if ((k & 15) == 0)  // the next tile's W rows into L2 while this one computes: W comes from memory (an expert's once a step)
          for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * k_len + k), _MM_HINT_T1);
        vfloat xv[V];
        for (int v = 0; v < V; ++v) xv[v] = simd::load(xt + k * ld + v * kLanes);
        for (int r = 0; r < NR; ++r) {
          const vfloat b = simd::set1(wb[r * wld + (k - k0)]);
          for (int v = 0; v < V; ++v) acc[r][v] = simd::fmadd(b, xv[v], acc[r][v]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int v = 0; v < V; ++v) simd::store(sums[r] + v * kLanes, simd::add(simd::load(sums[r] + v * kLanes), acc[r][v]));
  }
  if (cs == 1) {  // y^T as it is: each row's columns in a row
    for (int r = 0; r < NR; ++r)
      for (int64_t c = 0; c < cols; ++c) y[r * rs + c] = sums[r][c];
  } else {  // y: each column's NR values side by side
    for (int64_t c = 0; c < cols; ++c)
      for (int r = 0; r < NR; ++r) y[r * rs + c * cs] = sums[r][c];
  }
}

// W's rows [n0, n0 + rows) (a whole tile, or the last rows one at a time) against one panel of x^T's columns.
template <int V, typename T, typename X>
inline void panel(const T* w, int64_t n0, int64_t rows, int64_t k_len, const X* xt, int64_t ld, float* y, int64_t rs,
                  int64_t cs, int64_t cols) {
  constexpr int NR = nr_for(V);
  if (rows == NR) return tile<NR, V>(w + n0 * k_len, k_len, xt, ld, y + n0 * rs, rs, cs, cols);
  for (int64_t n = n0; n < n0 + rows; ++n) tile<1, V>(w + n * k_len, k_len, xt, ld, y + n * rs, rs, cs, cols);
}

// One panel of V vectors of x^T's columns (from c0, cols of them read) against all of W, split over the threads by
// tiles of W's rows.
template <int V, typename T, typename X>
void panel_product(const T* w, int64_t n_len, int64_t k_len, const X* xt, int64_t ld, float* y, int64_t rs, int64_t cs,
                   int64_t cols) {
  constexpr int NR = nr_for(V);
  at::parallel_for(0, (n_len + NR - 1) / NR, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR;
      panel<V>(w, n0, std::min<int64_t>(NR, n_len - n0), k_len, xt, ld, y, rs, cs, cols);
    }
  });
}

// panel_product<v> for a width v of 1 to kVMax vectors known at run time
template <int V, typename T, typename X>
void of_width(int64_t v, const T* w, int64_t n_len, int64_t k_len, const X* xt, int64_t ld, float* y, int64_t rs, int64_t cs,
              int64_t cols) {
  if (v == V) return panel_product<V>(w, n_len, k_len, xt, ld, y, rs, cs, cols);
  if constexpr (V < kVMax) return of_width<V + 1>(v, w, n_len, k_len, xt, ld, y, rs, cs, cols);
  TORCH_CHECK(false, "broadcast_linear: a panel of ", v, " vectors");
}

// y^T = W [n_len, K] . x^T [K, ld] over x^T's columns [0, cols), y^T's row n and column c at y[n * rs + c * cs]. Up to
// kVMax vectors of columns (AVX-512: 96, all that the experts' loop and broadcast_linear's own dispatch give it) are
// one panel; more (AVX2 builds, or broadcast_linear called directly past 96 rows) go in panels of vectors spread
// evenly, W read once per panel.
template <typename T, typename X>
void product(const T* w, int64_t n_len, int64_t k_len, const X* xt, int64_t ld, int64_t cols, float* y, int64_t rs,
             int64_t cs) {
  const int64_t vectors = ld / kLanes, panels = (vectors + kVMax - 1) / kVMax;
  for (int64_t p = 0, c0 = 0; p < panels; ++p) {
    const int64_t v = vectors / panels + (p < vectors % panels ? 1 : 0), panel_cols = std::min(v * kLanes, cols - c0);
    const X* xp = xt + c0;
    float* yp = y + c0 * cs;
    of_width<1>(v, w, n_len, k_len, xp, ld, yp, rs, cs, panel_cols);
    c0 += v * kLanes;
  }
}

template <typename T, typename X>
void gemm_t(const T* w, int64_t n_len, int64_t k_len, const X* xt, int64_t ld, float* yt) {
  constexpr auto dtype = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(ld % kLanes == 0 && ld <= broadcast_gemm_max_cols(dtype, k_len), "broadcast_gemm_t: x^T [", k_len, ", ", ld, "]");
  product(w, n_len, k_len, xt, ld, ld, yt, ld, 1);
}

#if defined(AFD_BROADCAST_DOT)
constexpr bool kPairsBuilt = true;
#else
constexpr bool kPairsBuilt = false;
#endif

}  // namespace

int64_t broadcast_gemm_max_cols(at::ScalarType dtype, int64_t k_len) {
  const int64_t most = k_len >= kMinK ? kMaxRows : dtype == at::kFloat && k_len >= kMinShortK ? kMaxShortKRows : 0;
  return most == 0 ? 0 : std::min(most, kMaxXtBytes / (k_len * int64_t{sizeof(float)}) / kLanes * kLanes);
}

void broadcast_gemm_t(const float* w, int64_t n_len, int64_t k_len, const float* xt, int64_t ld, float* yt) {
  gemm_t(w, n_len, k_len, xt, ld, yt);
}

void broadcast_gemm_t(const c10::BFloat16* w, int64_t n_len, int64_t k_len, const float* xt, int64_t ld, float* yt) {
  gemm_t(w, n_len, k_len, xt, ld, yt);
}

// bf16 on vdpbf16ps here, not AMX-BF16's tiles (which take bf16 linears and experts themselves where the OS grants them)
bool broadcast_gemm_pairs() { return kPairsBuilt && !amx_bf16_usable(); }

void broadcast_gemm_t_pairs(const c10::BFloat16* w, int64_t n_len, int64_t k_len, const uint32_t* xt2, int64_t ld, float* yt) {
  TORCH_CHECK(broadcast_gemm_pairs() && k_len % 2 == 0, "broadcast_gemm_t_pairs: K ", k_len, " where bf16 dot products ",
              broadcast_gemm_pairs() ? "run" : "are not built or AMX-BF16 takes bf16");
  static_assert(sizeof(Pair) == sizeof(uint32_t), "a pair of bfloat16 values in 32 bits");
  gemm_t(w, n_len, k_len, reinterpret_cast<const Pair*>(xt2), ld, yt);
}

bool broadcast_linear_takes(at::ScalarType dtype, int64_t rows, int64_t k_len) {
  const int64_t ld = (rows + kLanes - 1) / kLanes * kLanes;
  // bfloat16 where the CPU has neither bf16 dot products nor AMX-BF16 (bf16 emulated): W widened in L1 a block at a
  // time, 17-96 rows of V2-Lite's 2048 -> 2816 with W from memory 1.2-2.1x the register tiles (to 63 rows) and W
  // widened for the BLAS (from 64); on vdpbf16ps from 21 rows (17-20 were 0.90-1.14x oneDNN on V2-Lite's shapes, two
  // vectors of columns computed for them; 22 rows 1.00-1.17x, 24-64 rows 1.08-1.39x)
  const bool bf16 = dtype == at::kBFloat16 && (bf16_emulated() || (broadcast_gemm_pairs() && k_len % 2 == 0 && rows >= kMinPairRows));
  return (dtype == at::kFloat || bf16) && rows > small_linear_max_rows() && ld <= broadcast_gemm_max_cols(dtype, k_len);
}

int64_t broadcast_linear_max_rows() { return kMaxRows; }

int64_t broadcast_linear_min_pair_rows() { return broadcast_gemm_pairs() ? kMinPairRows : 0; }

at::Tensor broadcast_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "broadcast_linear: x [M, K] and weight [N, K], got ",
              x.sizes(), " and ", weight.sizes());
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && (bf16 || x.scalar_type() == at::kFloat) && weight.is_contiguous() &&
                  x.device().is_cpu() && weight.device().is_cpu(),
              "broadcast_linear: float32 or bfloat16 x and a contiguous weight of its dtype, on the CPU");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == weight.size(0)), "broadcast_linear: bias [N]");
  const c10::NoGradGuard no_grad;
  const int64_t rows = x.size(0), k_len = x.size(1), n_len = weight.size(0);
  const int64_t ld = (rows + kLanes - 1) / kLanes * kLanes;  // x^T's columns, whole vectors (the padding zeros)
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor out = at::empty({rows, n_len}, f32);
  if (bf16 && broadcast_gemm_pairs() && k_len % 2 == 0) {  // on vdpbf16ps: x's rows as 32-bit pairs, transposed, are x^T's pairs
    at::Tensor xt2 = at::zeros({k_len / 2, ld}, x.options().dtype(at::kInt));
    xt2.narrow(1, 0, rows).copy_(x.contiguous().view(at::kInt).t());
    product(weight.data_ptr<c10::BFloat16>(), n_len, k_len, reinterpret_cast<const Pair*>(xt2.data_ptr<int32_t>()), ld, rows,
            out.data_ptr<float>(), 1, n_len);
    if (bias.has_value()) out.add_(bias->to(at::kFloat));
    return out.to(at::kBFloat16);
  }
  at::Tensor xt = at::zeros({k_len, ld}, f32);
  xt.narrow(1, 0, rows).copy_(x.t());
  if (bf16)
    product(weight.data_ptr<c10::BFloat16>(), n_len, k_len, xt.data_ptr<float>(), ld, rows, out.data_ptr<float>(), 1, n_len);
  else
    product(weight.data_ptr<float>(), n_len, k_len, xt.data_ptr<float>(), ld, rows, out.data_ptr<float>(), 1, n_len);
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return bf16 ? out.to(at::kBFloat16) : out;
}

#else

bool broadcast_linear_takes(at::ScalarType, int64_t, int64_t) { return false; }

int64_t broadcast_linear_max_rows() { return 0; }

int64_t broadcast_linear_min_pair_rows() { return 0; }

int64_t broadcast_gemm_max_cols(at::ScalarType, int64_t) { return 0; }

void broadcast_gemm_t(const float*, int64_t, int64_t, const float*, int64_t, float*) {
  TORCH_CHECK(false, "broadcast_gemm_t: built without AVX-512 or AVX2");
}

void broadcast_gemm_t(const c10::BFloat16*, int64_t, int64_t, const float*, int64_t, float*) {
  TORCH_CHECK(false, "broadcast_gemm_t: built without AVX-512 or AVX2");
}

bool broadcast_gemm_pairs() { return false; }

void broadcast_gemm_t_pairs(const c10::BFloat16*, int64_t, int64_t, const uint32_t*, int64_t, float*) {
  TORCH_CHECK(false, "broadcast_gemm_t_pairs: built without AVX-512");
}

at::Tensor broadcast_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "broadcast_linear: built without AVX-512 or AVX2");
}

#endif
