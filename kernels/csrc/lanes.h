// Vector helpers shared by the C++ CPU kernels (GCC vector extensions, and the vdpbf16ps operand
// broadcast under the AVX512-BF16 target; in the source digest: kernels/cpu_build.py HEADERS).
#pragma once

#include <cstdint>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

// expf lane by lane (Cephes' polynomial, ~2 ulp over the range softmax uses) for V float lanes and
// I int32 lanes of the same count; lanes below -87 give ~1e-38, not 0, which a softmax sum cannot
// tell apart.
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.3f, hi = V{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to the nearest integer
  V n = (x * 1.44269504088896341f + magic) - magic;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V pow2;
  __builtin_memcpy(&pow2, &bits, sizeof(pow2));
  return p * pow2;
}

// the lanes of v folded pairwise by `op` (max or +) into every lane; lane 0 read
template <typename Op>
inline float fold16(v16 v, Op op) {
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// The largest and the sum of the lanes. Callers compiled for a wider target (the AVX512-BF16 kernels)
// must fold through these, not through a lambda of their own: GCC does not inline a callee of a wider
// target into fold16, which then runs the op as an out-of-line call per level.
inline float max16(v16 v) { return fold16(v, [](v16 a, v16 b) { return a > b ? a : b; }); }
inline float sum16(v16 v) { return fold16(v, [](v16 a, v16 b) { return a + b; }); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
#include <immintrin.h>

// the bfloat16 pair p[0], p[1] (p[0] in the low half) in every 32-bit lane: vdpbf16ps's broadcast operand
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(pair);
}

#pragma GCC pop_options
