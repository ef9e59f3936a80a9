// Per-chunk CPU kernels, compiled once per instruction set (CPU_CAPABILITY is DEFAULT or AVX2).
//
// Statistics: the vector loop keeps sum, sum of squares, max |x|, zero count (and sum |x|^p when
// the norm needs it) in independent lane accumulators. NaN and Inf are rare, so the vector loop
// does not count them: a chunk whose sum of squares comes out non-finite (the only way a NaN or
// Inf can be in it) is reduced again with the scalar StatsAcc::add, the exact arithmetic the
// CUDA kernel uses, which counts them and propagates NaN into max |x|.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

#include "../common/chunk_plan.h"
#include "kernels.h"

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t, PowMode mode>
StatsAcc<acc_of<scalar_t>> reduce_scalar(const scalar_t* x, int64_t n, double p) {
  using acc_t = acc_of<scalar_t>;
  StatsAcc<acc_t> s;
  for (int64_t i = 0; i < n; ++i) s.template add<mode>(static_cast<acc_t>(x[i]), acc_t(p));
  return s;
}

// Lane accumulators for one vector stream.
template <typename acc_t>
struct Lanes {
  using V = Vectorized<acc_t>;
  V sum{acc_t(0)}, sumsq{acc_t(0)}, maxabs{acc_t(0)}, zero{acc_t(0)}, powsum{acc_t(0)};

  template <PowMode mode>
  inline void add(const V& x, const V& p) {
    const V a = x.abs();
    sum = sum + x;
    sumsq = at::vec::fmadd(x, x, sumsq);
    // max without NaN handling (2 fewer instructions): a NaN makes sumsq NaN, and such chunks
    // are reduced again by the scalar path, which propagates it.
    maxabs = at::vec::clamp_min(a, maxabs);
    zero = zero + x.eq(V(acc_t(0)));  // eq gives 1 or 0 per lane
    if constexpr (mode == PowMode::kAbs) powsum = powsum + a;
    if constexpr (mode == PowMode::kPow) powsum = powsum + a.pow(p);
  }

  // Folds the lanes, in lane order, into s.
  inline void fold_into(StatsAcc<acc_t>& s) const {
    acc_t b_sum[V::size()], b_sq[V::size()], b_max[V::size()], b_zero[V::size()], b_pow[V::size()];
    sum.store(b_sum);
    sumsq.store(b_sq);
    maxabs.store(b_max);
    zero.store(b_zero);
    powsum.store(b_pow);
    for (int i = 0; i < V::size(); ++i) {
      s.sum += b_sum[i];
      s.sumsq += b_sq[i];
      s.maxabs = nan_max(s.maxabs, b_max[i]);
      s.zero += static_cast<int64_t>(b_zero[i]);
      s.powsum += b_pow[i];
    }
  }
};

// Two independent accumulators per statistic hide the add latency; more would spill on AVX2.
template <typename scalar_t, PowMode mode>
StatsAcc<acc_of<scalar_t>> reduce_vectorized(const scalar_t* x, int64_t n, double p) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const VA pv(static_cast<acc_t>(p));
  Lanes<acc_t> l0, l1;
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    constexpr int64_t kStep = 2 * VA::size();
    for (; i + kStep <= n; i += kStep) {
      l0.template add<mode>(VA::loadu(x + i), pv);
      l1.template add<mode>(VA::loadu(x + i + VA::size()), pv);
    }
  } else {  // Half / BFloat16: one load gives two float vectors
    constexpr int64_t kStep = Vectorized<scalar_t>::size();
    for (; i + kStep <= n; i += kStep) {
      VA lo, hi;
      at::vec::load_to_float<scalar_t>(x + i, lo, hi);
      l0.template add<mode>(lo, pv);
      l1.template add<mode>(hi, pv);
    }
  }
  StatsAcc<acc_t> s;
  l0.fold_into(s);
  l1.fold_into(s);
  s.combine(reduce_scalar<scalar_t, mode>(x + i, n - i, p));
  return s;
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
    if (!std::isfinite(s.sumsq)) s = reduce_scalar<scalar_t, mode>(x, n, p);
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
