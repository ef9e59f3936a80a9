// CUDA implementation of gradfuse::multi_tensor_exponent_histogram: the GPU's device guard,
// stream and launch for the glue of hist_ops.h around the kernels of hist_kernels.cuh (both also
// run on the CPU by the emulated tests, tests/cuda_emu). Nothing here waits for the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...)   \
  do {                                                      \
    kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__);  \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                         \
  } while (0)
#include "hist_ops.h"

namespace gradfuse::cuda {
namespace {

struct HistGpu {
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  using Guard = c10::cuda::CUDAGuard;
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) { return at::empty(sizes, opts); }
};

at::Tensor multi_tensor_exponent_histogram_cuda(at::TensorList tensors) {
  return multi_tensor_exponent_histogram_on<HistGpu>(tensors, "gradfuse.multi_tensor_exponent_histogram");
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_exponent_histogram", &multi_tensor_exponent_histogram_cuda);
}

}  // namespace gradfuse::cuda
