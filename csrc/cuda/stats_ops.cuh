// The statistics functor of the CUDA backend on the multi-tensor launcher (multi_tensor.cuh), and
// the host code that sequences its launches. ATen-free: nvcc compiles it for the GPU, g++ for the
// CUDA emulation of tests/cuda_emu. StatsOp runs the two passes of stats_math.h (pass 2, the NaN /
// Inf counts, only when the item's sum of squares is not finite, decided once for the block or
// warp) into the item's partial row, streaming the item with for_each_element; then
// finalize_kernel combines the rows of each tensor (whole-tensor tables) or unit. A packed item
// (per-unit tables only) gives each warp whole units in turn: a 768-element unit is one warp's 24
// 16-byte loads per lane rather than a mostly idle block.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "multi_tensor.cuh"

namespace gradfuse::cuda {

// The two passes of stats_math.h over x[0, n) by a group of kN threads (the block or a warp), of
// which this is thread `tid`; the result in thread 0 of the group.
template <int kN, PowMode mode, typename scalar_t>
__device__ inline StatsAcc<acc_of<scalar_t>> range_stats(const scalar_t* __restrict__ x, int n, int tid,
                                                         acc_of<scalar_t> p) {
  static_assert(kChunkElems <= (int64_t{1} << 24), "32-bit indices and float counts (ElemCount) per thread");
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  ElementAcc<acc_t> e;
  for_each_element<kN, false, scalar_t>(x, n, tid, [&](const P& v, int k) { e.template add<mode>(element(v, k), p); });
  StatsAcc<acc_t> total = group_reduce<kN>(e.stats());
  // Uniform over the group, so the barriers and shuffles inside are reached by all.
  if (group_broadcast<kN>(tid == 0 && needs_nonfinite_count(total))) {
    NonfiniteCount c;
    for_each_element<kN, false, scalar_t>(x, n, tid, [&](const P& v, int k) { c.add(element(v, k)); });
    StatsAcc<acc_t> counts;
    counts.nan = c.nan;
    counts.inf = c.inf;
    counts = group_reduce<kN>(counts);
    if (tid == 0) total.set_nonfinite_counts(counts.nan, counts.inf);
  }
  return total;
}

template <typename scalar_t, PowMode mode>
struct StatsOp {
  using acc_t = acc_of<scalar_t>;
  acc_t p;
  acc_t* part_f;
  int64_t* part_c;
  double* shifts;  // kMoments (whole-tensor tables): each result row's shift, for the finalize

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    const scalar_t* x = static_cast<const scalar_t*>(table.data[it.tensor]) + it.offset;
    const int tid = static_cast<int>(threadIdx.x);
    if constexpr (mode == PowMode::kMoments) {
      static_assert(!Table::kHasUnits, "moments of whole tensors only");
      // The tensor's shift, the same in every chunk: five loads per block, from L2 after the first.
      const acc_t shift = moment_shift<acc_t>(static_cast<const scalar_t*>(table.data[it.tensor]),
                                               table.numel[it.tensor]);
      const auto s = range_stats<kThreads, mode>(x, static_cast<int>(it.n), tid, shift);
      if (tid == 0) {
        store(s, it.prow);
        if (it.offset == 0) shifts[result_row(table, it)] = shift;
      }
      return;
    }
    if (Table::kHasUnits && it.packed) {  // uniform over the block
      for (int64_t k = tid / 32; k < it.num_units; k += kWarps) {
        const auto s = range_stats<32, mode>(x + k * it.unit_len, static_cast<int>(it.unit_len), tid % 32, p);
        if (tid % 32 == 0) store(s, it.prow + k);
      }
      return;
    }
    const auto s = range_stats<kThreads, mode>(x, static_cast<int>(it.n), tid, p);
    if (tid == 0) store(s, it.prow);
  }

  __device__ void store(const StatsAcc<acc_t>& s, int64_t prow) const {
    s.store(part_f + prow * kNumFloatStats, part_c + prow * kNumCountStats);
  }
};

// ---- Host side

// Statistics of every tensor (spans: Span, plan: ChunkPlan; one result row per tensor) or of every
// unit (UnitSpan, UnitPlan; the spans' rows must be consecutive: every unit of the call).
// part_f/part_c hold a row per chunk / partial row of the plan, out_f/out_c one per result row
// (kNumFloatStats doubles, kNumCountStats int64s).
// kMoments (whole-tensor spans only): `shifts` holds a double per result row, written by the
// items and read by the finalize.
template <typename scalar_t, typename SpanT, typename Plan, typename Stream>
void launch_stats(const std::vector<SpanT>& spans, const Plan& plan, PowMode mode, double p,
                  acc_of<scalar_t>* part_f, int64_t* part_c, double* out_f, int64_t* out_c, Stream stream,
                  double* shifts = nullptr) {
  using acc_t = acc_of<scalar_t>;
  for_each_table(spans, plan, [&](const auto& table) {
    using Table = std::decay_t<decltype(table)>;
    if (mode == PowMode::kNone) {
      launch_items(table, StatsOp<scalar_t, PowMode::kNone>{acc_t(p), part_f, part_c, nullptr}, stream);
    } else if (mode == PowMode::kAbs) {
      launch_items(table, StatsOp<scalar_t, PowMode::kAbs>{acc_t(p), part_f, part_c, nullptr}, stream);
    } else if (mode == PowMode::kPow) {
      launch_items(table, StatsOp<scalar_t, PowMode::kPow>{acc_t(p), part_f, part_c, nullptr}, stream);
    } else if constexpr (!Table::kHasUnits) {
      launch_items(table, StatsOp<scalar_t, PowMode::kMoments>{acc_t(0), part_f, part_c, shifts}, stream);
    }
    launch_finalize<acc_t>(table, part_f, part_c, nullptr, out_f, out_c, nullptr, stream, shifts);
  });
}

}  // namespace gradfuse::cuda
