// What ops_cuda.cu gives the glue of ops.h: the kernel launch (with its error check) expected as
// GRADFUSE_LAUNCH, and the Device it is templated on for the GPU: guard, current stream,
// allocation and the op names errors cite. The emulated tests (tests/cuda_emu/emu_ops.cpp)
// supply their own launch and Device instead. Include before ops.h.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...)   \
  do {                                                      \
    kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__);  \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                         \
  } while (0)

namespace gradfuse::cuda {

struct Gpu {
  static constexpr c10::DeviceType kType = c10::DeviceType::CUDA;
  static constexpr const char* kStatsOp = "gradfuse.multi_tensor_stats";
  static constexpr const char* kMomentsOp = "gradfuse.multi_tensor_moments";
  static constexpr const char* kScaleOp = "gradfuse.multi_tensor_scale_";
  static constexpr const char* kUnitStatsOp = "gradfuse.multi_tensor_unit_stats";
  static constexpr const char* kUnitScaleOp = "gradfuse.multi_tensor_unit_scale_";
  static constexpr const char* kClampOp = "gradfuse.multi_tensor_clamp_";
  static constexpr const char* kHistOp = "gradfuse.multi_tensor_exponent_histogram";
  static constexpr const char* kUpdateStatsOp = "multi_tensor_update_stats";
  static constexpr const char* kUpdateClipOp = "multi_tensor_update_clip_";
  static constexpr const char* kStepOp = "multi_tensor_optim_step_";
  using Guard = c10::cuda::CUDAGuard;
  static cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) { return at::empty(sizes, opts); }
};

}  // namespace gradfuse::cuda
