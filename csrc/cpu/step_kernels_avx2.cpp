// The fused optimizer-step kernels for AVX2 + FMA CPUs, chosen at run time by step_cpu.cpp.
#include "avx2_capability.h"
#ifdef CPU_CAPABILITY_AVX2
#include "step_kernels_impl.h"
#endif
