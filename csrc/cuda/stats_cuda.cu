// CUDA implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_: the
// ATen glue of stats_ops.h around the kernels of stats_kernels.cuh, on the GPU's Device
// (gpu_device.h). Both headers are also run on the CPU, on CPU tensors, by the emulated tests
// (tests/cuda_emu). Nothing here waits for the host.
#include <torch/library.h>

#include "gpu_device.h"
#include "stats_ops.h"

namespace gradfuse::cuda {

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_on<Gpu>);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_on<Gpu>);
}

}  // namespace gradfuse::cuda
