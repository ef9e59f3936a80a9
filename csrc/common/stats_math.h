// Per-element arithmetic shared by the CPU and CUDA backends.
//
// Both backends reduce each chunk (see chunk_plan.h) in the same two passes:
//  1. every element, with ElementAcc::add: sum, sum of squares, max |x| by a plain max (which
//     ignores NaN), the power sum, the zero count. Nothing else: this is the hot loop.
//  2. only for a chunk whose sum of squares came out non-finite, with NonfiniteCount::add: the
//     NaN and Inf counts, and max |x| becomes NaN when there is a NaN. Every square is >= 0, so a
//     single NaN or Inf makes the sum of squares NaN or Inf: a chunk that skips pass 2 has none.
//     (Finite values whose squares overflow also take pass 2, which then counts nothing.)
// The CUDA kernel runs these functions per element; the CPU vector loop does the same operations
// lane-wise and its scalar tail calls them. StatsAcc holds a reduced row (chunk or tensor).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "acc_row.h"

namespace gradfuse {

// Which extra power sum a pass needs for the requested norm_type.
// p == 2 and p == inf are read off sumsq and maxabs, p == 1 needs sum|x|, any other p needs pow.
// kMoments (multi_tensor_moments, norm_type 2) adds a stable second moment: the pass's parameter
// is then a shift K (a value of the tensor, see moment_shift), `sum` accumulates x - K and
// `powsum` (x - K)^2, and finish_moments turns them into the sum of x and the sum of squared
// deviations from the mean. (sum x^2 - (sum x)^2 / n loses every digit when |mean| >> std; with
// K taken from the data, x - K is of the size of the spread, and exact in float when x and K
// are within a factor of 2 of each other.)
enum class PowMode : int { kNone = 0, kAbs = 1, kPow = 2, kMoments = 3 };

inline PowMode pow_mode_for(double norm_type) {
  // p == 0 (count of non-zeros) is read off the zero count and numel.
  if (norm_type == 2.0 || norm_type == 0.0 || std::isinf(norm_type)) return PowMode::kNone;
  if (norm_type == 1.0) return PowMode::kAbs;
  return PowMode::kPow;
}

// The layout of the statistics rows, the one place the C++ side declares it (gradfuse/ops/layout.py
// declares it for Python; build_info()["stats_layout"] lists these names, and a test checks one
// against the other). X(column, StatsAcc member, how two partial rows combine: Add or NanMax).
// Every row, partial or final, stores the members in this order; the CUDA warp reduction and the
// partial rows of both backends go through StatsAcc, so a column added here reaches them all.
// Adding a statistic: CONTRIBUTING.md, "Adding a statistic".
#define GRADFUSE_FLOAT_STATS(X) \
  X(kSum, sum, Add)             \
  X(kSumSq, sumsq, Add)         \
  X(kMaxAbs, maxabs, NanMax)    \
  X(kPowSum, powsum, Add)
// The accumulated counts; numel, the last count column, is written when a row is finished (so the
// per-tensor results carry everything the Python side needs without a host-to-device copy).
#define GRADFUSE_COUNT_STATS(X) \
  X(kNanCount, nan, Add)        \
  X(kInfCount, inf, Add)        \
  X(kZeroCount, zero, Add)

#define GRADFUSE_STATS_ENUM(column, member, combine) column,
// The rows of multi_tensor_moments hold the sum of squared deviations from the mean (M2) in the
// power sum's column.
enum FloatStat : int { GRADFUSE_FLOAT_STATS(GRADFUSE_STATS_ENUM) kNumFloatStats };
enum CountStat : int { GRADFUSE_COUNT_STATS(GRADFUSE_STATS_ENUM) kNumel, kNumCountStats };
#undef GRADFUSE_STATS_ENUM

// a * b rounded to acc_t, never contracted with a following add into an FMA (see finish_moments).
template <typename T>
C10_HOST_DEVICE inline T mul_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, double>) {
    return __dmul_rn(a, b);
  } else {
    return __fmul_rn(a, b);
  }
#else
  volatile T product = a * b;  // a store the compiler must keep: the add cannot absorb the product
  return product;
#endif
}

// A reduced row (chunk, unit or tensor): one member per column of the tables above, and combine,
// store, load and for_each (acc_row.h).
template <typename acc_t>
struct StatsAcc {
  GRADFUSE_ACC_ROW(StatsAcc, GRADFUSE_FLOAT_STATS, GRADFUSE_COUNT_STATS)

  // Pass 2's result: a NaN anywhere makes max |x| NaN, as torch's max and vector_norm(inf) do.
  C10_HOST_DEVICE inline void set_nonfinite_counts(int64_t nan_count, int64_t inf_count) {
    nan = nan_count;
    inf = inf_count;
    if (nan_count > 0) maxabs = acc_t(NAN);
  }

  // kMoments, once per tensor, on its combined row (acc_t double): sum (of x - shift) becomes
  // the sum of x, powsum (of (x - shift)^2) the sum of squared deviations from the mean.
  // The products are rounded on their own (mul_rn), so that the result does not depend on whether
  // the compiler contracts a*b+c into an FMA (nvcc does by default, g++ on an FMA target). Finite
  // data whose squared deviations overflow keeps the +Inf a float64 two-pass gives: for
  // [1, 2, 1e300] the product overflows too, and Inf - Inf would be NaN. (A NaN or Inf element
  // makes the row NaN, as it makes torch.var NaN.)
  C10_HOST_DEVICE inline void finish_moments(acc_t shift, int64_t n) {
    if (n == 0) return;
    const bool overflowed = powsum == acc_t(INFINITY) && nan == 0 && inf == 0;
    const acc_t m2 = overflowed ? powsum : powsum - mul_rn(sum, sum / acc_t(n));
    powsum = m2 > acc_t(0) ? m2 : (m2 == m2 ? acc_t(0) : m2);  // rounding can leave a tiny negative
    sum += mul_rn(acc_t(n), shift);
  }
};

// max |x| for pass 1: ignores NaN (pass 2 restores it), in the fewest GPU instructions. For
// float, fmaxf is one FMNMX; a double fmax is 7 instructions on sm_90, a compare and select 3.
template <typename T>
C10_HOST_DEVICE inline T max_ignoring_nan(T m, T a) {
  if constexpr (std::is_same_v<T, float>) {
    return ::fmaxf(m, a);
  } else {
    return a > m ? a : m;
  }
}

// Counts are kept as float per thread or lane: (x == 0) ? 1 : 0 plus an add is two GPU
// instructions (FSET.BF, FADD), an integer count three. Exact up to 2^24 elements, far more than
// one chunk.
using ElemCount = float;

// Pass 1 of one thread (CUDA) or of the scalar tail (CPU), over at most one chunk.
template <typename acc_t>
struct ElementAcc {
  acc_t sum = 0;
  acc_t sumsq = 0;
  acc_t maxabs = 0;
  acc_t powsum = 0;
  ElemCount zero = 0;

  // p: the power of kPow, the shift of kMoments.
  template <PowMode mode>
  C10_HOST_DEVICE inline void add(acc_t x, acc_t p) {
    // fabs, not x < 0 ? -x : x, which keeps -0.0 negative: pow(-0.0, p < 0) is -inf.
    const acc_t a = ::fabs(x);
    if (mode == PowMode::kMoments) {
      const acc_t d = x - p;
      sum += d;
      powsum += d * d;
    } else {
      sum += x;
    }
    sumsq += x * x;
    maxabs = max_ignoring_nan(maxabs, a);
    if (mode == PowMode::kAbs) {
      powsum += a;
    } else if (mode == PowMode::kPow) {
      powsum += ::pow(a, p);
    }
    zero += (x == acc_t(0)) ? ElemCount(1) : ElemCount(0);
  }

  C10_HOST_DEVICE inline StatsAcc<acc_t> stats() const {
    StatsAcc<acc_t> s;
    s.sum = sum;
    s.sumsq = sumsq;
    s.maxabs = maxabs;
    s.powsum = powsum;
    s.zero = static_cast<int64_t>(zero);
    return s;
  }
};

// The shift K of kMoments for the tensor x[0, n): the median of five of its elements (the first,
// the last and the three quarter points), or 0 when that is not finite (a NaN or Inf row's
// moments are NaN in any case, and its sum must stay what an unshifted sum gives). The float
// rounding of the sums is amplified by about 1 + ((mean - K) / std)^2: a value of the data keeps
// that small, and the median keeps it small when one or two of the five are outliers (the first
// position of a sequence often is one: a start token's large activations). Five loads per block
// on the GPU; the same five on every block of the tensor, and on the CPU.
template <typename T>
C10_HOST_DEVICE inline T min_of(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
C10_HOST_DEVICE inline T max_of(T a, T b) {
  return a < b ? b : a;
}

constexpr int kShiftSamples = 5;

// The index of sample k (< kShiftSamples) of a tensor of n > 0 elements.
C10_HOST_DEVICE inline int64_t shift_sample(int64_t n, int k) {
  return (n - 1) * k / (kShiftSamples - 1);
}

template <typename acc_t, typename scalar_t>
C10_HOST_DEVICE inline acc_t moment_shift(const scalar_t* x, int64_t n) {
  if (n <= 0) return acc_t(0);
  acc_t v[kShiftSamples];
  for (int k = 0; k < kShiftSamples; ++k) v[k] = static_cast<acc_t>(x[shift_sample(n, k)]);
  // The median of five without branches (a tiny tensor pays this per call): the larger of the
  // two pairs' minima and the smaller of their maxima drop the lowest and the highest of four;
  // the median of those two and the fifth is the median of all five. (A NaN may make it any
  // of them: the row is NaN in any case.)
  const acc_t f = max_of(min_of(v[0], v[1]), min_of(v[2], v[3]));
  const acc_t g = min_of(max_of(v[0], v[1]), max_of(v[2], v[3]));
  const acc_t m = max_of(min_of(v[4], f), min_of(max_of(v[4], f), g));
  return ::fabs(m) < acc_t(INFINITY) ? m : acc_t(0);
}

// Pass 2, for chunks with a NaN or Inf somewhere.
struct NonfiniteCount {
  ElemCount nan = 0;
  ElemCount inf = 0;

  template <typename acc_t>
  C10_HOST_DEVICE inline void add(acc_t x) {
    nan += (x != x) ? ElemCount(1) : ElemCount(0);
    inf += (::fabs(x) == acc_t(INFINITY)) ? ElemCount(1) : ElemCount(0);
  }
};

// Whether a chunk needs pass 2.
template <typename acc_t>
C10_HOST_DEVICE inline bool needs_nonfinite_count(const StatsAcc<acc_t>& s) {
  return !(s.sumsq < acc_t(INFINITY));  // NaN or +Inf (a sum of squares is never negative)
}

// In-place scale of one element; the coefficient is already known to be < 1 (or NaN).
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline scalar_t scale_element(scalar_t x, acc_t coef) {
  return static_cast<scalar_t>(static_cast<acc_t>(x) * coef);
}

// Whether a clip coefficient requires touching memory: NaN does (torch multiplies by it).
template <typename T>
C10_HOST_DEVICE inline bool needs_scaling(T coef) {
  return !(coef >= T(1));
}

}  // namespace gradfuse
