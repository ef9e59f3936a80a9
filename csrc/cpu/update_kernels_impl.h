// Per-chunk kernels of the optimizer-update ops, compiled once per instruction set (CPU_CAPABILITY
// is DEFAULT or AVX2).
//
// The vector loops do the operations of update_math.h's update_element, applied_update_part and
// clipped_weight lane-wise, in the same order, each rounded to acc_t (float, or double for double
// input; float16 / bfloat16 are widened to float as they are loaded); the scalar tail of a chunk
// (fewer than one step of elements) calls those functions. Every element is read once; the stats
// kernel writes only its chunk's partial row, the clip kernel only the weights.
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

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "../common/chunk_plan.h"
#include "../common/update_math.h"
#include "update_kernels.h"
#include "vec_lanes.h"

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

template <typename scalar_t>
using update_acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Elements per vector step: two acc_t vectors (one float16 / bfloat16 vector).
template <typename scalar_t>
constexpr int64_t kUpdateStep = 2 * Vectorized<update_acc_of<scalar_t>>::size();

// x[0, kUpdateStep) as two acc_t vectors; an absent tensor (null) reads as zeros.
template <typename scalar_t>
inline void load_step(const scalar_t* x, Vectorized<update_acc_of<scalar_t>>& lo,
                      Vectorized<update_acc_of<scalar_t>>& hi) {
  using acc_t = update_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  if (x == nullptr) {
    lo = hi = VA(acc_t(0));
  } else if constexpr (std::is_same_v<scalar_t, acc_t>) {
    lo = VA::loadu(x);
    hi = VA::loadu(x + VA::size());
  } else {
    static_assert(kUpdateStep<scalar_t> == Vectorized<scalar_t>::size());
    at::vec::load_to_float<scalar_t>(x, lo, hi);
  }
}

// load_step for the stats kernel, which pairs the elements of its arrays lane by lane but does
// not depend on their order: on AVX2 a bfloat16 vector widens by interleaving with zeros (2
// operations where load_to_float takes 5; the lanes then hold the elements in another order, the
// same for every array, as in the stats kernels' widen16).
template <typename scalar_t>
inline void load_step_any_order(const scalar_t* x, Vectorized<update_acc_of<scalar_t>>& lo,
                                Vectorized<update_acc_of<scalar_t>>& hi) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (x != nullptr) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i z = _mm256_setzero_si256();
      lo = Vectorized<float>(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v)));
      hi = Vectorized<float>(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v)));
      return;
    }
  }
#endif
  load_step(x, lo, hi);
}

// Rounds two acc_t vectors to scalar_t into x[0, kUpdateStep).
template <typename scalar_t>
inline void store_step(scalar_t* x, const Vectorized<update_acc_of<scalar_t>>& lo,
                       const Vectorized<update_acc_of<scalar_t>>& hi) {
  using acc_t = update_acc_of<scalar_t>;
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    lo.store(x);
    hi.store(x + Vectorized<acc_t>::size());
  } else {
    at::vec::convert_from_float<scalar_t>(lo, hi).store(x);
  }
}

// UpdateParams in every lane.
template <typename acc_t>
struct VecParams {
  using VA = Vectorized<acc_t>;
  VA weight_decay, beta1, beta2, eps, one_minus_beta1, one_minus_beta2, one_minus_dampening;
  VA one_minus_one_minus_beta1;  // acc_t(1) - (1 - beta1), lerp_element's other branch
  VA neg_lr, neg_step_size, inv_bias_correction2_sqrt, decay, decay_factor, one_plus_decay;

  explicit VecParams(const UpdateParams<acc_t>& h)
      : weight_decay(h.weight_decay), beta1(h.beta1), beta2(h.beta2), eps(h.eps),
        one_minus_beta1(h.one_minus_beta1), one_minus_beta2(h.one_minus_beta2),
        one_minus_dampening(h.one_minus_dampening), one_minus_one_minus_beta1(acc_t(1) - h.one_minus_beta1),
        neg_lr(-h.lr), neg_step_size(-h.step_size), inv_bias_correction2_sqrt(h.inv_bias_correction2_sqrt),
        decay(h.decay), decay_factor(h.decay_factor), one_plus_decay(acc_t(1) + h.decay) {}
};

// update_element, lane-wise.
template <typename acc_t>
struct VecElement {
  Vectorized<acc_t> update, moment1, root, moment2;
};

template <UpdateRule rule, typename acc_t>
inline VecElement<acc_t> vec_update_element(const UpdateParams<acc_t>& h, const VecParams<acc_t>& p,
                                            const Vectorized<acc_t>& w, Vectorized<acc_t> g,
                                            const Vectorized<acc_t>& m, const Vectorized<acc_t>& v,
                                            const Vectorized<acc_t>& v_max, bool has_buffer) {
  using VA = Vectorized<acc_t>;
  VecElement<acc_t> e;
  if (h.maximize) g = g.neg();
  if constexpr (rule == UpdateRule::kAdam) {
    if (h.weight_decay != acc_t(0) && !h.decoupled) g = g + p.weight_decay * w;
    // lerp_element(m, g, 1 - beta1)
    e.moment1 = h.one_minus_beta1 < acc_t(0.5) ? m + p.one_minus_beta1 * (g - m)
                                               : g - (g - m) * p.one_minus_one_minus_beta1;
    VA v_new = v * p.beta2 + p.one_minus_beta2 * g * g;
    if (h.amsgrad) v_new = VA::blendv(v_new, v_max, (v_max > v_new) | (v_max != v_max));  // nan_max
    e.moment2 = v_new;
    e.root = vec_mul_rn(v_new.sqrt(), p.inv_bias_correction2_sqrt);  // adam_root
    const VA adam = p.neg_step_size * (e.moment1 / (e.root + p.eps));
    e.update = h.decoupled ? (vec_mul_rn(w, p.decay_factor) - w) + adam : adam;
    return e;
  } else {
    VA d = h.weight_decay != acc_t(0) ? g + p.weight_decay * w : g;
    const VA zeros(acc_t(0));
    e.moment1 = zeros;
    if (h.beta1 != acc_t(0)) {
      const VA buf = has_buffer ? m * p.beta1 + p.one_minus_dampening * d : d;
      e.moment1 = buf;
      d = h.nesterov ? d + p.beta1 * buf : buf;
    }
    e.root = zeros;
    e.moment2 = zeros;
    e.update = p.neg_lr * d;
    return e;
  }
}

// Sums of squares in lanes, blocked as the stats kernels block theirs (LaneSums): a run of kRun
// steps starts from zero and is then added into the chunk's sums, so a lane adds at most
// kRun + kChunkElems / (kRun * kUpdateStep) terms in sequence, not thousands.
template <typename acc_t>
struct VecSumSq {
  using VA = Vectorized<acc_t>;
  VA update, weight, moment1, moment2;

  inline void add(const VecSumSq& o) {
    update = update + o.update;
    weight = weight + o.weight;
    moment1 = moment1 + o.moment1;
    moment2 = moment2 + o.moment2;
  }
};

// The vector part of one chunk of the stats op: its first elements, a multiple of kUpdateStep,
// into s; returns how many. kCounts: also the non-finite counts. Without them (the first pass)
// those counts are 0, which holds where the sums of squares come out finite: a NaN or Inf update,
// weight or moment (root: sqrt(v') / sqrt(1 - beta2^t) >= sqrt(v')) makes its sum of squares NaN
// or Inf (every square is >= 0), as in the stats op's two passes (stats_math.h).
template <typename scalar_t, UpdateRule rule, bool kCounts>
int64_t update_stats_vectors(const UpdateParams<update_acc_of<scalar_t>>& h, const scalar_t* w, const scalar_t* g,
                             const scalar_t* m, const scalar_t* v, const scalar_t* v_max, int64_t n,
                             bool has_buffer, UpdateAcc<update_acc_of<scalar_t>>& s) {
  using acc_t = update_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  constexpr int64_t kStep = kUpdateStep<scalar_t>;
  constexpr int kRun = 32;
  static_assert(kChunkElems / Vectorized<acc_t>::size() < (1 << 24), "lane counts must stay exact");
  const VecParams<acc_t> p(h);
  const VA zeros(acc_t(0)), inf(std::numeric_limits<acc_t>::infinity()), eps(h.eps);
  const VecSumSq<acc_t> no_sums{zeros, zeros, zeros, zeros};
  VecSumSq<acc_t> top = no_sums, run = no_sums;
  // finite counts per lane (1 per finite value), and eps-dominated ones
  VA update_finite = zeros, weight_finite = zeros, moment_finite = zeros, eps_dominated = zeros;
  const auto add = [&](const VA& wv, const VecElement<acc_t>& e) {
    run.update = run.update + e.update * e.update;
    run.weight = run.weight + wv * wv;
    run.moment1 = run.moment1 + e.moment1 * e.moment1;
    run.moment2 = run.moment2 + e.root * e.root;
    if constexpr (kCounts) {
      update_finite = update_finite + e.update.abs().lt(inf);
      weight_finite = weight_finite + wv.abs().lt(inf);
      moment_finite = moment_finite + (e.moment1.abs().lt(inf) & e.moment2.abs().lt(inf));  // each on its own
    }
    if constexpr (rule == UpdateRule::kAdam) eps_dominated = eps_dominated + e.root.lt(eps);
  };
  int64_t i = 0;
  while (n - i >= kStep) {
    for (int k = 0; k < kRun && n - i >= kStep; ++k, i += kStep) {
      VA w_lo, w_hi, g_lo, g_hi, m_lo, m_hi, v_lo, v_hi, x_lo, x_hi;
      load_step_any_order(w + i, w_lo, w_hi);
      load_step_any_order(g + i, g_lo, g_hi);
      load_step_any_order(m ? m + i : nullptr, m_lo, m_hi);
      load_step_any_order(v ? v + i : nullptr, v_lo, v_hi);
      load_step_any_order(v_max ? v_max + i : nullptr, x_lo, x_hi);
      add(w_lo, vec_update_element<rule>(h, p, w_lo, g_lo, m_lo, v_lo, x_lo, has_buffer));
      add(w_hi, vec_update_element<rule>(h, p, w_hi, g_hi, m_hi, v_hi, x_hi, has_buffer));
    }
    top.add(run);
    run = no_sums;
  }
  s = UpdateAcc<acc_t>{};
  s.update_sumsq = lane_sum(top.update);
  s.weight_sumsq = lane_sum(top.weight);
  s.moment1_sumsq = lane_sum(top.moment1);
  s.moment2_sumsq = lane_sum(top.moment2);
  if constexpr (kCounts) {
    s.update_nonfinite = i - lane_count(update_finite);
    s.weight_nonfinite = i - lane_count(weight_finite);
    s.moment_nonfinite = i - lane_count(moment_finite);
  }
  s.eps_dominated = lane_count(eps_dominated);
  return i;
}

// The partial row of one chunk of the stats op. m, v, v_max: null where absent.
template <typename scalar_t, UpdateRule rule>
UpdateAcc<update_acc_of<scalar_t>> update_stats_chunk(const UpdateParams<update_acc_of<scalar_t>>& h,
                                                      const scalar_t* w, const scalar_t* g, const scalar_t* m,
                                                      const scalar_t* v, const scalar_t* v_max, int64_t n) {
  using acc_t = update_acc_of<scalar_t>;
  const bool has_buffer = m != nullptr;
  if (rule == UpdateRule::kSGD && h.beta1 == acc_t(0)) m = nullptr;  // not read
  if (!h.amsgrad) v_max = nullptr;  // not read
  if (rule == UpdateRule::kSGD) v = v_max = nullptr;
  UpdateAcc<acc_t> s;
  int64_t i = update_stats_vectors<scalar_t, rule, false>(h, w, g, m, v, v_max, n, has_buffer, s);
  if (!(std::isfinite(s.update_sumsq) && std::isfinite(s.weight_sumsq) && std::isfinite(s.moment1_sumsq) &&
        std::isfinite(s.moment2_sumsq))) {
    i = update_stats_vectors<scalar_t, rule, true>(h, w, g, m, v, v_max, n, has_buffer, s);  // pass 2
  }
  UpdateElementAcc<acc_t> tail;
  for (; i < n; ++i) {
    const acc_t wi = static_cast<acc_t>(w[i]);
    const acc_t mi = m ? static_cast<acc_t>(m[i]) : acc_t(0);
    const acc_t vi = v ? static_cast<acc_t>(v[i]) : acc_t(0);
    const acc_t xi = v_max ? static_cast<acc_t>(v_max[i]) : acc_t(0);
    tail.add(h, wi, update_element(h, wi, static_cast<acc_t>(g[i]), mi, vi, xi, has_buffer));
  }
  s.combine(tail.row());
  return s;
}

// One chunk of the clip op: w = clipped_weight(h, w, applied_update_part(h, g, m, v), c) in place.
// m, v: the state the step left (v: moment2_max with amsgrad), null where absent. first_max:
// amsgrad without moment2_max, v is moment2 and the loop takes first_amsgrad_max(v).
template <typename scalar_t, UpdateRule rule>
void update_clip_chunk(const UpdateParams<update_acc_of<scalar_t>>& h, update_acc_of<scalar_t> c, scalar_t* w,
                       const scalar_t* g, const scalar_t* m, const scalar_t* v, int64_t n, bool first_max) {
  using acc_t = update_acc_of<scalar_t>;
  using VA = Vectorized<acc_t>;
  constexpr int64_t kStep = kUpdateStep<scalar_t>;
  const VecParams<acc_t> p(h);
  const VA cv(c);
  const bool buffer_update = h.beta1 != acc_t(0) && !h.nesterov;  // SGD: the buffer is the update
  const bool reads_grad = rule == UpdateRule::kSGD && !buffer_update;
  const VA zeros(acc_t(0));
  const auto part = [&](const VA& gv, const VA& mv, VA vv) -> VA {  // applied_update_part
    if constexpr (rule == UpdateRule::kAdam) {
      if (first_max) vv = VA::blendv(vv, zeros, vv < zeros);  // first_amsgrad_max: a NaN stays
      const VA root = vec_mul_rn(vv.sqrt(), p.inv_bias_correction2_sqrt);  // adam_root
      return vec_mul_rn(p.neg_step_size, mv / (root + p.eps));
    } else {
      if (buffer_update) return vec_mul_rn(p.neg_lr, mv);
      const VA gg = h.maximize ? gv.neg() : gv;
      return vec_mul_rn(p.neg_lr, h.beta1 != acc_t(0) ? gg + vec_mul_rn(p.beta1, mv) : gg);
    }
  };
  const auto clipped = [&](const VA& wa, const VA& a) {  // clipped_weight
    const VA w_before = (wa - a) / p.one_plus_decay;
    return w_before + vec_mul_rn(cv, a + vec_mul_rn(p.decay, w_before));
  };
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    VA w_lo, w_hi, g_lo, g_hi, m_lo, m_hi, v_lo, v_hi;
    load_step(w + i, w_lo, w_hi);
    load_step(reads_grad ? g + i : nullptr, g_lo, g_hi);
    load_step(m ? m + i : nullptr, m_lo, m_hi);
    load_step(rule == UpdateRule::kAdam && v ? v + i : nullptr, v_lo, v_hi);
    store_step(w + i, clipped(w_lo, part(g_lo, m_lo, v_lo)), clipped(w_hi, part(g_hi, m_hi, v_hi)));
  }
  for (; i < n; ++i) {
    const acc_t mi = m ? static_cast<acc_t>(m[i]) : acc_t(0);
    acc_t vi = v ? static_cast<acc_t>(v[i]) : acc_t(0);
    if (first_max) vi = first_amsgrad_max(vi);
    const acc_t a = applied_update_part(h, static_cast<acc_t>(g[i]), mi, vi);
    w[i] = static_cast<scalar_t>(clipped_weight(h, static_cast<acc_t>(w[i]), a, c));
  }
}

template <typename scalar_t>
inline const scalar_t* span_data(const Span& s, int64_t offset) {
  return s.numel > 0 ? static_cast<const scalar_t*>(s.data) + offset : nullptr;
}

template <typename scalar_t, UpdateRule rule>
void update_stats_chunks_typed(const UpdateArgs& args, int64_t begin, int64_t end,
                               update_acc_of<scalar_t>* float_partials, int64_t* count_partials) {
  using acc_t = update_acc_of<scalar_t>;
  const int64_t* fc = args.first_chunk;
  int64_t t = owner_of_chunk(fc, args.num_tensors, begin), params_of = -1;
  UpdateParams<acc_t> h{};
  for (int64_t c = begin; c < end; ++c) {
    while (fc[t + 1] <= c) ++t;
    if (params_of != t) {
      h = UpdateParams<acc_t>::from_row(args.hyper + t * kNumHyper, rule);
      params_of = t;
    }
    const int64_t offset = (c - fc[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, args.params[t].numel - offset);
    update_stats_chunk<scalar_t, rule>(h, span_data<scalar_t>(args.params[t], offset),
                                       span_data<scalar_t>(args.grads[t], offset),
                                       span_data<scalar_t>(args.moment1[t], offset),
                                       span_data<scalar_t>(args.moment2[t], offset),
                                       span_data<scalar_t>(args.moment2_max[t], offset), n)
        .store(float_partials + c * kNumUpdateFloatStats, count_partials + c * kNumUpdateCountStats);
  }
}

template <typename scalar_t, UpdateRule rule>
void update_clip_chunks_typed(const UpdateArgs& args, const double* coefs, int64_t begin, int64_t end) {
  using acc_t = update_acc_of<scalar_t>;
  const int64_t* fc = args.first_chunk;
  int64_t t = owner_of_chunk(fc, args.num_tensors, begin), params_of = -1;
  UpdateParams<acc_t> h{};
  for (int64_t c = begin; c < end; ++c) {
    while (fc[t + 1] <= c) ++t;
    if (!clips_update(coefs[t])) continue;
    if (params_of != t) {
      h = UpdateParams<acc_t>::from_row(args.hyper + t * kNumHyper, rule);
      params_of = t;
    }
    const int64_t offset = (c - fc[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, args.params[t].numel - offset);
    const bool first_max = h.amsgrad && args.moment2_max[t].numel == 0;  // first_amsgrad_max(moment2)
    const Span& v_after = h.amsgrad && !first_max ? args.moment2_max[t] : args.moment2[t];
    update_clip_chunk<scalar_t, rule>(h, static_cast<acc_t>(coefs[t]),
                                      static_cast<scalar_t*>(args.params[t].data) + offset,
                                      span_data<scalar_t>(args.grads[t], offset),
                                      span_data<scalar_t>(args.moment1[t], offset),
                                      span_data<scalar_t>(v_after, offset), n, first_max);
  }
}

template <typename scalar_t>
void update_stats_dispatch_rule(const UpdateArgs& args, int64_t begin, int64_t end, void* fp, int64_t* cp) {
  auto* f = static_cast<update_acc_of<scalar_t>*>(fp);
  if (args.rule == UpdateRule::kAdam) {
    update_stats_chunks_typed<scalar_t, UpdateRule::kAdam>(args, begin, end, f, cp);
  } else {
    update_stats_chunks_typed<scalar_t, UpdateRule::kSGD>(args, begin, end, f, cp);
  }
}

template <typename scalar_t>
void update_clip_dispatch_rule(const UpdateArgs& args, const double* coefs, int64_t begin, int64_t end) {
  if (args.rule == UpdateRule::kAdam) {
    update_clip_chunks_typed<scalar_t, UpdateRule::kAdam>(args, coefs, begin, end);
  } else {
    update_clip_chunks_typed<scalar_t, UpdateRule::kSGD>(args, coefs, begin, end);
  }
}

}  // namespace

void update_stats_chunks(const UpdateArgs& args, int64_t begin, int64_t end, void* float_partials,
                         int64_t* count_partials) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return update_stats_dispatch_rule<float>(args, begin, end, float_partials, count_partials);
    case c10::ScalarType::Double: return update_stats_dispatch_rule<double>(args, begin, end, float_partials, count_partials);
    case c10::ScalarType::Half: return update_stats_dispatch_rule<c10::Half>(args, begin, end, float_partials, count_partials);
    case c10::ScalarType::BFloat16:
      return update_stats_dispatch_rule<c10::BFloat16>(args, begin, end, float_partials, count_partials);
    default: break;  // the op checked the dtype before
  }
}

void update_clip_chunks(const UpdateArgs& args, const double* coefs, int64_t begin, int64_t end) {
  switch (args.dtype) {
    case c10::ScalarType::Float: return update_clip_dispatch_rule<float>(args, coefs, begin, end);
    case c10::ScalarType::Double: return update_clip_dispatch_rule<double>(args, coefs, begin, end);
    case c10::ScalarType::Half: return update_clip_dispatch_rule<c10::Half>(args, coefs, begin, end);
    case c10::ScalarType::BFloat16: return update_clip_dispatch_rule<c10::BFloat16>(args, coefs, begin, end);
    default: break;  // the op checked the dtype before
  }
}

}  // namespace gradfuse::cpu::CPU_CAPABILITY
