// The CUDA kernels of gradfuse and the host code that sequences their launches, free of ATen.
//
// The same text is compiled by nvcc for the GPU (stats_cuda.cu adds the ATen glue: checks,
// allocation, device guard, stream) and by g++ under the CUDA emulation of tests/cuda_emu, which
// runs every kernel on the CPU in the test suite. So nothing here may use ATen, and every launch
// goes through GRADFUSE_LAUNCH(kernel, grid, block, stream, args...), which the includer defines:
// `kernel<<<grid, block, 0, stream>>>(args...)` plus a launch check under nvcc, a call of the
// emulator's launcher under g++.
//
// One launch covers up to kMaxTensorsPerLaunch tensors, whatever their sizes: their addresses,
// sizes and chunk ids travel in the kernel argument (CUDA >= 12.1 allows 32 KB; groups of at most
// kSmallTableTensors get a 1.5 KB table, as the whole argument is copied at every launch), each
// block finds its (tensor, chunk) by binary search over that table (chunk_plan.h, shared with
// the CPU). A block reduces its chunk in the two passes of stats_math.h; the hot one costs about
// 6 instructions per element on sm_90 (scripts/sass_budget.py checks the emitted SASS). Results
// are reduced in two stages with no float atomics, so they are bitwise stable: one block per
// chunk writes a partial row, then one warp per tensor combines that tensor's rows in chunk
// order, in double. Nothing here waits for the host.
#pragma once

#ifndef GRADFUSE_LAUNCH
#error "define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...) before including stats_kernels.cuh"
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

namespace gradfuse::cuda {

constexpr int kStatsThreads = 256;
constexpr int kFinalizeWarps = 4;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
// 3 x 8 bytes per tensor + header: 30 KB of the 32 KB kernel-argument space.
constexpr int kMaxTensorsPerLaunch = 1280;
// Groups this small launch with a 1.5 KB table instead: the whole argument is copied for every
// launch, whatever the number of tensors in it.
constexpr int kSmallTableTensors = 64;

template <int kCapacity>
struct LaunchTable {
  static constexpr int kMaxTensors = kCapacity;
  int64_t num_tensors;
  void* data[kCapacity];
  int64_t numel[kCapacity];
  int64_t first_chunk[kCapacity + 1];  // global chunk ids (ChunkPlan)
};
using LargeTable = LaunchTable<kMaxTensorsPerLaunch>;
using SmallTable = LaunchTable<kSmallTableTensors>;
static_assert(sizeof(LargeTable) <= 32000, "LaunchTable must fit the 32 KB kernel argument");

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

struct ChunkRef {
  int64_t tensor;  // index in the table
  int64_t offset;  // first element of the chunk
  int64_t n;       // elements in the chunk
};

template <typename Table>
__device__ inline ChunkRef locate_chunk(const Table& table) {
  const int64_t chunk = table.first_chunk[0] + blockIdx.x;
  const int64_t t = owner_of_chunk(table.first_chunk, table.num_tensors, chunk);
  const int64_t offset = (chunk - table.first_chunk[t]) * kChunkElems;
  return {t, offset, ::min(kChunkElems, table.numel[t] - offset)};
}

template <typename acc_t>
__device__ inline StatsAcc<acc_t> shfl_down(const StatsAcc<acc_t>& s, int delta) {
  StatsAcc<acc_t> o;
  o.sum = __shfl_down_sync(0xffffffffu, s.sum, delta);
  o.sumsq = __shfl_down_sync(0xffffffffu, s.sumsq, delta);
  o.maxabs = __shfl_down_sync(0xffffffffu, s.maxabs, delta);
  o.powsum = __shfl_down_sync(0xffffffffu, s.powsum, delta);
  o.nan = __shfl_down_sync(0xffffffffu, s.nan, delta);
  o.inf = __shfl_down_sync(0xffffffffu, s.inf, delta);
  o.zero = __shfl_down_sync(0xffffffffu, s.zero, delta);
  return o;
}

// Fixed-shape tree over the warp: lane 0 ends with the result, the same every run.
template <typename acc_t>
__device__ inline void warp_reduce(StatsAcc<acc_t>& s) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) s.combine(shfl_down(s, delta));
}

// The block's total, in thread 0 (the other threads get their warp's partial): the warp trees,
// then thread 0 combines the warps in order. Every thread must call it. Its shared rows may be
// written again by a later call only after another barrier (thread 0 reads them after this one).
template <typename acc_t>
__device__ inline StatsAcc<acc_t> block_reduce(StatsAcc<acc_t> s) {
  constexpr int kWarps = kStatsThreads / 32;
  __shared__ acc_t warp_f[kWarps][kNumFloatStats];
  __shared__ int64_t warp_c[kWarps][kNumCountStats];
  warp_reduce(s);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) s.store(warp_f[warp], warp_c[warp]);
  __syncthreads();
  if (threadIdx.x == 0) {
    s = StatsAcc<acc_t>::load(warp_f[0], warp_c[0]);
    for (int w = 1; w < kWarps; ++w) s.combine(StatsAcc<acc_t>::load(warp_f[w], warp_c[w]));
  }
  return s;
}

// Calls f(element as acc_t) for the elements of x[0, n) this thread owns, n <= kChunkElems.
// Aligned fast path: kUnroll independent 16-byte loads per thread in flight, then the arithmetic;
// misaligned views and tails element by element. 32-bit indices: a chunk is 65 536 elements.
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

template <typename scalar_t, typename F>
__device__ inline void for_each_element(const scalar_t* __restrict__ x, int n, F&& f) {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const int tid = static_cast<int>(threadIdx.x);
  int i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    const P* __restrict__ xp = reinterpret_cast<const P*>(x);
    const int packs = n / P::kSize;
    constexpr int kStride = kStatsThreads * kUnroll;
    int base = 0;
    for (; base + kStride <= packs; base += kStride) {
      P buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = xp[base + u * kStatsThreads + tid];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) f(element(buf[u], k));
      }
    }
    for (int j = base + tid; j < packs; j += kStatsThreads) {
      const P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) f(element(v, k));
    }
    i = packs * P::kSize;
  }
  for (int j = i + tid; j < n; j += kStatsThreads) f(static_cast<acc_t>(x[j]));
}

// One block per chunk, in the two passes of stats_math.h: pass 2 (NaN / Inf counts) only when
// the block's sum of squares is not finite, decided once for the whole block.
template <typename scalar_t, PowMode mode, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
stats_kernel(const __grid_constant__ Table table, acc_of<scalar_t> p,
             acc_of<scalar_t>* __restrict__ part_f, int64_t* __restrict__ part_c) {
  static_assert(kChunkElems <= (int64_t{1} << 24), "32-bit indices and float counts (ElemCount) per thread");
  using acc_t = acc_of<scalar_t>;
  const ChunkRef ref = locate_chunk(table);
  const scalar_t* __restrict__ x = static_cast<const scalar_t*>(table.data[ref.tensor]) + ref.offset;
  const int n = static_cast<int>(ref.n);

  ElementAcc<acc_t> e;
  for_each_element(x, n, [&](acc_t v) { e.template add<mode>(v, p); });
  StatsAcc<acc_t> total = block_reduce(e.stats());

  __shared__ bool count_nonfinite;
  if (threadIdx.x == 0) count_nonfinite = needs_nonfinite_count(total);
  __syncthreads();
  if (count_nonfinite) {  // uniform over the block, so the barriers inside are reached by all
    NonfiniteCount c;
    for_each_element(x, n, [&](acc_t v) { c.add(v); });
    StatsAcc<acc_t> counts;
    counts.nan = c.nan;
    counts.inf = c.inf;
    counts = block_reduce(counts);
    if (threadIdx.x == 0) total.set_nonfinite_counts(counts.nan, counts.inf);
  }
  if (threadIdx.x == 0) {
    const int64_t chunk = table.first_chunk[0] + blockIdx.x;
    total.store(part_f + chunk * kNumFloatStats, part_c + chunk * kNumCountStats);
  }
}

// One warp per tensor of the table: lane l takes chunks l, l+32, ... in order, then a fixed tree.
template <typename acc_t, typename Table>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
finalize_kernel(const __grid_constant__ Table table, int64_t tensor_base,
                const acc_t* __restrict__ part_f, const int64_t* __restrict__ part_c,
                double* __restrict__ out_f, int64_t* __restrict__ out_c) {
  const int64_t t = int64_t(blockIdx.x) * kFinalizeWarps + threadIdx.x / 32;
  if (t >= table.num_tensors) return;
  const int lane = threadIdx.x % 32;
  StatsAcc<double> s;
  for (int64_t c = table.first_chunk[t] + lane; c < table.first_chunk[t + 1]; c += 32) {
    s.combine(StatsAcc<acc_t>::load(part_f + c * kNumFloatStats, part_c + c * kNumCountStats));
  }
  warp_reduce(s);
  if (lane == 0) {
    const int64_t row = tensor_base + t;
    s.store(out_f + row * kNumFloatStats, out_c + row * kNumCountStats);
    out_c[row * kNumCountStats + kNumel] = table.numel[t];
  }
}

template <typename scalar_t, typename Table>
__global__ void __launch_bounds__(kStatsThreads)
scale_kernel(const __grid_constant__ Table table, const acc_of<scalar_t>* __restrict__ coef_ptr,
             bool conditional) {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const acc_t coef = *coef_ptr;
  if (conditional && !needs_scaling(coef)) return;  // decided on the device: no traffic on unclipped steps
  const ChunkRef ref = locate_chunk(table);
  scalar_t* __restrict__ x = static_cast<scalar_t*>(table.data[ref.tensor]) + ref.offset;
  int64_t i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    P* xp = reinterpret_cast<P*>(x);
    const int64_t packs = ref.n / P::kSize;
    for (int64_t j = threadIdx.x; j < packs; j += kStatsThreads) {
      P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) v.v[k] = scale_element<scalar_t, acc_t>(v.v[k], coef);
      xp[j] = v;
    }
    i = packs * P::kSize;
  }
  for (int64_t j = i + threadIdx.x; j < ref.n; j += kStatsThreads) x[j] = scale_element<scalar_t, acc_t>(x[j], coef);
}

// Host side. Splits the spans into launch tables of at most kMaxTensorsPerLaunch tensors each and
// calls launch(table, first tensor index, chunks in the table) for each table: a SmallTable when
// its tensors fit one, else a LargeTable.
template <typename Table, typename F>
void launch_table(const std::vector<Span>& spans, const ChunkPlan& plan, int64_t base, int64_t count,
                  F& launch) {
  Table table;
  table.num_tensors = count;
  for (int64_t k = 0; k < count; ++k) {
    table.data[k] = spans[base + k].data;
    table.numel[k] = spans[base + k].numel;
    table.first_chunk[k] = plan.first_chunk[base + k];
  }
  table.first_chunk[count] = plan.first_chunk[base + count];
  launch(table, base, table.first_chunk[count] - table.first_chunk[0]);
}

template <typename F>
void for_each_table(const std::vector<Span>& spans, const ChunkPlan& plan, F&& launch) {
  const int64_t n = static_cast<int64_t>(spans.size());
  for (int64_t base = 0; base < n; base += kMaxTensorsPerLaunch) {
    const int64_t count = std::min<int64_t>(kMaxTensorsPerLaunch, n - base);
    if (count <= kSmallTableTensors) {
      launch_table<SmallTable>(spans, plan, base, count, launch);
    } else {
      launch_table<LargeTable>(spans, plan, base, count, launch);
    }
  }
}

// Statistics of every span: part_f/part_c hold one row per chunk (at least plan.num_chunks()
// rows), out_f/out_c one row per span (kNumFloatStats doubles, kNumCountStats int64s).
template <typename scalar_t, typename Stream>
void launch_stats(const std::vector<Span>& spans, const ChunkPlan& plan, PowMode mode, double p,
                  acc_of<scalar_t>* part_f, int64_t* part_c, double* out_f, int64_t* out_c,
                  Stream stream) {
  using acc_t = acc_of<scalar_t>;
  for_each_table(spans, plan, [&](const auto& table, int64_t base, int64_t chunks) {
    using Table = std::decay_t<decltype(table)>;
    if (chunks > 0) {
      const auto grid = static_cast<unsigned>(chunks);
      auto* kernel = mode == PowMode::kNone  ? &stats_kernel<scalar_t, PowMode::kNone, Table>
                     : mode == PowMode::kAbs ? &stats_kernel<scalar_t, PowMode::kAbs, Table>
                                             : &stats_kernel<scalar_t, PowMode::kPow, Table>;
      GRADFUSE_LAUNCH(kernel, grid, kStatsThreads, stream, table, acc_t(p), part_f, part_c);
    }
    // Tensors without elements still get their (zero) row from the finalise step.
    const auto blocks = static_cast<unsigned>((table.num_tensors + kFinalizeWarps - 1) / kFinalizeWarps);
    auto* finalize = &finalize_kernel<acc_t, Table>;
    GRADFUSE_LAUNCH(finalize, blocks, kFinalizeWarps * 32, stream, table, base,
                    static_cast<const acc_t*>(part_f), static_cast<const int64_t*>(part_c),
                    out_f, out_c);
  });
}

// Multiplies every span in place by *coef (device memory, acc type); with `conditional` only
// when that coefficient needs it, decided by the kernel.
template <typename scalar_t, typename Stream>
void launch_scale(const std::vector<Span>& spans, const ChunkPlan& plan,
                  const acc_of<scalar_t>* coef, bool conditional, Stream stream) {
  for_each_table(spans, plan, [&](const auto& table, int64_t, int64_t chunks) {
    if (chunks == 0) return;
    auto* kernel = &scale_kernel<scalar_t, std::decay_t<decltype(table)>>;
    GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(chunks), kStatsThreads, stream, table, coef,
                    conditional);
  });
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
