// Interface between the CPU clipping ops (clip_cpu.cpp) and their per-item kernels
// (clip_kernels_impl.h), compiled once per instruction set with the stats kernels.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "../common/stats_math.h"
#include "../common/unit_plan.h"

namespace gradfuse::cpu {

struct UnitArgs {
  const UnitSpan* spans;  // the plan's tensors (their data)
  const UnitPlan* plan;
  c10::ScalarType dtype;
};

// Partial rows (acc type: float, or double for double input) of items [begin, end).
using UnitStatsItemsFn = void (*)(const UnitArgs&, PowMode, double p, int64_t begin, int64_t end,
                                  void* float_partials, int64_t* count_partials);
// Scales the units of items [begin, end) by coefs[row] (acc type); conditional: only units whose
// coefficient needs it.
using UnitScaleItemsFn = void (*)(const UnitArgs&, const void* coefs, bool conditional,
                                  int64_t begin, int64_t end);
// Clamps items [begin, end) (units of 1) to [-v, v] in place; their partial rows of the values
// before, and the clamped-element count of each item.
using ClampItemsFn = void (*)(const UnitArgs&, double v, int64_t begin, int64_t end,
                              void* float_partials, int64_t* count_partials, int64_t* clamped);

#define GRADFUSE_DECLARE_CPU_CLIP_KERNELS(ISA)                                                      \
  namespace ISA {                                                                                   \
  void unit_stats_items(const UnitArgs&, PowMode, double, int64_t, int64_t, void*, int64_t*);       \
  void unit_scale_items(const UnitArgs&, const void*, bool, int64_t, int64_t);                      \
  void clamp_items(const UnitArgs&, double, int64_t, int64_t, void*, int64_t*, int64_t*);           \
  }

GRADFUSE_DECLARE_CPU_CLIP_KERNELS(DEFAULT)
#if defined(__x86_64__) || defined(_M_X64)
GRADFUSE_DECLARE_CPU_CLIP_KERNELS(AVX2)
#endif

}  // namespace gradfuse::cpu
