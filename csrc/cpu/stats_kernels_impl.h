// Per-chunk CPU kernels, compiled once per instruction set (CPU_CAPABILITY is DEFAULT or AVX2).
//
// Statistics: the two passes of stats_math.h, as the CUDA kernel runs them. Pass 1 keeps sum,
// sum of squares, max |x|, zero count (and sum |x|^p when the norm needs it; with kMoments, sum
// and powsum of x - K) in independent vector lanes; its scalar tail is ElementAcc::add itself.
// Pass 2 (NaN and Inf counts) runs only on a chunk whose sum of squares is not finite.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "../common/chunk_plan.h"
#include "stats_kernels.h"

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

// Whether a zero-padded last vector step leaves the sums as they are: not for |x|^p with p <= 0
// (the raw op; gradfuse sends p < 0 elsewhere), whose tail (< one step) takes ElementAcc::add
// instead. kMoments pads its shift vector with zeros too (padded_shift): a padded lane then adds
// 0 - 0, not (0 - K) and K^2, which taken off again would swamp the sum of squared deviations.
template <PowMode mode>
inline bool padding_adds_nothing(double p) {
  return mode != PowMode::kPow || p > 0;
}

// The shift K as `count` elements of scalar_t followed by zeros (kPairElems in all, as the tail
// buffer): loaded like the tail, the lanes of its first `count` elements hold K, the others 0.
// K is an element of the tensor, so exact in scalar_t.
template <typename scalar_t, int64_t kElems>
inline void fill_padded_shift(scalar_t (&buf)[kElems], double shift, int64_t count) {
  for (int64_t i = 0; i < kElems; ++i) buf[i] = i < count ? static_cast<scalar_t>(shift) : scalar_t(0);
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

  // The lanes added in lane order into a chunk's row (whose sums start at 0).
  template <PowMode mode>
  inline void fold_into(StatsAcc<acc_t>& s) const {
    s.sum += lane_sum(sum);
    s.sumsq += lane_sum(sumsq);
    if constexpr (mode != PowMode::kNone) s.powsum += lane_sum(powsum);
  }

  static inline acc_t lane_sum(const V& v) {
    acc_t b[V::size()];
    v.store(b);
    acc_t t = 0;
    for (int i = 0; i < V::size(); ++i) t += b[i];
    return t;
  }
};

// The sums of one vector of x into r (the AVX2 loops; Lanes::add does the same): x and x^2, or
// with kMoments x - K (shift: K in every lane), x^2 and (x - K)^2.
template <PowMode mode, typename acc_t>
inline void add_sums(LaneSums<acc_t>& r, const Vectorized<acc_t>& x, const Vectorized<acc_t>& shift) {
  if constexpr (mode == PowMode::kMoments) {
    const Vectorized<acc_t> d = x - shift;
    r.sum = r.sum + d;
    r.powsum = at::vec::fmadd(d, d, r.powsum);
  } else {
    r.sum = r.sum + x;
  }
  r.sumsq = at::vec::fmadd(x, x, r.sumsq);
}

// Pass 1 of one vector stream.
template <typename acc_t>
struct Lanes {
  using V = Vectorized<acc_t>;
  LaneSums<acc_t> run;
  V maxabs, zero;

  // p: the power of kPow, the shift of kMoments (as ElementAcc::add).
  template <PowMode mode>
  inline void add(const V& x, const V& p) {
    const V a = x.abs();
    add_sums<mode>(run, x, p);
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
  // The tail (fewer than kPairElems elements: all of a tiny tensor) as one more vector step on a
  // zero-padded copy: a padded 0 adds nothing to the sums and max |x| (nor to |x|^p for p > 0),
  // and is taken off the zero count. 16 scalar steps would cost more than the rest of a tiny
  // tensor's work.
  const int64_t rem = n - done;
  int64_t padded = 0;
  if (rem > 0 && padding_adds_nothing<mode>(p)) {
    scalar_t buf[kPairElems<scalar_t>];
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), x + done, rem * sizeof(scalar_t));
    if constexpr (mode == PowMode::kMoments) {
      scalar_t shift_buf[kPairElems<scalar_t>];
      fill_padded_shift(shift_buf, p, rem);
      VA s_lo, s_hi;
      for_each_vector_pair(shift_buf, kPairElems<scalar_t>, [&](const VA& lo, const VA& hi) { s_lo = lo, s_hi = hi; });
      for_each_vector_pair(buf, kPairElems<scalar_t>, [&](const VA& lo, const VA& hi) {
        l0.template add<mode>(lo, s_lo);
        l1.template add<mode>(hi, s_hi);
      });
    } else {
      for_each_vector_pair(buf, kPairElems<scalar_t>, add);
    }
    mid.template add<mode>(l0.run, l1.run);
    padded = kPairElems<scalar_t> - rem;
    done = n;
  }
  top.template add<mode>(mid, no_sums);
  StatsAcc<acc_t> s;
  top.template fold_into<mode>(s);
  acc_t b_max0[VA::size()], b_max1[VA::size()];
  l0.maxabs.store(b_max0);
  l1.maxabs.store(b_max1);
  const VA zero_lanes = l0.zero + l1.zero;  // exact: at most a chunk per lane
  acc_t b_zero[VA::size()];
  zero_lanes.store(b_zero);
  for (int i = 0; i < VA::size(); ++i) {  // in lane order
    s.maxabs = nan_max(s.maxabs, nan_max(b_max0[i], b_max1[i]));
    s.zero += static_cast<int64_t>(b_zero[i]);
  }
  s.zero -= padded;
  ElementAcc<acc_t> tail;  // see padding_adds_nothing
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

#if defined(CPU_CAPABILITY_AVX2)
// Pass 1 over one chunk of float16 / bfloat16 on AVX2, on the raw 16-bit lanes where it can: with
// the sign bit cleared, x == 0 is a 16-bit compare with 0 and max |x| a 16-bit unsigned max (the
// order of |x| is that of its bits, Inf above every finite value; a NaN's bits are above Inf, but
// a NaN makes the sum of squares NaN, and pass 2 then sets max |x| to NaN in any case). 16
// elements per step take 2 integer operations for these, where the float lanes take 8. Only the
// sums run on float lanes, blocked as in reduce_vectorized. bfloat16 widens by interleaving with
// zeros (the lanes then hold the elements in another order; the sums do not depend on it),
// float16 by vcvtph2ps.
template <typename scalar_t>
inline void widen16(__m256i v, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i z = _mm256_setzero_si256();
    lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
  } else {
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
  }
}

// Zero-padding loads of the last rem (< 8) floats of a chunk: masked-off lanes read as +0.0 and
// touch no memory, so a tiny tensor needs no copy to a padded buffer.
inline __m256 load_tail_ps(const float* x, int64_t rem) {
  alignas(32) static const int32_t kMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_maskload_ps(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask + 8 - rem)));
}

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int64_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// Asks for byte `ahead` of a chunk of nbytes at `bytes`, or past its end, for the memory read
// after it (`pf`: the next chunk or tensor; may be null).
inline void prefetch_ahead(const char* bytes, int64_t nbytes, int64_t ahead, const char* pf) {
  if (ahead < nbytes) {
    _mm_prefetch(bytes + ahead, _MM_HINT_T0);
  } else if (pf != nullptr) {
    _mm_prefetch(pf + (ahead - nbytes), _MM_HINT_T0);
  }
}

// Pass 1 over one chunk of float32 on AVX2: reduce_vectorized's blocked sums, with the other
// statistics in fewer operations per vector: max |x| as max(max x, -min x) (no |x| per element;
// both ignore NaN like the float lanes did, and pass 2 restores it), the zero count as an
// integer lane count (compare, subtract the all-ones mask: 2 operations where eq() took 3). 6
// vector operations per 8 elements for p = 2. The tail (< 16 elements: all of a tiny tensor) is
// read with masked loads (the masked-off lanes are +0.0, taken off the zero count); the lanes
// are folded in registers. `pf` (may be null) is the memory read after this chunk: the next
// tensor's first bytes, prefetched while this chunk is reduced (a new tensor is a new stream to
// the hardware prefetcher, which starts it late: on 10 000 tensors of 4-16 KB that was a miss
// per cache line).
template <PowMode mode>
StatsAcc<float> reduce_f32(const float* x, int64_t n, double p, const char* pf) {
  using VA = Vectorized<float>;
  constexpr int64_t kStep = 16;  // elements per step: two vectors, one cache line
  constexpr int64_t kRun = 32;   // as in reduce_vectorized
  constexpr int64_t kAhead = 2048;  // prefetch distance in bytes
  const __m256 zero_ps = _mm256_setzero_ps();
  __m256 mx0 = zero_ps, mx1 = zero_ps, mn0 = zero_ps, mn1 = zero_ps;
  __m256i z0 = _mm256_setzero_si256(), z1 = z0;
  const VA pv(static_cast<float>(p)), zeros(0.f);
  const LaneSums<float> no_sums{zeros, zeros, zeros};
  LaneSums<float> r0 = no_sums, r1 = no_sums, mid = no_sums, top = no_sums;
  // s0, s1: the shift of kMoments per lane (pv; in the tail 0 in the padded lanes)
  const auto step = [&](__m256 lo, __m256 hi, LaneSums<float>& r0, LaneSums<float>& r1, const VA& s0,
                        const VA& s1) {
    const VA l(lo), h(hi);
    add_sums<mode>(r0, l, s0);
    add_sums<mode>(r1, h, s1);
    mx0 = _mm256_max_ps(mx0, lo);
    mn0 = _mm256_min_ps(mn0, lo);
    mx1 = _mm256_max_ps(mx1, hi);
    mn1 = _mm256_min_ps(mn1, hi);
    z0 = _mm256_sub_epi32(z0, _mm256_castps_si256(_mm256_cmp_ps(lo, zero_ps, _CMP_EQ_OQ)));
    z1 = _mm256_sub_epi32(z1, _mm256_castps_si256(_mm256_cmp_ps(hi, zero_ps, _CMP_EQ_OQ)));
    if constexpr (mode == PowMode::kAbs) {
      r0.powsum = r0.powsum + l.abs();
      r1.powsum = r1.powsum + h.abs();
    } else if constexpr (mode == PowMode::kPow) {
      r0.powsum = r0.powsum + l.abs().pow(pv);
      r1.powsum = r1.powsum + h.abs().pow(pv);
    }
  };
  const char* const bytes = reinterpret_cast<const char*>(x);
  const int64_t nbytes = n * static_cast<int64_t>(sizeof(float));
  int64_t i = 0;
  for (int runs = 1; n - i >= kStep; ++runs) {
    // Two sum streams, not four as in reduce_16bit: with the max, min and zero lanes, four would
    // need more than the 16 vector registers (measured: a third slower on cached data).
    for (int k = 0; k < kRun && n - i >= kStep; ++k, i += kStep) {
      prefetch_ahead(bytes, nbytes, i * static_cast<int64_t>(sizeof(float)) + kAhead, pf);
      step(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i + 8), r0, r1, pv, pv);
    }
    mid.template add<mode>(r0, r1);
    r0 = r1 = no_sums;
    if (runs % kRun == 0) {
      top.template add<mode>(mid, no_sums);
      mid = no_sums;
    }
  }
  const int64_t rem = n - i;
  int64_t padded = 0;
  if (rem > 0 && padding_adds_nothing<mode>(p)) {  // zero-padded, as in reduce_vectorized
    const __m256 lo = rem >= 8 ? _mm256_loadu_ps(x + i) : load_tail_ps(x + i, rem);
    const __m256 hi = rem > 8 ? load_tail_ps(x + i + 8, rem - 8) : zero_ps;
    if constexpr (mode == PowMode::kMoments) {
      alignas(32) float shift[kStep];
      fill_padded_shift(shift, p, rem);
      step(lo, hi, r0, r1, VA::loadu(shift), VA::loadu(shift + 8));
    } else {
      step(lo, hi, r0, r1, pv, pv);
    }
    mid.template add<mode>(r0, r1);
    padded = kStep - rem;
    i = n;
  }
  top.template add<mode>(mid, no_sums);
  StatsAcc<float> s;
  top.template fold_into<mode>(s);
  const __m256 neg_min = _mm256_sub_ps(zero_ps, _mm256_min_ps(mn0, mn1));
  s.maxabs = hmax_ps(_mm256_max_ps(_mm256_max_ps(mx0, mx1), neg_min));
  s.zero = hsum_epi32(_mm256_add_epi32(z0, z1)) - padded;
  ElementAcc<float> tail;  // see padding_adds_nothing
  for (; i < n; ++i) tail.template add<mode>(x[i], static_cast<float>(p));
  s.combine(tail.stats());
  return s;
}

template <typename scalar_t>
inline float float_of_bits16(uint16_t bits) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  } else {
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
}

template <typename scalar_t, PowMode mode>
StatsAcc<float> reduce_16bit(const scalar_t* x, int64_t n, double p, const char* pf) {
  using VA = Vectorized<float>;
  constexpr int64_t kStep = 16;  // elements per 256-bit load
  constexpr int64_t kRun = 32;   // as in reduce_vectorized
  static_assert(kChunkElems / kStep < 32768, "16-bit zero counts per lane must not overflow");
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff), zero_bits = _mm256_setzero_si256();
  __m256i max_bits = zero_bits, zero_lanes = zero_bits;
  const VA pv(static_cast<float>(p)), zeros(0.f);
  const LaneSums<float> no_sums{zeros, zeros, zeros};
  LaneSums<float> r0 = no_sums, r1 = no_sums, r2 = no_sums, r3 = no_sums, mid = no_sums, top = no_sums;
  // s0, s1: the shift of kMoments per lane (pv; in the tail 0 in the padded lanes)
  const auto step = [&](__m256i v, LaneSums<float>& r0, LaneSums<float>& r1, const VA& s0, const VA& s1) {
    const __m256i a = _mm256_and_si256(v, abs_mask);
    zero_lanes = _mm256_sub_epi16(zero_lanes, _mm256_cmpeq_epi16(a, zero_bits));  // -1 per zero
    max_bits = _mm256_max_epu16(max_bits, a);
    __m256 lo, hi;
    widen16<scalar_t>(v, lo, hi);
    const VA l(lo), h(hi);
    add_sums<mode>(r0, l, s0);
    add_sums<mode>(r1, h, s1);
    if constexpr (mode == PowMode::kAbs || mode == PowMode::kPow) {
      __m256 alo, ahi;
      widen16<scalar_t>(a, alo, ahi);  // |x|, exactly
      if constexpr (mode == PowMode::kAbs) {
        r0.powsum = r0.powsum + VA(alo);
        r1.powsum = r1.powsum + VA(ahi);
      } else {
        r0.powsum = r0.powsum + VA(alo).pow(pv);
        r1.powsum = r1.powsum + VA(ahi).pow(pv);
      }
    }
  };
  constexpr int64_t kAhead = 2048;  // prefetch distance in bytes, as in reduce_f32
  const char* const bytes = reinterpret_cast<const char*>(x);
  const int64_t nbytes = n * static_cast<int64_t>(sizeof(scalar_t));
  int64_t i = 0;
  for (int runs = 1; n - i >= kStep; ++runs) {
    // Two steps (one cache line) per iteration into four sum streams: with two, the latency of
    // the sum-of-squares FMA chain bounded the loop (half of what the vector units can do).
    for (int k = 0; k < kRun && n - i >= kStep; ++k) {
      prefetch_ahead(bytes, nbytes, i * static_cast<int64_t>(sizeof(scalar_t)) + kAhead, pf);
      step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), r0, r1, pv, pv);
      if (n - i >= 2 * kStep) {
        step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + kStep)), r2, r3, pv, pv);
        i += 2 * kStep;
      } else {
        i += kStep;
      }
    }
    mid.template add<mode>(r0, r1);
    mid.template add<mode>(r2, r3);
    r0 = r1 = r2 = r3 = no_sums;
    if (runs % kRun == 0) {
      top.template add<mode>(mid, no_sums);
      mid = no_sums;
    }
  }
  const int64_t rem = n - i;
  int64_t padded = 0;
  if (rem > 0 && padding_adds_nothing<mode>(p)) {  // zero-padded, as in reduce_vectorized
    alignas(32) uint16_t buf[kStep] = {};
    std::memcpy(buf, x + i, rem * sizeof(scalar_t));
    if constexpr (mode == PowMode::kMoments) {
      // widened as the data, so each lane's shift sits where its element does
      alignas(32) scalar_t shift[kStep];
      fill_padded_shift(shift, p, rem);
      __m256 s_lo, s_hi;
      widen16<scalar_t>(_mm256_load_si256(reinterpret_cast<const __m256i*>(shift)), s_lo, s_hi);
      step(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)), r0, r1, VA(s_lo), VA(s_hi));
    } else {
      step(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)), r0, r1, pv, pv);
    }
    mid.template add<mode>(r0, r1);
    padded = kStep - rem;
    i = n;
  }
  top.template add<mode>(mid, no_sums);
  StatsAcc<float> s;
  top.template fold_into<mode>(s);
  alignas(32) uint16_t b_max[kStep], b_zero[kStep];
  _mm256_store_si256(reinterpret_cast<__m256i*>(b_max), max_bits);
  _mm256_store_si256(reinterpret_cast<__m256i*>(b_zero), zero_lanes);
  uint16_t max_abs_bits = 0;
  for (int k = 0; k < kStep; ++k) {
    max_abs_bits = std::max(max_abs_bits, b_max[k]);
    s.zero += b_zero[k];
  }
  s.maxabs = float_of_bits16<scalar_t>(max_abs_bits);
  s.zero -= padded;
  ElementAcc<float> tail;  // see padding_adds_nothing
  for (; i < n; ++i) tail.template add<mode>(static_cast<float>(x[i]), static_cast<float>(p));
  s.combine(tail.stats());
  return s;
}
#endif

// Both passes over one chunk.
template <typename scalar_t, PowMode mode>
inline StatsAcc<acc_of<scalar_t>> reduce_chunk(const scalar_t* x, int64_t n, double p,
                                                const char* pf = nullptr) {
#if defined(CPU_CAPABILITY_AVX2)
  constexpr bool k16 = std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16>;
  StatsAcc<acc_of<scalar_t>> s;
  if constexpr (k16) {
    s = reduce_16bit<scalar_t, mode>(x, n, p, pf);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    s = reduce_f32<mode>(x, n, p, pf);
  } else {
    s = reduce_vectorized<scalar_t, mode>(x, n, p);
  }
#else
  auto s = reduce_vectorized<scalar_t, mode>(x, n, p);
#endif
  if (needs_nonfinite_count(s)) {
    const NonfiniteCount counts = count_nonfinite(x, n);
    s.set_nonfinite_counts(static_cast<int64_t>(counts.nan), static_cast<int64_t>(counts.inf));
  }
  return s;
}

// StatsTensorsFn (stats_kernels.h) for one dtype and mode.
template <typename scalar_t>
double tensor_shift(const Span& span) {
  return static_cast<double>(moment_shift<acc_of<scalar_t>>(static_cast<const scalar_t*>(span.data), span.numel));
}

template <typename scalar_t, PowMode mode>
void stats_tensors_typed(const ChunkArgs& args, double p, int64_t begin, int64_t end,
                         acc_of<scalar_t>* float_partials, int64_t* count_partials,
                         double* out_f, int64_t* out_c) {
  const int64_t* fc = args.first_chunk;
  const int64_t n = args.num_tensors, total = fc[n];
  int64_t t = owner_of_chunk(fc, n, begin);
  if (fc[t] >= begin) {
    while (t > 0 && fc[t - 1] >= begin) --t;  // empty tensors starting at chunk `begin`
  }
  // Each tensor's first cache line is a miss of its own (a tiny tensor has no other): ask for
  // the next tensors' while this one is reduced.
  constexpr int64_t kAhead = 8;
  for (; t < n && (fc[t] < end || end == total); ++t) {
    if (t + kAhead < n) {
      const Span& ahead = args.spans[t + kAhead];
      if constexpr (mode == PowMode::kMoments) {  // the shift's samples, each on a line of its own
        for (int k = 0; k < kShiftSamples && ahead.numel; ++k) {
          __builtin_prefetch(static_cast<const scalar_t*>(ahead.data) + shift_sample(ahead.numel, k));
        }
      } else {
        __builtin_prefetch(ahead.data);
      }
    }
    const Span span = args.spans[t];
    const auto* x = static_cast<const scalar_t*>(span.data);
    // kMoments: the pass's parameter is the tensor's shift (the same for all of its chunks)
    const double param = mode == PowMode::kMoments ? tensor_shift<scalar_t>(span) : p;
    const int64_t c0 = std::max(fc[t], begin), c1 = std::min(fc[t + 1], end);
    // What is read after each chunk (for its prefetch): the next chunk, or the next tensor.
    const char* next_tensor = t + 1 < n ? static_cast<const char*>(args.spans[t + 1].data) : nullptr;
    const auto after = [&](int64_t c, int64_t offset) {
      return c + 1 < fc[t + 1] ? reinterpret_cast<const char*>(x + offset + kChunkElems) : next_tensor;
    };
    if (fc[t] >= begin && fc[t + 1] <= end) {  // the whole tensor: its row
      StatsAcc<double> s;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t offset = (c - fc[t]) * kChunkElems;
        s.combine(reduce_chunk<scalar_t, mode>(x + offset, std::min(kChunkElems, span.numel - offset), param,
                                               after(c, offset)));
      }
      if constexpr (mode == PowMode::kMoments) s.finish_moments(param, span.numel);
      s.store(out_f + t * kNumFloatStats, out_c + t * kNumCountStats);
      out_c[t * kNumCountStats + kNumel] = span.numel;
    } else {  // a part: its chunks' partials
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t offset = (c - fc[t]) * kChunkElems;
        reduce_chunk<scalar_t, mode>(x + offset, std::min(kChunkElems, span.numel - offset), param, after(c, offset))
            .store(float_partials + c * kNumFloatStats, count_partials + c * kNumCountStats);
      }
    }
  }
}

template <typename scalar_t>
void stats_tensors_dispatch_mode(const ChunkArgs& args, PowMode mode, double p, int64_t begin,
                                 int64_t end, void* fp, int64_t* cp, double* of, int64_t* oc) {
  auto* f = static_cast<acc_of<scalar_t>*>(fp);
  switch (mode) {
    case PowMode::kNone: return stats_tensors_typed<scalar_t, PowMode::kNone>(args, p, begin, end, f, cp, of, oc);
    case PowMode::kAbs: return stats_tensors_typed<scalar_t, PowMode::kAbs>(args, p, begin, end, f, cp, of, oc);
    case PowMode::kPow: return stats_tensors_typed<scalar_t, PowMode::kPow>(args, p, begin, end, f, cp, of, oc);
    case PowMode::kMoments: return stats_tensors_typed<scalar_t, PowMode::kMoments>(args, p, begin, end, f, cp, of, oc);
  }
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
    reduce_chunk<scalar_t, mode>(x, n, p).store(float_partials + c * kNumFloatStats, count_partials + c * kNumCountStats);
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
    case PowMode::kMoments: break;  // whole tensors only (stats_tensors)
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// In-place scale of float16 / bfloat16 on AVX2, 16 elements per 256-bit step, with the bits of
// at::vec's load_to_float / convert_from_float, which torch's x.mul_(c) stores too: the product
// in float, rounded to nearest even. Fewer operations per element than those conversions (no
// lane extraction or permutation), so that the loop keeps up with memory.
//
// bfloat16: the even elements of a step widen with a 16-bit shift of each 32-bit lane, the odd
// ones by clearing the low half, so the products stay in the lanes they came from and no
// permutation is needed on the way back. The rounding runs on 16-bit lanes: with H and L the high
// and low halves of a product, the result is H + 1 where L + (H & 1) > 0x8000 (the carry of
// at::vec's bits + 0x7fff + lsb; a carry into the exponent gives Inf as there), that is where
// L - (~H & 1), saturated at 0, has its top bit set. A NaN product has H & 0x7fff > 0x7f80
// (quiet, so bit 6 of H is set) and stores 0xffff, as at::vec does.
inline __m256i scale_bf16x16(__m256i v, __m256 cv) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const __m256i one = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi16(0x7fff), inf_bits = _mm256_set1_epi16(0x7f80);
  const __m256i even = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), cv));
  const __m256i odd = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high_half)), cv));
  const __m256i hi = _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA);
  const __m256i lo = _mm256_blend_epi16(even, _mm256_slli_epi32(odd, 16), 0xAA);
  // -1 (round up) where L - (~H & 1) >= 0x8000: its top bit, as a signed compare with 0
  const __m256i round_up = _mm256_cmpgt_epi16(zero, _mm256_subs_epu16(lo, _mm256_andnot_si256(hi, one)));
  const __m256i nan = _mm256_cmpgt_epi16(_mm256_and_si256(hi, abs_mask), inf_bits);
  return _mm256_or_si256(_mm256_sub_epi16(hi, round_up), nan);
}

// How far ahead of the in-place bfloat16 scale its loop prefetches. The step's arithmetic (about
// 4.5 cycles per 32 bytes) otherwise runs mostly in series with the misses of its loads: against
// torch scaling float32 of the same bytes in place on one thread, about 70% without, 95% with
// 2-8 KB ahead. (float16's F16C step is shorter: 85% without.)
constexpr int64_t kScalePrefetchBytes = 4096;

// Returns the elements done (a multiple of 16; the rest is the caller's scalar tail).
template <typename scalar_t>
int64_t scale_16bit(scalar_t* x, int64_t n, float c) {
  const __m256 cv = _mm256_set1_ps(c);
  int64_t i = 0;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    constexpr int64_t kAhead = kScalePrefetchBytes / sizeof(scalar_t);
    const auto two_steps = [x, cv](int64_t k) {  // two independent steps
      auto* p = reinterpret_cast<__m256i*>(x + k);
      const __m256i a = _mm256_loadu_si256(p), b = _mm256_loadu_si256(p + 1);
      _mm256_storeu_si256(p, scale_bf16x16(a, cv));
      _mm256_storeu_si256(p + 1, scale_bf16x16(b, cv));
    };
    // One prefetch per 32 elements (a 64-byte line), only of the span's own elements.
    for (; i + 32 + kAhead <= n; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(x + i + kAhead), _MM_HINT_T0);
      two_steps(i);
    }
    for (; i + 32 <= n; i += 32) two_steps(i);
    for (; i + 16 <= n; i += 16) {
      auto* p = reinterpret_cast<__m256i*>(x + i);
      _mm256_storeu_si256(p, scale_bf16x16(_mm256_loadu_si256(p), cv));
    }
  } else {  // float16: F16C both ways, 128-bit loads and stores (no lane extraction)
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const auto at = [x](int64_t k) { return reinterpret_cast<__m128i*>(x + k); };
    for (; i + 32 <= n; i += 32) {
      const __m256 a = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i))), cv);
      const __m256 b = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i + 8))), cv);
      const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i + 16))), cv);
      const __m256 e = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i + 24))), cv);
      _mm_storeu_si128(at(i), _mm256_cvtps_ph(a, kRound));
      _mm_storeu_si128(at(i + 8), _mm256_cvtps_ph(b, kRound));
      _mm_storeu_si128(at(i + 16), _mm256_cvtps_ph(d, kRound));
      _mm_storeu_si128(at(i + 24), _mm256_cvtps_ph(e, kRound));
    }
    for (; i + 16 <= n; i += 16) {
      const __m256 a = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i))), cv);
      const __m256 b = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(at(i + 8))), cv);
      _mm_storeu_si128(at(i), _mm256_cvtps_ph(a, kRound));
      _mm_storeu_si128(at(i + 8), _mm256_cvtps_ph(b, kRound));
    }
  }
  return i;
}
#endif

// x[0, n) *= c in place, vectorised in steps of one Vectorized<scalar_t>; the tail with
// scale_element. The one scale loop of the CPU backend: multi_tensor_scale_ (scale_chunks) and
// the per-unit scale (clip_kernels_impl.h).
template <typename scalar_t>
void scale_span(scalar_t* x, int64_t n, acc_of<scalar_t> c) {
  using acc_t = acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const VA cv(c);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    static_assert(Vectorized<scalar_t>::size() == 16, "the same split into steps and tail");
    i = scale_16bit<scalar_t>(x, n, c);
  } else
#endif
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
void scale_chunks_typed(const ChunkArgs& args, double coef, int64_t begin, int64_t end) {
  const auto c = static_cast<acc_of<scalar_t>>(coef);
  int64_t t = owner_of_chunk(args.first_chunk, args.num_tensors, begin);
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    while (args.first_chunk[t + 1] <= chunk) ++t;
    const int64_t offset = (chunk - args.first_chunk[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, args.spans[t].numel - offset);
    scale_span<scalar_t>(static_cast<scalar_t*>(args.spans[t].data) + offset, n, c);
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

void stats_tensors(const ChunkArgs& args, PowMode mode, double p, int64_t begin, int64_t end,
                   void* float_partials, int64_t* count_partials, double* out_f, int64_t* out_c) {
  switch (args.dtype) {
    case c10::ScalarType::Float:
      return stats_tensors_dispatch_mode<float>(args, mode, p, begin, end, float_partials, count_partials, out_f, out_c);
    case c10::ScalarType::Double:
      return stats_tensors_dispatch_mode<double>(args, mode, p, begin, end, float_partials, count_partials, out_f, out_c);
    case c10::ScalarType::Half:
      return stats_tensors_dispatch_mode<c10::Half>(args, mode, p, begin, end, float_partials, count_partials, out_f, out_c);
    case c10::ScalarType::BFloat16:
      return stats_tensors_dispatch_mode<c10::BFloat16>(args, mode, p, begin, end, float_partials, count_partials, out_f, out_c);
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
