// Per-element arithmetic of the exponent histogram, shared by the CPU and CUDA backends.
//
// Bins (kNumHistBins per tensor, the same for every input dtype):
//   0                 kBinBelow   finite, non-zero, |x| < 2^-149 (float64 input only)
//   1                 kBinZero    +0 and -0
//   2 .. 278          e + 151     floor(log2|x|) == e, for e in [-149, 127] (the exponents of
//                                 float32 and bfloat16 including their subnormals; float16's
//                                 are [-24, 15])
//   279               kBinAbove   finite, |x| >= 2^128 (float64 input only)
//   280, 281, 282     +Inf, -Inf, NaN
// The exponent comes from the bits alone (integer arithmetic on the representation): for a
// normal number its biased exponent field minus the bias, for a subnormal the position of the
// mantissa's highest set bit.
//
// Both backends count each chunk (chunk_plan.h) in two passes, as the statistics do:
//  1. every element, by hot_row(): its biased exponent field plus a constant (one shift, one
//     AND, one add), which is the final bin of every normal number. Zeros and subnormals share
//     the row of the exponent field 0 (kLowRow), Inf and NaN that of the largest field
//     (kHighRow); for float64 these rows also take every |x| outside [2^-149, 2^128).
//  2. only for a chunk with a count in kLowRow or kHighRow: every element whose hot row is one
//     of those two gets its exact bin from exponent_bin(), moved there from the lumped row.
// So the hot loop never tests for zero, subnormal, Inf or NaN; a chunk without zeros,
// subnormals or non-finite values (most gradient chunks) never runs pass 2.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace gradfuse {

constexpr int kNumHistBins = 283;
constexpr int kBinBelow = 0;
constexpr int kBinZero = 1;
constexpr int kMinBinExponent = -149;
constexpr int kMaxBinExponent = 127;
constexpr int kExponentBinOffset = 151;  // bin of exponent e: e + 151
constexpr int kBinAbove = 279;
constexpr int kBinPosInf = 280;
constexpr int kBinNegInf = 281;
constexpr int kBinNan = 282;

// The IEEE layout of an input dtype, by width: uint16 for float16 / bfloat16 (which differ in
// their field widths), uint32 for float32, uint64 for float64.
template <typename bits_t, int kMantissaBits_, int kExponentBits_>
struct FloatLayout {
  using Bits = bits_t;
  static constexpr int kMantissaBits = kMantissaBits_;
  static constexpr int kExponentBits = kExponentBits_;
  static constexpr int kWidth = 8 * sizeof(bits_t);
  static constexpr int kBias = (1 << (kExponentBits - 1)) - 1;
  static constexpr int kMaxField = (1 << kExponentBits) - 1;
  static constexpr bits_t kSignBit = bits_t(bits_t(1) << (kWidth - 1));
  static constexpr bits_t kMantissaMask = bits_t((bits_t(1) << kMantissaBits) - 1);
  // Hot row of exponent field E: E + kRowOffset (the final bin of a normal number), clamped to
  // [0, kBinAbove] where the dtype's exponents reach outside the bins (float64 only).
  static constexpr int kRowOffset = kExponentBinOffset - kBias;
  static constexpr bool kClamp = kRowOffset + 1 < kBinZero + 1 || kRowOffset + kMaxField > kBinAbove;
  static constexpr int kLowRow = kClamp ? kBinBelow : kRowOffset;                // field 0
  static constexpr int kHighRow = kClamp ? kBinAbove : kRowOffset + kMaxField;   // field max
};
using Fp16Layout = FloatLayout<uint16_t, 10, 5>;
using Bf16Layout = FloatLayout<uint16_t, 7, 8>;
using Fp32Layout = FloatLayout<uint32_t, 23, 8>;
using Fp64Layout = FloatLayout<uint64_t, 52, 11>;
static_assert(Fp32Layout::kLowRow == 24 && Fp32Layout::kHighRow == 279 && !Fp32Layout::kClamp, "");
static_assert(Bf16Layout::kLowRow == 24 && !Bf16Layout::kClamp, "");
static_assert(Fp16Layout::kLowRow == 136 && Fp16Layout::kHighRow == 167 && !Fp16Layout::kClamp, "");
static_assert(Fp64Layout::kClamp, "");

// Index of the highest set bit of a non-zero value (-1 for 0).
C10_HOST_DEVICE inline int highest_bit(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return 63 - __clzll(static_cast<long long>(v));
#else
  return v == 0 ? -1 : 63 - __builtin_clzll(v);
#endif
}

// Pass 1: the row of an element's exponent field (see the header comment).
template <typename L>
C10_HOST_DEVICE inline int hot_row(typename L::Bits bits) {
  const int field = static_cast<int>((bits >> L::kMantissaBits) & typename L::Bits(L::kMaxField));
  if constexpr (L::kClamp) {
    const int row = field + L::kRowOffset;
    // Exponents below -149 (and zero) go to kBinBelow, not to kBinZero; above 127 to kBinAbove.
    return row <= kBinZero ? kBinBelow : (row > kBinAbove ? kBinAbove : row);
  } else {
    return field + L::kRowOffset;
  }
}

// Whether pass 2 must look at an element of hot row `row`.
template <typename L>
C10_HOST_DEVICE inline bool needs_exact_bin(int row) {
  return row == L::kLowRow || row == L::kHighRow;
}

// The exact bin of an element, from its bits.
template <typename L>
C10_HOST_DEVICE inline int exponent_bin(typename L::Bits bits) {
  using B = typename L::Bits;
  const B mag = bits & B(~L::kSignBit);
  const int field = static_cast<int>(mag >> L::kMantissaBits);
  if (field == L::kMaxField) {
    if ((mag & L::kMantissaMask) != 0) return kBinNan;
    return (bits & L::kSignBit) ? kBinNegInf : kBinPosInf;
  }
  if (mag == 0) return kBinZero;
  // A subnormal m * 2^(1 - bias - M) has floor(log2) = highest_bit(m) + 1 - bias - M.
  const int e = field != 0 ? field - L::kBias
                           : highest_bit(static_cast<uint64_t>(mag)) + 1 - L::kBias - L::kMantissaBits;
  if (e < kMinBinExponent) return kBinBelow;
  if (e > kMaxBinExponent) return kBinAbove;
  return e + kExponentBinOffset;
}

}  // namespace gradfuse
