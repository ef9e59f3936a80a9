// Interface between the CPU optimizer-update ops (update_cpu.cpp) and their per-chunk kernels
// (update_kernels_impl.h), compiled once per instruction set (update_kernels_default.cpp,
// update_kernels_avx2.cpp) and picked at run time like the stats kernels.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/chunk_plan.h"
#include "../common/update_math.h"

namespace gradfuse::cpu {

// Arguments shared by every chunk of one call. The chunk plan is that of `params`; a state span
// with no elements is absent (Adam's state before its first step, SGD's missing buffer, unused).
struct UpdateArgs {
  const Span* params;
  const Span* grads;
  const Span* moment1;
  const Span* moment2;
  const Span* moment2_max;
  const double* hyper;  // [num_tensors, kNumHyper]
  int64_t num_tensors;
  const int64_t* first_chunk;  // ChunkPlan::first_chunk
  c10::ScalarType dtype;
  UpdateRule rule;
};

// Reduces chunks [begin, end) into rows of float_partials (acc type: float, or double for double
// input; kNumUpdateFloatStats per row) and count_partials (kNumUpdateCountStats per row; numel not
// written).
using UpdateStatsChunksFn = void (*)(const UpdateArgs&, int64_t begin, int64_t end, void* float_partials,
                                     int64_t* count_partials);
// Clips the update of every chunk in [begin, end) whose tensor's coefficient (coefs, float64, one
// per tensor) is below 1, in place in params.
using UpdateClipChunksFn = void (*)(const UpdateArgs&, const double* coefs, int64_t begin, int64_t end);

#define GRADFUSE_DECLARE_CPU_UPDATE_KERNELS(ISA)                                       \
  namespace ISA {                                                                      \
  void update_stats_chunks(const UpdateArgs&, int64_t, int64_t, void*, int64_t*);      \
  void update_clip_chunks(const UpdateArgs&, const double*, int64_t, int64_t);         \
  }

GRADFUSE_DECLARE_CPU_UPDATE_KERNELS(DEFAULT)
#if defined(__x86_64__) || defined(_M_X64)
GRADFUSE_DECLARE_CPU_UPDATE_KERNELS(AVX2)
#endif

}  // namespace gradfuse::cpu
