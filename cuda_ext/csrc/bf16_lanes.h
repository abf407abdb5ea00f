// bf16 rows in fp32 vector lanes: a bf16 is the top half of an fp32, so a load widens by a 16-bit shift and a store
// rounds to nearest even once, exactly as c10::BFloat16's conversion does (a NaN stays a quiet NaN). Kernels that
// read both dtypes call load_row_lanes / store_row_lanes and compile to the fp32 code for float.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace pagedserve {

typedef uint16_t Bf16BitLanes __attribute__((vector_size(kLanes * 2)));
typedef uint32_t Fp32BitLanes __attribute__((vector_size(kLanes * 4)));

// kLanes bf16 values from `source`, as fp32.
inline Lanes widen_bf16_lanes(const c10::BFloat16* source) {
  Bf16BitLanes halves;
  std::memcpy(&halves, source, sizeof(halves));
  const Fp32BitLanes words = __builtin_convertvector(halves, Fp32BitLanes) << 16;
  Lanes lanes;
  std::memcpy(&lanes, &words, sizeof(lanes));
  return lanes;
}

// kLanes fp32 values rounded to bf16 (nearest, ties to even) into `target`.
inline void narrow_bf16_lanes(c10::BFloat16* target, Lanes lanes) {
  Fp32BitLanes bits;
  std::memcpy(&bits, &lanes, sizeof(bits));
  Fp32BitLanes rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const Fp32BitLanes quiet_nan = rounded - rounded + 0x7fc0u;
  rounded = lanes != lanes ? quiet_nan : rounded;
  const Bf16BitLanes halves = __builtin_convertvector(rounded, Bf16BitLanes);
  std::memcpy(target, &halves, sizeof(halves));
}

inline Lanes load_row_lanes(const float* source) {
  return load_lanes(source);
}

inline Lanes load_row_lanes(const c10::BFloat16* source) {
  return widen_bf16_lanes(source);
}

inline void store_row_lanes(float* target, Lanes lanes) {
  store_lanes(target, lanes);
}

inline void store_row_lanes(c10::BFloat16* target, Lanes lanes) {
  narrow_bf16_lanes(target, lanes);
}

// The dtypes whose rows the vector kernels read: fp32, and bf16 widened to fp32 lanes.
template <typename scalar_t>
constexpr bool kRowLanes = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

}  // namespace pagedserve
