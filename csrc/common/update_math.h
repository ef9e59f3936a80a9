// Per-element arithmetic of the optimizer-update ops, shared by the CPU and CUDA backends:
// the update that torch.optim.SGD, Adam or AdamW is about to apply to one element, formed as
// torch's own step forms it (torch/optim/sgd.py, adam.py: the same operations in the same order,
// each rounded to acc_t), from the weight, the gradient and the optimizer's state before the step.
//
//  - multi_tensor_update_stats reads the state *before* optimizer.step() and reduces, per tensor,
//    the rows laid out by GRADFUSE_UPDATE_FLOAT_STATS / GRADFUSE_UPDATE_COUNT_STATS. It writes
//    nothing and keeps no temporaries.
//  - multi_tensor_update_clip_ runs *after* optimizer.step(), on the state the step left, and
//    rescales the update just applied by a per-tensor coefficient c < 1:
//    w = w_before + c * u, with u = w_after - w_before, without a copy of w_before. Every update
//    here is a + k * w_before, where a does not depend on the weight and can be formed again from
//    the state the step left (and the gradient), and k is the weight's own coefficient
//    (-lr * weight_decay where the decay is outside the state, else 0). So
//    w_before = (w_after - a) / (1 + k) and the clipped weight is w_before + c * (a + k * w_before).
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "stats_math.h"

namespace gradfuse {

// The optimizer whose step is formed (the op's `rule` argument).
enum class UpdateRule : int64_t { kSGD = 0, kAdam = 1 };

// The hyper-parameter table: float64 [n, kNumHyper], one row per tensor, on the tensors' device
// (so a tensor learning rate or a capturable step counter never goes through the host).
// SGD reads kBeta1 as momentum and kBeta2 as dampening; kStep is Adam's step number t of the step
// being taken (the state's step + 1); kFlags holds UpdateFlag bits as a float64 integer.
enum HyperColumn : int { kLr, kWeightDecay, kBeta1, kBeta2, kEps, kStep, kFlags, kNumHyper };
enum UpdateFlag : int { kMaximize = 1, kNesterov = 2, kAmsgrad = 4, kDecoupled = 8 };

// The update-statistics rows (float64 [n, kNumUpdateFloatStats], int64 [n, kNumUpdateCountStats]),
// the one place the C++ side declares them (gradfuse/ops/layout.py declares them for Python):
//   update_sumsq   sum u^2 of the update u = w_after - w_before
//   weight_sumsq   sum w^2 of the weight before the step
//   moment1_sumsq  sum m'^2 of the first moment after the step (Adam's exp_avg, SGD's momentum
//                  buffer; 0 for SGD without momentum)
//   moment2_sumsq  sum r^2 of Adam's bias-corrected root r = sqrt(v') / sqrt(1 - beta2^t) (v' the
//                  second moment after the step, its running max with amsgrad); 0 for SGD
//   update_nonfinite, weight_nonfinite: NaN or Inf elements of u, of w
//   moment_nonfinite  elements whose m' or v' is NaN or Inf
//   eps_dominated     Adam: elements with r < eps (the denominator is mostly eps)
//   numel             (written when a row is finished)
#define GRADFUSE_UPDATE_FLOAT_STATS(X) \
  X(kUpdateSumSq, update_sumsq, Add)   \
  X(kWeightSumSq, weight_sumsq, Add)   \
  X(kMoment1SumSq, moment1_sumsq, Add) \
  X(kMoment2SumSq, moment2_sumsq, Add)
#define GRADFUSE_UPDATE_COUNT_STATS(X)       \
  X(kUpdateNonfinite, update_nonfinite, Add) \
  X(kWeightNonfinite, weight_nonfinite, Add) \
  X(kMomentNonfinite, moment_nonfinite, Add) \
  X(kEpsDominated, eps_dominated, Add)

#define GRADFUSE_UPDATE_ENUM(column, member, combine) column,
enum UpdateFloatStat : int { GRADFUSE_UPDATE_FLOAT_STATS(GRADFUSE_UPDATE_ENUM) kNumUpdateFloatStats };
enum UpdateCountStat : int { GRADFUSE_UPDATE_COUNT_STATS(GRADFUSE_UPDATE_ENUM) kUpdateNumel, kNumUpdateCountStats };
#undef GRADFUSE_UPDATE_ENUM

// A reduced row of the update statistics (chunk, tensor), as StatsAcc is for the gradient's: one
// member per column of the tables above, and combine, store, load and for_each (acc_row.h).
template <typename acc_t>
struct UpdateAcc {
  GRADFUSE_ACC_ROW(UpdateAcc, GRADFUSE_UPDATE_FLOAT_STATS, GRADFUSE_UPDATE_COUNT_STATS)
};

// One tensor's constants, from its row of the hyper table. Scalars torch computes in Python
// floats (the bias corrections, the step size) are computed here in double and then rounded to
// acc_t, as torch rounds a Python scalar to the dtype an op computes in.
template <typename acc_t>
struct UpdateParams {
  UpdateRule rule;
  bool maximize, nesterov, amsgrad, decoupled;
  acc_t lr, weight_decay, beta1, beta2, eps;
  acc_t one_minus_beta1;  // Adam: exp_avg.lerp_(grad, 1 - beta1)
  acc_t one_minus_beta2;  // Adam: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  acc_t one_minus_dampening;  // SGD: buf.mul_(momentum).add_(grad, alpha=1 - dampening)
  acc_t step_size;            // Adam: lr / (1 - beta1^t)
  acc_t inv_bias_correction2_sqrt;  // Adam: 1 / sqrt(1 - beta2^t), so that r is one product
  acc_t decay;          // the weight's coefficient k in u = a + k * w_before (0 or -lr * weight_decay)
  acc_t decay_factor;   // AdamW's param.mul_(1 - lr * weight_decay)

  C10_HOST_DEVICE static inline UpdateParams from_row(const double* row, UpdateRule rule) {
    UpdateParams h;
    h.rule = rule;
    const int flags = static_cast<int>(row[kFlags]);
    h.maximize = (flags & kMaximize) != 0;
    h.nesterov = (flags & kNesterov) != 0;
    h.amsgrad = (flags & kAmsgrad) != 0;
    h.decoupled = (flags & kDecoupled) != 0;
    h.lr = acc_t(row[kLr]);
    h.weight_decay = acc_t(row[kWeightDecay]);
    h.beta1 = acc_t(row[kBeta1]);
    h.beta2 = acc_t(row[kBeta2]);
    h.eps = acc_t(row[kEps]);
    h.one_minus_beta1 = acc_t(1.0 - row[kBeta1]);
    h.one_minus_beta2 = acc_t(1.0 - row[kBeta2]);
    h.one_minus_dampening = acc_t(1.0 - row[kBeta2]);
    const double t = row[kStep];
    h.step_size = acc_t(row[kLr] / (1.0 - ::pow(row[kBeta1], t)));
    h.inv_bias_correction2_sqrt = acc_t(1.0 / ::sqrt(1.0 - ::pow(row[kBeta2], t)));
    h.decay_factor = acc_t(1.0 - row[kLr] * row[kWeightDecay]);
    // Where the decay sits outside the state: AdamW's decoupled decay, and SGD's when the update
    // is not the momentum buffer itself (no momentum, or nesterov).
    const bool outside = rule == UpdateRule::kAdam ? h.decoupled : (row[kBeta1] == 0.0 || h.nesterov);
    h.decay = outside ? acc_t(-row[kLr] * row[kWeightDecay]) : acc_t(0);
    return h;
  }
};

// torch.lerp's formula (aten/src/ATen/native/Lerp.h): exact at both ends.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t lerp_element(acc_t start, acc_t end, acc_t weight) {
  return weight < acc_t(0.5) ? start + weight * (end - start) : end - (end - start) * (acc_t(1) - weight);
}

// Adam's bias-corrected root r = sqrt(v) * (1 / sqrt(1 - beta2^t)): torch divides by
// sqrt(1 - beta2^t); the product with the reciprocal, formed once per tensor, is within an ulp of
// that quotient and spares an IEEE division per element. Rounded on its own (mul_rn): r + eps
// comes out the same whether or not the compiler contracts it.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t adam_root(const UpdateParams<acc_t>& h, acc_t v) {
  return mul_rn(acc_t(::sqrt(v)), h.inv_bias_correction2_sqrt);
}

// One element's update and moments.
template <typename acc_t>
struct UpdateElement {
  acc_t update;   // u = w_after - w_before
  acc_t moment1;  // m' (Adam), the momentum buffer after the step (SGD with momentum), else 0
  acc_t root;     // Adam: r = sqrt(v') / sqrt(1 - beta2^t) (adam_root); else 0
  acc_t moment2;  // Adam: v' as the denominator uses it; else 0
};

// Before the step. m, v, v_max: the state before the step, 0 where the state does not exist yet
// (Adam's moments start at zero). has_buffer: SGD's momentum buffer exists (the first step takes
// the buffer to be the gradient itself, not a zero buffer decayed).
template <typename acc_t>
C10_HOST_DEVICE inline UpdateElement<acc_t> update_element(const UpdateParams<acc_t>& h, acc_t w, acc_t g,
                                                           acc_t m, acc_t v, acc_t v_max, bool has_buffer) {
  UpdateElement<acc_t> e;
  if (h.maximize) g = -g;
  if (h.rule == UpdateRule::kAdam) {
    if (h.weight_decay != acc_t(0) && !h.decoupled) g = g + h.weight_decay * w;  // grad.add(param, alpha=wd)
    e.moment1 = lerp_element(m, g, h.one_minus_beta1);
    acc_t v_new = v * h.beta2 + h.one_minus_beta2 * g * g;
    if (h.amsgrad) v_new = nan_max(v_max, v_new);  // torch.maximum: a NaN on either side propagates
    e.moment2 = v_new;
    e.root = adam_root(h, v_new);
    const acc_t adam = -h.step_size * (e.moment1 / (e.root + h.eps));  // param.addcdiv_(m, denom, value=-step_size)
    // param.mul_(1 - lr * wd) first. The product is rounded on its own (mul_rn), as torch rounds
    // it: contracted into w * (1 - lr * wd) - w, it would be the exact -lr * wd * w, which differs
    // from torch's step by far more than an ulp of the update where the update is mostly decay.
    e.update = h.decoupled ? (mul_rn(w, h.decay_factor) - w) + adam : adam;
    return e;
  }
  acc_t d = h.weight_decay != acc_t(0) ? g + h.weight_decay * w : g;  // grad.add(param, alpha=wd)
  e.moment1 = 0;
  if (h.beta1 != acc_t(0)) {
    const acc_t buf = has_buffer ? m * h.beta1 + h.one_minus_dampening * d : d;
    e.moment1 = buf;
    d = h.nesterov ? d + h.beta1 * buf : buf;
  }
  e.root = 0;
  e.moment2 = 0;
  e.update = -h.lr * d;  // param.add_(grad, alpha=-lr)
  return e;
}

// The clip (applied_update_part, clipped_weight) rounds every product that feeds an addition on
// its own (mul_rn), so that its weights are the same bits whether or not the compiler contracts
// a * b + c into an FMA (nvcc does by default, g++ on an FMA target): the CPU and CUDA backends
// write the same weights. The statistics (update_element) leave the other products to the
// compiler: a contracted v * beta2 + (1 - beta2) * g * g, lerp, g + wd * w or the momentum
// buffer differs by at most an ulp of its result, far inside the statistics' tolerance.

// What amsgrad's running max is where the state holds no moment2_max: that of a first amsgrad
// step, torch.maximum(zeros, v) (0 where v < 0; a NaN kept). The clip's v_after then.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t first_amsgrad_max(acc_t v) {
  return nan_max(acc_t(0), v);
}

// After the step: the part a of the update just applied that does not depend on the weight,
// formed again from the state the step left (m, v or v_max, the momentum buffer) and the gradient.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t applied_update_part(const UpdateParams<acc_t>& h, acc_t g, acc_t m_after,
                                                 acc_t v_after) {
  if (h.rule == UpdateRule::kAdam) {
    return mul_rn(-h.step_size, m_after / (adam_root(h, v_after) + h.eps));
  }
  if (h.beta1 != acc_t(0) && !h.nesterov) return mul_rn(-h.lr, m_after);  // the buffer holds the decay
  if (h.maximize) g = -g;
  return mul_rn(-h.lr, h.beta1 != acc_t(0) ? g + mul_rn(h.beta1, m_after) : g);
}

// After the step: the weight w_before + c * u, from w_after = w_before * (1 + k) + a.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t clipped_weight(const UpdateParams<acc_t>& h, acc_t w_after, acc_t a, acc_t c) {
  const acc_t w_before = (w_after - a) / (acc_t(1) + h.decay);
  return w_before + mul_rn(c, a + mul_rn(h.decay, w_before));
}

// Whether a tensor's update must be rescaled: a coefficient below 1 (a NaN coefficient, from an
// update that is not finite, leaves the weights as the step left them).
template <typename T>
C10_HOST_DEVICE inline bool clips_update(T coef) {
  return coef < T(1);
}

// Non-finite test of one value, as a count (two instructions on the GPU, see ElemCount).
template <typename acc_t>
C10_HOST_DEVICE inline ElemCount nonfinite_count(acc_t x) {
  return ::fabs(x) < acc_t(INFINITY) ? ElemCount(0) : ElemCount(1);
}

// Accumulates one element into a thread's or a scalar tail's running sums.
template <typename acc_t>
struct UpdateElementAcc {
  acc_t update_sumsq = 0, weight_sumsq = 0, moment1_sumsq = 0, moment2_sumsq = 0;
  ElemCount update_nonfinite = 0, weight_nonfinite = 0, moment_nonfinite = 0, eps_dominated = 0;

  C10_HOST_DEVICE inline void add(const UpdateParams<acc_t>& h, acc_t w, const UpdateElement<acc_t>& e) {
    add_sums(h, w, e);
    add_nonfinite(w, e);
  }

  // The sums of squares and eps_dominated: pass 1 of a kernel that counts the non-finite values
  // in a second pass, only where sums_finite() is false. A NaN or Inf update, weight or moment
  // makes its sum of squares NaN or Inf (every square is >= 0; r >= sqrt(v'), and a negative v'
  // makes r NaN), so a pass whose sums are finite has none of them to count.
  C10_HOST_DEVICE inline void add_sums(const UpdateParams<acc_t>& h, acc_t w, const UpdateElement<acc_t>& e) {
    update_sumsq += e.update * e.update;
    weight_sumsq += w * w;
    moment1_sumsq += e.moment1 * e.moment1;
    moment2_sumsq += e.root * e.root;
    eps_dominated += (h.rule == UpdateRule::kAdam && e.root < h.eps) ? ElemCount(1) : ElemCount(0);
  }

  // The non-finite counts (pass 2).
  C10_HOST_DEVICE inline void add_nonfinite(acc_t w, const UpdateElement<acc_t>& e) {
    update_nonfinite += nonfinite_count(e.update);
    weight_nonfinite += nonfinite_count(w);
    // each on its own: m' + v' overflows for finite moments near the largest value
    const acc_t inf = acc_t(INFINITY);
    moment_nonfinite += ::fabs(e.moment1) < inf && ::fabs(e.moment2) < inf ? ElemCount(0) : ElemCount(1);
  }

  C10_HOST_DEVICE inline bool sums_finite() const {
    return nonfinite_count(update_sumsq + weight_sumsq + moment1_sumsq + moment2_sumsq) == ElemCount(0);
  }

  C10_HOST_DEVICE inline UpdateAcc<acc_t> row() const {
    UpdateAcc<acc_t> s;
    s.update_sumsq = update_sumsq;
    s.weight_sumsq = weight_sumsq;
    s.moment1_sumsq = moment1_sumsq;
    s.moment2_sumsq = moment2_sumsq;
    s.update_nonfinite = static_cast<int64_t>(update_nonfinite);
    s.weight_nonfinite = static_cast<int64_t>(weight_nonfinite);
    s.moment_nonfinite = static_cast<int64_t>(moment_nonfinite);
    s.eps_dominated = static_cast<int64_t>(eps_dominated);
    return s;
  }
};

}  // namespace gradfuse
