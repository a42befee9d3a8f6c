// Vectorized math the fused kernels share (cpu_sampling.cpp's draw, cpu_decoder.cpp's attention),
// and the prefetch the matmuls and attention ask for memory with: AVX2, the library's ISA.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace inferkiln {

constexpr float kLeast = -87.33654f;  // log of float's least normal: e^x below it counts as 0

// e^x for x <= 0, 8 at a time: 2^n e^r with r = x - n ln 2 in [-ln2/2, ln2/2] and Cephes' degree-6
// polynomial for e^r (within 2 ulp of expf); 0 below kLeast and for NaN.
inline __m256 exp8(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kLeast), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kLeast));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(two_n)), keep);
}

inline float exp1(float x) { return x >= kLeast ? std::exp(x) : 0.0f; }  // exp8 of one

// the largest of x[0..n), or NaN where any is NaN
inline float row_max(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    top = _mm256_max_ps(top, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best = lanes[0];
  for (int j = 1; j < 8; ++j) best = std::max(best, lanes[j]);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

// Asks for `count` elements from `from`, a 64-byte line at a time, ahead of their use.
template <_mm_hint Hint, typename T>
inline void prefetch(const T* from, int64_t count) {
  for (int64_t i = 0; i < count; i += 64 / sizeof(T)) _mm_prefetch(reinterpret_cast<const char*>(from + i), Hint);
}

}  // namespace inferkiln
