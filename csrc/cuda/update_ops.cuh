// The optimizer-update functors of the CUDA backend on the multi-tensor launcher
// (multi_tensor.cuh), and the host code that sequences their launches. ATen-free, as
// stats_ops.cuh. Both stream five tensor lists at once through a several-list table: parameters,
// gradients, moment1, moment2, moment2_max (kUpdateLists), an absent state tensor being a null
// pointer that reads as zeros. The per-element work is update_math.h's, the one arithmetic of
// both backends; each block reads its tensor's row of the hyper-parameter table once.
//  - UpdateStatsOp: the update the optimizer is about to apply (update_element) and its sums
//    (UpdateElementAcc; the non-finite counts in a second pass over a thread's elements, only
//    where its sums are not finite) over the item into the item's partial row; then
//    finalize_kernel combines the rows of each tensor in order, in double, and writes its numel.
//  - UpdateClipOp: reads its tensor's coefficient first; a tensor whose coefficient is not below 1
//    (NaN included) is left without touching its memory, else every weight becomes
//    clipped_weight(w, applied_update_part(g, m, v)), written in place.
// Both are instantiated per rule (UpdateRule), so that the element loop holds one optimizer's
// arithmetic, and stream each item with one loop per case of the state present (decided per
// block), which reads only the lists that case uses: its traffic is the bytes it needs.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/update_math.h"
#include "multi_tensor.cuh"

namespace gradfuse::cuda {

// The lists of the optimizer-update ops, in table order.
enum UpdateList : int { kParamsList, kGradsList, kMoment1List, kMoment2List, kMoment2MaxList, kUpdateLists };

// Tensor it.tensor's element pointer in `list` at the item's first element (null when absent).
template <typename scalar_t, typename Table>
__device__ inline scalar_t* item_data(const Table& table, int list, const UnitItem& it) {
  auto* p = static_cast<scalar_t*>(list_data(table, list, it.tensor));
  return p == nullptr ? nullptr : p + it.offset;
}

// Lists as bits of a mask (for_each_element_of_lists' kLoaded / kMaybe).
constexpr unsigned list_bit(int list) { return 1u << list; }
constexpr unsigned kWG = list_bit(kParamsList) | list_bit(kGradsList);
constexpr unsigned kWGM = kWG | list_bit(kMoment1List);
constexpr unsigned kWGMV = kWGM | list_bit(kMoment2List);
constexpr unsigned kAllLists = kWGMV | list_bit(kMoment2MaxList);

template <typename scalar_t, int kLists>
__device__ inline unsigned present_lists(scalar_t* const (&x)[kLists]) {
  unsigned bits = 0;
#pragma unroll
  for (int l = 0; l < kLists; ++l) bits |= x[l] != nullptr ? list_bit(l) : 0u;
  return bits;
}

template <typename scalar_t, UpdateRule kRule>
struct UpdateStatsOp {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const double* hyper;  // [n, kNumHyper], row = the tensor's index in the call
  acc_t* part_f;
  int64_t* part_c;

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    static_assert(Table::kNumLists == kUpdateLists && !Table::kHasUnits, "a five-list whole-tensor table");
    const auto h = UpdateParams<acc_t>::from_row(hyper + result_row(table, it) * kNumHyper, kRule);
    scalar_t* const x[kUpdateLists] = {
        item_data<scalar_t>(table, kParamsList, it), item_data<scalar_t>(table, kGradsList, it),
        item_data<scalar_t>(table, kMoment1List, it), item_data<scalar_t>(table, kMoment2List, it),
        item_data<scalar_t>(table, kMoment2MaxList, it)};
    const int n = static_cast<int>(it.n);
    UpdateElementAcc<acc_t> e;
    // One loop per case of the state present, uniform over the block: each reads only the lists
    // it uses (SGD never reads the second moments; Adam reads moment2_max with amsgrad only).
    const unsigned present = present_lists(x);
    if constexpr (kRule == UpdateRule::kAdam) {
      const unsigned used = present & (h.amsgrad ? kAllLists : kWGMV);
      // On the first step (no state: v = 0) amsgrad's max(0, v') is v' (v' = (1 - beta2) g^2 >= 0,
      // or NaN, which the max keeps): the loop without the max is exact there, and knows it at
      // compile time. With moment2 but no moment2_max, v' < 0 is possible (a negative moment2)
      // and the max with zeros is not v': the loop for any combination, which takes it.
      UpdateParams<acc_t> ams = h, plain = h;
      ams.amsgrad = true;
      plain.amsgrad = false;
      if (used == kWGMV && !h.amsgrad) {
        stream<kWGMV, 0>(plain, x, n, e);
      } else if (used == kAllLists) {
        stream<kAllLists, 0>(ams, x, n, e);
      } else if (used == kWG) {  // the first step: no state yet
        stream<kWG, 0>(plain, x, n, e);
      } else {  // any other combination
        stream<kWG, kAllLists & ~kWG>(h, x, n, e);
      }
    } else {
      if (present & list_bit(kMoment1List)) {
        stream<kWGM, 0>(h, x, n, e);
      } else {
        stream<kWG, 0>(h, x, n, e);
      }
    }
    const UpdateAcc<acc_t> s = block_reduce(e.row());
    if (threadIdx.x == 0) s.store(part_f + it.prow * kNumUpdateFloatStats, part_c + it.prow * kNumUpdateCountStats);
  }

  // The thread's elements in two passes, as the stats op's (stats_math.h): pass 1 the sums of
  // squares and eps_dominated; pass 2, over the same elements, the non-finite counts, only where
  // the thread's sums are not finite (UpdateElementAcc::add_sums).
  template <unsigned kLoaded, unsigned kMaybe>
  __device__ void stream(const UpdateParams<acc_t>& h, scalar_t* const (&x)[kUpdateLists], int n,
                         UpdateElementAcc<acc_t>& e) const {
    stream_pass<kLoaded, kMaybe, false>(h, x, n, e);
    if (!e.sums_finite()) stream_pass<kLoaded, kMaybe, true>(h, x, n, e);
  }

  template <unsigned kLoaded, unsigned kMaybe, bool kNonfinite>
  __device__ void stream_pass(const UpdateParams<acc_t>& h, scalar_t* const (&x)[kUpdateLists], int n,
                              UpdateElementAcc<acc_t>& e) const {
    const bool has_buffer = x[kMoment1List] != nullptr && ((kLoaded | kMaybe) & list_bit(kMoment1List)) != 0;
    for_each_element_of_lists<kThreads, kUpdateLists, 0u, kLoaded, kMaybe, scalar_t>(
        x, n, static_cast<int>(threadIdx.x), [&](const P (&p)[kUpdateLists], int k) {
          const acc_t w = element(p[kParamsList], k);
          const UpdateElement<acc_t> u =
              update_element(h, w, element(p[kGradsList], k), element(p[kMoment1List], k),
                             element(p[kMoment2List], k), element(p[kMoment2MaxList], k), has_buffer);
          if constexpr (kNonfinite) {
            e.add_nonfinite(w, u);
          } else {
            e.add_sums(h, w, u);
          }
        });
  }
};

template <typename scalar_t, UpdateRule kRule>
struct UpdateClipOp {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const double* hyper;  // [n, kNumHyper]
  const double* coefs;  // [n]

  // The lists of the clip's loop: the weights (read and written), the gradient, the first moment
  // and the second moment the step left (moment2_max with amsgrad; without it, moment2, whose
  // max with zeros is that of a first amsgrad step: first_amsgrad_max).
  enum : int { kW, kG, kM, kV, kClipLists };

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    static_assert(Table::kNumLists == kUpdateLists && !Table::kHasUnits, "a five-list whole-tensor table");
    const int64_t row = result_row(table, it);
    const double coef = coefs[row];  // once per block
    if (!clips_update(coef)) return;  // decided on the device: no traffic
    const auto h = UpdateParams<acc_t>::from_row(hyper + row * kNumHyper, kRule);
    const acc_t c = static_cast<acc_t>(coef);
    scalar_t* const v_max = h.amsgrad ? item_data<scalar_t>(table, kMoment2MaxList, it) : nullptr;
    const bool first_max = h.amsgrad && v_max == nullptr;  // v_after = first_amsgrad_max(moment2)
    scalar_t* const x[kClipLists] = {item_data<scalar_t>(table, kParamsList, it),
                                     item_data<scalar_t>(table, kGradsList, it),
                                     item_data<scalar_t>(table, kMoment1List, it),
                                     first_max || !h.amsgrad ? item_data<scalar_t>(table, kMoment2List, it) : v_max};
    const int n = static_cast<int>(it.n);
    const unsigned present = present_lists(x);
    constexpr unsigned w = list_bit(kW), g = list_bit(kG), m = list_bit(kM), v = list_bit(kV);
    // applied_update_part reads the gradient only for SGD without the buffer holding the update.
    if constexpr (kRule == UpdateRule::kAdam) {
      if ((present & (m | v)) == (m | v) && !first_max) {
        stream<w | m | v, 0, false>(h, c, x, n, false);
      } else {  // state absent, or amsgrad without moment2_max: rare, the loop that checks each
        stream<w, m | v, true>(h, c, x, n, first_max);
      }
    } else {
      if ((present & m) && h.beta1 != acc_t(0) && !h.nesterov) {
        stream<w | m, 0, false>(h, c, x, n, false);
      } else if (present & m) {
        stream<w | g | m, 0, false>(h, c, x, n, false);
      } else {
        stream<w | g, 0, false>(h, c, x, n, false);
      }
    }
  }

  // kMayTakeFirstMax: the loop takes first_amsgrad_max of the second moment where first_max.
  template <unsigned kLoaded, unsigned kMaybe, bool kMayTakeFirstMax>
  __device__ void stream(const UpdateParams<acc_t>& h, acc_t c, scalar_t* const (&x)[kClipLists], int n,
                         bool first_max) const {
    for_each_element_of_lists<kThreads, kClipLists, list_bit(kW), kLoaded, kMaybe, scalar_t>(
        x, n, static_cast<int>(threadIdx.x), [&](P (&p)[kClipLists], int k) {
          acc_t v_after = element(p[kV], k);
          if constexpr (kMayTakeFirstMax) v_after = first_max ? first_amsgrad_max(v_after) : v_after;
          const acc_t a = applied_update_part(h, element(p[kG], k), element(p[kM], k), v_after);
          p[kW].v[k] = static_cast<scalar_t>(clipped_weight(h, element(p[kW], k), a, c));
        });
  }
};

// ---- Host side

// The update statistics of every tensor (one result row each, from its row of `hyper`):
// part_f/part_c hold a row per chunk of the plan, out_f/out_c one per tensor.
template <typename scalar_t, typename Stream>
void launch_update_stats(const std::vector<ListSpan<kUpdateLists>>& spans, const ChunkPlan& plan, UpdateRule rule,
                         const double* hyper, acc_of<scalar_t>* part_f, int64_t* part_c, double* out_f,
                         int64_t* out_c, Stream stream) {
  using acc_t = acc_of<scalar_t>;
  for_each_table(spans, plan, [&](const auto& table) {
    if (rule == UpdateRule::kAdam) {
      launch_items(table, UpdateStatsOp<scalar_t, UpdateRule::kAdam>{hyper, part_f, part_c}, stream);
    } else {
      launch_items(table, UpdateStatsOp<scalar_t, UpdateRule::kSGD>{hyper, part_f, part_c}, stream);
    }
    launch_finalize<acc_t, UpdateAcc>(table, part_f, part_c, nullptr, out_f, out_c, nullptr, stream);
  });
}

// Rescales, in place, the update just applied to every tensor whose coefs entry is below 1.
template <typename scalar_t, typename Stream>
void launch_update_clip(const std::vector<ListSpan<kUpdateLists>>& spans, const ChunkPlan& plan, UpdateRule rule,
                        const double* hyper, const double* coefs, Stream stream) {
  for_each_table(spans, plan, [&](const auto& table) {
    if (rule == UpdateRule::kAdam) {
      launch_items(table, UpdateClipOp<scalar_t, UpdateRule::kAdam>{hyper, coefs}, stream);
    } else {
      launch_items(table, UpdateClipOp<scalar_t, UpdateRule::kSGD>{hyper, coefs}, stream);
    }
  });
}

}  // namespace gradfuse::cuda
