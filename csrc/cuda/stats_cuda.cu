// CUDA implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_: the
// ATen glue (input checks, allocation, device guard, stream) around the kernels of
// stats_kernels.cuh, which hold everything that runs on the GPU and are also run on the CPU by
// the emulated tests (tests/cuda_emu). Nothing here waits for the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../common/op_checks.h"

#define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...)   \
  do {                                                      \
    kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__);  \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                         \
  } while (0)
#include "stats_kernels.cuh"

namespace gradfuse::cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_cuda(at::TensorList tensors, double norm_type) {
  check_group(tensors, "gradfuse.multi_tensor_stats", c10::DeviceType::CUDA);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) {
    return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong))};
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  const DenseGroup group(tensors);
  const auto dtype = tensors[0].scalar_type();
  const int64_t part_rows = std::max<int64_t>(group.plan.num_chunks(), 1);
  auto part_f = at::empty({part_rows, kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = at::empty({part_rows, kNumCountStats}, opts.dtype(at::kLong));
  auto out_f = at::empty({n, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = at::empty({n, kNumCountStats}, opts.dtype(at::kLong));
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_stats<scalar_t>(group.spans, group.plan, pow_mode_for(norm_type), norm_type,
                           static_cast<acc_of<scalar_t>*>(part_f.data_ptr()), part_c.data_ptr<int64_t>(),
                           out_f.data_ptr<double>(), out_c.data_ptr<int64_t>(), stream);
  });
  return {out_f, out_c};
}

void multi_tensor_scale_cuda(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  check_group(tensors, "gradfuse.multi_tensor_scale_", c10::DeviceType::CUDA);
  if (tensors.empty()) return;
  TORCH_CHECK(coef.numel() == 1 && coef.device() == tensors[0].device(),
              "gradfuse.multi_tensor_scale_: coef must be a one-element tensor on ",
              tensors[0].device(), ", got shape ", coef.sizes(), " on ", coef.device());
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const auto dtype = tensors[0].scalar_type();
  const auto coef_acc = coef.reshape({}).to(partial_dtype(dtype));  // no-op when it matches
  // Deciding for the other views would need the host; multiplying them by min(coef, 1) is exact
  // when coef >= 1.
  const auto dense = scale_non_dense_(tensors, conditional ? at::clamp_max(coef_acc, 1.0) : coef_acc);
  if (dense.empty()) return;
  const DenseGroup group(dense);
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_scale<scalar_t>(group.spans, group.plan,
                           static_cast<const acc_of<scalar_t>*>(coef_acc.data_ptr()), conditional, stream);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cuda);
}

}  // namespace gradfuse::cuda
