// Per-element arithmetic of the clipping ops shared by the CPU and CUDA backends; the
// scale itself is scale_element / needs_scaling of stats_math.h.
#pragma once

#include <c10/macros/Macros.h>

#include "stats_math.h"

namespace gradfuse {

// clip_grad_value_'s clamp_min_(-v) then clamp_max_(v) (v >= 0) of one element, selecting the
// stored value itself rather than converting: x (NaN and -0.0 included) when it is within
// [-v, v], else the bound. `v` and `neg_v` are the bound as rounded to scalar_t (as torch rounds
// the scalar), `v_acc` the same value in acc_t: a rounded v that overflows to inf clamps nothing.
template <typename scalar_t, typename acc_t>
C10_HOST_DEVICE inline scalar_t clamp_element(scalar_t x_stored, acc_t x, acc_t v_acc,
                                              scalar_t v, scalar_t neg_v) {
  return x < -v_acc ? neg_v : (x > v_acc ? v : x_stored);
}

// Whether clamping changes the element (NaN never does; -0.0 never does).
template <typename acc_t>
C10_HOST_DEVICE inline bool is_clamped(acc_t x, acc_t v_acc) {
  return ::fabs(x) > v_acc;
}

}  // namespace gradfuse
