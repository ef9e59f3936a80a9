// CUDA implementation of gradfuse::multi_tensor_exponent_histogram: the glue of hist_ops.h around
// the kernels of hist_kernels.cuh, on the GPU's Device (gpu_device.h); both also run on the CPU
// in the emulated tests (tests/cuda_emu). Nothing here waits for the host.
#include <torch/library.h>

#include "gpu_device.h"
#include "hist_ops.h"

namespace gradfuse::cuda {
namespace {

at::Tensor multi_tensor_exponent_histogram_cuda(at::TensorList tensors) {
  return multi_tensor_exponent_histogram_on<Gpu>(tensors, "gradfuse.multi_tensor_exponent_histogram");
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_exponent_histogram", &multi_tensor_exponent_histogram_cuda);
}

}  // namespace gradfuse::cuda
