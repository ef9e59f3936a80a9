// CUDA implementations of the gradfuse ops: the ATen glue of ops.h around the kernels of
// stats_ops.cuh, clip_ops.cuh, hist_ops.cuh, update_ops.cuh and step_ops.cuh, on the GPU's Device
// (gpu_device.h). All of these also run on the CPU, on CPU tensors, in the emulated tests
// (tests/cuda_emu). One translation unit, so that every kernel is instantiated once. Nothing here
// waits for the host.
#include <torch/library.h>

#include "gpu_device.h"
#include "ops.h"

namespace gradfuse::cuda {

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_on<Gpu>);
  m.impl("multi_tensor_moments", &multi_tensor_moments_on<Gpu>);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_on<Gpu>);
  m.impl("multi_tensor_unit_stats", &multi_tensor_unit_stats_on<Gpu>);
  m.impl("multi_tensor_unit_scale_", &multi_tensor_unit_scale_on<Gpu>);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_on<Gpu>);
  m.impl("multi_tensor_exponent_histogram", &multi_tensor_exponent_histogram_on<Gpu>);
  m.impl("multi_tensor_update_stats", &multi_tensor_update_stats_on<Gpu>);
  m.impl("multi_tensor_update_clip_", &multi_tensor_update_clip_on<Gpu>);
  m.impl("multi_tensor_optim_step_", &multi_tensor_optim_step_on<Gpu>);
}

}  // namespace gradfuse::cuda
