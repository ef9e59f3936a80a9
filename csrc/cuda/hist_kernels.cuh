// The CUDA kernels of gradfuse::multi_tensor_exponent_histogram and the host code that launches
// them, free of ATen: compiled by nvcc (hist_cuda.cu) and by g++ under the CUDA emulation of
// tests/cuda_emu, like stats_kernels.cuh, whose launch tables, chunk lookup and 16-byte packs
// they share. Include after defining GRADFUSE_LAUNCH.
//
// One block per chunk counts its elements in the two passes of common/hist_math.h into a
// histogram in shared memory, then writes it as the chunk's partial row; one block per tensor
// then sums that tensor's rows in chunk order. Integer counts, no float atomics: exact and the
// same every run.
//
// Shared-memory contention. A histogram update is an atomic add to a shared counter, and when
// most values of a warp share an exponent (a constant or nearly constant tensor, a tensor of
// zeros, or simply the few most common exponents of a gradient) 32 lanes adding to one counter
// would be serialised 32 ways. Here every lane of a warp has a column of its own: the block's
// histogram is hist[bin][32], lane l adds to hist[bin][l]. Whatever the bins, the 32 lanes of an
// atomic instruction address 32 different words in 32 different banks: one conflict-free shared
// atomic per element, whatever the data (the all-same-exponent input is tested). Warps share the
// columns, so the adds stay atomic across warps. The block's total for a bin is the sum of its
// 32 columns, read at the end with a per-thread rotation so that those reads are conflict-free
// too. Cost: 283 x 32 x 4 = 36 KB of shared memory per block.
#pragma once

#ifndef GRADFUSE_LAUNCH
#error "define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...) before including hist_kernels.cuh"
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../common/hist_math.h"
#include "stats_kernels.cuh"

namespace gradfuse::cuda {

constexpr int kHistThreads = 256;
constexpr int kHistUnroll = 4;  // 16-byte loads in flight per thread

template <typename scalar_t>
using layout_of = std::conditional_t<
    std::is_same_v<scalar_t, float>, Fp32Layout,
    std::conditional_t<std::is_same_v<scalar_t, double>, Fp64Layout,
                       std::conditional_t<std::is_same_v<scalar_t, c10::Half>, Fp16Layout, Bf16Layout>>>;

struct alignas(16) Words {
  uint32_t w[4];
};

// Element k of a 16-byte pack, as its bits.
template <typename L>
__device__ inline typename L::Bits bits_at(const Words& p, int k) {
  using B = typename L::Bits;
  if constexpr (sizeof(B) == 2) {
    return static_cast<B>(p.w[k / 2] >> (16 * (k % 2)));
  } else if constexpr (sizeof(B) == 4) {
    return p.w[k];
  } else {
    return (static_cast<uint64_t>(p.w[2 * k + 1]) << 32) | p.w[2 * k];
  }
}

// Calls f(bits) for the elements of x[0, n) this thread owns, n <= kChunkElems: the loop of
// stats_kernels.cuh's for_each_element, on the raw bits.
template <typename L, typename F>
__device__ inline void for_each_bits(const char* __restrict__ x, int n, F&& f) {
  using B = typename L::Bits;
  constexpr int kPer = 16 / sizeof(B);
  const int tid = static_cast<int>(threadIdx.x);
  int i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(Words) == 0) {
    const Words* __restrict__ xp = reinterpret_cast<const Words*>(x);
    const int packs = n / kPer;
    constexpr int kStride = kHistThreads * kHistUnroll;
    int base = 0;
    for (; base + kStride <= packs; base += kStride) {
      Words buf[kHistUnroll];
#pragma unroll
      for (int u = 0; u < kHistUnroll; ++u) buf[u] = xp[base + u * kHistThreads + tid];
#pragma unroll
      for (int u = 0; u < kHistUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) f(bits_at<L>(buf[u], k));
      }
    }
    for (int j = base + tid; j < packs; j += kHistThreads) {
      const Words v = xp[j];
#pragma unroll
      for (int k = 0; k < kPer; ++k) f(bits_at<L>(v, k));
    }
    i = packs * kPer;
  }
  for (int j = i + tid; j < n; j += kHistThreads) {
    B b;
    memcpy(&b, x + static_cast<int64_t>(j) * sizeof(B), sizeof(B));
    f(b);
  }
}

template <typename scalar_t, typename Table>
__global__ void __launch_bounds__(kHistThreads)
hist_kernel(const __grid_constant__ Table table, int64_t* __restrict__ part) {
  using L = layout_of<scalar_t>;
  using B = typename L::Bits;
  __shared__ int hist[kNumHistBins][32];
  __shared__ bool refine;
  const ChunkRef ref = locate_chunk(table);
  const char* __restrict__ x = static_cast<const char*>(table.data[ref.tensor]) + ref.offset * int64_t(sizeof(B));
  const int n = static_cast<int>(ref.n);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;

  for (int i = tid; i < kNumHistBins * 32; i += kHistThreads) (&hist[0][0])[i] = 0;
  __syncthreads();
  int* const column = &hist[0][lane];
  // Pass 1: one shift, one AND, one address and one conflict-free shared atomic per element.
  for_each_bits<L>(x, n, [&](B bits) { atomicAdd(column + 32 * hot_row<L>(bits), 1); });
  __syncthreads();
  if (tid < 32) {
    refine = __any_sync(0xffffffffu, hist[L::kLowRow][lane] != 0 || hist[L::kHighRow][lane] != 0);
  }
  __syncthreads();
  if (refine) {  // uniform over the block
    // Pass 2: zeros, subnormals, Inf, NaN (float64: also |x| outside [2^-149, 2^128)) move from
    // their lumped row to their exact bin. Same element -> thread map as pass 1.
    for_each_bits<L>(x, n, [&](B bits) {
      const int row = hot_row<L>(bits);
      if (needs_exact_bin<L>(row)) {
        atomicAdd(column + 32 * row, -1);
        atomicAdd(column + 32 * exponent_bin<L>(bits), 1);
      }
    });
    __syncthreads();
  }
  const int64_t chunk = table.first_chunk[0] + blockIdx.x;
  for (int r = tid; r < kNumHistBins; r += kHistThreads) {
    int sum = 0;
    // Thread r starts at column r % 32: the 32 threads of a warp read 32 different banks.
    for (int k = 0; k < 32; ++k) sum += hist[r][(r + k) % 32];
    part[chunk * kNumHistBins + r] = sum;
  }
}

// One block per tensor of the table: thread b sums bin b over the tensor's chunks, in order.
template <typename Table>
__global__ void __launch_bounds__(kHistThreads)
hist_finalize_kernel(const __grid_constant__ Table table, int64_t tensor_base,
                     const int64_t* __restrict__ part, int64_t* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const int64_t row = tensor_base + t;
  for (int b = static_cast<int>(threadIdx.x); b < kNumHistBins; b += kHistThreads) {
    int64_t sum = 0;
    for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t + 1]; ++c) sum += part[c * kNumHistBins + b];
    out[row * kNumHistBins + b] = sum;  // tensors without elements get their zero row here
  }
}

// Histograms of every span: part holds one row of kNumHistBins per chunk (at least
// plan.num_chunks() rows), out one row per span.
template <typename scalar_t, typename Stream>
void launch_histogram(const std::vector<Span>& spans, const ChunkPlan& plan, int64_t* part,
                      int64_t* out, Stream stream) {
  for_each_table(spans, plan, [&](const auto& table, int64_t base, int64_t chunks) {
    using Table = std::decay_t<decltype(table)>;
    if (chunks > 0) {
      auto* kernel = &hist_kernel<scalar_t, Table>;
      GRADFUSE_LAUNCH(kernel, static_cast<unsigned>(chunks), kHistThreads, stream, table, part);
    }
    auto* finalize = &hist_finalize_kernel<Table>;
    GRADFUSE_LAUNCH(finalize, static_cast<unsigned>(table.num_tensors), kHistThreads, stream, table,
                    base, static_cast<const int64_t*>(part), out);
  });
}

}  // namespace gradfuse::cuda
