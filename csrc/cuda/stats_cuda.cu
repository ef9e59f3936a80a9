// CUDA implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_: the
// GPU's device guard, stream and launch for the ATen glue of stats_ops.h around the kernels of
// stats_kernels.cuh. Both headers are also run on the CPU, on CPU tensors, by the emulated tests
// (tests/cuda_emu). Nothing here waits for the host.
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
#include "stats_ops.h"

namespace gradfuse::cuda {
namespace {

struct Gpu {
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  static constexpr const char* kStatsOp = "gradfuse.multi_tensor_stats";
  static constexpr const char* kScaleOp = "gradfuse.multi_tensor_scale_";
  using Guard = c10::cuda::CUDAGuard;
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) { return at::empty(sizes, opts); }
};

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_on<Gpu>);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_on<Gpu>);
}

}  // namespace gradfuse::cuda
