// CUDA implementations of the clipping ops of issue 17 (multi_tensor_unit_stats,
// multi_tensor_unit_scale_, multi_tensor_clamp_): the GPU's device guard, stream and launch for the
// ATen glue of clip_ops.h around the kernels of clip_kernels.cuh, which the emulated tests also run
// on the CPU (tests/cuda_emu). Nothing here waits for the host.
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
#include "clip_ops.h"

namespace gradfuse::cuda {
namespace {

struct GpuClip {
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  static constexpr const char* kUnitStatsOp = "gradfuse.multi_tensor_unit_stats";
  static constexpr const char* kUnitScaleOp = "gradfuse.multi_tensor_unit_scale_";
  static constexpr const char* kClampOp = "gradfuse.multi_tensor_clamp_";
  using Guard = c10::cuda::CUDAGuard;
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) { return at::empty(sizes, opts); }
};

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_unit_stats", &multi_tensor_unit_stats_on<GpuClip>);
  m.impl("multi_tensor_unit_scale_", &multi_tensor_unit_scale_on<GpuClip>);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_on<GpuClip>);
}

}  // namespace gradfuse::cuda
