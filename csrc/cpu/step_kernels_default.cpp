// The fused optimizer-step kernels for any x86-64 / ARM CPU: at::vec's default (or NEON) vectors.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "step_kernels_impl.h"
