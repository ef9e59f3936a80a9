// The multi-tensor launcher of the CUDA backend: one launch table, one kernel template and one
// traversal of a tensor's elements, serving every op through a functor (stats_ops.cuh,
// clip_ops.cuh, hist_ops.cuh, update_ops.cuh), as apex's multi_tensor_apply and PyTorch's MultiTensorApply do.
// Free of ATen.
//
// The same text is compiled by nvcc for the GPU (the .cu files add the ATen glue of ops.h:
// checks, allocation, device guard, stream) and by g++ under the CUDA emulation of
// tests/cuda_emu, which runs every kernel on the CPU in the test suite. So nothing here may use
// ATen, and every launch goes through GRADFUSE_LAUNCH(kernel, grid, block, stream, args...),
// which the includer defines: `kernel<<<grid, block, 0, stream>>>(args...)` plus a launch check
// under nvcc, a call of the emulator's launcher under g++.
//
// Work is a list of *items* over the tensors of a call, each done by one block:
//  - whole-tensor ops (statistics, histogram, the optimizer-update ops): the chunks of the chunk
//    plan (chunk_plan.h);
//  - per-unit ops (unit statistics, scale, clamp): the items of the unit plan (unit_plan.h), of
//    which units of 1 are the chunk plan again.
// Both plans are shared with the CPU backend. One launch covers up to kMaxTensorsPerLaunch
// (whole-tensor), kMaxUnitTensorsPerLaunch (per-unit, whose table has three more columns) or
// kMaxListTensorsPerLaunch (ops that stream several tensor lists at once, parameters, gradients
// and optimizer state: a data pointer per list) tensors, whatever their sizes: their addresses, sizes and item ids travel in the kernel argument
// (CUDA >= 12.1 allows 32 KB; groups of at most kSmallTableTensors get a small table, as the whole
// argument is copied at every launch). Each block finds its item by binary search over that
// table. multi_tensor_kernel<Op, Table> hands the item to Op, which streams it with
// for_each_element (for_each_element_of_lists over several lists): 16-byte loads per thread in
// flight (scripts/sass_budget.py checks the instructions per element the compiler emitted).
//
// Reductions are in two stages with no float atomics, so results are bitwise stable: one partial
// row per item (or per unit of a packed item), then finalize_kernel combines the rows of each
// result row in order, in double. Nothing here waits for the host.
#pragma once

#ifndef GRADFUSE_LAUNCH
#error "define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...) before including multi_tensor.cuh"
#endif

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/chunk_plan.h"
#include "../common/stats_math.h"
#include "../common/unit_plan.h"
#include "../common/update_math.h"

namespace gradfuse::cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kFinalizeWarps = 4;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
// Whole-tensor tables: 3 x 8 bytes per tensor, 30 KB of the 32 KB kernel-argument space.
constexpr int kMaxTensorsPerLaunch = 1280;
// Per-unit tables: 6 x 8 bytes per tensor, 24 KB.
constexpr int kMaxUnitTensorsPerLaunch = 512;
// Several-list tables (five data pointers per tensor: the optimizer-update ops' parameters,
// gradients and three state lists): 7 x 8 bytes per tensor, 28 KB.
constexpr int kMaxListTensorsPerLaunch = 512;
// Groups this small launch with a small table instead: the whole argument is copied for every
// launch, whatever the number of tensors in it.
constexpr int kSmallTableTensors = 64;

template <int kCapacity>
struct UnitColumns {
  int64_t units[kCapacity];
  int64_t row[kCapacity + 1];         // each tensor's first unit among the call's units; [n]: the end
  int64_t first_prow[kCapacity + 1];  // global partial rows (UnitPlan)
};
struct NoUnitColumns {};

// The data pointers of lists 1 .. kLists-1 (list 0 is LaunchTable::data); null where a tensor of
// that list is absent.
template <int kCapacity, int kLists>
struct ListColumns {
  void* list_data[kLists - 1][kCapacity];
};
template <int kCapacity>
struct ListColumns<kCapacity, 1> {};

// The kernel argument: kCapacity tensors of a whole-tensor op (kUnits false) or a per-unit op,
// each with kLists data pointers (tensor i of every list has the same number of elements).
template <int kCapacity, bool kUnits, int kLists = 1>
struct LaunchTable : std::conditional_t<kUnits, UnitColumns<kCapacity>, NoUnitColumns>,
                     ListColumns<kCapacity, kLists> {
  static_assert(kLists == 1 || !kUnits, "several lists for whole-tensor tables only");
  static constexpr int kMaxTensors = kCapacity;
  static constexpr bool kHasUnits = kUnits;
  static constexpr int kNumLists = kLists;
  int64_t num_tensors;
  int64_t first_row;  // whole-tensor tables: the result row (call index) of tensor 0
  void* data[kCapacity];
  int64_t numel[kCapacity];
  int64_t first_item[kCapacity + 1];  // global item ids: chunks (ChunkPlan) or UnitPlan items
};
static_assert(sizeof(LaunchTable<kMaxTensorsPerLaunch, false>) <= 32000, "the table must fit the 32 KB kernel argument");
static_assert(sizeof(LaunchTable<kMaxUnitTensorsPerLaunch, true>) <= 32000, "the table must fit the 32 KB kernel argument");
static_assert(sizeof(LaunchTable<kMaxListTensorsPerLaunch, false, 5>) <= 32000,
              "the table must fit the 32 KB kernel argument");
// One list adds nothing to a table.
static_assert(sizeof(LaunchTable<kSmallTableTensors, false>) == (2 + 3 * kSmallTableTensors + 1) * 8,
              "a one-list table is num_tensors, first_row and three columns");

// Tensor t's data pointer in list `list` of the table.
template <typename Table>
__host__ __device__ inline void* list_data(const Table& table, int list, int64_t t) {
  if constexpr (Table::kNumLists == 1) {
    return table.data[t];
  } else {
    return list == 0 ? table.data[t] : table.list_data[list - 1][t];
  }
}

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

// Item `item` of the table (a chunk of a whole-tensor table is an item of units of 1).
template <typename Table>
__device__ inline UnitItem locate(const Table& table, int64_t item) {
  if constexpr (Table::kHasUnits) {
    return locate_unit_item(table.first_item, table.first_prow, table.numel, table.units,
                            table.num_tensors, item);
  } else {
    const int64_t t = owner_of_chunk(table.first_item, table.num_tensors, item);
    UnitItem r;
    r.tensor = t;
    r.unit = 0;
    r.num_units = 1;
    r.offset = (item - table.first_item[t]) * kChunkElems;
    r.n = ::min(kChunkElems, table.numel[t] - r.offset);
    r.unit_len = table.numel[t];
    r.prow = item;
    r.packed = false;
    return r;
  }
}

// The result row of an item's (first) unit.
template <typename Table>
__device__ inline int64_t result_row(const Table& table, const UnitItem& it) {
  if constexpr (Table::kHasUnits) {
    return table.row[it.tensor] + it.unit;
  } else {
    return table.first_row + it.tensor;
  }
}

// One block per item of the table: Op streams it (the functors of *_ops.cuh).
template <typename Op, typename Table>
__global__ void __launch_bounds__(kThreads)
multi_tensor_kernel(const __grid_constant__ Table table, const Op op) {
  op(table, locate(table, table.first_item[0] + blockIdx.x));
}

// The columns of a reduced row type (StatsAcc, UpdateAcc), for the shared rows of block_reduce
// and the finalize.
template <typename Row>
struct RowColumns;
template <typename acc_t>
struct RowColumns<StatsAcc<acc_t>> {
  using acc = acc_t;
  static constexpr int kFloats = kNumFloatStats, kCounts = kNumCountStats, kNumelColumn = kNumel;
};
template <typename acc_t>
struct RowColumns<UpdateAcc<acc_t>> {
  using acc = acc_t;
  static constexpr int kFloats = kNumUpdateFloatStats, kCounts = kNumUpdateCountStats, kNumelColumn = kUpdateNumel;
};

// Every column of the lane delta places down (Row::for_each visits them in column order).
template <typename Row>
__device__ inline Row shfl_down(Row s, int delta) {
  s.for_each([delta](auto& member) { member = __shfl_down_sync(0xffffffffu, member, delta); });
  return s;
}

// Fixed-shape tree over the warp: lane 0 ends with the result, the same every run.
template <typename Row>
__device__ inline void warp_reduce(Row& s) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) s.combine(shfl_down(s, delta));
}

// The block's total, in thread 0 (the other threads get their warp's partial): the warp trees,
// then thread 0 combines the warps in order. Every thread must call it. Its shared rows may be
// written again by a later call only after another barrier (thread 0 reads them after this one).
template <typename Row>
__device__ inline Row block_reduce(Row s) {
  using C = RowColumns<Row>;
  __shared__ typename C::acc warp_f[kWarps][C::kFloats];
  __shared__ int64_t warp_c[kWarps][C::kCounts];
  warp_reduce(s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) s.store(warp_f[warp], warp_c[warp]);
  __syncthreads();
  if (threadIdx.x == 0) {
    s = Row::load(warp_f[0], warp_c[0]);
    for (int w = 1; w < kWarps; ++w) s.combine(Row::load(warp_f[w], warp_c[w]));
  }
  return s;
}

// The total of kN threads (a block of kThreads, or a warp), in thread 0 of the group.
template <int kN, typename acc_t>
__device__ inline StatsAcc<acc_t> group_reduce(StatsAcc<acc_t> s) {
  static_assert(kN == 32 || kN == kThreads, "a warp or the block");
  if constexpr (kN == 32) {
    warp_reduce(s);
    return s;
  } else {
    return block_reduce(s);
  }
}

// Thread 0's `flag`, given to every thread of the group of kN threads (which must all call it).
template <int kN>
__device__ inline bool group_broadcast(bool flag) {
  if constexpr (kN == 32) {
    return __shfl_sync(0xffffffffu, static_cast<int>(flag), 0) != 0;
  } else {
    __shared__ bool shared_flag;
    if (threadIdx.x == 0) shared_flag = flag;
    __syncthreads();
    return shared_flag;
  }
}

// Element k of a pack, as acc_t. bf16 is read from the 32-bit word that holds it, so the upper
// element of a word costs one AND instead of an extract and a shift.
template <typename scalar_t>
__device__ inline acc_of<scalar_t> element(const Pack<scalar_t>& pack, int k) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    uint32_t word;
    memcpy(&word, &pack.v[k & ~1], sizeof(word));
    const uint32_t bits = k % 2 == 0 ? word << 16 : word & 0xffff0000u;
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
  } else {
    return static_cast<acc_of<scalar_t>>(pack.v[k]);
  }
}

// Element k of a pack, as its bits (an unsigned integer of the element's width).
template <typename Bits, typename scalar_t>
__device__ inline Bits bits_at(const Pack<scalar_t>& pack, int k) {
  static_assert(sizeof(Bits) == sizeof(scalar_t), "bits of the element's width");
  if constexpr (sizeof(Bits) == 2) {
    uint32_t word;
    memcpy(&word, &pack.v[k & ~1], sizeof(word));
    return static_cast<Bits>(word >> (16 * (k % 2)));
  } else {
    Bits b;
    memcpy(&b, &pack.v[k], sizeof(b));
    return b;
  }
}

// The one traversal: calls f(pack, k) for every element of x[0, n) (n <= kChunkElems) that
// thread `tid` of a group of kN threads (the block, or a warp) owns: element k of `pack`. Aligned
// fast path: kUnroll independent 16-byte loads per thread in flight, then the work; misaligned
// views and tails element by element, each as element 0 of an otherwise zero pack. With kWrite,
// f may change pack.v[k] and every pack is stored back. 32-bit indices: a chunk is 65 536
// elements.
template <int kN, bool kWrite, typename scalar_t, typename F>
__device__ inline void for_each_element(std::conditional_t<kWrite, scalar_t, const scalar_t>* __restrict__ x,
                                        int n, int tid, F&& f) {
  using P = Pack<scalar_t>;
  using PackPtr = std::conditional_t<kWrite, P, const P>*;
  int i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    const PackPtr __restrict__ xp = reinterpret_cast<PackPtr>(x);
    const int packs = n / P::kSize;
    constexpr int kStride = kN * kUnroll;
    int base = 0;
    for (; base + kStride <= packs; base += kStride) {
      P buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = xp[base + u * kN + tid];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) f(buf[u], k);
        if constexpr (kWrite) xp[base + u * kN + tid] = buf[u];
      }
    }
    for (int j = base + tid; j < packs; j += kN) {
      P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) f(v, k);
      if constexpr (kWrite) xp[j] = v;
    }
    i = packs * P::kSize;
  }
  for (int j = i + tid; j < n; j += kN) {
    P v{};
    v.v[0] = x[j];
    f(v, 0);
    if constexpr (kWrite) x[j] = v.v[0];
  }
}

// The traversal of several lists at once (tensor i of each list: the same n elements): calls
// f(packs, k) for every element thread `tid` of a group of kN threads owns, packs[l] holding list
// l's element k. Which lists are read is decided at compile time, so that the loop of each case
// holds only its own loads: lists in kLoaded are read (their pointers must not be null), lists in
// kMaybe are read where their pointer is not null (an absent tensor), and every other list reads
// as zeros without touching memory. Aligned fast path when every list read or written is 16-byte
// aligned: one 16-byte load per list and thread in flight, a pack of each list per trip (the
// arithmetic of the ops that stream several lists is long enough to hide the loop); else element
// by element, as for_each_element's misaligned path. Lists in kWritten: f may change
// packs[l].v[k], and the packs are stored back (a written list in kMaybe where its pointer is not
// null; one in neither kLoaded nor kMaybe is written only, its packs starting as zeros for f to
// fill); the other lists are only read. done (optional): called after f has seen the elements of
// a pack, before its stores, as done(packs, first, count): `first` list 0's pack as read, `count`
// the elements of the pack in use (the first `count`: a whole pack, or 1 on the element-wise path).
struct NoPackEnd {
  template <typename... T>
  __device__ void operator()(T&&...) const {}
};

template <int kN, int kLists, unsigned kWritten, unsigned kLoaded, unsigned kMaybe, typename scalar_t, typename F,
          typename G = NoPackEnd>
__device__ inline void for_each_element_of_lists(scalar_t* const (&x)[kLists], int n, int tid, F&& f,
                                                 G&& done = G{}) {
  static_assert((kLoaded & kMaybe) == 0, "a list is loaded or maybe loaded");
  using P = Pack<scalar_t>;
  const auto read = [&](int l) {
    return ((kLoaded >> l) & 1u) != 0 || (((kMaybe >> l) & 1u) != 0 && x[l] != nullptr);
  };
  const auto written = [&](int l) {
    return ((kWritten >> l) & 1u) != 0 && (((kMaybe >> l) & 1u) == 0 || x[l] != nullptr);
  };
  bool aligned = true;
#pragma unroll
  for (int l = 0; l < kLists; ++l) {
    if (((kLoaded | kMaybe | kWritten) >> l) & 1u) {
      aligned = aligned && reinterpret_cast<uintptr_t>(x[l]) % sizeof(P) == 0;
    }
  }
  int i = 0;
  if (aligned) {
    const int packs = n / P::kSize;
#pragma unroll 1  // a pack of each list per trip (scripts/sass_budget.py reads the traffic from it)
    for (int j = tid; j < packs; j += kN) {
      P v[kLists];
#pragma unroll
      for (int l = 0; l < kLists; ++l) v[l] = read(l) ? reinterpret_cast<const P*>(x[l])[j] : P{};
      const P first = v[0];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) f(v, k);
      done(v, first, int{P::kSize});  // (a value: the hook may take it by reference)
#pragma unroll
      for (int l = 0; l < kLists; ++l) {
        if (written(l)) reinterpret_cast<P*>(x[l])[j] = v[l];
      }
    }
    i = packs * P::kSize;
  }
  for (int j = i + tid; j < n; j += kN) {
    P v[kLists];
#pragma unroll
    for (int l = 0; l < kLists; ++l) {
      v[l] = P{};
      if (read(l)) v[l].v[0] = x[l][j];
    }
    const P first = v[0];
    f(v, 0);
    done(v, first, 1);
#pragma unroll
    for (int l = 0; l < kLists; ++l) {
      if (written(l)) x[l][j] = v[l].v[0];
    }
  }
}

// Which rows a table's finalize step writes, and where each one's partial rows are.
struct RowParts {
  int64_t first;  // first partial row
  int64_t count;  // partial rows, combined in order
  int64_t len;    // elements of the row's unit (tensor)
};

template <typename Table>
__host__ __device__ inline int64_t rows_begin(const Table& table) {
  if constexpr (Table::kHasUnits) return table.row[0]; else return table.first_row;
}
template <typename Table>
__host__ __device__ inline int64_t rows_end(const Table& table) {
  if constexpr (Table::kHasUnits) return table.row[table.num_tensors]; else return table.first_row + table.num_tensors;
}

template <typename Table>
__device__ inline RowParts row_parts(const Table& table, int64_t row) {
  if constexpr (Table::kHasUnits) {
    const int64_t t = owner_of_chunk(table.row, table.num_tensors, row);
    const UnitGeometry g = unit_geometry(table.numel[t], table.units[t]);
    return {table.first_prow[t] + (row - table.row[t]) * g.pieces, g.pieces, g.unit_len};
  } else {
    const int64_t t = row - table.first_row;
    return {table.first_item[t], table.first_item[t + 1] - table.first_item[t], table.numel[t]};
  }
}

// Statistics, second stage: one warp per result row of the table; lane l takes the row's partial
// rows l, l+32, ... in order, then a fixed tree. Row: the reduced row type (StatsAcc, or
// UpdateAcc of the optimizer-update statistics), combined in double. `part_extra` (optional): one
// count per partial row (the clamp's), summed into out_extra. `shifts` (optional, kMoments,
// StatsAcc only): the row's shift, for StatsAcc::finish_moments. Rows without elements get their
// zero row here.
template <template <typename> class Row, typename acc_t, typename Table>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
finalize_kernel(const __grid_constant__ Table table, const acc_t* __restrict__ part_f,
                const int64_t* __restrict__ part_c, const int64_t* __restrict__ part_extra,
                double* __restrict__ out_f, int64_t* __restrict__ out_c, int64_t* __restrict__ out_extra,
                const double* __restrict__ shifts) {
  using C = RowColumns<Row<double>>;
  const int64_t row = rows_begin(table) + int64_t(blockIdx.x) * kFinalizeWarps + threadIdx.x / 32;
  if (row >= rows_end(table)) return;  // whole warps
  const int lane = threadIdx.x % 32;
  const RowParts parts = row_parts(table, row);
  Row<double> s;
  int64_t extra = 0;
  for (int64_t r = parts.first + lane; r < parts.first + parts.count; r += 32) {
    s.combine(Row<acc_t>::load(part_f + r * C::kFloats, part_c + r * C::kCounts));
    if (part_extra) extra += part_extra[r];
  }
  warp_reduce(s);
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) extra += __shfl_down_sync(0xffffffffu, extra, delta);
  if (lane == 0) {
    if constexpr (std::is_same_v<Row<double>, StatsAcc<double>>) {
      if (shifts != nullptr && parts.len > 0) s.finish_moments(shifts[row], parts.len);
    }
    s.store(out_f + row * C::kFloats, out_c + row * C::kCounts);
    out_c[row * C::kCounts + C::kNumelColumn] = parts.len;
    if (out_extra) out_extra[row] = extra;
  }
}

// Host side: the table of spans[base, base + count).
template <typename Table>
void fill_table(Table& table, const std::vector<Span>& spans, const ChunkPlan& plan, int64_t base, int64_t count) {
  table.num_tensors = count;
  table.first_row = base;
  for (int64_t k = 0; k < count; ++k) {
    table.data[k] = spans[base + k].data;
    table.numel[k] = spans[base + k].numel;
    table.first_item[k] = plan.first_chunk[base + k];
  }
  table.first_item[count] = plan.first_chunk[base + count];
}

// One tensor of a several-list call: its elements and its data pointer in each list (null: absent).
template <int kLists>
struct ListSpan {
  void* data[kLists];
  int64_t numel;
};

template <typename Table, int kLists>
void fill_table(Table& table, const std::vector<ListSpan<kLists>>& spans, const ChunkPlan& plan, int64_t base,
                int64_t count) {
  static_assert(Table::kNumLists == kLists, "a table of the spans' lists");
  table.num_tensors = count;
  table.first_row = base;
  for (int64_t k = 0; k < count; ++k) {
    table.data[k] = spans[base + k].data[0];
    for (int l = 1; l < kLists; ++l) table.list_data[l - 1][k] = spans[base + k].data[l];
    table.numel[k] = spans[base + k].numel;
    table.first_item[k] = plan.first_chunk[base + k];
  }
  table.first_item[count] = plan.first_chunk[base + count];
}

template <typename Table>
void fill_table(Table& table, const std::vector<UnitSpan>& spans, const UnitPlan& plan, int64_t base, int64_t count) {
  table.num_tensors = count;
  table.first_row = spans[base].row;
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
}

// The tables a kind of span fills: Span whole-tensor tables, UnitSpan per-unit tables,
// ListSpan<kLists> whole-tensor tables of kLists lists.
template <typename SpanT>
struct TableKind {
  static constexpr bool kUnits = false;
  static constexpr int kLists = 1, kMax = kMaxTensorsPerLaunch;
};
template <>
struct TableKind<UnitSpan> {
  static constexpr bool kUnits = true;
  static constexpr int kLists = 1, kMax = kMaxUnitTensorsPerLaunch;
};
template <int kNumLists>
struct TableKind<ListSpan<kNumLists>> {
  static constexpr bool kUnits = false;
  static constexpr int kLists = kNumLists, kMax = kMaxListTensorsPerLaunch;
};

// Splits the spans (Span: whole-tensor tables, UnitSpan: per-unit tables, ListSpan: several-list
// tables) into launch tables and calls launch(table) for each: a small table when its tensors fit
// one, else a large one.
template <typename SpanT, typename Plan, typename F>
void for_each_table(const std::vector<SpanT>& spans, const Plan& plan, F&& launch) {
  constexpr bool kUnits = TableKind<SpanT>::kUnits;
  constexpr int kLists = TableKind<SpanT>::kLists, kMax = TableKind<SpanT>::kMax;
  const int64_t n = static_cast<int64_t>(spans.size());
  for (int64_t base = 0; base < n; base += kMax) {
    const int64_t count = std::min<int64_t>(kMax, n - base);
    if (count <= kSmallTableTensors) {
      LaunchTable<kSmallTableTensors, kUnits, kLists> table;
      fill_table(table, spans, plan, base, count);
      launch(table);
    } else {
      LaunchTable<kMax, kUnits, kLists> table;
      fill_table(table, spans, plan, base, count);
      launch(table);
    }
  }
}

// multi_tensor_kernel<Op> over every item of the table.
template <typename Table, typename Op, typename Stream>
void launch_items(const Table& table, const Op& op, Stream stream) {
  const int64_t items = table.first_item[table.num_tensors] - table.first_item[0];
  if (items == 0) return;
  auto* kernel = &multi_tensor_kernel<Op, Table>;
  GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(items), kThreads, stream, table, op);
}

template <typename acc_t, template <typename> class Row = StatsAcc, typename Table, typename Stream>
void launch_finalize(const Table& table, const acc_t* part_f, const int64_t* part_c, const int64_t* part_extra,
                     double* out_f, int64_t* out_c, int64_t* out_extra, Stream stream,
                     const double* shifts = nullptr) {
  const int64_t rows = rows_end(table) - rows_begin(table);
  if (rows == 0) return;
  auto* finalize = &finalize_kernel<Row, acc_t, Table>;
  GRADFUSE_LAUNCH(finalize, static_cast<unsigned>((rows + kFinalizeWarps - 1) / kFinalizeWarps),
                  kFinalizeWarps * 32, stream, table, part_f, part_c, part_extra, out_f, out_c, out_extra, shifts);
}

// Calls f(scalar_t{}) for a floating dtype the kernels take (checked by the caller), so that the
// ATen glue and the emulator dispatch the same four instantiations.
template <typename F>
void dispatch_float(c10::ScalarType t, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: return f(float{});
    case c10::ScalarType::Double: return f(double{});
    case c10::ScalarType::Half: return f(c10::Half{});
    case c10::ScalarType::BFloat16: return f(c10::BFloat16{});
    default: break;
  }
}

}  // namespace gradfuse::cuda
