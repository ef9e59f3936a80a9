// The CPU kernels for any x86-64 / ARM CPU: at::vec's default (or NEON) vectors.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "stats_kernels_impl.h"
#include "clip_kernels_impl.h"  // the clipping kernels, same instruction set
