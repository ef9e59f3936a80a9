// The ATen side of the CUDA ops (input checks, allocation, device guard, stream) around the
// launches of stats_kernels.cuh, written once for two devices: the GPU (stats_cuda.cu) and the
// CUDA emulation that runs the same kernels on CPU tensors in the tests (tests/cuda_emu). A
// Device supplies:
//   kType            the tensors' device type
//   kStatsOp, kScaleOp  the ops' names, for error messages
//   Guard            constructed from the tensors' device (the GPU's CUDAGuard)
//   stream()         the stream to launch on
//   empty(sizes, o)  allocation of results and partials (the emulation poisons them, so a kernel
//                    that leaves a row unwritten fails the tests)
// Include after defining GRADFUSE_LAUNCH.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "../common/op_checks.h"
#include "stats_kernels.cuh"

namespace gradfuse::cuda {

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_on(at::TensorList tensors, double norm_type) {
  check_group(tensors, Device::kStatsOp, Device::kType);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) {
    return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong))};
  }
  const typename Device::Guard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  const DenseGroup group(tensors);
  const auto dtype = tensors[0].scalar_type();
  const int64_t part_rows = std::max<int64_t>(group.plan.num_chunks(), 1);
  auto part_f = Device::empty({part_rows, kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = Device::empty({part_rows, kNumCountStats}, opts.dtype(at::kLong));
  auto out_f = Device::empty({n, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = Device::empty({n, kNumCountStats}, opts.dtype(at::kLong));
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_stats<scalar_t>(group.spans, group.plan, pow_mode_for(norm_type), norm_type,
                           static_cast<acc_of<scalar_t>*>(part_f.data_ptr()), part_c.template data_ptr<int64_t>(),
                           out_f.template data_ptr<double>(), out_c.template data_ptr<int64_t>(), stream);
  });
  return {out_f, out_c};
}

template <typename Device>
void multi_tensor_scale_on(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  check_group(tensors, Device::kScaleOp, Device::kType);
  if (tensors.empty()) return;
  TORCH_CHECK(coef.numel() == 1 && coef.device() == tensors[0].device(),
              Device::kScaleOp, ": coef must be a one-element tensor on ",
              tensors[0].device(), ", got shape ", coef.sizes(), " on ", coef.device());
  const typename Device::Guard guard(tensors[0].device());
  const auto dtype = tensors[0].scalar_type();
  const auto coef_acc = coef.reshape({}).to(partial_dtype(dtype));  // no-op when it matches
  // Deciding for the other views would need the host; multiplying them by min(coef, 1) is exact
  // when coef >= 1.
  const auto dense = scale_non_dense_(tensors, conditional ? at::clamp_max(coef_acc, 1.0) : coef_acc);
  if (dense.empty()) return;
  const DenseGroup group(dense);
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_scale<scalar_t>(group.spans, group.plan,
                           static_cast<const acc_of<scalar_t>*>(coef_acc.data_ptr()), conditional, stream);
  });
}

}  // namespace gradfuse::cuda
