// The fused optimizer step of the CUDA backend (multi_tensor_optim_step_) on the multi-tensor
// launcher (multi_tensor.cuh), and the host code that sequences its launches. ATen-free, as
// update_ops.cuh, whose five-list tables it streams: parameters, gradients, moment1, moment2,
// moment2_max (kUpdateLists), an absent state tensor being a null pointer.
//
// StepOp<scalar_t, rule, stats>: each block reads its tensor's row of the step table once (the
// scalars torch forms in Python, step_math.h's StepParams), the skip flag, the gradient scale and
// its update coefficient, all on the device; then every element gets step_math.h's step, the one
// arithmetic of both backends, with a correctly rounded square root (sqrt_to) and no torch scalar
// tails. So the weights and state it writes are the CPU kernels' bits under
// set_step_torch_sqrt(False) with torch_threads 0. The block streams its chunk with one loop per
// case of the state the step reads and writes (decided per block, uniform over it), each moving
// only the lists its case needs:
//   SGD without momentum                 reads w, g          writes w
//   SGD's first step with momentum       reads w, g          writes w, buf (the buffer is the gradient)
//   SGD with momentum                    reads w, g, buf     writes w, buf
//   Adam / AdamW                         reads w, g, m, v    writes w, m, v
//   with amsgrad                         reads w, g, m, v, v_max and writes them but g
// and, for each, with or without a gradient scale and an update rescale. The rare cases (SGD's
// momentum without a buffer, amsgrad without max_exp_avg_sq) take one loop that reads the optional
// list where present. A skip flag that is not zero (NaN included) writes nothing: without
// statistics the block returns before touching memory; with them it streams the same loops
// without their stores. An update coefficient below 1 rescales the tensor's update
// (w_before + c * (w_after - w_before), rounded as the CPU kernels round it).
//
// With statistics, the rows of multi_tensor_update_stats for the step taken (its update after the
// rescale): one pass (the step writes what a second pass would read), each thread's sums, and its
// non-finite counts taken per pack once its sums are no longer finite (StepElementAcc); then the
// block's row in its partial row (block_reduce, a fixed tree), and finalize_kernel combines each
// tensor's rows in order, in double. Deterministic; no atomics.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/step_math.h"
#include "../common/update_math.h"
#include "multi_tensor.cuh"
#include "update_ops.cuh"

namespace gradfuse::cuda {

// A rare path out of line, a call its loop branches around: scripts/sass_budget.py counts a trip
// of a loop without the blocks a branch skips to call a routine (as IEEE division's slow path).
#if defined(__CUDACC__)
#define GRADFUSE_NOINLINE __noinline__
#else
#define GRADFUSE_NOINLINE __attribute__((noinline))
#endif

// Elements with a NaN or Inf update, weight, or moment (moment1, or with Adam the second moment).
struct NonfiniteCounts {
  ElemCount update = 0, weight = 0, moment = 0;
};

// The counts of the first `count` elements of a pack, from the weights before and after the step
// and the moments after it (v: the second moment the root was taken of; SGD: zeros).
template <typename scalar_t, UpdateRule kRule>
GRADFUSE_NOINLINE __device__ NonfiniteCounts count_nonfinite(Pack<scalar_t> w_before, Pack<scalar_t> w_after,
                                                             Pack<scalar_t> m, Pack<scalar_t> v, int count) {
  using acc_t = acc_of<scalar_t>;
  NonfiniteCounts c;
  for (int k = 0; k < count; ++k) {
    const acc_t w = element(w_before, k), mk = element(m, k);
    c.update += nonfinite_count(element(w_after, k) - w);
    c.weight += nonfinite_count(w);
    if constexpr (kRule == UpdateRule::kAdam) {
      // NaN or Inf in either (a sum of the two could overflow)
      const acc_t vk = element(v, k);
      c.moment += (::fabs(mk) < acc_t(INFINITY) && ::fabs(vk) < acc_t(INFINITY)) ? ElemCount(0) : ElemCount(1);
    } else {
      c.moment += nonfinite_count(mk);
    }
  }
  return c;
}

// One thread's statistics of the steps it took: the CPU kernels' columns (add_element_stats of
// step_kernels_impl.h). The step overwrites what a second pass would read, so the non-finite counts
// are taken in the same pass: per pack (count_nonfinite), only once the sums are not finite.
template <typename acc_t, UpdateRule kRule>
struct StepElementAcc {
  acc_t update_sumsq = 0, weight_sumsq = 0, moment1_sumsq = 0, moment2_sumsq = 0;
  ElemCount update_nonfinite = 0, weight_nonfinite = 0, moment_nonfinite = 0, eps_dominated = 0;

  // u: the update applied, w: the weight before, m: moment1 (or the momentum buffer) after, root:
  // Adam's bias-corrected root (SGD: none).
  C10_HOST_DEVICE inline void add_sums(acc_t u, acc_t w, acc_t m, acc_t root, acc_t eps) {
    update_sumsq += u * u;
    weight_sumsq += w * w;
    moment1_sumsq += m * m;
    if constexpr (kRule == UpdateRule::kAdam) {
      moment2_sumsq += root * root;
      eps_dominated += root < eps ? ElemCount(1) : ElemCount(0);
    }
  }

  // True until an element with a NaN or Inf update, weight, moment1 or (Adam) second moment is
  // added: its square, or that of Adam's root (sqrt(v') / sqrt(1 - beta2^t): NaN or Inf for a v'
  // that is, NaN for a negative one), makes its sum NaN or Inf for good (every term is >= 0). A
  // finite square that overflows makes it false too: the counts are then taken for nothing.
  C10_HOST_DEVICE inline bool sums_finite() const {
    return nonfinite_count(update_sumsq + weight_sumsq + moment1_sumsq + moment2_sumsq) == ElemCount(0);
  }

  C10_HOST_DEVICE inline void add_counts(const NonfiniteCounts& c) {
    update_nonfinite += c.update;
    weight_nonfinite += c.weight;
    moment_nonfinite += c.moment;
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

// What a block's step takes besides the row of the table, the same for all its threads.
template <typename acc_t>
struct StepBlock {
  bool writes;   // not write=False, not skipped
  bool scaled;   // a gradient scale was given
  acc_t scale;
  bool clip;     // an update coefficient below 1
  acc_t coef;
};

template <typename scalar_t, UpdateRule kRule, bool kStats>
struct StepOp {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  using Params = StepParams<scalar_t, acc_t>;
  using Acc = StepElementAcc<acc_t, kRule>;
  const double* coefs;         // [n, kNumStepCoefs], row = the tensor's index in the call
  const double* grad_scale;    // one element (or one per tensor), or null: no scale
  bool scale_per_tensor;       // grad_scale is [n], row = the tensor's index in the call
  const double* skip;          // one element, or null: no flag
  const double* update_coefs;  // [n], or null
  bool write;                  // false: the statistics only
  acc_t* part_f;               // kStats: a row per chunk
  int64_t* part_c;

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    static_assert(Table::kNumLists == kUpdateLists && !Table::kHasUnits, "a five-list whole-tensor table");
    StepBlock<acc_t> b;
    b.writes = write && !(skip != nullptr && *skip != 0.0);  // decided on the device
    if constexpr (!kStats) {
      if (!b.writes) return;  // a skipped step: no traffic
    }
    const int64_t row = result_row(table, it);
    const Params h = Params::from_row(coefs + row * kNumStepCoefs, kRule);
    b.scaled = grad_scale != nullptr;
    b.scale = b.scaled ? static_cast<acc_t>(grad_scale[scale_per_tensor ? row : 0]) : acc_t(1);
    const double coef = update_coefs != nullptr ? update_coefs[row] : 1.0;
    b.clip = update_coefs != nullptr && clips_update(coef);
    b.coef = static_cast<acc_t>(coef);
    scalar_t* const x[kUpdateLists] = {
        item_data<scalar_t>(table, kParamsList, it), item_data<scalar_t>(table, kGradsList, it),
        item_data<scalar_t>(table, kMoment1List, it), item_data<scalar_t>(table, kMoment2List, it),
        item_data<scalar_t>(table, kMoment2MaxList, it)};
    const int n = static_cast<int>(it.n);
    Acc e;
    constexpr unsigned W = list_bit(kParamsList), M = list_bit(kMoment1List), V = list_bit(kMoment2List),
                       X = list_bit(kMoment2MaxList);
    // One loop per case, each given a copy of the row with the flags its case fixes, so that the
    // compiler knows them there; any other combination of flags and state takes a loop that
    // reads and writes the optional list where present.
    if constexpr (kRule == UpdateRule::kAdam) {
      // The argument checks made moment1 and moment2 present; moment2_max is read with amsgrad.
      if (!h.amsgrad) {
        Params plain = h;
        plain.amsgrad = false;
        run<kWGMV, W | M | V>(plain, b, x, n, e);
      } else if (x[kMoment2MaxList] != nullptr) {
        Params ams = h;
        ams.amsgrad = true;
        run<kWGMV | X, W | M | V | X>(ams, b, x, n, e);
      } else {  // amsgrad without max_exp_avg_sq: max(0, v'), as the CPU kernels take it
        run<kWGMV, W | M | V | X, X>(h, b, x, n, e);
      }
    } else {
      // SGD's buffer: read and written with momentum, written only on the first step.
      if (!h.has_momentum) {
        Params plain = h;
        plain.has_momentum = false;
        run<kWG, W>(plain, b, x, n, e);
      } else if (x[kMoment1List] != nullptr && h.first) {
        Params first = h;
        first.has_momentum = true;
        first.first = true;
        run<kWG, W | M>(first, b, x, n, e);
      } else if (x[kMoment1List] != nullptr) {
        Params later = h;
        later.has_momentum = true;
        later.first = false;
        run<kWGM, W | M>(later, b, x, n, e);
      } else {  // momentum without a buffer: one formed from zeros (the CPU kernels'), not kept
        run<kWG, W | M, M>(h, b, x, n, e);
      }
    }
    if constexpr (kStats) {
      const UpdateAcc<acc_t> s = block_reduce(e.row());
      if (threadIdx.x == 0) s.store(part_f + it.prow * kNumUpdateFloatStats, part_c + it.prow * kNumUpdateCountStats);
    }
  }

  // How a loop takes the gradient scale: none, one, or either (decided per element: the loops of
  // the uncommon cases, which also read their kMaybe list where present).
  enum ScaleMode : int { kUnscaled, kScaled, kEitherScale };

  // The case's loop (kLoaded read, kMaybe read where present, kWritten written; written lists
  // in kMaybe where present) with or without its stores, the scale and the rescale.
  template <unsigned kLoaded, unsigned kWritten, unsigned kMaybe = 0u>
  __device__ void run(const Params& h, const StepBlock<acc_t>& b, scalar_t* const (&x)[kUpdateLists], int n,
                      Acc& e) const {
    if constexpr (kMaybe != 0u) {
      if (b.writes) {
        with_clip<kLoaded, kMaybe, kWritten, kEitherScale>(h, b, x, n, e);
      } else if constexpr (kStats) {
        with_clip<kLoaded, kMaybe, 0u, kEitherScale>(h, b, x, n, e);
      }
    } else if (b.writes) {
      if (b.scaled) {
        with_clip<kLoaded, 0u, kWritten, kScaled>(h, b, x, n, e);
      } else {
        with_clip<kLoaded, 0u, kWritten, kUnscaled>(h, b, x, n, e);
      }
    } else if constexpr (kStats) {
      if (b.scaled) {
        with_clip<kLoaded, 0u, 0u, kScaled>(h, b, x, n, e);
      } else {
        with_clip<kLoaded, 0u, 0u, kUnscaled>(h, b, x, n, e);
      }
    }
  }

  template <unsigned kLoaded, unsigned kMaybe, unsigned kWritten, int kScale>
  __device__ void with_clip(const Params& h, const StepBlock<acc_t>& b, scalar_t* const (&x)[kUpdateLists], int n,
                            Acc& e) const {
    if (b.clip) {
      stream<kLoaded, kMaybe, kWritten, kScale, true>(h, b, x, n, e);
    } else {
      stream<kLoaded, kMaybe, kWritten, kScale, false>(h, b, x, n, e);
    }
  }

  template <unsigned kLoaded, unsigned kMaybe, unsigned kWritten, int kScale, bool kClip>
  __device__ void stream(const Params& h, const StepBlock<acc_t>& b, scalar_t* const (&x)[kUpdateLists], int n,
                         Acc& e) const {
    // The packs hold each element's results after the step, in the lists written and, for the
    // statistics' non-finite counts, in the others too (registers, not stored).
    constexpr bool kKeepW = kStats || (kWritten & list_bit(kParamsList)) != 0;
    constexpr bool kKeepM = kStats || (kWritten & list_bit(kMoment1List)) != 0;
    constexpr bool kKeepV = kStats || (kWritten & list_bit(kMoment2List)) != 0;
    for_each_element_of_lists<kThreads, kUpdateLists, kWritten, kLoaded, kMaybe, scalar_t>(
        x, n, static_cast<int>(threadIdx.x),
        [&](P (&p)[kUpdateLists], int k) {
          const acc_t w_before = element(p[kParamsList], k);
          acc_t g = element(p[kGradsList], k);
          // the gradient times the scale, rounded to its dtype as a scaling pass would leave it
          if (kScale == kScaled || (kScale == kEitherScale && b.scaled)) g = round_to<scalar_t>(mul_rn(g, b.scale));
          StepState<acc_t> s{w_before, element(p[kMoment1List], k), element(p[kMoment2List], k),
                             element(p[kMoment2MaxList], k), acc_t(0)};
          if constexpr (kRule == UpdateRule::kAdam) {
            adam_finish(h, sqrt_to<scalar_t>(adam_moments(h, g, s, false)), s);
          } else {
            sgd_element(h, g, s, false);
          }
          if constexpr (kClip) s.w = round_to<scalar_t>(w_before + mul_rn(b.coef, s.w - w_before));
          if constexpr (kStats) e.add_sums(s.w - w_before, w_before, s.m, s.root, h.eps);
          if constexpr (kKeepW) p[kParamsList].v[k] = static_cast<scalar_t>(s.w);
          if constexpr (kKeepM) p[kMoment1List].v[k] = static_cast<scalar_t>(s.m);
          if constexpr (kRule == UpdateRule::kAdam) {
            if constexpr (kKeepV) p[kMoment2List].v[k] = static_cast<scalar_t>(s.v);
            if constexpr ((kWritten & list_bit(kMoment2MaxList)) != 0) {
              p[kMoment2MaxList].v[k] = static_cast<scalar_t>(s.v_max);
            } else if constexpr (kStats) {
              if (h.amsgrad) p[kMoment2MaxList].v[k] = static_cast<scalar_t>(s.v_max);
            }
          }
        },
        [&](const P (&p)[kUpdateLists], const P& w_read, int count) {
          if constexpr (kStats) {
            if (e.sums_finite()) return;  // no NaN or Inf so far: nothing to count
            P v{};  // the second moment the root was taken of
            if constexpr (kRule == UpdateRule::kAdam) v = h.amsgrad ? p[kMoment2MaxList] : p[kMoment2List];
            e.add_counts(count_nonfinite<scalar_t, kRule>(w_read, p[kParamsList], p[kMoment1List], v, count));
          }
        });
  }
};

// ---- Host side

// The step of every tensor (rule: its row of `coefs`). grad_scale (one element, or [n] with
// scale_per_tensor), skip, update_coefs: device pointers or null. stats: part_f/part_c hold a row per chunk of the plan, out_f/out_c one per
// tensor (else all null).
template <typename scalar_t, typename Stream>
void launch_optim_step(const std::vector<ListSpan<kUpdateLists>>& spans, const ChunkPlan& plan, UpdateRule rule,
                       const double* coefs, const double* grad_scale, bool scale_per_tensor, const double* skip,
                       const double* update_coefs, bool write, acc_of<scalar_t>* part_f, int64_t* part_c, double* out_f, int64_t* out_c,
                       Stream stream) {
  using acc_t = acc_of<scalar_t>;
  const bool stats = out_f != nullptr;
  for_each_table(spans, plan, [&](const auto& table) {
    const auto launch = [&](auto rule_tag) {
      constexpr UpdateRule kRule = decltype(rule_tag)::value;
      if (stats) {
        launch_items(table, StepOp<scalar_t, kRule, true>{coefs, grad_scale, scale_per_tensor, skip, update_coefs, write,
                                                           part_f, part_c},
                     stream);
        launch_finalize<acc_t, UpdateAcc>(table, part_f, part_c, nullptr, out_f, out_c, nullptr, stream);
      } else {
        launch_items(table, StepOp<scalar_t, kRule, false>{coefs, grad_scale, scale_per_tensor, skip, update_coefs,
                                                            write, nullptr, nullptr},
                     stream);
      }
    };
    if (rule == UpdateRule::kAdam) {
      launch(std::integral_constant<UpdateRule, UpdateRule::kAdam>{});
    } else {
      launch(std::integral_constant<UpdateRule, UpdateRule::kSGD>{});
    }
  });
}

}  // namespace gradfuse::cuda
