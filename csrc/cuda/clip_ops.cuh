// The clipping functors of the CUDA backend (multi_tensor_scale_, the per-unit scale, the clamp)
// on the multi-tensor launcher (multi_tensor.cuh), and the host code that sequences their
// launches. ATen-free, as stats_ops.cuh.
//  - ScaleOp: loads its unit's coefficient once per block (split items) or once per unit and warp
//    (packed items), decides there whether to touch memory at all, and then costs a multiply and a
//    store per element.
//  - ClampOp: reads and writes each element once, accumulating the statistics of the value read,
//    the NaN and Inf counts (it cannot come back for them: the data is overwritten) and the count
//    of elements it changes.
// The per-unit statistics are StatsOp's (stats_ops.cuh) on a unit plan.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/clip_math.h"
#include "stats_ops.cuh"

namespace gradfuse::cuda {

// x[0, n) *= coef by a group of kN threads: a multiply and a store per element.
template <int kN, typename scalar_t>
__device__ inline void scale_range(scalar_t* __restrict__ x, int n, int tid, acc_of<scalar_t> coef) {
  for_each_element<kN, true, scalar_t>(x, n, tid, [&](Pack<scalar_t>& v, int k) {
    v.v[k] = scale_element<scalar_t, acc_of<scalar_t>>(v.v[k], coef);
  });
}

template <typename scalar_t>
struct ScaleOp {
  using acc_t = acc_of<scalar_t>;
  const acc_t* coefs;   // coefs[row * coef_stride] for result row `row`: one per unit, or one for all
  int64_t coef_stride;  // 1 or 0
  bool conditional;     // only where the coefficient needs it (needs_scaling)

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    scalar_t* x = static_cast<scalar_t*>(table.data[it.tensor]) + it.offset;
    const int64_t row = result_row(table, it);
    const int tid = static_cast<int>(threadIdx.x);
    if (!(Table::kHasUnits && it.packed)) {
      const acc_t coef = coefs[row * coef_stride];  // once per block
      if (conditional && !needs_scaling(coef)) return;  // decided on the device: no traffic
      scale_range<kThreads>(x, static_cast<int>(it.n), tid, coef);
      return;
    }
    for (int64_t k = tid / 32; k < it.num_units; k += kWarps) {
      const acc_t coef = coefs[(row + k) * coef_stride];
      if (conditional && !needs_scaling(coef)) continue;
      scale_range<32>(x + k * it.unit_len, static_cast<int>(it.unit_len), tid % 32, coef);
    }
  }
};

// Units of 1 only (split items). v_acc: the bound as rounded to scalar_t (v), in acc_t.
template <typename scalar_t>
struct ClampOp {
  using acc_t = acc_of<scalar_t>;
  acc_t v_acc;
  scalar_t v, neg_v;
  acc_t* part_f;
  int64_t* part_c;
  int64_t* part_clamped;

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    scalar_t* x = static_cast<scalar_t*>(table.data[it.tensor]) + it.offset;
    ElementAcc<acc_t> e;
    NonfiniteCount nonfinite;
    ElemCount changed = 0;
    for_each_element<kThreads, true, scalar_t>(x, static_cast<int>(it.n), static_cast<int>(threadIdx.x), [&](Pack<scalar_t>& p, int k) {
      const scalar_t stored = p.v[k];
      const acc_t a = static_cast<acc_t>(stored);
      e.template add<PowMode::kNone>(a, acc_t(0));
      nonfinite.add(a);
      changed += is_clamped(a, v_acc) ? ElemCount(1) : ElemCount(0);
      p.v[k] = clamp_element<scalar_t, acc_t>(stored, a, v_acc, v, neg_v);
    });
    StatsAcc<acc_t> s = e.stats();
    s.set_nonfinite_counts(static_cast<int64_t>(nonfinite.nan), static_cast<int64_t>(nonfinite.inf));
    s = block_reduce(s);
    __syncthreads();  // block_reduce's shared rows are read by thread 0 above before being reused
    StatsAcc<acc_t> c;
    c.zero = static_cast<int64_t>(changed);
    c = block_reduce(c);
    if (threadIdx.x == 0) {
      s.store(part_f + it.prow * kNumFloatStats, part_c + it.prow * kNumCountStats);
      part_clamped[it.prow] = c.zero;
    }
  }
};

// ---- Host side

// Multiplies every unit in place by coefs[its row * coef_stride] (device memory, acc type); with
// `conditional` only where that coefficient needs it, decided by the kernel.
template <typename scalar_t, typename Stream>
void launch_scale(const std::vector<UnitSpan>& spans, const UnitPlan& plan, const acc_of<scalar_t>* coefs,
                  int64_t coef_stride, bool conditional, Stream stream) {
  for_each_table(spans, plan, [&](const auto& table) {
    launch_items(table, ScaleOp<scalar_t>{coefs, coef_stride, conditional}, stream);
  });
}

// Clamps every span (units of 1) to [-v, v] in place; statistics of the values before and the
// elements changed per span.
template <typename scalar_t, typename Stream>
void launch_clamp(const std::vector<UnitSpan>& spans, const UnitPlan& plan, double v, acc_of<scalar_t>* part_f,
                  int64_t* part_c, int64_t* part_clamped, double* out_f, int64_t* out_c, int64_t* out_clamped,
                  Stream stream) {
  using acc_t = acc_of<scalar_t>;
  const scalar_t v_stored = static_cast<scalar_t>(v), neg_stored = static_cast<scalar_t>(-v);
  const acc_t v_acc = static_cast<acc_t>(v_stored);  // the bound as torch rounds it
  for_each_table(spans, plan, [&](const auto& table) {
    launch_items(table, ClampOp<scalar_t>{v_acc, v_stored, neg_stored, part_f, part_c, part_clamped}, stream);
    launch_finalize<acc_t>(table, part_f, part_c, part_clamped, out_f, out_c, out_clamped, stream);
  });
}

}  // namespace gradfuse::cuda
