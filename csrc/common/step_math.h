// Per-element arithmetic of the fused optimizer step (multi_tensor_optim_step_), shared by the CPU
// and CUDA backends: torch.optim.SGD, Adam and AdamW's step, bit for bit as torch's own CPU
// kernels compute it (torch/optim/sgd.py, adam.py, the for-loop form; its foreach form gives the
// same bits on the CPU).
//
// torch's step is a sequence of tensor operations, each rounded to the parameter's dtype (a
// float16 / bfloat16 step computes every operation in float and rounds its result to 16 bits).
// step_element does the same operations in the same order, with each one's rounding, so that
// one pass over weight, gradient and state reproduces torch's several. Measured on torch's AVX2
// kernels (x86-64), which fix three things beyond the order of operations:
//  - `a.add(b, alpha=s)`, `lerp_` and `addcmul_` are fused multiply-adds (at::vec::fmadd, or
//    a * b + c contracted by the compiler);
//  - a 16-bit `add` rounds its alpha (and a scalar `add_(eps)` its scalar) to 16 bits first; the
//    other scalars (`mul_`, `lerp_`'s weight, `addcmul_`'s and `addcdiv_`'s values, the divisor
//    of `/`) are taken in float;
//  - a 16-bit `add` with alpha rounds alpha * b to 16 bits in its scalar loop (the last
//    elements of each thread's range, fewer than 32) and not in its vector loop: torch's result
//    there depends on its thread count, so the kernels are told, per element, which loop torch
//    would have used (TorchTail).
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "update_math.h"

namespace gradfuse {

// The step's per-tensor table: float64 [n, kNumStepCoefs] on the tensors' device. Every scalar
// torch computes in Python (the bias corrections, the step size, 1 - lr * weight_decay) is
// formed there as torch forms it, in float64, and the kernels round it as torch's kernels do.
enum StepCoef : int {
  kStepWeightDecay,     // grad.add(param, alpha=weight_decay): SGD, Adam's L2 decay
  kStepMomentum,        // SGD: buf.mul_(momentum); nesterov: grad.add(buf, alpha=momentum)
  kStepDampAlpha,       // SGD: buf.add_(grad, alpha=1 - dampening)
  kStepNegLr,           // SGD: param.add_(grad, alpha=-lr)
  kStepLerpWeight,      // Adam: exp_avg.lerp_(grad, 1 - beta1)
  kStepBeta2,           // Adam: exp_avg_sq.mul_(beta2)
  kStepOneMinusBeta2,   // Adam: .addcmul_(grad, grad, value=1 - beta2)
  kStepBc2Sqrt,         // Adam: sqrt(v) / (1 - beta2^t) ** 0.5
  kStepEps,             // Adam: .add_(eps)
  kStepNegStepSize,     // Adam: param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1^t))
  kStepDecayFactor,     // AdamW: param.mul_(1 - lr * weight_decay)
  kStepFlags,           // StepFlag bits, as a float64 integer
  kNumStepCoefs
};
enum StepFlag : int {
  kStepMaximize = 1,
  kStepNesterov = 2,
  kStepAmsgrad = 4,
  kStepDecoupled = 8,
  kStepFirst = 16,  // SGD: no momentum buffer yet (the buffer becomes the gradient itself)
};

// Below this many elements per thread torch runs an elementwise operation on one thread
// (at::internal::GRAIN_SIZE); its vector loop takes 2 * Vectorized<scalar_t>::size() elements a
// step (32 for a 16-bit type on AVX2).
constexpr int64_t kTorchGrain = 32768;
constexpr int64_t kTorchVecStep16 = 32;

// Which elements of a tensor torch's elementwise loop runs in its scalar tail, for a tensor of
// numel elements and torch's thread count: at::parallel_for cuts [0, numel) into ranges of
// ceil(numel / t) elements, t = min(threads, ceil(numel / grain)), and each range runs its vector
// loop over the largest multiple of the vector step, then the scalar loop. threads == 0: no
// scalar tails (a backend whose reference step has none).
struct TorchTail {
  int64_t range = 1, step = 1;
  bool none = true;

  C10_HOST_DEVICE static inline TorchTail of(int64_t numel, int64_t threads) {
    TorchTail t;
    if (threads <= 0 || numel <= 0) return t;
    int64_t parts = numel < kTorchGrain ? 1 : (numel + kTorchGrain - 1) / kTorchGrain;
    if (parts > threads) parts = threads;
    t.range = (numel + parts - 1) / parts;
    t.step = kTorchVecStep16;
    t.none = false;
    return t;
  }

  // Whether element i (of numel) runs in a scalar tail.
  C10_HOST_DEVICE inline bool at(int64_t i, int64_t numel) const {
    if (none) return false;
    const int64_t start = (i / range) * range;
    const int64_t len = numel - start < range ? numel - start : range;
    return i - start >= len - len % step;
  }

  // Whether any element of [i, i + n) runs in a scalar tail.
  C10_HOST_DEVICE inline bool any(int64_t i, int64_t n, int64_t numel) const {
    if (none) return false;
    for (int64_t k = i; k < i + n; k = (k / range + 1) * range) {
      const int64_t start = (k / range) * range;
      const int64_t len = numel - start < range ? numel - start : range;
      const int64_t tail_start = start + len - len % step;
      const int64_t end = start + len;
      if (tail_start < end && tail_start < i + n && end > i) return true;
    }
    return false;
  }
};

// x rounded to scalar_t and widened back: what storing an intermediate tensor keeps.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline acc_t round_to(acc_t x) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return x;
  } else {
    return static_cast<acc_t>(static_cast<scalar_t>(x));
  }
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t fma_acc(acc_t a, acc_t b, acc_t c) {
  return ::fma(a, b, c);
}

// sqrt rounded once to scalar_t. float16: float's sqrt rounded again to 16 bits can land on a tie
// that the exact root does not (torch's float16 sqrt is correctly rounded), so it goes by double.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline acc_t sqrt_to(acc_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return static_cast<acc_t>(static_cast<scalar_t>(static_cast<float>(::sqrt(static_cast<double>(x)))));
  } else {
    return round_to<scalar_t>(acc_t(::sqrt(x)));
  }
}

// torch's lerp (aten/src/ATen/native/Lerp.h, vector form): exact at both ends, one rounding.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t lerp_fma(acc_t start, acc_t end, acc_t weight) {
  const acc_t diff = end - start;
  return ::fabs(weight) < acc_t(0.5) ? fma_acc(weight, diff, start) : fma_acc(weight - acc_t(1), diff, end);
}

// One tensor's row of the table, rounded as torch's kernels take each scalar.
template <typename scalar_t, typename acc_t>
struct StepParams {
  UpdateRule rule;
  bool maximize, nesterov, amsgrad, decoupled, first;
  // `add` alphas and `add_(eps)`: rounded to scalar_t (exactly representable in acc_t)
  acc_t weight_decay, momentum, damp_alpha, neg_lr, eps;
  // the other scalars, in acc_t
  acc_t momentum_mul, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, neg_step_size, decay_factor;
  bool has_weight_decay, has_momentum;

  C10_HOST_DEVICE static inline StepParams from_row(const double* row, UpdateRule rule) {
    StepParams h;
    h.rule = rule;
    const int flags = static_cast<int>(row[kStepFlags]);
    h.maximize = (flags & kStepMaximize) != 0;
    h.nesterov = (flags & kStepNesterov) != 0;
    h.amsgrad = (flags & kStepAmsgrad) != 0;
    h.decoupled = (flags & kStepDecoupled) != 0;
    h.first = (flags & kStepFirst) != 0;
    const auto alpha = [](double x) { return static_cast<acc_t>(static_cast<scalar_t>(x)); };
    h.weight_decay = alpha(row[kStepWeightDecay]);
    h.momentum = alpha(row[kStepMomentum]);
    h.damp_alpha = alpha(row[kStepDampAlpha]);
    h.neg_lr = alpha(row[kStepNegLr]);
    h.eps = alpha(row[kStepEps]);
    h.momentum_mul = acc_t(row[kStepMomentum]);
    h.lerp_weight = acc_t(row[kStepLerpWeight]);
    h.beta2 = acc_t(row[kStepBeta2]);
    h.one_minus_beta2 = acc_t(row[kStepOneMinusBeta2]);
    h.bc2_sqrt = acc_t(row[kStepBc2Sqrt]);
    h.neg_step_size = acc_t(row[kStepNegStepSize]);
    h.decay_factor = acc_t(row[kStepDecayFactor]);
    h.has_weight_decay = row[kStepWeightDecay] != 0.0;
    h.has_momentum = row[kStepMomentum] != 0.0;
    return h;
  }
};

// a.add(b, alpha=s) rounded to scalar_t, s already rounded as torch rounds it; tail: torch's
// scalar loop, which rounds s * b to scalar_t first (a 16-bit type only: in float and double both
// loops are one fused multiply-add).
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline acc_t add_alpha(acc_t a, acc_t b, acc_t s, bool tail) {
  if (!std::is_same_v<scalar_t, acc_t> && tail) return round_to<scalar_t>(a + round_to<scalar_t>(s * b));
  return round_to<scalar_t>(fma_acc(s, b, a));
}

// One element's state, before and after the step.
template <typename acc_t>
struct StepState {
  acc_t w, m, v, v_max;
  acc_t root;  // Adam: sqrt(v') / sqrt(1 - beta2^t) as the denominator holds it before eps; else 0
};

// Adam's step up to the square root: the gradient's decay, the moments, their max with amsgrad.
// Returns the v' whose root the denominator takes.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline acc_t adam_moments(const StepParams<scalar_t, acc_t>& h, acc_t g, StepState<acc_t>& s,
                                          bool tail) {
  if (h.maximize) g = -g;
  if (h.has_weight_decay) {
    if (h.decoupled) {
      s.w = round_to<scalar_t>(mul_rn(s.w, h.decay_factor));  // param.mul_(1 - lr * wd)
    } else {
      g = add_alpha<scalar_t>(g, s.w, h.weight_decay, tail);  // grad.add(param, alpha=wd)
    }
  }
  s.m = round_to<scalar_t>(lerp_fma(s.m, g, h.lerp_weight));
  s.v = round_to<scalar_t>(mul_rn(s.v, h.beta2));
  s.v = round_to<scalar_t>(fma_acc(h.one_minus_beta2 * g, g, s.v));  // addcmul_: (value * g) * g + v
  if (!h.amsgrad) return s.v;
  s.v_max = nan_max(s.v_max, s.v);  // torch.maximum: a NaN on either side propagates
  return s.v_max;
}

// Adam's step from the square root of the v' adam_moments returned, as torch's sqrt rounds it.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline void adam_finish(const StepParams<scalar_t, acc_t>& h, acc_t root_of_v, StepState<acc_t>& s) {
  s.root = round_to<scalar_t>(root_of_v / h.bc2_sqrt);
  const acc_t denom = round_to<scalar_t>(s.root + h.eps);
  s.w = round_to<scalar_t>(s.w + mul_rn(h.neg_step_size, s.m) / denom);  // addcdiv_: w + value * m / denom
}

// SGD's whole step.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline void sgd_element(const StepParams<scalar_t, acc_t>& h, acc_t g, StepState<acc_t>& s,
                                        bool tail) {
  if (h.maximize) g = -g;
  if (h.has_weight_decay) g = add_alpha<scalar_t>(g, s.w, h.weight_decay, tail);
  if (h.has_momentum) {
    s.m = h.first ? g : add_alpha<scalar_t>(round_to<scalar_t>(mul_rn(s.m, h.momentum_mul)), g, h.damp_alpha, tail);
    g = h.nesterov ? add_alpha<scalar_t>(g, s.m, h.momentum, tail) : s.m;
  }
  s.root = 0;
  s.w = add_alpha<scalar_t>(s.w, g, h.neg_lr, tail);
}

// The step for one element, with a correctly rounded square root (torch's, but for float and
// double on an x86 build of torch, whose CPU sqrt is MKL's: the CPU kernels call it there). g:
// the gradient as read (scaled, if the step scales it). s: the weight and state before the step
// (m: exp_avg or the momentum buffer; v: exp_avg_sq; v_max: max_exp_avg_sq with amsgrad),
// changed in place to after the step.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline void step_element(const StepParams<scalar_t, acc_t>& h, acc_t g, StepState<acc_t>& s,
                                         bool tail) {
  if (h.rule == UpdateRule::kAdam) {
    adam_finish(h, sqrt_to<scalar_t>(adam_moments(h, g, s, tail)), s);
  } else {
    sgd_element(h, g, s, tail);
  }
}

}  // namespace gradfuse
