// The vector type the kernels compute in, for the widest instruction set the build machine has:
//
//   AVX-512 (F, BW, VL)   16 float32 lanes, 32 registers, masked loads and stores for tails
//   AVX2 + FMA + F16C     8 float32 lanes, 16 registers, tails through a zero-filled copy
//
// (the kernels are built with -march=native on the machine that runs them, afd/kernels/__init__.py). Values
// of float32, bfloat16 or float16 are loaded and widened to float32 in registers (bfloat16: the upper half of
// a float32; float16: the F16C conversion), never converted through scalars. A kernel's register tiles are
// sized from kRegisters; without either instruction set AFD_SIMD is undefined and kernels keep their plain
// loops (or pass their work to ATen).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AFD_SIMD 1
#define AFD_SIMD_NAME "avx512"
#define AFD_SIMD_AVX512 1
#include <immintrin.h>

namespace afd_simd {

constexpr int kLanes = 16;
constexpr int kRegisters = 32;
using vfloat = __m512;
struct Tail {  // the first n lanes of a vector
  __mmask16 bits;
};

inline Tail tail(int64_t n) { return {n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1)}; }
inline vfloat zero() { return _mm512_setzero_ps(); }
inline vfloat set1(float a) { return _mm512_set1_ps(a); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(vfloat v) { return _mm512_reduce_add_ps(v); }

inline vfloat load(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vfloat load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline vfloat load(const float* p, Tail t) { return _mm512_maskz_loadu_ps(t.bits, p); }
inline vfloat load(const c10::BFloat16* p, Tail t) {
  const __m256i raw = _mm256_maskz_loadu_epi16(t.bits, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vfloat load(const c10::Half* p, Tail t) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(t.bits, p)); }

inline void store(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, vfloat v, Tail t) { _mm512_mask_storeu_ps(p, t.bits, v); }

inline vfloat add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
inline vfloat min(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
inline vfloat max(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat round_nearest(vfloat a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat scale_by_power_of_two(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); }  // p * 2^n

}  // namespace afd_simd

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AFD_SIMD 1
#define AFD_SIMD_NAME "avx2"
#include <immintrin.h>

namespace afd_simd {

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using vfloat = __m256;
struct Tail {  // the first n lanes of a vector
  int64_t n;
};

inline Tail tail(int64_t n) { return {n >= 8 ? 8 : n}; }
inline vfloat zero() { return _mm256_setzero_ps(); }
inline vfloat set1(float a) { return _mm256_set1_ps(a); }
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(vfloat v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline vfloat load(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vfloat load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A tail: its n values copied into a zeroed vector's worth of memory, then loaded (AVX2 has no masked 16-bit
// load; a tail is at most one vector per row).
template <typename T>
inline vfloat load(const T* p, Tail t) {
  if (t.n == 8) return load(p);
  T buf[8];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, t.n * sizeof(T));
  return load(buf);
}

inline void store(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline void store(float* p, vfloat v, Tail t) {
  if (t.n == 8) return store(p, v);
  float buf[8];
  _mm256_storeu_ps(buf, v);
  std::memcpy(p, buf, t.n * sizeof(float));
}

inline vfloat add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
inline vfloat min(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
inline vfloat max(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat round_nearest(vfloat a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vfloat scale_by_power_of_two(vfloat p, vfloat n) {  // p * 2^n, n an integer in [-126, 127]
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace afd_simd

#else
#define AFD_SIMD_NAME "none"
#endif

#if defined(AFD_SIMD)
namespace afd_simd {

// e^x for x in float32's range, within 2 ulp of expf (x past +-87.3 clamped: e^x then saturates to ~1e38 or ~1e-38,
// not inf or 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial, scaled by 2^n. What a kernel's
// loop calls where std::exp would stop it vectorising.
inline vfloat exp(vfloat x) {
  x = max(min(x, set1(87.3f)), set1(-87.3f));
  const vfloat n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vfloat r = fmadd(n, set1(-0.693359375f), x);
  r = fmadd(n, set1(2.12194440e-4f), r);
  vfloat p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, set1(1.f)));
  return scale_by_power_of_two(p, n);
}

}  // namespace afd_simd
#endif
