// The fused optimizer-step kernels for AVX2 + FMA CPUs, chosen at run time by step_cpu.cpp. The
// instruction set is chosen here, before any header, as stats_clip_kernels_avx2.cpp does (see
// there why: setuptools has no per-file flags).
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx,avx2,fma,f16c")
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "step_kernels_impl.h"
#endif
