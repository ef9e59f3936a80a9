// The ATen side of the CUDA clipping ops (issue 17) around the launches of clip_kernels.cuh,
// written once for the GPU (clip_cuda.cu) and the CUDA emulation of the tests (tests/cuda_emu), as
// stats_ops.h is. A Device supplies what stats_ops.h describes, with the op names kUnitStatsOp,
// kUnitScaleOp and kClampOp. Include after defining GRADFUSE_LAUNCH.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/unit_ops.h"
#include "clip_kernels.cuh"

namespace gradfuse::cuda {

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_unit_stats_on(at::TensorList tensors, at::IntArrayRef units,
                                                              double norm_type) {
  check_group(tensors, Device::kUnitStatsOp, Device::kType);
  const int64_t total = check_units(tensors, units, Device::kUnitStatsOp);
  if (tensors.empty()) {
    return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong))};
  }
  const typename Device::Guard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  auto out_f = Device::empty({total, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = Device::empty({total, kNumCountStats}, opts.dtype(at::kLong));
  if (total == 0) return {out_f, out_c};
  const UnitGroup group(tensors, units);
  const auto dtype = tensors[0].scalar_type();
  const int64_t part_rows = std::max<int64_t>(group.plan.num_prows(), 1);
  auto part_f = Device::empty({part_rows, kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = Device::empty({part_rows, kNumCountStats}, opts.dtype(at::kLong));
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_unit_stats<scalar_t>(group.spans, group.plan, pow_mode_for(norm_type), norm_type,
                                static_cast<acc_of<scalar_t>*>(part_f.data_ptr()), part_c.template data_ptr<int64_t>(),
                                out_f.template data_ptr<double>(), out_c.template data_ptr<int64_t>(), stream);
  });
  return {out_f, out_c};
}

template <typename Device>
void multi_tensor_unit_scale_on(at::TensorList tensors, at::IntArrayRef units, const at::Tensor& coefs,
                                bool conditional) {
  check_group(tensors, Device::kUnitScaleOp, Device::kType);
  const int64_t total = check_units(tensors, units, Device::kUnitScaleOp);
  if (tensors.empty()) return;
  const typename Device::Guard guard(tensors[0].device());
  const auto coefs_acc = checked_coefs(coefs, total, tensors[0], Device::kUnitScaleOp);
  // The views the kernels cannot take are scaled by ATen with min(coef, 1) (exact when >= 1).
  const UnitGroup group = scale_units_elsewhere_(tensors, units, conditional ? at::clamp_max(coefs_acc, 1.0) : coefs_acc);
  if (group.plan.num_items() == 0) return;
  const auto stream = Device::stream();
  dispatch_float(tensors[0].scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_unit_scale<scalar_t>(group.spans, group.plan, static_cast<const acc_of<scalar_t>*>(coefs_acc.data_ptr()),
                                conditional, stream);
  });
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_tensor_clamp_on(at::TensorList tensors, double clip_value) {
  check_group(tensors, Device::kClampOp, Device::kType);
  check_clip_value(clip_value, Device::kClampOp);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) {
    return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong)),
            at::empty({0}, at::dtype(at::kLong))};
  }
  const typename Device::Guard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  // Neither a clamp nor statistics depend on the order: any dense tensor is a span; the others
  // are clamped in a contiguous copy, copied back.
  std::vector<at::Tensor> dense;
  dense.reserve(n);
  for (const auto& t : tensors) dense.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
  const UnitGroup group(dense, std::vector<int64_t>(n, 1));
  const auto dtype = tensors[0].scalar_type();
  const int64_t part_rows = std::max<int64_t>(group.plan.num_prows(), 1);
  auto part_f = Device::empty({part_rows, kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = Device::empty({part_rows, kNumCountStats}, opts.dtype(at::kLong));
  auto part_clamped = Device::empty({part_rows}, opts.dtype(at::kLong));
  auto out_f = Device::empty({n, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = Device::empty({n, kNumCountStats}, opts.dtype(at::kLong));
  auto clamped = Device::empty({n}, opts.dtype(at::kLong));
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_clamp<scalar_t>(group.spans, group.plan, clip_value, static_cast<acc_of<scalar_t>*>(part_f.data_ptr()),
                           part_c.template data_ptr<int64_t>(), part_clamped.template data_ptr<int64_t>(),
                           out_f.template data_ptr<double>(), out_c.template data_ptr<int64_t>(),
                           clamped.template data_ptr<int64_t>(), stream);
  });
  for (int64_t i = 0; i < n; ++i) {
    if (!dense[i].is_same(tensors[i])) tensors[i].copy_(dense[i]);
  }
  return {out_f, out_c, clamped};
}

}  // namespace gradfuse::cuda
