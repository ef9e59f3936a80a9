// The multi-tensor chunk plan shared by the CPU and CUDA backends.
//
// Every tensor of a (device, dtype) group is cut into chunks of kChunkElems elements; chunk ids
// run over all tensors in order (tensor 0's chunks first). A tensor with no elements owns no
// chunk, so it cannot shift the ids of the tensors after it. Each chunk is reduced by exactly one
// worker (a CPU task or a CUDA block) into its own partial row, and the partials of a tensor are
// combined in chunk order: the result does not depend on thread count or scheduling.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <vector>

namespace gradfuse {

constexpr int64_t kChunkElems = 65536;

// One tensor's elements as a flat span of memory (the tensor is non-overlapping and dense), as
// both backends' kernels see it: no ATen types, so the device code builds without ATen.
struct Span {
  void* data;
  int64_t numel;
};

struct ChunkPlan {
  // first_chunk[i] is the id of tensor i's first chunk; first_chunk[n] the total chunk count.
  std::vector<int64_t> first_chunk;

  int64_t num_chunks() const { return first_chunk.back(); }
};

inline ChunkPlan make_chunk_plan(const std::vector<Span>& spans) {
  ChunkPlan plan;
  plan.first_chunk.reserve(spans.size() + 1);
  int64_t next = 0;
  for (const Span& s : spans) {
    plan.first_chunk.push_back(next);
    next += (s.numel + kChunkElems - 1) / kChunkElems;
  }
  plan.first_chunk.push_back(next);
  return plan;
}

// The tensor that owns `chunk`: the last i with first_chunk[i] <= chunk among tensors that own
// chunks. Works on host arrays and on the CUDA kernel-argument table alike.
C10_HOST_DEVICE inline int64_t owner_of_chunk(const int64_t* first_chunk, int64_t num_tensors,
                                              int64_t chunk) {
  int64_t lo = 0, hi = num_tensors;  // invariant: first_chunk[lo] <= chunk < first_chunk[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (first_chunk[mid] <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace gradfuse
