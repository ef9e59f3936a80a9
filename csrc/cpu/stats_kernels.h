// Interface between the CPU op (stats_cpu.cpp) and the per-chunk kernels, which are compiled
// once per instruction set (stats_clip_kernels_default.cpp, stats_clip_kernels_avx2.cpp) and picked at run time, as
// PyTorch does with its DispatchStub: a default build still runs on a CPU without AVX2.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/chunk_plan.h"
#include "../common/stats_math.h"

namespace gradfuse::cpu {

// Arguments shared by every chunk of one call.
struct ChunkArgs {
  const Span* spans;
  int64_t num_tensors;
  const int64_t* first_chunk;  // ChunkPlan::first_chunk
  c10::ScalarType dtype;
};

// Reduces chunks [begin, end) into rows of float_partials (acc type: float, or double for double
// input; kNumFloatStats per row) and count_partials (kNumCountStats per row).
using StatsChunksFn = void (*)(const ChunkArgs&, PowMode mode, double p, int64_t begin,
                               int64_t end, void* float_partials, int64_t* count_partials);
// Statistics of whole tensors for chunks [begin, end): the result rows (out_f: double,
// kNumFloatStats per tensor; out_c: kNumCountStats, numel included) of every tensor whose chunks
// all lie in the range, its chunks combined in chunk order in double; the chunk partials (as
// StatsChunksFn) of a tensor that crosses an end of the range, for the caller to combine. Empty
// tensors belong to the range holding the chunk id they start at (the last range: the end).
// With [begin, end) = all chunks, partials are never written and may be null.
using StatsTensorsFn = void (*)(const ChunkArgs&, PowMode mode, double p, int64_t begin,
                                int64_t end, void* float_partials, int64_t* count_partials,
                                double* out_f, int64_t* out_c);
// Multiplies the elements of chunks [begin, end) by coef in place.
using ScaleChunksFn = void (*)(const ChunkArgs&, double coef, int64_t begin, int64_t end);

#define GRADFUSE_DECLARE_CPU_KERNELS(ISA)                                                     \
  namespace ISA {                                                                             \
  void stats_chunks(const ChunkArgs&, PowMode, double, int64_t, int64_t, void*, int64_t*);    \
  void scale_chunks(const ChunkArgs&, double, int64_t, int64_t);                              \
  void stats_tensors(const ChunkArgs&, PowMode, double, int64_t, int64_t, void*, int64_t*,    \
                     double*, int64_t*);                                                      \
  }

GRADFUSE_DECLARE_CPU_KERNELS(DEFAULT)
#if defined(__x86_64__) || defined(_M_X64)
#define GRADFUSE_HAVE_AVX2_KERNELS 1
GRADFUSE_DECLARE_CPU_KERNELS(AVX2)
#endif

}  // namespace gradfuse::cpu
