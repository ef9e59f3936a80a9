// The optimizer-update kernels for AVX2 + FMA CPUs, chosen at run time by update_cpu.cpp.
#include "avx2_capability.h"
#ifdef CPU_CAPABILITY_AVX2
#include "update_kernels_impl.h"
#endif
