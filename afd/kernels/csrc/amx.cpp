// GEMMs on AMX tiles (Sapphire Rapids and later), the weight read as it lies ([N, K], nn.Linear's layout), with no
// packed copy of it, up to 256 rows (int8) or 512 (bf16; small_linear gives it 128, moe_experts' loop chunks of 512):
//
// * int8: acc = q W^T, exact (TDPBSSD: signed x signed into int32; no bias trick, no row sums);
// * bfloat16: acc = x W^T in float32 (TDPBF16PS: products of bf16 pairs summed in float32, as oneDNN's AMX kernels
//   compute torch's bf16 linear here; denormal inputs read as zero).
//
// A tile is 16 rows of 64 bytes: 64 int8 or 32 bf16 values of K. The product C[i][j] += sum_r sum_b A[i][g r + b]
// B[r][g j + b] (g = 4 int8 or 2 bf16 values, one 4-byte group) takes A = 16 rows of W and 64 bytes of their K (one
// strided tile load, no reordering); B must hold x's 16 rows' same 64 bytes, one 4-byte group of a row side by side
// per tile row: x is repacked so once per call (it is the small operand at any size that matters), and C is
// (x W^T)^T, written back transposed. The repacking moves 4-byte groups whatever the type: one routine serves both.
//
// Work is split over torch's threads by blocks of 32 W rows (two A tiles); each block meets every 16- or 32-row
// block of x (256 x K int8 or 512 x K bf16 values packed at most: in L2) while it is in L1/L2, so W is read from memory once per call.
// Tile registers: 2 A, 1-2 B and 2-4 C (at most 8). Where the tiles cannot run (not compiled for this CPU, the OS
// refuses the tile state, K not a multiple of a tile row, more than 256 rows, 512 for bf16), the entry points
// return false and the caller takes its other path; W rows past the last whole block of 32 run as one more block,
// zero-padded.

#include "int8_linear.h"
#include "small_linear.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__linux__) && (defined(__AMX_INT8__) || defined(__AMX_BF16__))
#define AFD_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(AFD_AMX)
namespace {

constexpr int kTileRows = 16, kTileBytes = 64;  // a tile: 16 rows of 64 bytes
// int8, measured against torch._int_mm (weights from memory, 2816 x 2048 and 2048 x 1408): 1.1-1.5x at 8-128 rows,
// even at 512, 0.7-0.9x at 2048 (these tiles reach ~30 % of AMX's peak; oneDNN's on a prepacked weight 2.5x more)
constexpr int64_t kMaxRows = 256;
// bfloat16, against torch's bf16 linear (oneDNN on AMX, W reordered per call), the same shapes and 3072 x 2048, weights
// from memory: 1.7-2.0x at 8-16 rows, 1.4-1.8x at 48, 1.0-1.3x at 128, 0.95-1.0x at 256
constexpr int64_t kMaxBf16Rows = 128;
// a GEMM's rows at once for moe_experts' loop (an expert's rows of a prefill, in chunks of this many): W read once
// for all of them, x's packed rows (512 x K bf16) re-read from L2 for each block of W
constexpr int64_t kMaxBf16GemmRows = 512;
constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for the AMX tile state (Linux >= 5.16)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (A tile a, B tile b -> tmm a + 2b); tmm4-5: A (W); tmm6-7: B (x, repacked)
TileConfig tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = kTileBytes, cfg.rows[t] = kTileRows;
  return cfg;
}

// x [rows, K bytes] as B tiles: block of 16 rows tb, 64-byte chunk kc -> 1 KB at ((tb * chunks + kc) * 16 + r) * 64,
// holding row (tb * 16 + j)'s bytes 64 kc + 4 r .. + 3 at 4 j; rows past the end are zeros.
std::vector<char> pack_rows(const char* x, int64_t rows, int64_t k_bytes) {
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows, chunks = k_bytes / kTileBytes;
  std::vector<char> packed(blocks * chunks * kTileRows * kTileBytes, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t tb = b0; tb < b1; ++tb)
      for (int64_t j = 0; j < std::min<int64_t>(kTileRows, rows - tb * kTileRows); ++j) {
        const char* row = x + (tb * kTileRows + j) * k_bytes;
        for (int64_t kc = 0; kc < chunks; ++kc) {
          char* tile = packed.data() + (tb * chunks + kc) * kTileRows * kTileBytes;
          for (int r = 0; r < kTileRows; ++r) std::memcpy(tile + r * kTileBytes + 4 * j, row + kc * kTileBytes + 4 * r, 4);
        }
      }
  });
  return packed;
}

// C tiles of W rows n0.. (16 a tile) x x rows m0.. (16 a tile), stored, then written to out [rows, N] transposed.
template <typename Acc>
void write_back(const Acc (&c)[kTileRows][kTileRows], int64_t n0, int64_t m0, int64_t rows, int64_t n_len, Acc* out) {
  for (int64_t j = 0; j < std::min<int64_t>(kTileRows, rows - m0); ++j)
    for (int i = 0; i < kTileRows; ++i) out[(m0 + j) * n_len + n0 + i] = c[i][j];
}

// The accumulator of In's tile product.
template <typename In>
struct Dot;
#if defined(__AMX_INT8__)
template <>
struct Dot<int8_t> {
  using Acc = int32_t;
};
#endif
#if defined(__AMX_BF16__)
template <>
struct Dot<c10::BFloat16> {
  using Acc = float;
};
#endif

// In's tile product into C tile c from A tile a and B tile b: the intrinsics are macros that paste their literal
// arguments into register names, so a macro, not a template, chooses between them.
#if defined(__AMX_INT8__)
#define AFD_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#else
#define AFD_DPBSSD(c, a, b)
#endif
#if defined(__AMX_BF16__)
#define AFD_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#else
#define AFD_DPBF16PS(c, a, b)
#endif
#define AFD_DOT(In, c, a, b)                   \
  if constexpr (std::is_same_v<In, int8_t>) {  \
    AFD_DPBSSD(c, a, b);                       \
  } else {                                     \
    AFD_DPBF16PS(c, a, b);                     \
  }

// One block of 32 W rows against x's rows, B tiles of x taken MB (1 or 2) at a time.
template <typename In, int MB>
void block(const In* w, int64_t k_len, const char* packed, int64_t rows, int64_t n0, int64_t n_len, typename Dot<In>::Acc* out) {
  using Acc = typename Dot<In>::Acc;
  const int64_t k_bytes = k_len * static_cast<int64_t>(sizeof(In));
  const int64_t chunks = k_bytes / kTileBytes, row_blocks = (rows + kTileRows - 1) / kTileRows;
  const char* w0 = reinterpret_cast<const char*>(w + n0 * k_len);
  const char* w1 = w0 + kTileRows * k_bytes;
  alignas(64) Acc c[kTileRows][kTileRows];
  for (int64_t tb = 0; tb < row_blocks; tb += MB) {
    const bool two = MB == 2 && tb + 1 < row_blocks;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const char* b0 = packed + tb * chunks * kTileRows * kTileBytes;
    const char* b1 = b0 + chunks * kTileRows * kTileBytes;
    for (int64_t kc = 0; kc < chunks; ++kc) {
      _tile_loadd(4, w0 + kc * kTileBytes, k_bytes);
      _tile_loadd(5, w1 + kc * kTileBytes, k_bytes);
      _tile_loadd(6, b0 + kc * kTileRows * kTileBytes, kTileBytes);
      AFD_DOT(In, 0, 4, 6)
      AFD_DOT(In, 1, 5, 6)
      if (two) {
        _tile_loadd(7, b1 + kc * kTileRows * kTileBytes, kTileBytes);
        AFD_DOT(In, 2, 4, 7)
        AFD_DOT(In, 3, 5, 7)
      }
    }
    const int64_t m0 = tb * kTileRows;
    _tile_stored(0, c, kTileRows * 4);  // the tile macros are statements (inline asm)
    write_back(c, n0, m0, rows, n_len, out);
    _tile_stored(1, c, kTileRows * 4);
    write_back(c, n0 + kTileRows, m0, rows, n_len, out);
    if (two) {
      _tile_stored(2, c, kTileRows * 4);
      write_back(c, n0, m0 + kTileRows, rows, n_len, out);
      _tile_stored(3, c, kTileRows * 4);
      write_back(c, n0 + kTileRows, m0 + kTileRows, rows, n_len, out);
    }
  }
}

bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// out [rows, N] = x [rows, K] . w [N, K]^T in Acc, both contiguous; false where the tiles do not take the call.
template <typename In>
bool gemm(const In* x, int64_t rows, int64_t k_len, const In* w, int64_t n_len, typename Dot<In>::Acc* out) {
  using Acc = typename Dot<In>::Acc;
  const int64_t k_bytes = k_len * static_cast<int64_t>(sizeof(In));
  const int64_t blocks = n_len / (2 * kTileRows);
  const int64_t max_rows = std::is_same_v<In, int8_t> ? kMaxRows : kMaxBf16GemmRows;
  if (rows < 1 || rows > max_rows || blocks == 0 || k_bytes % kTileBytes != 0 || !amx_usable()) return false;
  const std::vector<char> packed = pack_rows(reinterpret_cast<const char*>(x), rows, k_bytes);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (2 * kTileRows * k_bytes));  // >= 64 KB of W a task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const TileConfig cfg = tile_config();  // per thread: the tile state is a thread's
    _tile_loadconfig(&cfg);
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (rows > kTileRows) block<In, 2>(w, k_len, packed.data(), rows, nb * 2 * kTileRows, n_len, out);
      else block<In, 1>(w, k_len, packed.data(), rows, nb * 2 * kTileRows, n_len, out);
    }
    _tile_release();
  });
  const int64_t done = blocks * 2 * kTileRows, tail = n_len - done;
  if (tail > 0) {  // the last W rows, fewer than two tiles: a block of them zero-padded to two (a scalar loop here had
                   // made a 32 x 256 . 80 x 256 bf16 product 7x slower than a 96-row one)
    std::vector<In> w_pad(2 * kTileRows * k_len, In(0));
    std::memcpy(w_pad.data(), w + done * k_len, tail * k_len * sizeof(In));
    std::vector<Acc> out_pad(rows * 2 * kTileRows);
    const TileConfig cfg = tile_config();
    _tile_loadconfig(&cfg);
    if (rows > kTileRows) block<In, 2>(w_pad.data(), k_len, packed.data(), rows, 0, 2 * kTileRows, out_pad.data());
    else block<In, 1>(w_pad.data(), k_len, packed.data(), rows, 0, 2 * kTileRows, out_pad.data());
    _tile_release();
    for (int64_t m = 0; m < rows; ++m) std::memcpy(out + m * n_len + done, out_pad.data() + m * 2 * kTileRows, tail * sizeof(Acc));
  }
  return true;
}

}  // namespace
#endif

bool amx_int8_usable() {
#if defined(AFD_AMX) && defined(__AMX_INT8__)
  return amx_usable();
#else
  return false;
#endif
}

bool int8_gemm_amx(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, int64_t n_len, int32_t* out) {
#if defined(AFD_AMX) && defined(__AMX_INT8__)
  return gemm<int8_t>(q, rows, k_len, w, n_len, out);
#else
  return false;
#endif
}

bool amx_bf16_usable() {
#if defined(AFD_AMX) && defined(__AMX_BF16__)
  return amx_usable();
#else
  return false;
#endif
}

int64_t amx_bf16_max_rows() {
#if defined(AFD_AMX)
  return kMaxBf16Rows;
#else
  return 0;
#endif
}

int64_t amx_bf16_gemm_max_rows() {
#if defined(AFD_AMX)
  return kMaxBf16GemmRows;
#else
  return 0;
#endif
}

bool bf16_gemm_amx(const c10::BFloat16* x, int64_t rows, int64_t k_len, const c10::BFloat16* w, int64_t n_len, float* out) {
#if defined(AFD_AMX) && defined(__AMX_BF16__)
  return gemm<c10::BFloat16>(x, rows, k_len, w, n_len, out);
#else
  return false;
#endif
}

namespace {

// x [M, K] . W [N, K]^T in float32 on the AMX-BF16 tiles, both bfloat16 on the CPU, W contiguous and read in place;
// an undefined tensor where the tiles do not take the call.
at::Tensor amx_product(const at::Tensor& x, const at::Tensor& weight) {
  if (!(x.device().is_cpu() && x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
        weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && x.size(1) == weight.size(1)))
    return at::Tensor();
  if (x.size(0) > amx_bf16_max_rows()) return at::Tensor();  // past 128 rows oneDNN's blocked kernels are as fast
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
  const bool taken = bf16_gemm_amx(xc.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), weight.data_ptr<c10::BFloat16>(),
                                   weight.size(0), out.data_ptr<float>());
  return taken ? out : at::Tensor();
}

}  // namespace

// bfloat16 past the register tiles' rows: oneDNN's bf16 linear (AMX here too) reorders W into its blocked layout
// every call, which at prefill's per-expert sizes costs more than the product.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  if (bias.has_value() && !(bias->dim() == 1 && bias->size(0) == weight.size(0))) return at::Tensor();
  at::Tensor out = amx_product(x, weight);
  if (!out.defined()) return out;
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(at::kBFloat16);
}

at::Tensor bf16_matmul_amx(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_bf16_usable(), "bf16_matmul_amx: no AMX-BF16 tiles here (not built for this CPU, or the OS refuses their state)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                  x.size(1) == weight.size(1), "bf16_matmul_amx: x [M, K] and weight [N, K], both bfloat16");
  const at::Tensor out = amx_product(x, weight.contiguous());
  TORCH_CHECK(out.defined(), "bf16_matmul_amx: the tiles take 1-", amx_bf16_max_rows(), " rows, K a multiple of 32 and N >= 32");
  return out;
}
