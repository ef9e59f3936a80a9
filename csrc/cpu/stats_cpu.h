// The CPU stats op's inputs and its kernels, for callers that read the gradients themselves:
// gradfuse::watch::ParamWatch (csrc/watch.cpp) fills StatsInputs in the same pass that reads each
// parameter's gradient, so that 10 000 tiny tensors are walked once per step, not three times
// (read, op, scale check), and no reference to them is taken.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/chunk_plan.h"

namespace gradfuse::cpu {

// One call's inputs as the stats kernels see them: the spans and the chunk plan (as
// ChunkPlan::first_chunk) of one dtype's dense CPU tensors, in order.
struct StatsInputs {
  std::vector<Span> spans;
  std::vector<int64_t> first_chunk;  // as ChunkPlan::first_chunk, once finish() has run
  std::vector<at::Tensor> copies;    // contiguous copies of the inputs that are not dense
  int64_t bytes = 0;
  int64_t next_chunk = 0;
  int64_t elems = 0;

  void reserve(size_t n) {
    spans.reserve(n);
    first_chunk.reserve(n + 1);
  }
  // Appends a non-overlapping and dense tensor's elements.
  void append(const void* data, int64_t numel) {
    spans.push_back({const_cast<void*>(data), numel});
    first_chunk.push_back(next_chunk);
    next_chunk += (numel + kChunkElems - 1) / kChunkElems;
    elems += numel;
  }
  void finish(at::ScalarType dtype) {
    first_chunk.push_back(next_chunk);
    bytes = elems * static_cast<int64_t>(c10::elementSize(dtype));
  }
};

// gradfuse::multi_tensor_stats (CPU) on inputs read already (finish() called, at least one
// tensor): the same kernels, thread split and results, bit for bit, as the op. moments: the rows
// of multi_tensor_moments instead (norm_type 2).
std::tuple<at::Tensor, at::Tensor> stats_of_inputs(const StatsInputs& in, at::ScalarType dtype,
                                                   double norm_type, bool moments = false);

}  // namespace gradfuse::cpu
