// The ATen side of the CUDA exponent-histogram op around the launches of hist_kernels.cuh,
// written once for the GPU (hist_cuda.cu) and the CUDA emulation of the tests (tests/cuda_emu),
// with the Device interface of stats_ops.h. Include after defining GRADFUSE_LAUNCH.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "../common/hist_math.h"
#include "../common/op_checks.h"
#include "hist_kernels.cuh"
#include "stats_ops.h"

namespace gradfuse::cuda {

template <typename Device>
at::Tensor multi_tensor_exponent_histogram_on(at::TensorList tensors, const char* op) {
  check_group(tensors, op, Device::kType);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) return at::zeros({0, kNumHistBins}, at::dtype(at::kLong));
  const typename Device::Guard guard(tensors[0].device());
  const auto opts = tensors[0].options().dtype(at::kLong);
  const DenseGroup group(tensors);
  auto part = Device::empty({std::max<int64_t>(group.plan.num_chunks(), 1), kNumHistBins}, opts);
  auto out = Device::empty({n, kNumHistBins}, opts);
  const auto stream = Device::stream();
  dispatch_float(tensors[0].scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_histogram<scalar_t>(group.spans, group.plan, part.template data_ptr<int64_t>(),
                               out.template data_ptr<int64_t>(), stream);
  });
  return out;
}

}  // namespace gradfuse::cuda
