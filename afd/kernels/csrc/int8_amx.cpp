// The int8 GEMM on AMX-INT8 (Sapphire Rapids and later): acc = q W^T, exact, up to 256 rows, the weight read
// as it lies ([N, K], nn.Linear's layout), with no packed copy of it.
//
// TDPBSSD multiplies a tile of signed bytes [16 rows x 64] by one of signed bytes in VNNI layout [16 x (16 x 4)]
// into 16 x 16 int32: C[i][j] += sum_r sum_b A[i][4r + b] * B[r][4j + b]. With A = 16 rows of W and 64 of their K
// (one strided tile load, no reordering), B must hold q's 16 rows' same 64 K, four bytes of a row side by side
// per tile row: q is repacked so once per call (it is the small operand at any size that matters), and C is
// (q W^T)^T, written back transposed. Signed by signed: no bias trick, no row sums.
//
// Work is split over torch's threads by blocks of 32 W rows (two A tiles); each block meets every 16- or 32-row
// block of q (256 x K bytes packed at most: in L2) while it is in L1/L2, so W is read from memory once per call.
// Tile registers: 2 A, 1-2 B and 2-4 C (at most 8). Where the tiles cannot run (no AMX-INT8 compiled, the OS
// refuses the tile state, K not a multiple of 64, more than 256 rows), int8_gemm_amx returns false and the caller
// takes its other path; W rows past the last whole block of 32 are summed by a plain loop.

#include "int8_linear.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define AFD_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(AFD_AMX)
namespace {

constexpr int kTileRows = 16, kTileBytes = 64;  // a tile: 16 rows of 64 bytes
// measured against torch._int_mm (weights from memory, 2816 x 2048 and 2048 x 1408): 1.1-1.5x at 8-128 rows, even
// at 512, 0.7-0.9x at 2048 (these tiles reach ~30 % of AMX's peak; oneDNN's on a prepacked weight 2.5x more)
constexpr int64_t kMaxRows = 256;
constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for the AMX tile state (Linux >= 5.16)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (A tile a, B tile b -> tmm a + 2b); tmm4-5: A (W); tmm6-7: B (q, repacked)
TileConfig tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = kTileBytes, cfg.rows[t] = kTileRows;
  return cfg;
}

// q [rows, K] as B tiles: block of 16 rows tb, K chunk kc -> 1 KB at ((tb * chunks + kc) * 16 + r) * 64, holding
// row (tb * 16 + j)'s bytes 64 kc + 4 r .. + 3 at 4 j; rows past the end are zeros.
std::vector<int8_t> pack_rows(const int8_t* q, int64_t rows, int64_t k_len) {
  const int64_t blocks = (rows + kTileRows - 1) / kTileRows, chunks = k_len / kTileBytes;
  std::vector<int8_t> packed(blocks * chunks * kTileRows * kTileBytes, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t tb = b0; tb < b1; ++tb)
      for (int64_t j = 0; j < std::min<int64_t>(kTileRows, rows - tb * kTileRows); ++j) {
        const int8_t* row = q + (tb * kTileRows + j) * k_len;
        for (int64_t kc = 0; kc < chunks; ++kc) {
          int8_t* tile = packed.data() + (tb * chunks + kc) * kTileRows * kTileBytes;
          for (int r = 0; r < kTileRows; ++r) std::memcpy(tile + r * kTileBytes + 4 * j, row + kc * kTileBytes + 4 * r, 4);
        }
      }
  });
  return packed;
}

// C tiles of W rows n0.. (16 a tile) x q rows m0.. (16 a tile), stored, then written to out [rows, N] transposed.
void write_back(const int32_t (&c)[kTileRows][kTileRows], int64_t n0, int64_t m0, int64_t rows, int64_t n_len, int32_t* out) {
  for (int64_t j = 0; j < std::min<int64_t>(kTileRows, rows - m0); ++j)
    for (int i = 0; i < kTileRows; ++i) out[(m0 + j) * n_len + n0 + i] = c[i][j];
}

// One block of 32 W rows against q's rows, B tiles of q taken MB (1 or 2) at a time.
template <int MB>
void block(const int8_t* w, int64_t k_len, const int8_t* packed, int64_t rows, int64_t n0, int64_t n_len, int32_t* out) {
  const int64_t chunks = k_len / kTileBytes, row_blocks = (rows + kTileRows - 1) / kTileRows;
  const int8_t* w0 = w + n0 * k_len;
  const int8_t* w1 = w0 + kTileRows * k_len;
  alignas(64) int32_t c[kTileRows][kTileRows];
  for (int64_t tb = 0; tb < row_blocks; tb += MB) {
    const bool two = MB == 2 && tb + 1 < row_blocks;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    const int8_t* b0 = packed + tb * chunks * kTileRows * kTileBytes;
    const int8_t* b1 = b0 + chunks * kTileRows * kTileBytes;
    for (int64_t kc = 0; kc < chunks; ++kc) {
      _tile_loadd(4, w0 + kc * kTileBytes, k_len);
      _tile_loadd(5, w1 + kc * kTileBytes, k_len);
      _tile_loadd(6, b0 + kc * kTileRows * kTileBytes, kTileBytes);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 5, 6);
      if (two) {
        _tile_loadd(7, b1 + kc * kTileRows * kTileBytes, kTileBytes);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbssd(3, 5, 7);
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

}  // namespace

bool amx_int8_usable() {
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

bool int8_gemm_amx(const int8_t* q, int64_t rows, int64_t k_len, const int8_t* w, int64_t n_len, int32_t* out) {
  const int64_t blocks = n_len / (2 * kTileRows);
  if (rows < 1 || rows > kMaxRows || blocks == 0 || k_len % kTileBytes != 0 || !amx_int8_usable()) return false;
  const std::vector<int8_t> packed = pack_rows(q, rows, k_len);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (2 * kTileRows * k_len));  // >= 64 KB of W a task
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const TileConfig cfg = tile_config();  // per thread: the tile state is a thread's
    _tile_loadconfig(&cfg);
    for (int64_t nb = b0; nb < b1; ++nb) {
      if (rows > kTileRows) block<2>(w, k_len, packed.data(), rows, nb * 2 * kTileRows, n_len, out);
      else block<1>(w, k_len, packed.data(), rows, nb * 2 * kTileRows, n_len, out);
    }
    _tile_release();
  });
  at::parallel_for(0, rows, 1, [&](int64_t m0, int64_t m1) {  // the last W rows, fewer than two tiles
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = blocks * 2 * kTileRows; n < n_len; ++n) {
        int32_t sum = 0;
        for (int64_t k = 0; k < k_len; ++k) sum += int32_t(q[m * k_len + k]) * int32_t(w[n * k_len + k]);
        out[m * n_len + n] = sum;
      }
  });
  return true;
}

#else

bool amx_int8_usable() { return false; }

bool int8_gemm_amx(const int8_t*, int64_t, int64_t, const int8_t*, int64_t, int32_t*) { return false; }

#endif
