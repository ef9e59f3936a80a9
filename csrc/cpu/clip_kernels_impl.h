// Per-item CPU kernels of the clipping ops, compiled once per instruction set: included
// by stats_clip_kernels_default.cpp / stats_clip_kernels_avx2.cpp after stats_kernels_impl.h, whose
// chunk reductions (reduce_vectorized, count_nonfinite: the two passes of stats_math.h) and scale
// loop (scale_span) they reuse per unit.
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
    case PowMode::kMoments: break;  // whole tensors only (multi_tensor_moments)
  }
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

#if defined(CPU_CAPABILITY_AVX2)
// float16 / bfloat16 on AVX2: statistics and clamp in ONE loop, 16 elements per step, the clamp
// on the raw 16-bit lanes. With a = bits & 0x7fff, the order of |x| is that of a (Inf above every
// finite value, NaN above Inf), so for a bound b = bits of the stored bound (>= +0):
// an element is clamped iff b < a <= Inf's bits (NaN never is), and becomes its own sign | b:
// the same bits as torch.clamp's (the bound as torch rounds it, the sign of the clamped side;
// no conversion back from float, so nothing to round). Statistics as reduce_16bit: zero count
// and max |x| on the raw lanes, the sums on float lanes blocked as in reduce_vectorized; NaN and
// Inf counts on the raw lanes too (after the clamp an Inf would be gone). Counts live in 16-bit
// lanes, folded out every kRun * kRun steps (at most 1 024 per lane).
template <typename scalar_t>
StatsAcc<float> clamp_16bit(scalar_t* x, int64_t n, uint16_t bound_bits, int64_t* changed) {
  using VA = Vectorized<float>;
  constexpr int64_t kStep = 16;
  constexpr int64_t kRun = 32;
  constexpr uint16_t kInfBits = std::is_same_v<scalar_t, c10::BFloat16> ? 0x7f80 : 0x7c00;
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff), sign_mask = _mm256_set1_epi16(static_cast<int16_t>(0x8000));
  const __m256i zero_bits = _mm256_setzero_si256(), inf_bits = _mm256_set1_epi16(static_cast<int16_t>(kInfBits));
  const __m256i bound = _mm256_set1_epi16(static_cast<int16_t>(bound_bits));
  __m256i max_bits = zero_bits, zero_lanes = zero_bits, nan_lanes = zero_bits, inf_lanes = zero_bits,
          changed_lanes = zero_bits;
  int64_t zeros = 0, nans = 0, infs = 0, clamped = 0;
  const auto fold_counts = [&]() {
    alignas(32) uint16_t b[4][kStep];
    _mm256_store_si256(reinterpret_cast<__m256i*>(b[0]), zero_lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b[1]), nan_lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b[2]), inf_lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(b[3]), changed_lanes);
    for (int k = 0; k < kStep; ++k) {
      zeros += b[0][k];
      nans += b[1][k];
      infs += b[2][k];
      clamped += b[3][k];
    }
    zero_lanes = nan_lanes = inf_lanes = changed_lanes = zero_bits;
  };
  const VA zeros_v(0.f);
  const LaneSums<float> no_sums{zeros_v, zeros_v, zeros_v};
  LaneSums<float> r0 = no_sums, r1 = no_sums, mid = no_sums, top = no_sums;
  const auto step = [&](__m256i v) {
    const __m256i a = _mm256_and_si256(v, abs_mask);
    zero_lanes = _mm256_sub_epi16(zero_lanes, _mm256_cmpeq_epi16(a, zero_bits));  // -1 per zero
    max_bits = _mm256_max_epu16(max_bits, a);
    const __m256i nan = _mm256_cmpgt_epi16(a, inf_bits);  // a <= 0x7fff: signed compares are exact
    nan_lanes = _mm256_sub_epi16(nan_lanes, nan);
    inf_lanes = _mm256_sub_epi16(inf_lanes, _mm256_cmpeq_epi16(a, inf_bits));
    const __m256i over = _mm256_andnot_si256(nan, _mm256_cmpgt_epi16(a, bound));
    changed_lanes = _mm256_sub_epi16(changed_lanes, over);
    __m256 lo, hi;
    widen16<scalar_t>(v, lo, hi);
    add_sums<PowMode::kNone>(r0, VA(lo), zeros_v);
    add_sums<PowMode::kNone>(r1, VA(hi), zeros_v);
    return _mm256_blendv_epi8(v, _mm256_or_si256(_mm256_and_si256(v, sign_mask), bound), over);
  };
  int64_t i = 0;
  for (int runs = 1; n - i >= kStep; ++runs) {
    for (int k = 0; k < kRun && n - i >= kStep; ++k, i += kStep) {
      auto* p = reinterpret_cast<__m256i*>(x + i);
      _mm256_storeu_si256(p, step(_mm256_loadu_si256(p)));
    }
    mid.template add<PowMode::kNone>(r0, r1);
    r0 = r1 = no_sums;
    if (runs % kRun == 0) {
      top.template add<PowMode::kNone>(mid, no_sums);
      mid = no_sums;
      fold_counts();
    }
  }
  const int64_t rem = n - i;
  if (rem > 0) {  // zero-padded: a 0 adds nothing but a zero (taken off) and is never clamped
    alignas(32) uint16_t buf[kStep] = {};
    std::memcpy(buf, x + i, rem * sizeof(scalar_t));
    auto* p = reinterpret_cast<__m256i*>(buf);
    _mm256_store_si256(p, step(_mm256_load_si256(p)));
    std::memcpy(x + i, buf, rem * sizeof(scalar_t));
    mid.template add<PowMode::kNone>(r0, r1);
    zeros -= kStep - rem;
  }
  top.template add<PowMode::kNone>(mid, no_sums);
  fold_counts();
  StatsAcc<float> s;
  top.template fold_into<PowMode::kNone>(s);
  alignas(32) uint16_t b_max[kStep];
  _mm256_store_si256(reinterpret_cast<__m256i*>(b_max), max_bits);
  uint16_t max_abs_bits = 0;
  for (int k = 0; k < kStep; ++k) max_abs_bits = std::max(max_abs_bits, b_max[k]);
  s.maxabs = float_of_bits16<scalar_t>(max_abs_bits);
  s.zero = zeros;
  s.set_nonfinite_counts(nans, infs);
  *changed = clamped;
  return s;
}
#endif

template <typename scalar_t>
void clamp_typed(const UnitArgs& args, double v, int64_t begin, int64_t end, acc_of<scalar_t>* fp,
                 int64_t* cp, int64_t* clamped) {
  using acc_t = acc_of<scalar_t>;
  const scalar_t v_stored = static_cast<scalar_t>(v), neg_stored = static_cast<scalar_t>(-v);
  const acc_t v_acc = static_cast<acc_t>(v_stored);  // the bound as torch rounds it
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    if ((v_stored.x & 0x8000) == 0) {  // (a bound of -0.0 takes the loop below)
      for (int64_t item = begin; item < end; ++item) {
        const UnitItem it = args.plan->locate(item);
        scalar_t* x = static_cast<scalar_t*>(args.spans[it.tensor].data) + it.offset;
        clamp_16bit<scalar_t>(x, it.n, v_stored.x, clamped + it.prow)
            .store(fp + it.prow * kNumFloatStats, cp + it.prow * kNumCountStats);
      }
      return;
    }
  }
#endif
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
