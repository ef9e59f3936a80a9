// Per-item CPU kernels of the clipping ops (issue 17), compiled once per instruction set: included
// by kernels_default.cpp / kernels_avx2.cpp after kernels_impl.h, whose chunk reductions
// (reduce_vectorized, count_nonfinite: the two passes of stats_math.h) they reuse per unit.
#pragma once

#include "../common/clip_math.h"
#include "clip_kernels.h"

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

// The statistics of x[0, n) (n <= kChunkElems) as one chunk of multi_tensor_stats computes them.
template <typename scalar_t, PowMode mode>
StatsAcc<acc_of<scalar_t>> span_stats(const scalar_t* x, int64_t n, double p) {
  auto s = reduce_vectorized<scalar_t, mode>(x, n, p);
  if (needs_nonfinite_count(s)) {
    const NonfiniteCount counts = count_nonfinite(x, n);
    s.set_nonfinite_counts(static_cast<int64_t>(counts.nan), static_cast<int64_t>(counts.inf));
  }
  return s;
}

template <typename scalar_t, PowMode mode>
void unit_stats_typed(const UnitArgs& args, double p, int64_t begin, int64_t end,
                      acc_of<scalar_t>* fp, int64_t* cp) {
  for (int64_t item = begin; item < end; ++item) {
    const UnitItem it = args.plan->locate(item);
    const scalar_t* x = static_cast<const scalar_t*>(args.spans[it.tensor].data) + it.offset;
    if (it.packed) {
      for (int64_t k = 0; k < it.num_units; ++k) {
        span_stats<scalar_t, mode>(x + k * it.unit_len, it.unit_len, p)
            .store(fp + (it.prow + k) * kNumFloatStats, cp + (it.prow + k) * kNumCountStats);
      }
    } else {
      span_stats<scalar_t, mode>(x, it.n, p).store(fp + it.prow * kNumFloatStats, cp + it.prow * kNumCountStats);
    }
  }
}

template <typename scalar_t>
void unit_stats_dispatch(const UnitArgs& args, PowMode mode, double p, int64_t begin, int64_t end,
                         void* fp, int64_t* cp) {
  auto* f = static_cast<acc_of<scalar_t>*>(fp);
  switch (mode) {
    case PowMode::kNone: return unit_stats_typed<scalar_t, PowMode::kNone>(args, p, begin, end, f, cp);
    case PowMode::kAbs: return unit_stats_typed<scalar_t, PowMode::kAbs>(args, p, begin, end, f, cp);
    case PowMode::kPow: return unit_stats_typed<scalar_t, PowMode::kPow>(args, p, begin, end, f, cp);
  }
}

// x[0, n) *= c, vectorised as scale_chunks; the tail with scale_element.
template <typename scalar_t>
void scale_span(scalar_t* x, int64_t n, acc_of<scalar_t> c) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const VA cv(c);
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

template <typename scalar_t>
void unit_scale_typed(const UnitArgs& args, const acc_of<scalar_t>* coefs, bool conditional,
                      int64_t begin, int64_t end) {
  for (int64_t item = begin; item < end; ++item) {
    const UnitItem it = args.plan->locate(item);
    scalar_t* x = static_cast<scalar_t*>(args.spans[it.tensor].data) + it.offset;
    const int64_t row = args.plan->row[it.tensor] + it.unit;
    for (int64_t k = 0; k < it.num_units; ++k) {
      const auto c = coefs[row + k];
      if (conditional && !needs_scaling(c)) continue;  // not read, not written
      scale_span<scalar_t>(x + k * it.unit_len, it.packed ? it.unit_len : it.n, c);
    }
  }
}

// Clamp x[0, n) to [-v, v] in place; returns the elements changed. Exact selects (clamp_element)
// lane-wise: the stored value itself or the bound, so no rounding happens on the way back.
template <typename scalar_t>
int64_t clamp_span(scalar_t* x, int64_t n, acc_of<scalar_t> v_acc, scalar_t v, scalar_t neg_v) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const VA vv(v_acc), nv(-v_acc);
  VA count(acc_t(0));
  const auto clamp = [&](const VA& a) {
    count = count + a.abs().gt(vv);  // 1 or 0 per lane; NaN compares false
    return VA::blendv(VA::blendv(a, vv, a > vv), nv, a < nv);
  };
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    for (; i + VA::size() <= n; i += VA::size()) clamp(VA::loadu(x + i)).store(x + i);
  } else {
    constexpr int64_t kStep = Vectorized<scalar_t>::size();
    for (; i + kStep <= n; i += kStep) {
      VA lo, hi;
      at::vec::load_to_float<scalar_t>(x + i, lo, hi);
      at::vec::convert_from_float<scalar_t>(clamp(lo), clamp(hi)).store(x + i);
    }
  }
  acc_t lanes[VA::size()];
  count.store(lanes);
  int64_t changed = 0;
  for (int j = 0; j < VA::size(); ++j) changed += static_cast<int64_t>(lanes[j]);
  for (; i < n; ++i) {
    const acc_t a = static_cast<acc_t>(x[i]);
    changed += is_clamped(a, v_acc) ? 1 : 0;
    x[i] = clamp_element<scalar_t, acc_t>(x[i], a, v_acc, v, neg_v);
  }
  return changed;
}

// Statistics, then clamp, of blocks small enough to stay in the L1/L2 cache in between: memory
// is read once and written once.
constexpr int64_t kClampBlockElems = 8192;

template <typename scalar_t>
void clamp_typed(const UnitArgs& args, double v, int64_t begin, int64_t end, acc_of<scalar_t>* fp,
                 int64_t* cp, int64_t* clamped) {
  using acc_t = acc_of<scalar_t>;
  const scalar_t v_stored = static_cast<scalar_t>(v), neg_stored = static_cast<scalar_t>(-v);
  const acc_t v_acc = static_cast<acc_t>(v_stored);  // the bound as torch rounds it
  for (int64_t item = begin; item < end; ++item) {
    const UnitItem it = args.plan->locate(item);
    scalar_t* x = static_cast<scalar_t*>(args.spans[it.tensor].data) + it.offset;
    StatsAcc<acc_t> s;
    int64_t changed = 0;
    for (int64_t b = 0; b < it.n; b += kClampBlockElems) {
      const int64_t len = std::min(kClampBlockElems, it.n - b);
      s.combine(span_stats<scalar_t, PowMode::kNone>(x + b, len, 2.0));
      changed += clamp_span<scalar_t>(x + b, len, v_acc, v_stored, neg_stored);
    }
    s.store(fp + it.prow * kNumFloatStats, cp + it.prow * kNumCountStats);
    clamped[it.prow] = changed;
  }
}

}  // namespace

void unit_stats_items(const UnitArgs& args, PowMode mode, double p, int64_t begin, int64_t end,
                      void* fp, int64_t* cp) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return unit_stats_dispatch<float>(args, mode, p, begin, end, fp, cp);
    case c10::ScalarType::Double: return unit_stats_dispatch<double>(args, mode, p, begin, end, fp, cp);
    case c10::ScalarType::Half: return unit_stats_dispatch<c10::Half>(args, mode, p, begin, end, fp, cp);
    case c10::ScalarType::BFloat16: return unit_stats_dispatch<c10::BFloat16>(args, mode, p, begin, end, fp, cp);
    default: break;  // the op checked the dtype before
  }
}

void unit_scale_items(const UnitArgs& args, const void* coefs, bool conditional, int64_t begin,
                      int64_t end) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return unit_scale_typed<float>(args, static_cast<const float*>(coefs), conditional, begin, end);
    case c10::ScalarType::Double: return unit_scale_typed<double>(args, static_cast<const double*>(coefs), conditional, begin, end);
    case c10::ScalarType::Half: return unit_scale_typed<c10::Half>(args, static_cast<const float*>(coefs), conditional, begin, end);
    case c10::ScalarType::BFloat16: return unit_scale_typed<c10::BFloat16>(args, static_cast<const float*>(coefs), conditional, begin, end);
    default: break;
  }
}

void clamp_items(const UnitArgs& args, double v, int64_t begin, int64_t end, void* fp, int64_t* cp,
                 int64_t* clamped) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return clamp_typed<float>(args, v, begin, end, static_cast<float*>(fp), cp, clamped);
    case c10::ScalarType::Double: return clamp_typed<double>(args, v, begin, end, static_cast<double*>(fp), cp, clamped);
    case c10::ScalarType::Half: return clamp_typed<c10::Half>(args, v, begin, end, static_cast<float*>(fp), cp, clamped);
    case c10::ScalarType::BFloat16: return clamp_typed<c10::BFloat16>(args, v, begin, end, static_cast<float*>(fp), cp, clamped);
    default: break;
  }
}

}  // namespace gradfuse::cpu::CPU_CAPABILITY
