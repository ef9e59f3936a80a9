// Included first, before any other header, by the *_avx2.cpp files: the rest of the translation
// unit is compiled for AVX2 + FMA CPUs (the kernels that cpu_capability.h picks at run time).
// setuptools has no per-file flags, so the instruction set is chosen here, the way -mavx2 -mfma
// -mf16c would: the pragma for code generation (it holds to the end of the translation unit),
// the macros for the headers that test them (sleef, at::vec). CPU_CAPABILITY puts at::vec's AVX2
// types in their own namespace, so they do not clash with the default build of the same templates.
// Other than on x86-64 it defines nothing, and the including file guards its kernels with
// #ifdef CPU_CAPABILITY_AVX2.
#pragma once

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
#endif
