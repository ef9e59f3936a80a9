// The CUDA ops as functors of the multi-tensor launcher (multi_tensor.cuh), and the host code that
// sequences their launches. ATen-free: nvcc compiles it for the GPU, g++ for the CUDA emulation of
// tests/cuda_emu. Each functor gets one item (a chunk, a piece of a unit, or whole short units)
// and streams it with for_each_element:
//  - StatsOp: the two passes of stats_math.h (pass 2, the NaN / Inf counts, only when the item's
//    sum of squares is not finite, decided once for the block or warp) into the item's partial
//    row; then finalize_kernel combines the rows of each tensor (whole-tensor tables) or unit.
//  - ScaleOp: loads its unit's coefficient once per block (split items) or once per unit and warp
//    (packed items), decides there whether to touch memory at all, and then costs a multiply and a
//    store per element.
//  - ClampOp: reads and writes each element once, accumulating the statistics of the value read,
//    the NaN and Inf counts (it cannot come back for them: the data is overwritten) and the count
//    of elements it changes.
//  - HistOp: the two passes of hist_math.h into a histogram in shared memory, written as the
//    chunk's partial row; hist_finalize_kernel sums a tensor's rows in chunk order.
// A packed item (per-unit tables only) gives each warp whole units in turn: a 768-element unit is
// one warp's 24 16-byte loads per lane rather than a mostly idle block.
//
// Histogram contention. A histogram update is an atomic add to a shared counter, and when most
// values of a warp share an exponent (a constant or nearly constant tensor, a tensor of zeros, or
// simply the few most common exponents of a gradient) 32 lanes adding to one counter would be
// serialised 32 ways. Here every lane of a warp has a column of its own: the block's histogram is
// hist[bin][32], lane l adds to hist[bin][l]. Whatever the bins, the 32 lanes of an atomic
// instruction address 32 different words in 32 different banks: one conflict-free shared atomic
// per element, whatever the data (the all-same-exponent input is tested). Warps share the
// columns, so the adds stay atomic across warps. The block's total for a bin is the sum of its 32
// columns, read at the end with a per-thread rotation so that those reads are conflict-free too.
// Cost: 283 x 32 x 4 = 36 KB of shared memory per block.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/clip_math.h"
#include "../common/hist_math.h"
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

template <typename scalar_t>
using layout_of = std::conditional_t<
    std::is_same_v<scalar_t, float>, Fp32Layout,
    std::conditional_t<std::is_same_v<scalar_t, double>, Fp64Layout,
                       std::conditional_t<std::is_same_v<scalar_t, c10::Half>, Fp16Layout, Bf16Layout>>>;

// Whole-tensor tables only (the chunk is the partial row).
template <typename scalar_t>
struct HistOp {
  int64_t* part;

  template <typename Table>
  __device__ void operator()(const Table& table, const UnitItem& it) const {
    using L = layout_of<scalar_t>;
    using B = typename L::Bits;
    using P = Pack<scalar_t>;
    __shared__ int hist[kNumHistBins][32];
    __shared__ bool refine;
    const scalar_t* x = static_cast<const scalar_t*>(table.data[it.tensor]) + it.offset;
    const int n = static_cast<int>(it.n);
    const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;

    for (int i = tid; i < kNumHistBins * 32; i += kThreads) (&hist[0][0])[i] = 0;
    __syncthreads();
    int* const column = &hist[0][lane];
    // Pass 1: one shift, one AND, one address and one conflict-free shared atomic per element.
    for_each_element<kThreads, false, scalar_t>(x, n, tid, [&](const P& p, int k) {
      atomicAdd(column + 32 * hot_row<L>(bits_at<B>(p, k)), 1);
    });
    __syncthreads();
    if (tid < 32) {
      refine = __any_sync(0xffffffffu, hist[L::kLowRow][lane] != 0 || hist[L::kHighRow][lane] != 0);
    }
    __syncthreads();
    if (refine) {  // uniform over the block
      // Pass 2: zeros, subnormals, Inf, NaN (float64: also |x| outside [2^-149, 2^128)) move from
      // their lumped row to their exact bin. Same element -> thread map as pass 1.
      for_each_element<kThreads, false, scalar_t>(x, n, tid, [&](const P& p, int k) {
        const B bits = bits_at<B>(p, k);
        const int row = hot_row<L>(bits);
        if (needs_exact_bin<L>(row)) {
          atomicAdd(column + 32 * row, -1);
          atomicAdd(column + 32 * exponent_bin<L>(bits), 1);
        }
      });
      __syncthreads();
    }
    for (int r = tid; r < kNumHistBins; r += kThreads) {
      int sum = 0;
      // Thread r starts at column r % 32: the 32 threads of a warp read 32 different banks.
      for (int k = 0; k < 32; ++k) sum += hist[r][(r + k) % 32];
      part[it.prow * kNumHistBins + r] = sum;
    }
  }
};

// One block per tensor of the table: thread b sums bin b over the tensor's chunks, in order.
template <typename Table>
__global__ void __launch_bounds__(kThreads)
hist_finalize_kernel(const __grid_constant__ Table table, const int64_t* __restrict__ part, int64_t* __restrict__ out) {
  const int64_t row = rows_begin(table) + blockIdx.x;
  const RowParts parts = row_parts(table, row);
  for (int b = static_cast<int>(threadIdx.x); b < kNumHistBins; b += kThreads) {
    int64_t sum = 0;
    for (int64_t c = parts.first; c < parts.first + parts.count; ++c) sum += part[c * kNumHistBins + b];
    out[row * kNumHistBins + b] = sum;  // tensors without elements get their zero row here
  }
}

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

// Histograms of every span: part holds one row of kNumHistBins per chunk, out one row per span.
template <typename scalar_t, typename Stream>
void launch_histogram(const std::vector<Span>& spans, const ChunkPlan& plan, int64_t* part, int64_t* out,
                      Stream stream) {
  for_each_table(spans, plan, [&](const auto& table) {
    using Table = std::decay_t<decltype(table)>;
    launch_items(table, HistOp<scalar_t>{part}, stream);
    auto* finalize = &hist_finalize_kernel<Table>;
    GRADFUSE_LAUNCH(finalize, static_cast<unsigned>(table.num_tensors), kThreads, stream, table,
                    static_cast<const int64_t*>(part), out);
  });
}

}  // namespace gradfuse::cuda
