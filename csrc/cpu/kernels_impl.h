// Per-chunk CPU kernels, compiled once per instruction set (CPU_CAPABILITY is DEFAULT or AVX2).
//
// Statistics: the two passes of stats_math.h, as the CUDA kernel runs them. Pass 1 keeps sum,
// sum of squares, max |x|, zero count (and sum |x|^p when the norm needs it) in independent
// vector lanes; its scalar tail is ElementAcc::add itself. Pass 2 (NaN and Inf counts) runs only
// on a chunk whose sum of squares is not finite.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../common/chunk_plan.h"
#include "kernels.h"

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Elements per step of for_each_vector_pair: two acc_t vectors (one Half / BFloat16 vector).
template <typename scalar_t>
constexpr int64_t kPairElems = 2 * Vectorized<acc_of<scalar_t>>::size();

// Calls f(lo, hi) for each pair of consecutive Vectorized<acc_t> of x[0, n) and returns how many
// elements that covered (a multiple of kPairElems; the rest is the caller's scalar tail).
template <typename scalar_t, typename F>
int64_t for_each_vector_pair(const scalar_t* x, int64_t n, F&& f) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  int64_t i = 0;
  static_assert(kPairElems<scalar_t> == 2 * VA::size() && (std::is_same_v<scalar_t, acc_t> ||
                kPairElems<scalar_t> == Vectorized<scalar_t>::size()));
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (; i + kPairElems<scalar_t> <= n; i += kPairElems<scalar_t>) f(VA::loadu(x + i), VA::loadu(x + i + VA::size()));
  } else {  // one load gives two float vectors
    for (; i + kPairElems<scalar_t> <= n; i += kPairElems<scalar_t>) {
      VA lo, hi;
      at::vec::load_to_float<scalar_t>(x + i, lo, hi);
      f(lo, hi);
    }
  }
  return i;
}

// Lane sums. A float sum of thousands of values in sequence drifts from float64 (each addition
// rounds at the size of the running sum), so they are blocked: each stream's running sums take
// kRun steps, then both streams fold into `mid`, which folds into `top` every kRun runs. A lane
// of a 65 536-element chunk adds at most 32 + 64 + 4 terms in sequence instead of 4 096. On
// 196 613 values of +-1e30, sum |x| is 6.8e-7 off float64 (a 65 536-long sequence: 2.3e-4).
template <typename acc_t>
struct LaneSums {
  using V = Vectorized<acc_t>;
  V sum, sumsq, powsum;

  template <PowMode mode>
  inline void add(const LaneSums& a, const LaneSums& b) {
    sum = sum + a.sum + b.sum;
    sumsq = sumsq + a.sumsq + b.sumsq;
    if constexpr (mode != PowMode::kNone) powsum = powsum + a.powsum + b.powsum;
  }
};

// Pass 1 of one vector stream.
template <typename acc_t>
struct Lanes {
  using V = Vectorized<acc_t>;
  LaneSums<acc_t> run;
  V maxabs, zero;

  template <PowMode mode>
  inline void add(const V& x, const V& p) {
    const V a = x.abs();
    run.sum = run.sum + x;
    run.sumsq = at::vec::fmadd(x, x, run.sumsq);
    maxabs = at::vec::clamp_min(a, maxabs);  // ignores NaN, as on the GPU; pass 2 restores it
    zero = zero + x.eq(V(acc_t(0)));  // eq gives 1 or 0 per lane
    if constexpr (mode == PowMode::kAbs) run.powsum = run.powsum + a;
    if constexpr (mode == PowMode::kPow) run.powsum = run.powsum + a.pow(p);
  }
};

// Pass 1 over one chunk. Two independent streams hide the add latency; more would spill on AVX2.
template <typename scalar_t, PowMode mode>
StatsAcc<acc_of<scalar_t>> reduce_vectorized(const scalar_t* x, int64_t n, double p) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  constexpr int64_t kRun = 32;  // steps per run, runs per mid (see LaneSums)
  const VA pv(static_cast<acc_t>(p)), zeros(acc_t(0));
  // Copied, never constructed in the loop: GCC's AVX2 build calls the vector constructor
  // out of line.
  const LaneSums<acc_t> no_sums{zeros, zeros, zeros};
  Lanes<acc_t> l0{no_sums, zeros, zeros}, l1{no_sums, zeros, zeros};
  LaneSums<acc_t> mid = no_sums, top = no_sums;
  const auto add = [&](const VA& lo, const VA& hi) {
    l0.template add<mode>(lo, pv);
    l1.template add<mode>(hi, pv);
  };
  int64_t done = 0;
  for (int runs = 1; n - done >= kPairElems<scalar_t>; ++runs) {
    done += for_each_vector_pair(x + done, std::min(kRun * kPairElems<scalar_t>, n - done), add);
    mid.template add<mode>(l0.run, l1.run);
    l0.run = l1.run = no_sums;
    if (runs % kRun == 0) {
      top.template add<mode>(mid, no_sums);
      mid = no_sums;
    }
  }
  top.template add<mode>(mid, no_sums);
  StatsAcc<acc_t> s;
  acc_t b_sum[VA::size()], b_sq[VA::size()], b_pow[VA::size()], b_max0[VA::size()], b_max1[VA::size()];
  top.sum.store(b_sum);
  top.sumsq.store(b_sq);
  top.powsum.store(b_pow);
  l0.maxabs.store(b_max0);
  l1.maxabs.store(b_max1);
  const VA zero_lanes = l0.zero + l1.zero;  // exact: at most a chunk per lane
  acc_t b_zero[VA::size()];
  zero_lanes.store(b_zero);
  for (int i = 0; i < VA::size(); ++i) {  // in lane order
    s.sum += b_sum[i];
    s.sumsq += b_sq[i];
    s.powsum += b_pow[i];
    s.maxabs = nan_max(s.maxabs, nan_max(b_max0[i], b_max1[i]));
    s.zero += static_cast<int64_t>(b_zero[i]);
  }
  ElementAcc<acc_t> tail;
  for (int64_t i = done; i < n; ++i) tail.template add<mode>(static_cast<acc_t>(x[i]), acc_t(p));
  s.combine(tail.stats());
  return s;
}

// Pass 2 over one chunk: its NaN and Inf counts.
template <typename scalar_t>
NonfiniteCount count_nonfinite(const scalar_t* x, int64_t n) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const VA inf(std::numeric_limits<acc_t>::infinity());
  VA nan_lanes(acc_t(0)), inf_lanes(acc_t(0));
  const int64_t done = for_each_vector_pair(x, n, [&](const VA& lo, const VA& hi) {
    nan_lanes = nan_lanes + lo.ne(lo) + hi.ne(hi);  // 1 or 0 per lane, like eq
    inf_lanes = inf_lanes + lo.abs().eq(inf) + hi.abs().eq(inf);
  });
  NonfiniteCount c;
  acc_t b_nan[VA::size()], b_inf[VA::size()];
  nan_lanes.store(b_nan);
  inf_lanes.store(b_inf);
  for (int i = 0; i < VA::size(); ++i) {
    c.nan += static_cast<ElemCount>(b_nan[i]);
    c.inf += static_cast<ElemCount>(b_inf[i]);
  }
  for (int64_t i = done; i < n; ++i) c.add(static_cast<acc_t>(x[i]));
  return c;
}

template <typename scalar_t, PowMode mode>
void stats_chunks_typed(const ChunkArgs& args, double p, int64_t begin, int64_t end,
                        acc_of<scalar_t>* float_partials, int64_t* count_partials) {
  int64_t t = owner_of_chunk(args.first_chunk, args.num_tensors, begin);
  for (int64_t c = begin; c < end; ++c) {
    while (args.first_chunk[t + 1] <= c) ++t;
    const int64_t offset = (c - args.first_chunk[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, args.spans[t].numel - offset);
    const scalar_t* x = static_cast<const scalar_t*>(args.spans[t].data) + offset;
    auto s = reduce_vectorized<scalar_t, mode>(x, n, p);
    if (needs_nonfinite_count(s)) {
      const NonfiniteCount counts = count_nonfinite(x, n);
      s.set_nonfinite_counts(static_cast<int64_t>(counts.nan), static_cast<int64_t>(counts.inf));
    }
    s.store(float_partials + c * kNumFloatStats, count_partials + c * kNumCountStats);
  }
}

template <typename scalar_t>
void stats_chunks_dispatch_mode(const ChunkArgs& args, PowMode mode, double p, int64_t begin,
                                int64_t end, void* fp, int64_t* cp) {
  auto* f = static_cast<acc_of<scalar_t>*>(fp);
  switch (mode) {
    case PowMode::kNone: return stats_chunks_typed<scalar_t, PowMode::kNone>(args, p, begin, end, f, cp);
    case PowMode::kAbs: return stats_chunks_typed<scalar_t, PowMode::kAbs>(args, p, begin, end, f, cp);
    case PowMode::kPow: return stats_chunks_typed<scalar_t, PowMode::kPow>(args, p, begin, end, f, cp);
  }
}

template <typename scalar_t>
void scale_chunks_typed(const ChunkArgs& args, double coef, int64_t begin, int64_t end) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const acc_t c = static_cast<acc_t>(coef);
  const VA cv(c);
  int64_t t = owner_of_chunk(args.first_chunk, args.num_tensors, begin);
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    while (args.first_chunk[t + 1] <= chunk) ++t;
    const int64_t offset = (chunk - args.first_chunk[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, args.spans[t].numel - offset);
    scalar_t* x = static_cast<scalar_t*>(args.spans[t].data) + offset;
    int64_t i = 0;
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      for (; i + VA::size() <= n; i += VA::size()) (VA::loadu(x + i) * cv).store(x + i);
    } else {
      constexpr int64_t kStep = Vectorized<scalar_t>::size();
      for (; i + kStep <= n; i += kStep) {
        VA lo, hi;
        at::vec::load_to_float<scalar_t>(x + i, lo, hi);
        at::vec::convert_from_float<scalar_t>(lo * cv, hi * cv).store(x + i);
      }
    }
    for (; i < n; ++i) x[i] = scale_element<scalar_t, acc_t>(x[i], c);
  }
}

}  // namespace

void stats_chunks(const ChunkArgs& args, PowMode mode, double p, int64_t begin, int64_t end,
                  void* float_partials, int64_t* count_partials) {
  switch (args.dtype) {
    case c10::ScalarType::Float:
      return stats_chunks_dispatch_mode<float>(args, mode, p, begin, end, float_partials, count_partials);
    case c10::ScalarType::Double:
      return stats_chunks_dispatch_mode<double>(args, mode, p, begin, end, float_partials, count_partials);
    case c10::ScalarType::Half:
      return stats_chunks_dispatch_mode<c10::Half>(args, mode, p, begin, end, float_partials, count_partials);
    case c10::ScalarType::BFloat16:
      return stats_chunks_dispatch_mode<c10::BFloat16>(args, mode, p, begin, end, float_partials, count_partials);
    default:
      break;  // the op checked the dtype before
  }
}

void scale_chunks(const ChunkArgs& args, double coef, int64_t begin, int64_t end) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return scale_chunks_typed<float>(args, coef, begin, end);
    case c10::ScalarType::Double: return scale_chunks_typed<double>(args, coef, begin, end);
    case c10::ScalarType::Half: return scale_chunks_typed<c10::Half>(args, coef, begin, end);
    case c10::ScalarType::BFloat16: return scale_chunks_typed<c10::BFloat16>(args, coef, begin, end);
    default: break;
  }
}

}  // namespace gradfuse::cpu::CPU_CAPABILITY
