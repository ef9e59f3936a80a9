// The CUDA kernels of the clipping ops (issue 17): per-unit statistics, per-unit (per-tensor)
// scale and clamp-by-value with the statistics before clamping, and the host code that sequences
// their launches. ATen-free, like stats_kernels.cuh (whose block / warp reductions, packs and
// GRADFUSE_LAUNCH convention they share): nvcc compiles them for the GPU (clip_cuda.cu), g++ for
// the CUDA emulation of tests/cuda_emu.
//
// Work is the unit plan of common/unit_plan.h: one block per item. A split item (a piece of at
// most kChunkElems elements of one unit; units of 1 are the chunk plan) is streamed by the whole
// block, as stats_kernel streams a chunk; a packed item (whole short units) gives each warp whole
// units in turn. Statistics go through per-(unit, piece) partial rows, combined per unit in piece
// order by one thread per unit: no float atomics, bitwise stable. The scale loads its unit's
// coefficient once per block (split) or once per unit and warp (packed), decides there whether
// to touch memory at all, and then costs a multiply and a store per element. The clamp reads and
// writes each element once, accumulating the statistics of the value read, the NaN and Inf counts
// (it cannot come back for them: the data is overwritten) and the count of elements it changes.
#pragma once

#include "../common/clip_math.h"
#include "../common/unit_plan.h"
#include "stats_kernels.cuh"

namespace gradfuse::cuda {

// 8 + 32 + 3 x 8 bytes per tensor: 28.7 KB of the 32 KB kernel argument.
constexpr int kMaxUnitTensorsPerLaunch = 512;
constexpr int kSmallUnitTableTensors = 64;

template <int kCapacity>
struct UnitLaunchTable {
  static constexpr int kMaxTensors = kCapacity;
  int64_t num_tensors;
  void* data[kCapacity];
  int64_t numel[kCapacity];
  int64_t units[kCapacity];
  int64_t row[kCapacity + 1];         // each tensor's first unit among the call's units; [n]: the end
  int64_t first_item[kCapacity + 1];  // global item ids (UnitPlan)
  int64_t first_prow[kCapacity + 1];  // global partial rows
};
using LargeUnitTable = UnitLaunchTable<kMaxUnitTensorsPerLaunch>;
using SmallUnitTable = UnitLaunchTable<kSmallUnitTableTensors>;
static_assert(sizeof(LargeUnitTable) <= 32000, "UnitLaunchTable must fit the 32 KB kernel argument");

template <typename Table>
__device__ inline UnitItem locate_item(const Table& table) {
  return locate_unit_item(table.first_item, table.first_prow, table.numel, table.units,
                          table.num_tensors, table.first_item[0] + blockIdx.x);
}

// for_each_element of stats_kernels.cuh for kThreads threads (a block, or a warp) of which this
// is thread `tid`: kUnroll 16-byte loads in flight when x is aligned, element by element else.
template <int kThreads, typename scalar_t, typename F>
__device__ inline void for_each_element_of(const scalar_t* __restrict__ x, int n, int tid, F&& f) {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  int i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    const P* __restrict__ xp = reinterpret_cast<const P*>(x);
    const int packs = n / P::kSize;
    constexpr int kStride = kThreads * kUnroll;
    int base = 0;
    for (; base + kStride <= packs; base += kStride) {
      P buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = xp[base + u * kThreads + tid];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) f(element(buf[u], k));
      }
    }
    for (int j = base + tid; j < packs; j += kThreads) {
      const P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) f(element(v, k));
    }
    i = packs * P::kSize;
  }
  for (int j = i + tid; j < n; j += kThreads) f(static_cast<acc_t>(x[j]));
}

// The same traversal, read-modify-write: f(scalar_t& stored) may replace each element.
template <int kThreads, typename scalar_t, typename F>
__device__ inline void for_each_element_rw(scalar_t* __restrict__ x, int n, int tid, F&& f) {
  using P = Pack<scalar_t>;
  int i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    P* __restrict__ xp = reinterpret_cast<P*>(x);
    const int packs = n / P::kSize;
    constexpr int kStride = kThreads * kUnroll;
    int base = 0;
    for (; base + kStride <= packs; base += kStride) {
      P buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = xp[base + u * kThreads + tid];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) f(buf[u].v[k]);
        xp[base + u * kThreads + tid] = buf[u];
      }
    }
    for (int j = base + tid; j < packs; j += kThreads) {
      P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) f(v.v[k]);
      xp[j] = v;
    }
    i = packs * P::kSize;
  }
  for (int j = i + tid; j < n; j += kThreads) f(x[j]);
}

// x[0, n) *= coef by kThreads threads: a multiply and a store per element.
template <int kThreads, typename scalar_t>
__device__ inline void scale_range(scalar_t* __restrict__ x, int n, int tid, acc_of<scalar_t> coef) {
  for_each_element_rw<kThreads>(x, n, tid, [&](scalar_t& v) {
    v = scale_element<scalar_t, acc_of<scalar_t>>(v, coef);
  });
}

// The two passes of stats_math.h over x[0, n) by one warp; the result in lane 0.
template <typename scalar_t, PowMode mode>
__device__ inline StatsAcc<acc_of<scalar_t>> warp_stats(const scalar_t* x, int n, int lane,
                                                        acc_of<scalar_t> p) {
  using acc_t = acc_of<scalar_t>;
  ElementAcc<acc_t> e;
  for_each_element_of<32>(x, n, lane, [&](acc_t v) { e.template add<mode>(v, p); });
  StatsAcc<acc_t> s = e.stats();
  warp_reduce(s);
  if (__shfl_sync(0xffffffffu, static_cast<int>(needs_nonfinite_count(s)), 0)) {  // uniform over the warp
    NonfiniteCount c;
    for_each_element_of<32>(x, n, lane, [&](acc_t v) { c.add(v); });
    StatsAcc<acc_t> counts;
    counts.nan = c.nan;
    counts.inf = c.inf;
    warp_reduce(counts);
    if (lane == 0) s.set_nonfinite_counts(counts.nan, counts.inf);
  }
  return s;
}

template <typename scalar_t, PowMode mode, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
unit_stats_kernel(const __grid_constant__ Table table, acc_of<scalar_t> p,
                  acc_of<scalar_t>* __restrict__ part_f, int64_t* __restrict__ part_c) {
  using acc_t = acc_of<scalar_t>;
  const UnitItem it = locate_item(table);
  const scalar_t* __restrict__ x = static_cast<const scalar_t*>(table.data[it.tensor]) + it.offset;
  if (it.packed) {  // uniform over the block
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int64_t k = warp; k < it.num_units; k += kStatsThreads / 32) {
      const StatsAcc<acc_t> s = warp_stats<scalar_t, mode>(x + k * it.unit_len, static_cast<int>(it.unit_len), lane, p);
      if (lane == 0) s.store(part_f + (it.prow + k) * kNumFloatStats, part_c + (it.prow + k) * kNumCountStats);
    }
    return;
  }
  // Split: stats_kernel's two passes over the piece.
  const int n = static_cast<int>(it.n);
  ElementAcc<acc_t> e;
  for_each_element_of<kStatsThreads>(x, n, threadIdx.x, [&](acc_t v) { e.template add<mode>(v, p); });
  StatsAcc<acc_t> total = block_reduce(e.stats());
  __shared__ bool count_nonfinite;
  if (threadIdx.x == 0) count_nonfinite = needs_nonfinite_count(total);
  __syncthreads();
  if (count_nonfinite) {
    NonfiniteCount c;
    for_each_element_of<kStatsThreads>(x, n, threadIdx.x, [&](acc_t v) { c.add(v); });
    StatsAcc<acc_t> counts;
    counts.nan = c.nan;
    counts.inf = c.inf;
    counts = block_reduce(counts);
    if (threadIdx.x == 0) total.set_nonfinite_counts(counts.nan, counts.inf);
  }
  if (threadIdx.x == 0) total.store(part_f + it.prow * kNumFloatStats, part_c + it.prow * kNumCountStats);
}

// One thread per unit row of the table: that unit's partial rows in piece order, in double.
// `part_extra` (optional): one count per partial row (the clamp's), summed into out_extra.
template <typename acc_t, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
unit_finalize_kernel(const __grid_constant__ Table table, const acc_t* __restrict__ part_f,
                     const int64_t* __restrict__ part_c, const int64_t* __restrict__ part_extra,
                     double* __restrict__ out_f, int64_t* __restrict__ out_c,
                     int64_t* __restrict__ out_extra) {
  const int64_t row = table.row[0] + int64_t(blockIdx.x) * kStatsThreads + threadIdx.x;
  if (row >= table.row[table.num_tensors]) return;
  const int64_t t = owner_of_chunk(table.row, table.num_tensors, row);
  const UnitGeometry g = unit_geometry(table.numel[t], table.units[t]);
  const int64_t first = table.first_prow[t] + (row - table.row[t]) * g.pieces;
  StatsAcc<double> s;
  int64_t extra = 0;
  for (int64_t r = first; r < first + g.pieces; ++r) {
    s.combine(StatsAcc<acc_t>::load(part_f + r * kNumFloatStats, part_c + r * kNumCountStats));
    if (part_extra) extra += part_extra[r];
  }
  s.store(out_f + row * kNumFloatStats, out_c + row * kNumCountStats);
  out_c[row * kNumCountStats + kNumel] = g.unit_len;
  if (out_extra) out_extra[row] = extra;
}

template <typename scalar_t, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
unit_scale_kernel(const __grid_constant__ Table table, const acc_of<scalar_t>* __restrict__ coefs,
                  bool conditional) {
  using acc_t = acc_of<scalar_t>;
  const UnitItem it = locate_item(table);
  scalar_t* __restrict__ x = static_cast<scalar_t*>(table.data[it.tensor]) + it.offset;
  const int64_t row = table.row[it.tensor] + it.unit;
  if (!it.packed) {
    const acc_t coef = coefs[row];  // once per block
    if (conditional && !needs_scaling(coef)) return;  // decided on the device: no traffic
    scale_range<kStatsThreads>(x, static_cast<int>(it.n), threadIdx.x, coef);
    return;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t k = warp; k < it.num_units; k += kStatsThreads / 32) {
    const acc_t coef = coefs[row + k];
    if (conditional && !needs_scaling(coef)) continue;
    scale_range<32>(x + k * it.unit_len, static_cast<int>(it.unit_len), lane, coef);
  }
}

// Units of 1 only (split items). v_acc: the bound as rounded to scalar_t (v), in acc_t.
template <typename scalar_t, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
clamp_kernel(const __grid_constant__ Table table, acc_of<scalar_t> v_acc, scalar_t v, scalar_t neg_v,
             acc_of<scalar_t>* __restrict__ part_f, int64_t* __restrict__ part_c,
             int64_t* __restrict__ part_clamped) {
  using acc_t = acc_of<scalar_t>;
  const UnitItem it = locate_item(table);
  scalar_t* __restrict__ x = static_cast<scalar_t*>(table.data[it.tensor]) + it.offset;
  ElementAcc<acc_t> e;
  NonfiniteCount nonfinite;
  ElemCount changed = 0;
  for_each_element_rw<kStatsThreads>(x, static_cast<int>(it.n), threadIdx.x, [&](scalar_t& stored) {
    const acc_t a = static_cast<acc_t>(stored);
    e.template add<PowMode::kNone>(a, acc_t(0));
    nonfinite.add(a);
    changed += is_clamped(a, v_acc) ? ElemCount(1) : ElemCount(0);
    stored = clamp_element<scalar_t, acc_t>(stored, a, v_acc, v, neg_v);
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

// Host side: splits the spans into launch tables and calls launch(table, items in the table).
template <typename Table, typename F>
void launch_unit_table(const std::vector<UnitSpan>& spans, const UnitPlan& plan, int64_t base,
                       int64_t count, F& launch) {
  Table table;
  table.num_tensors = count;
  for (int64_t k = 0; k < count; ++k) {
    const UnitSpan& s = spans[base + k];
    table.data[k] = s.data;
    table.numel[k] = s.numel;
    table.units[k] = s.units;
    table.row[k] = s.row;
    table.first_item[k] = plan.first_item[base + k];
    table.first_prow[k] = plan.first_prow[base + k];
  }
  table.row[count] = spans[base + count - 1].row + spans[base + count - 1].units;
  table.first_item[count] = plan.first_item[base + count];
  table.first_prow[count] = plan.first_prow[base + count];
  launch(table, table.first_item[count] - table.first_item[0]);
}

template <typename F>
void for_each_unit_table(const std::vector<UnitSpan>& spans, const UnitPlan& plan, F&& launch) {
  const int64_t n = static_cast<int64_t>(spans.size());
  for (int64_t base = 0; base < n; base += kMaxUnitTensorsPerLaunch) {
    const int64_t count = std::min<int64_t>(kMaxUnitTensorsPerLaunch, n - base);
    if (count <= kSmallUnitTableTensors) {
      launch_unit_table<SmallUnitTable>(spans, plan, base, count, launch);
    } else {
      launch_unit_table<LargeUnitTable>(spans, plan, base, count, launch);
    }
  }
}

template <typename acc_t, typename Table, typename Stream>
void launch_unit_finalize(const Table& table, const acc_t* part_f, const int64_t* part_c,
                          const int64_t* part_extra, double* out_f, int64_t* out_c,
                          int64_t* out_extra, Stream stream) {
  const int64_t rows = table.row[table.num_tensors] - table.row[0];
  if (rows == 0) return;
  auto* finalize = &unit_finalize_kernel<acc_t, Table>;
  GRADFUSE_LAUNCH(finalize, static_cast<unsigned>((rows + kStatsThreads - 1) / kStatsThreads),
                  kStatsThreads, stream, table, part_f, part_c, part_extra, out_f, out_c, out_extra);
}

// Statistics of every unit: part_f/part_c hold at least plan.num_prows() rows, out_f/out_c one
// row per unit (the spans' rows must be consecutive: every unit of the call).
template <typename scalar_t, typename Stream>
void launch_unit_stats(const std::vector<UnitSpan>& spans, const UnitPlan& plan, PowMode mode,
                       double p, acc_of<scalar_t>* part_f, int64_t* part_c, double* out_f,
                       int64_t* out_c, Stream stream) {
  using acc_t = acc_of<scalar_t>;
  for_each_unit_table(spans, plan, [&](const auto& table, int64_t items) {
    using Table = std::decay_t<decltype(table)>;
    if (items > 0) {
      auto* kernel = mode == PowMode::kNone  ? &unit_stats_kernel<scalar_t, PowMode::kNone, Table>
                     : mode == PowMode::kAbs ? &unit_stats_kernel<scalar_t, PowMode::kAbs, Table>
                                             : &unit_stats_kernel<scalar_t, PowMode::kPow, Table>;
      GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(items), kStatsThreads, stream, table, acc_t(p),
                      part_f, part_c);
    }
    launch_unit_finalize<acc_t>(table, part_f, part_c, nullptr, out_f, out_c, nullptr, stream);
  });
}

// Multiplies every unit in place by coefs[its row] (device memory, acc type).
template <typename scalar_t, typename Stream>
void launch_unit_scale(const std::vector<UnitSpan>& spans, const UnitPlan& plan,
                       const acc_of<scalar_t>* coefs, bool conditional, Stream stream) {
  for_each_unit_table(spans, plan, [&](const auto& table, int64_t items) {
    if (items == 0) return;
    auto* kernel = &unit_scale_kernel<scalar_t, std::decay_t<decltype(table)>>;
    GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(items), kStatsThreads, stream, table, coefs, conditional);
  });
}

// Clamps every span (units of 1) to [-v, v] in place; statistics of the values before and the
// elements changed per span.
template <typename scalar_t, typename Stream>
void launch_clamp(const std::vector<UnitSpan>& spans, const UnitPlan& plan, double v,
                  acc_of<scalar_t>* part_f, int64_t* part_c, int64_t* part_clamped, double* out_f,
                  int64_t* out_c, int64_t* out_clamped, Stream stream) {
  using acc_t = acc_of<scalar_t>;
  const scalar_t v_stored = static_cast<scalar_t>(v), neg_stored = static_cast<scalar_t>(-v);
  const acc_t v_acc = static_cast<acc_t>(v_stored);  // the bound as torch rounds it
  for_each_unit_table(spans, plan, [&](const auto& table, int64_t items) {
    using Table = std::decay_t<decltype(table)>;
    if (items > 0) {
      auto* kernel = &clamp_kernel<scalar_t, Table>;
      GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(items), kStatsThreads, stream, table, v_acc,
                      v_stored, neg_stored, part_f, part_c, part_clamped);
    }
    launch_unit_finalize<acc_t>(table, part_f, part_c, part_clamped, out_f, out_c, out_clamped, stream);
  });
}

}  // namespace gradfuse::cuda
