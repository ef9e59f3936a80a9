// Interface between the CPU fused optimizer step (step_cpu.cpp) and its per-chunk kernels
// (step_kernels_impl.h), compiled once per instruction set (step_kernels_default.cpp,
// step_kernels_avx2.cpp) and picked at run time like the other kernels.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/chunk_plan.h"
#include "../common/step_math.h"

namespace gradfuse::cpu {

// Arguments shared by every chunk of one call. The chunk plan is that of `params`; a state span
// with no elements is not read or written (SGD without momentum, Adam without amsgrad).
struct StepArgs {
  Span* params;
  const Span* grads;
  Span* moment1;
  Span* moment2;
  Span* moment2_max;
  const double* coefs;  // [num_tensors, kNumStepCoefs]
  int64_t num_tensors;
  const int64_t* first_chunk;  // ChunkPlan::first_chunk
  c10::ScalarType dtype;
  UpdateRule rule;
  int64_t torch_threads;       // TorchTail: the thread count of the torch step reproduced; 0: none
  bool scale_grads;            // every gradient times its scale as read (rounded to its dtype)
  double grad_scale;           // the scale of every tensor, unless grad_scales is given
  const double* grad_scales;   // [num_tensors] or null: tensor t's scale
  const double* update_coefs;  // [num_tensors] or null: the update of tensor t times update_coefs[t] when < 1
  bool write;                  // false: the statistics only, nothing written
  // torch's float / double sqrt where it is MKL's (x86 builds of torch), else null: a correctly
  // rounded one
  void (*sqrt_f32)(int64_t n, const float* x, float* out);
  void (*sqrt_f64)(int64_t n, const double* x, double* out);
};

// Runs chunks [begin, end); with float_partials non-null, also their update-statistics rows (acc
// type: float, or double for double input; kNumUpdateFloatStats / kNumUpdateCountStats per row).
using StepChunksFn = void (*)(const StepArgs&, int64_t begin, int64_t end, void* float_partials,
                              int64_t* count_partials);

// Whether the step takes torch's float / double sqrt (MKL's, where torch's CPU sqrt is MKL's; the
// default) or a correctly rounded one, as the CUDA kernels do (the emulated grid compares them).
bool step_torch_sqrt_available();
bool step_torch_sqrt();
void set_step_torch_sqrt(bool on);

#define GRADFUSE_DECLARE_CPU_STEP_KERNELS(ISA)                                      \
  namespace ISA {                                                                   \
  void step_chunks(const StepArgs&, int64_t, int64_t, void*, int64_t*);             \
  }

GRADFUSE_DECLARE_CPU_STEP_KERNELS(DEFAULT)
#if defined(__x86_64__) || defined(_M_X64)
GRADFUSE_DECLARE_CPU_STEP_KERNELS(AVX2)
#endif

}  // namespace gradfuse::cpu
