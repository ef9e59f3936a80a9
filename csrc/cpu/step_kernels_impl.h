// Per-chunk kernels of the fused optimizer step, compiled once per instruction set (CPU_CAPABILITY
// is DEFAULT or AVX2).
//
// The vector loop does step_math.h's step_element lane-wise, with the same roundings: each
// intermediate that torch stores as a tensor is rounded to scalar_t (float16 / bfloat16 go
// through float, as torch's kernels do). Steps that hold an element torch would run in its
// scalar tail (TorchTail; 16-bit `add` with alpha only) and the last elements of a chunk take the
// scalar function. Weight, gradient and state are read once and written once.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../common/chunk_plan.h"
#include "../common/step_math.h"
#include "step_kernels.h"
#include "vec_lanes.h"

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

// The per-vector helpers below must inline into the loops (g++ left the bfloat16 load a call).
#define GRADFUSE_STEP_INLINE __attribute__((always_inline)) inline

template <typename scalar_t>
using step_acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Elements per vector step: two acc_t vectors (one float16 / bfloat16 vector).
template <typename scalar_t>
constexpr int64_t kStepElems = 2 * Vectorized<step_acc_of<scalar_t>>::size();

// Two acc_t vectors: kStepElems elements.
template <typename acc_t>
struct V2 {
  Vectorized<acc_t> lo, hi;
};

template <typename acc_t, typename F>
inline V2<acc_t> map2(const V2<acc_t>& a, F&& f) {
  return {f(a.lo), f(a.hi)};
}

template <typename acc_t, typename F>
inline V2<acc_t> map2(const V2<acc_t>& a, const V2<acc_t>& b, F&& f) {
  return {f(a.lo, b.lo), f(a.hi, b.hi)};
}

template <typename scalar_t>
GRADFUSE_STEP_INLINE V2<step_acc_of<scalar_t>> load2(const scalar_t* x) {
  using acc_t = step_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return {VA::loadu(x), VA::loadu(x + VA::size())};
  } else {
    V2<acc_t> r;
    at::vec::load_to_float<scalar_t>(x, r.lo, r.hi);
    return r;
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// A float rounded to bfloat16 and widened back, in the float's register: at::vec's rounding (to
// nearest even) without packing to 16 bits and unpacking again, and without its NaN test: every
// NaN in the step has its low 16 bits clear (it is a bfloat16 widened, the processor's default
// NaN, or one propagated from those; a NaN gradient scale is made the default NaN first), and
// such a NaN comes out of the rounding unchanged.
GRADFUSE_STEP_INLINE Vectorized<float> round_bf16(const Vectorized<float>& x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_castsi256_ps(r);
}

// Floats that are bfloat16 values already (round_bf16's), stored as bfloat16: at::vec's
// conversion (a NaN becomes 0xffff) without its rounding, which would change nothing.
GRADFUSE_STEP_INLINE void store_rounded_bf16(c10::BFloat16* out, const Vectorized<float>& lo, const Vectorized<float>& hi) {
  const __m256i nan = _mm256_set1_epi32(0xffff);
  const auto top = [&](const Vectorized<float>& v) {
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q));
    return _mm256_blendv_epi8(nan, _mm256_srli_epi32(_mm256_castps_si256(v), 16), ordered);
  };
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top(lo), top(hi)), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
}
#endif

// Stores v, whose values are scalar_t values already (the step rounds everything it stores).
template <typename scalar_t>
GRADFUSE_STEP_INLINE void store2(scalar_t* x, const V2<step_acc_of<scalar_t>>& v) {
  using acc_t = step_acc_of<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    v.lo.store(x);
    v.hi.store(x + Vectorized<acc_t>::size());
#if defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    store_rounded_bf16(x, v.lo, v.hi);
#endif
  } else {
    at::vec::convert_from_float<scalar_t>(v.lo, v.hi).store(x);
  }
}

// round_to, lane-wise: through scalar_t and back (exact for float and double).
template <typename scalar_t>
GRADFUSE_STEP_INLINE V2<step_acc_of<scalar_t>> round2(const V2<step_acc_of<scalar_t>>& v) {
  if constexpr (std::is_same_v<scalar_t, step_acc_of<scalar_t>>) {
    return v;
#if defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return {round_bf16(v.lo), round_bf16(v.hi)};
#endif
  } else {
    V2<float> r;
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(at::vec::convert_from_float<scalar_t>(v.lo, v.hi));
    r.lo = lo;
    r.hi = hi;
    return r;
  }
}

// A fused multiply-add in every lane (at::vec's default fmadd is a * b + c, two roundings).
template <typename acc_t>
inline Vectorized<acc_t> vfma(const Vectorized<acc_t>& a, const Vectorized<acc_t>& b, const Vectorized<acc_t>& c) {
#if defined(CPU_CAPABILITY_AVX2)
  return at::vec::fmadd(a, b, c);
#else
  constexpr int n = Vectorized<acc_t>::size();
  acc_t x[n], y[n], z[n];
  a.store(x);
  b.store(y);
  c.store(z);
  for (int i = 0; i < n; ++i) x[i] = std::fma(x[i], y[i], z[i]);
  return Vectorized<acc_t>::loadu(x);
#endif
}

// The vector forms of step_math.h's adam_moments, adam_finish and sgd_element, for kStepElems
// elements none of which is in a torch scalar tail.
template <typename scalar_t>
struct VecStep {
  using acc_t = step_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  using P = StepParams<scalar_t, acc_t>;
  const P& h;
  VA weight_decay, momentum, damp_alpha, neg_lr, eps, momentum_mul, lerp_weight, lerp_weight_m1, beta2,
      one_minus_beta2, bc2_sqrt, neg_step_size, decay_factor, inv_bc2_sqrt, neg_bc2_sqrt;
  bool small_weight, by_reciprocal;

  explicit VecStep(const P& p)
      : h(p), weight_decay(p.weight_decay), momentum(p.momentum), damp_alpha(p.damp_alpha), neg_lr(p.neg_lr),
        eps(p.eps), momentum_mul(p.momentum_mul), lerp_weight(p.lerp_weight),
        lerp_weight_m1(p.lerp_weight - acc_t(1)), beta2(p.beta2), one_minus_beta2(p.one_minus_beta2),
        bc2_sqrt(p.bc2_sqrt), neg_step_size(p.neg_step_size), decay_factor(p.decay_factor),
        inv_bc2_sqrt(acc_t(1) / p.bc2_sqrt), neg_bc2_sqrt(-p.bc2_sqrt),
        small_weight(std::fabs(p.lerp_weight) < acc_t(0.5)),
        by_reciprocal(std::is_same_v<acc_t, float> && p.bc2_sqrt >= std::ldexp(1.0f, -30) && p.bc2_sqrt <= 1.0f) {}

  // a / bc2_sqrt, a being a square root (0 to 2^64, inf or NaN). The divider bounds this loop, so
  // for float (and bc2_sqrt in [2^-30, 1], which every beta2 below 1 - 2^-60 gives) the quotient is
  // Markstein's: q = a * (1 / c) corrected once by the exact remainder a - q * c, which is the
  // correctly rounded a / c where nothing overflows or underflows, as these ranges ensure
  // (Markstein's theorem, 1 / c being correctly rounded; test_optim_exact.py checks roots across
  // the float range against torch's division); where the remainder is 0 (q exact) or NaN (a is
  // inf or NaN), q itself.
  inline VA over_bc2_sqrt(const VA& a) const {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<acc_t, float>) {
      if (by_reciprocal) {
        const __m256 q = _mm256_mul_ps(a, inv_bc2_sqrt);
        const __m256 r = _mm256_fmadd_ps(q, neg_bc2_sqrt, a);
        const __m256 corrected = _mm256_fmadd_ps(r, inv_bc2_sqrt, q);
        return _mm256_blendv_ps(q, corrected, _mm256_cmp_ps(r, _mm256_setzero_ps(), _CMP_NEQ_OQ));
      }
    }
#endif
    return a / bc2_sqrt;
  }

  // add_alpha outside a tail: one fused multiply-add, rounded to scalar_t.
  inline V2<acc_t> add_alpha(const V2<acc_t>& a, const V2<acc_t>& b, const VA& s) const {
    return round2<scalar_t>(map2(a, b, [&](const VA& x, const VA& y) { return vfma(s, y, x); }));
  }

  inline V2<acc_t> decayed(const V2<acc_t>& w) const {  // param.mul_(1 - lr * wd)
    return round2<scalar_t>(map2(w, [&](const VA& a) { return vec_mul_rn(a, decay_factor); }));
  }

  // adam_moments; w is not changed (decayed() gives AdamW's decayed weight). Returns the v' used.
  inline V2<acc_t> adam_moments(V2<acc_t> g, const V2<acc_t>& w, V2<acc_t>& m, V2<acc_t>& v,
                                V2<acc_t>& v_max) const {
    if (h.maximize) g = map2(g, [](const VA& a) { return a.neg(); });
    if (h.has_weight_decay && !h.decoupled) g = add_alpha(g, w, weight_decay);
    m = round2<scalar_t>(map2(m, g, [&](const VA& start, const VA& end) {
      const VA diff = end - start;
      return small_weight ? vfma(lerp_weight, diff, start) : vfma(lerp_weight_m1, diff, end);
    }));
    v = round2<scalar_t>(map2(v, [&](const VA& a) { return vec_mul_rn(a, beta2); }));
    v = round2<scalar_t>(map2(v, g, [&](const VA& a, const VA& gg) { return vfma(one_minus_beta2 * gg, gg, a); }));
    if (!h.amsgrad) return v;
    v_max = map2(v_max, v, [](const VA& x, const VA& y) { return VA::blendv(y, x, (x > y) | (x != x)); });
    return v_max;
  }

  // adam_finish: w (already decayed) to after the step, from m' and the rounded sqrt of v'.
  inline void adam_finish(const V2<acc_t>& root_of_v, const V2<acc_t>& m, V2<acc_t>& w, V2<acc_t>& root) const {
    root = round2<scalar_t>(map2(root_of_v, [&](const VA& a) { return over_bc2_sqrt(a); }));
    const V2<acc_t> denom = round2<scalar_t>(map2(root, [&](const VA& a) { return a + eps; }));
    const V2<acc_t> q = map2(m, denom, [&](const VA& mm, const VA& d) { return vec_mul_rn(neg_step_size, mm) / d; });
    w = round2<scalar_t>(map2(w, q, [](const VA& a, const VA& b) { return a + b; }));
  }

  inline void sgd(V2<acc_t> g, V2<acc_t>& w, V2<acc_t>& m) const {
    if (h.maximize) g = map2(g, [](const VA& a) { return a.neg(); });
    if (h.has_weight_decay) g = add_alpha(g, w, weight_decay);
    if (h.has_momentum) {
      m = h.first ? g
                  : add_alpha(round2<scalar_t>(map2(m, [&](const VA& a) { return vec_mul_rn(a, momentum_mul); })), g,
                              damp_alpha);
      g = h.nesterov ? add_alpha(g, m, momentum) : m;
    }
    w = add_alpha(w, g, neg_lr);
  }
};

// Running sums of one chunk's update statistics, lane-wise.
template <typename acc_t>
struct VecStepStats {
  using VA = Vectorized<acc_t>;
  VA update = VA(acc_t(0)), weight = VA(acc_t(0)), moment1 = VA(acc_t(0)), moment2 = VA(acc_t(0));
  VA update_finite = VA(acc_t(0)), weight_finite = VA(acc_t(0)), moment_finite = VA(acc_t(0));
  VA eps_dominated = VA(acc_t(0));

  inline void add(const VA& u, const VA& w, const VA& m, const VA& v, const VA& root, const VA& eps, bool adam) {
    const VA inf(std::numeric_limits<acc_t>::infinity());
    update = update + u * u;
    weight = weight + w * w;
    moment1 = moment1 + m * m;
    moment2 = moment2 + root * root;
    update_finite = update_finite + u.abs().lt(inf);
    weight_finite = weight_finite + w.abs().lt(inf);
    moment_finite = moment_finite + (m.abs().lt(inf) & v.abs().lt(inf));
    if (adam) eps_dominated = eps_dominated + root.lt(eps);
  }

  // The lanes summed in lane order into s, for `elems` elements.
  inline void into(UpdateAcc<acc_t>& s, int64_t elems) const {
    s.update_sumsq += lane_sum(update);
    s.weight_sumsq += lane_sum(weight);
    s.moment1_sumsq += lane_sum(moment1);
    s.moment2_sumsq += lane_sum(moment2);
    s.update_nonfinite += elems - lane_count(update_finite);
    s.weight_nonfinite += elems - lane_count(weight_finite);
    s.moment_nonfinite += elems - lane_count(moment_finite);
    s.eps_dominated += lane_count(eps_dominated);
  }
};

// The scalar statistics of one element, into s.
template <typename acc_t>
inline void add_element_stats(UpdateAcc<acc_t>& s, acc_t u, acc_t w, acc_t m, acc_t v, acc_t root, acc_t eps,
                              bool adam) {
  const auto nonfinite = [](acc_t x) { return std::fabs(x) < std::numeric_limits<acc_t>::infinity() ? 0 : 1; };
  s.update_sumsq += u * u;
  s.weight_sumsq += w * w;
  s.moment1_sumsq += m * m;
  s.moment2_sumsq += root * root;
  s.update_nonfinite += nonfinite(u);
  s.weight_nonfinite += nonfinite(w);
  s.moment_nonfinite += (nonfinite(m) | nonfinite(v));
  s.eps_dominated += (adam && root < eps) ? 1 : 0;
}

template <typename scalar_t>
inline scalar_t* span_at(const Span& s, int64_t offset) {
  return s.numel > 0 ? static_cast<scalar_t*>(s.data) + offset : nullptr;
}

// What one chunk needs besides its elements.
template <typename scalar_t>
struct ChunkCtx {
  using acc_t = step_acc_of<scalar_t>;
  const StepArgs& a;
  const StepParams<scalar_t, acc_t>& h;
  TorchTail tail;
  int64_t numel;        // of the whole tensor
  int64_t offset;       // of the chunk in the tensor
  bool scale, clip, write;
  acc_t scale_acc, clip_acc;
};

// Square roots of x[0, n) into out, rounded as torch's sqrt of scalar_t rounds them (MKL's for
// float and double where torch uses it, a.sqrt_f32 / a.sqrt_f64; else correctly rounded).
template <typename scalar_t>
inline void block_sqrt(const StepArgs& a, const step_acc_of<scalar_t>* x, step_acc_of<scalar_t>* out, int64_t n) {
  using acc_t = step_acc_of<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (a.sqrt_f32 != nullptr) return a.sqrt_f32(n, x, out);
  } else if constexpr (std::is_same_v<scalar_t, double>) {
    if (a.sqrt_f64 != nullptr) return a.sqrt_f64(n, x, out);
  }
  using VA = Vectorized<acc_t>;
  int64_t i = 0;
  if constexpr (!std::is_same_v<scalar_t, c10::Half>) {
    for (; i + 2 * VA::size() <= n; i += 2 * VA::size()) {
      const V2<acc_t> r = round2<scalar_t>(
          map2(V2<acc_t>{VA::loadu(x + i), VA::loadu(x + i + VA::size())}, [](const VA& v) { return v.sqrt(); }));
      r.lo.store(out + i);
      r.hi.store(out + i + VA::size());
    }
  }
  for (; i < n; ++i) out[i] = sqrt_to<scalar_t>(x[i]);
}

template <typename scalar_t>
inline void store_acc(step_acc_of<scalar_t>* out, const V2<step_acc_of<scalar_t>>& v) {
  v.lo.store(out);
  v.hi.store(out + Vectorized<step_acc_of<scalar_t>>::size());
}

template <typename scalar_t>
inline V2<step_acc_of<scalar_t>> load_acc(const step_acc_of<scalar_t>* x) {
  using VA = Vectorized<step_acc_of<scalar_t>>;
  return {VA::loadu(x), VA::loadu(x + VA::size())};
}

// The first element at or after i (of numel) that torch runs in a scalar tail, numel if none:
// the tails are the last (range length % step) elements of each of TorchTail's ranges.
inline int64_t next_tail(const TorchTail& t, int64_t i, int64_t numel) {
  if (t.none) return numel;
  for (int64_t start = (i / t.range) * t.range; start < numel; start += t.range) {
    const int64_t len = std::min(numel - start, t.range);
    const int64_t tail_start = start + len - len % t.step;
    if (tail_start < start + len && i < start + len) return std::max(i, tail_start);
  }
  return numel;
}

// What every step does once an element's weight after the step is known: the update clip
// (w_before + c * (w' - w_before) where c < 1), the statistics, the weight's store.
template <typename scalar_t, bool kStats>
struct ChunkFinish {
  using acc_t = step_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  const ChunkCtx<scalar_t>& c;
  const bool adam;
  const VA clip_v = VA(c.clip_acc), eps_v = VA(c.h.eps);
  UpdateAcc<acc_t>* row;
  VecStepStats<acc_t> lanes;
  int64_t vec_elems = 0;

  ChunkFinish(const ChunkCtx<scalar_t>& ctx, bool is_adam, UpdateAcc<acc_t>* r) : c(ctx), adam(is_adam), row(r) {}

  // kStepElems elements at w. m: the moment after the step; used: the v' whose root Adam took
  // (SGD: zeros); root: Adam's bias-corrected root (SGD: zeros).
  inline void vec(scalar_t* w, const V2<acc_t>& w_before, V2<acc_t> wv, const V2<acc_t>& m, const V2<acc_t>& used,
                  const V2<acc_t>& root) {
    if (c.clip) {
      wv = round2<scalar_t>(
          map2(w_before, wv, [&](const VA& bw, const VA& after) { return bw + vec_mul_rn(clip_v, after - bw); }));
    }
    if constexpr (kStats) {
      lanes.add(wv.lo - w_before.lo, w_before.lo, m.lo, used.lo, root.lo, eps_v, adam);
      lanes.add(wv.hi - w_before.hi, w_before.hi, m.hi, used.hi, root.hi, eps_v, adam);
      vec_elems += kStepElems<scalar_t>;
    }
    if (c.write) store2(w, wv);
  }

  inline void scalar(scalar_t* w, acc_t w_before, acc_t w_after, acc_t m, acc_t used, acc_t root) {
    if (c.clip) w_after = round_to<scalar_t>(w_before + mul_rn(c.clip_acc, w_after - w_before));
    if constexpr (kStats) add_element_stats<acc_t>(*row, w_after - w_before, w_before, m, used, root, c.h.eps, adam);
    if (c.write) *w = static_cast<scalar_t>(w_after);
  }

  // The vector lanes into the row, after the chunk's scalar elements (in this order on every path).
  inline void done() {
    if constexpr (kStats) lanes.into(*row, vec_elems);
  }
};

// One Adam element by the scalar functions (a torch scalar-tail element, or a chunk's last ones).
template <typename scalar_t>
inline StepState<step_acc_of<scalar_t>> adam_moments_at(const ChunkCtx<scalar_t>& c, const scalar_t* w,
                                                        const scalar_t* g, const scalar_t* m, const scalar_t* v,
                                                        const scalar_t* v_max, int64_t i, step_acc_of<scalar_t>& used) {
  using acc_t = step_acc_of<scalar_t>;
  StepState<acc_t> s{static_cast<acc_t>(w[i]), static_cast<acc_t>(m[i]), static_cast<acc_t>(v[i]),
                     v_max ? static_cast<acc_t>(v_max[i]) : acc_t(0), acc_t(0)};
  acc_t gk = static_cast<acc_t>(g[i]);
  if (c.scale) gk = round_to<scalar_t>(gk * c.scale_acc);
  used = adam_moments(c.h, gk, s, c.tail.at(c.offset + i, c.numel));
  return s;
}

template <typename scalar_t>
inline void store_moments(scalar_t* m, scalar_t* v, scalar_t* v_max, int64_t i, const StepState<step_acc_of<scalar_t>>& s) {
  m[i] = static_cast<scalar_t>(s.m);
  v[i] = static_cast<scalar_t>(s.v);
  if (v_max) v_max[i] = static_cast<scalar_t>(s.v_max);
}

template <typename scalar_t>
inline void store_moments2(scalar_t* m, scalar_t* v, scalar_t* v_max, int64_t i, const V2<step_acc_of<scalar_t>>& mv,
                           const V2<step_acc_of<scalar_t>>& vv, const V2<step_acc_of<scalar_t>>& xv) {
  store2(m + i, mv);
  store2(v + i, vv);
  if (v_max) store2(v_max + i, xv);
}

// Elements per Adam block: the moments of the block first, then its roots (one call where they are
// MKL's), then the weights; the block's m' and v' wait in these buffers (in L1), so memory is read
// once. Two short dependency chains: one long one per element (some eight roundings, a root and two
// quotients) left the core waiting on its latency.
constexpr int64_t kAdamBlock = 512;

// Adam over one chunk: elements [0, n) at w, g, m, v, v_max (state pointers null where absent).
template <typename scalar_t, bool kStats>
void adam_chunk(const ChunkCtx<scalar_t>& c, scalar_t* w, const scalar_t* g, scalar_t* m, scalar_t* v,
                scalar_t* v_max, int64_t n, ChunkFinish<scalar_t, kStats>& fin) {
  using acc_t = step_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  constexpr int64_t kStep = kStepElems<scalar_t>;
  const auto& h = c.h;
  const VecStep<scalar_t> vec(h);
  const V2<acc_t> zeros{VA(acc_t(0)), VA(acc_t(0))};
  const VA scale_v(c.scale_acc);
  const bool decay = h.has_weight_decay && h.decoupled;
  alignas(64) acc_t m_buf[kAdamBlock], used_buf[kAdamBlock], sqrt_buf[kAdamBlock];
  for (int64_t b = 0; b < n; b += kAdamBlock) {
    const int64_t len = std::min(kAdamBlock, n - b);
    const int64_t vec_len = c.tail.any(c.offset + b, len, c.numel) ? 0 : len - len % kStep;
    // moments
    for (int64_t k = 0; k < len;) {
      const int64_t i = b + k;
      if (k < vec_len) {
        V2<acc_t> gv = load2(g + i), mv = load2(m + i), vv = load2(v + i);
        V2<acc_t> xv = v_max ? load2(v_max + i) : zeros;
        if (c.scale) gv = round2<scalar_t>(map2(gv, [&](const VA& x) { return x * scale_v; }));
        const V2<acc_t> used = vec.adam_moments(gv, load2(w + i), mv, vv, xv);
        store_acc<scalar_t>(m_buf + k, mv);
        store_acc<scalar_t>(used_buf + k, used);
        if (c.write) store_moments2(m, v, v_max, i, mv, vv, xv);
        k += kStep;
        continue;
      }
      const StepState<acc_t> s = adam_moments_at(c, w, g, m, v, v_max, i, used_buf[k]);
      m_buf[k] = s.m;
      if (c.write) store_moments(m, v, v_max, i, s);
      ++k;
    }
    block_sqrt<scalar_t>(c.a, used_buf, sqrt_buf, len);
    // weights
    int64_t k = 0;
    for (; k < vec_len; k += kStep) {
      const int64_t i = b + k;
      const V2<acc_t> w_before = load2(w + i);
      V2<acc_t> wv = decay ? vec.decayed(w_before) : w_before, root;
      const V2<acc_t> mv = load_acc<scalar_t>(m_buf + k);
      vec.adam_finish(load_acc<scalar_t>(sqrt_buf + k), mv, wv, root);
      fin.vec(w + i, w_before, wv, mv, load_acc<scalar_t>(used_buf + k), root);
    }
    for (; k < len; ++k) {
      const int64_t i = b + k;
      const acc_t w_before = static_cast<acc_t>(w[i]);
      StepState<acc_t> s{w_before, m_buf[k], acc_t(0), acc_t(0), acc_t(0)};
      if (decay) s.w = round_to<scalar_t>(mul_rn(s.w, h.decay_factor));
      adam_finish(h, sqrt_buf[k], s);
      fin.scalar(w + i, w_before, s.w, s.m, used_buf[k], s.root);
    }
  }
}

// SGD over one chunk (m: the momentum buffer, null without momentum).
template <typename scalar_t, bool kStats>
void sgd_chunk(const ChunkCtx<scalar_t>& c, scalar_t* w, const scalar_t* g, scalar_t* m, int64_t n,
               ChunkFinish<scalar_t, kStats>& fin) {
  using acc_t = step_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  constexpr int64_t kStep = kStepElems<scalar_t>;
  const auto& h = c.h;
  const VecStep<scalar_t> vec(h);
  const V2<acc_t> zeros{VA(acc_t(0)), VA(acc_t(0))};
  const VA scale_v(c.scale_acc);
  int64_t tail_at = next_tail(c.tail, c.offset, c.numel) - c.offset;  // chunk-local, may be >= n
  for (int64_t i = 0; i < n;) {
    if (i + kStep <= n && i + kStep <= tail_at) {
      const V2<acc_t> w_before = load2(w + i);
      V2<acc_t> wv = w_before, gv = load2(g + i), mv = m ? load2(m + i) : zeros;
      if (c.scale) gv = round2<scalar_t>(map2(gv, [&](const VA& x) { return x * scale_v; }));
      vec.sgd(gv, wv, mv);
      fin.vec(w + i, w_before, wv, mv, zeros, zeros);
      if (c.write && m) store2(m + i, mv);
      i += kStep;
      continue;
    }
    // a step holding a torch scalar-tail element, or the chunk's last elements
    for (const int64_t end = std::min(n, i + kStep); i < end; ++i) {
      const acc_t w_before = static_cast<acc_t>(w[i]);
      StepState<acc_t> s{w_before, m ? static_cast<acc_t>(m[i]) : acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
      acc_t gk = static_cast<acc_t>(g[i]);
      if (c.scale) gk = round_to<scalar_t>(gk * c.scale_acc);
      sgd_element(c.h, gk, s, c.tail.at(c.offset + i, c.numel));
      fin.scalar(w + i, w_before, s.w, s.m, acc_t(0), acc_t(0));
      if (c.write && m) m[i] = static_cast<scalar_t>(s.m);
    }
    if (i > tail_at) tail_at = next_tail(c.tail, c.offset + i, c.numel) - c.offset;
  }
}

// x, or a quiet NaN without payload for any NaN (round_bf16 takes NaNs with their low 16 bits
// clear).
template <typename acc_t>
inline acc_t canonical_nan(acc_t x) {
  return std::isnan(x) ? std::numeric_limits<acc_t>::quiet_NaN() : x;
}

// One chunk of tensor t: elements [offset, offset + n).
template <typename scalar_t, UpdateRule rule, bool kStats>
void step_chunk(const StepArgs& a, const StepParams<scalar_t, step_acc_of<scalar_t>>& h, const TorchTail& tail,
                int64_t t, int64_t offset, int64_t n, UpdateAcc<step_acc_of<scalar_t>>* row) {
  using acc_t = step_acc_of<scalar_t>;
  const double uc = a.update_coefs ? a.update_coefs[t] : 1.0;
  const double gs = a.grad_scales ? a.grad_scales[t] : a.grad_scale;
  const ChunkCtx<scalar_t> c{a, h, tail, a.params[t].numel, offset, a.scale_grads, a.update_coefs && clips_update(uc),
                             a.write, canonical_nan(static_cast<acc_t>(gs)), static_cast<acc_t>(uc)};
  scalar_t* w = span_at<scalar_t>(a.params[t], offset);
  const scalar_t* g = span_at<scalar_t>(a.grads[t], offset);
  ChunkFinish<scalar_t, kStats> fin(c, rule == UpdateRule::kAdam, row);
  if constexpr (rule == UpdateRule::kAdam) {
    adam_chunk<scalar_t, kStats>(c, w, g, span_at<scalar_t>(a.moment1[t], offset),
                                 span_at<scalar_t>(a.moment2[t], offset),
                                 h.amsgrad ? span_at<scalar_t>(a.moment2_max[t], offset) : nullptr, n, fin);
  } else {
    sgd_chunk<scalar_t, kStats>(c, w, g, h.has_momentum ? span_at<scalar_t>(a.moment1[t], offset) : nullptr, n, fin);
  }
  fin.done();
}

template <typename scalar_t, UpdateRule rule>
void step_chunks_typed(const StepArgs& a, int64_t begin, int64_t end, step_acc_of<scalar_t>* fp, int64_t* cp) {
  using acc_t = step_acc_of<scalar_t>;
  const int64_t* fc = a.first_chunk;
  int64_t t = owner_of_chunk(fc, a.num_tensors, begin), params_of = -1;
  StepParams<scalar_t, acc_t> h{};
  TorchTail tail;
  for (int64_t c = begin; c < end; ++c) {
    while (fc[t + 1] <= c) ++t;
    if (params_of != t) {
      h = StepParams<scalar_t, acc_t>::from_row(a.coefs + t * kNumStepCoefs, rule);
      // only a 16-bit `add` with alpha differs between torch's loops (SGD; Adam's L2 decay)
      const bool adds_alpha = rule == UpdateRule::kSGD || (h.has_weight_decay && !h.decoupled);
      tail = std::is_same_v<scalar_t, acc_t> || !adds_alpha ? TorchTail{}
                                                             : TorchTail::of(a.params[t].numel, a.torch_threads);
      params_of = t;
    }
    const int64_t offset = (c - fc[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, a.params[t].numel - offset);
    if (fp != nullptr) {
      UpdateAcc<acc_t> row;
      step_chunk<scalar_t, rule, true>(a, h, tail, t, offset, n, &row);
      row.store(fp + c * kNumUpdateFloatStats, cp + c * kNumUpdateCountStats);
    } else {
      step_chunk<scalar_t, rule, false>(a, h, tail, t, offset, n, nullptr);
    }
  }
}

template <typename scalar_t>
void step_dispatch_rule(const StepArgs& a, int64_t begin, int64_t end, void* fp, int64_t* cp) {
  auto* f = static_cast<step_acc_of<scalar_t>*>(fp);
  if (a.rule == UpdateRule::kAdam) {
    step_chunks_typed<scalar_t, UpdateRule::kAdam>(a, begin, end, f, cp);
  } else {
    step_chunks_typed<scalar_t, UpdateRule::kSGD>(a, begin, end, f, cp);
  }
}

}  // namespace

void step_chunks(const StepArgs& a, int64_t begin, int64_t end, void* float_partials, int64_t* count_partials) {
  switch (a.dtype) {
    case c10::ScalarType::Float: return step_dispatch_rule<float>(a, begin, end, float_partials, count_partials);
    case c10::ScalarType::Double: return step_dispatch_rule<double>(a, begin, end, float_partials, count_partials);
    case c10::ScalarType::Half: return step_dispatch_rule<c10::Half>(a, begin, end, float_partials, count_partials);
    case c10::ScalarType::BFloat16:
      return step_dispatch_rule<c10::BFloat16>(a, begin, end, float_partials, count_partials);
    default: break;  // the op checked the dtype before
  }
}

}  // namespace gradfuse::cpu::CPU_CAPABILITY

#undef GRADFUSE_STEP_INLINE
