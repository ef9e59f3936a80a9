// CUDA implementations of the clipping ops of issue 17 (multi_tensor_unit_stats,
// multi_tensor_unit_scale_, multi_tensor_clamp_): the ATen glue of clip_ops.h around the kernels of
// clip_kernels.cuh, on the GPU's Device (gpu_device.h); the emulated tests also run both on the
// CPU (tests/cuda_emu). Nothing here waits for the host.
#include <torch/library.h>

#include "gpu_device.h"
#include "clip_ops.h"

namespace gradfuse::cuda {

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_unit_stats", &multi_tensor_unit_stats_on<Gpu>);
  m.impl("multi_tensor_unit_scale_", &multi_tensor_unit_scale_on<Gpu>);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_on<Gpu>);
}

}  // namespace gradfuse::cuda
