// fp32 vector lanes as wide as the build target's registers (16 with AVX-512, 8 with AVX2, 4 otherwise), and the
// few vector helpers every kernel shares. Inline, so each kernel's loops keep them in registers.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedserve {

// One hardware register: a wider generic vector than the target has is expanded piecewise, several times slower.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * 4)));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * 4)));

inline Lanes load_lanes(const float* source) {
  Lanes lanes;
  std::memcpy(&lanes, source, sizeof(lanes));
  return lanes;
}

inline void store_lanes(float* target, Lanes lanes) {
  std::memcpy(target, &lanes, sizeof(lanes));
}

// The ISA's splat, not `Lanes{} + value`: an add of +0 is no identity for -0.f, so the compiler must keep it (an
// xor, an add and a broadcast where one FMA with a broadcast memory operand would do).
inline Lanes broadcast(float value) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(value);
#elif defined(__AVX__)
  return _mm256_set1_ps(value);
#elif defined(__SSE__)
  return _mm_set1_ps(value);
#else
  return Lanes{} + value;
#endif
}

// A shuffle tree, not a serial chain of lane adds (the compiler may not reorder float adds itself).
inline float sum_lanes(Lanes lanes) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(lanes);
#elif defined(__AVX__)
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#else
  return (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
#endif
}

inline float max_lanes(Lanes lanes) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(lanes);
#else
  float max = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) {
    max = std::max(max, lanes[i]);
  }
  return max;
#endif
}

// exp(x) = 2^k * e^r with k = round(x / ln 2), |r| <= ln(2) / 2; e^r by its degree-6 Taylor polynomial
// (relative error below 2e-7). Inputs are clamped to the range where the result is a normal float.
inline Lanes exp_lanes(Lanes x) {
  const Lanes low = broadcast(-87.0f), high = broadcast(88.0f);
  x = x < low ? low : x;
  x = x > high ? high : x;
  const Lanes scaled = x * 1.44269504088896341f;
  const IntLanes k = __builtin_convertvector(scaled + (scaled >= 0.f ? broadcast(0.5f) : broadcast(-0.5f)), IntLanes);
  const Lanes kf = __builtin_convertvector(k, Lanes);
  const Lanes r = x - kf * 0.693145751953125f - kf * 1.428606765330187e-06f;
  Lanes p = broadcast(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IntLanes bits = (k + 127) << 23;
  Lanes two_to_k;
  std::memcpy(&two_to_k, &bits, sizeof(two_to_k));
  return p * two_to_k;
}

#if defined(__AVX512BF16__)
// target[0..count) = source[0..count) rounded to bf16, to nearest even, as torch's fp32 -> bf16 conversion rounds.
inline void floats_to_bf16(uint16_t* target, const float* source, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(source + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(target + i), reinterpret_cast<const __m256i&>(rounded));
  }
  if (i < count) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (count - i)) - 1);
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, source + i));
    _mm256_mask_storeu_epi16(target + i, tail, reinterpret_cast<const __m256i&>(rounded));
  }
}
#endif

}  // namespace pagedserve
