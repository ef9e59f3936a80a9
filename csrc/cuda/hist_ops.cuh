// The exponent-histogram functor of the CUDA backend on the multi-tensor launcher
// (multi_tensor.cuh), and the host code that sequences its launches. ATen-free, as stats_ops.cuh.
// HistOp runs the two passes of hist_math.h into a histogram in shared memory, written as the
// chunk's partial row; hist_finalize_kernel sums a tensor's rows in chunk order.
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

#include "../common/hist_math.h"
#include "multi_tensor.cuh"

namespace gradfuse::cuda {

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
