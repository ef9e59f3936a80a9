// Per-element arithmetic shared by the CPU and CUDA backends.
//
// Both backends accumulate one StatsAcc per chunk (see chunk_plan.h) with exactly these
// functions, so the CPU tests check the arithmetic the GPU runs. The CPU vectorised loop does the
// same operations lane-wise and folds its lanes in with `combine`.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace gradfuse {

// Which extra power sum a pass needs for the requested norm_type.
// p == 2 and p == inf are read off sumsq and maxabs, p == 1 needs sum|x|, any other p needs pow.
enum class PowMode : int { kNone = 0, kAbs = 1, kPow = 2 };

inline PowMode pow_mode_for(double norm_type) {
  // p == 0 (count of non-zeros) is read off the zero count and numel.
  if (norm_type == 2.0 || norm_type == 0.0 || std::isinf(norm_type)) return PowMode::kNone;
  if (norm_type == 1.0) return PowMode::kAbs;
  return PowMode::kPow;
}

// Columns of the float statistics, per chunk and per tensor.
enum FloatStat : int { kSum = 0, kSumSq = 1, kMaxAbs = 2, kPowSum = 3, kNumFloatStats = 4 };
// Columns of the count statistics. Numel is not accumulated: the finalise step writes it, so
// the per-tensor results carry everything the Python side needs without a host-to-device copy.
enum CountStat : int { kNanCount = 0, kInfCount = 1, kZeroCount = 2, kNumel = 3, kNumCountStats = 4 };

// max that propagates NaN from either side, like torch.max and vector_norm(ord=inf);
// fmaxf would silently drop it.
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

template <typename acc_t>
struct StatsAcc {
  acc_t sum = 0;
  acc_t sumsq = 0;
  acc_t maxabs = 0;
  acc_t powsum = 0;
  int64_t nan = 0;
  int64_t inf = 0;
  int64_t zero = 0;

  template <PowMode mode>
  C10_HOST_DEVICE inline void add(acc_t x, acc_t p) {
    const acc_t a = x < acc_t(0) ? -x : x;  // NaN stays NaN
    sum += x;
    sumsq += x * x;
    maxabs = nan_max(maxabs, a);
    if (mode == PowMode::kAbs) {
      powsum += a;
    } else if (mode == PowMode::kPow) {
      powsum += ::pow(a, p);
    }
    nan += (x != x);
    inf += (a == acc_t(INFINITY));
    zero += (x == acc_t(0));
  }

  template <typename other_t>
  C10_HOST_DEVICE inline void combine(const StatsAcc<other_t>& o) {
    sum += acc_t(o.sum);
    sumsq += acc_t(o.sumsq);
    maxabs = nan_max(maxabs, acc_t(o.maxabs));
    powsum += acc_t(o.powsum);
    nan += o.nan;
    inf += o.inf;
    zero += o.zero;
  }

  // Layout of one row of the partial / result tensors.
  C10_HOST_DEVICE inline void store(acc_t* floats, int64_t* counts) const {
    floats[kSum] = sum;
    floats[kSumSq] = sumsq;
    floats[kMaxAbs] = maxabs;
    floats[kPowSum] = powsum;
    counts[kNanCount] = nan;
    counts[kInfCount] = inf;
    counts[kZeroCount] = zero;
  }

  C10_HOST_DEVICE static inline StatsAcc load(const acc_t* floats, const int64_t* counts) {
    StatsAcc s;
    s.sum = floats[kSum];
    s.sumsq = floats[kSumSq];
    s.maxabs = floats[kMaxAbs];
    s.powsum = floats[kPowSum];
    s.nan = counts[kNanCount];
    s.inf = counts[kInfCount];
    s.zero = counts[kZeroCount];
    return s;
  }
};

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
