// The CPU kernels for AVX2 + FMA CPUs, chosen at run time by stats_cpu.cpp.
#include "avx2_capability.h"
#ifdef CPU_CAPABILITY_AVX2
#include "stats_kernels_impl.h"
#include "clip_kernels_impl.h"  // the clipping kernels, same instruction set
#endif
