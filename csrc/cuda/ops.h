// The ATen side of the CUDA ops (input checks, allocation, device guard, stream) around the
// launches of stats_ops.cuh, clip_ops.cuh, hist_ops.cuh, update_ops.cuh and step_ops.cuh, written
// once for two devices: the GPU (the .cu files) and the CUDA emulation that runs the same kernels
// on CPU tensors in the tests (tests/cuda_emu). A Device supplies:
//   kType            the tensors' device type
//   kStatsOp, kMomentsOp, kScaleOp, kUnitStatsOp, kUnitScaleOp, kClampOp, kHistOp,
//   kUpdateStatsOp, kUpdateClipOp, kStepOp
//                    the ops' names, for error messages
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
#include <utility>
#include <vector>

#include "../common/engine.h"
#include "clip_ops.cuh"
#include "hist_ops.cuh"
#include "stats_ops.cuh"
#include "step_ops.cuh"
#include "update_ops.cuh"

namespace gradfuse::cuda {

inline std::tuple<at::Tensor, at::Tensor> no_rows() {
  return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong))};
}

// Statistics rows of a group (DenseGroup: per tensor; UnitGroup: per unit), `rows` of them;
// `moments`: the rows of multi_tensor_moments (DenseGroup, norm_type 2).
template <typename Device, typename Group>
std::tuple<at::Tensor, at::Tensor> stats_rows(const Group& group, const at::Tensor& first, int64_t rows,
                                              int64_t part_rows, double norm_type, bool moments = false) {
  const auto opts = first.options();
  const auto dtype = first.scalar_type();
  auto part_f = Device::empty({std::max<int64_t>(part_rows, 1), kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = Device::empty({std::max<int64_t>(part_rows, 1), kNumCountStats}, opts.dtype(at::kLong));
  auto out_f = Device::empty({rows, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = Device::empty({rows, kNumCountStats}, opts.dtype(at::kLong));
  at::Tensor shifts;
  if (moments) shifts = Device::empty({rows}, opts.dtype(at::kDouble));
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_stats<scalar_t>(group.spans, group.plan, moments ? PowMode::kMoments : pow_mode_for(norm_type), norm_type,
                           static_cast<acc_of<scalar_t>*>(part_f.data_ptr()), part_c.template data_ptr<int64_t>(),
                           out_f.template data_ptr<double>(), out_c.template data_ptr<int64_t>(), stream,
                           moments ? shifts.template data_ptr<double>() : nullptr);
  });
  return {out_f, out_c};
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_on(at::TensorList tensors, double norm_type) {
  check_group(tensors, Device::kStatsOp, Device::kType);
  if (tensors.empty()) return no_rows();
  const typename Device::Guard guard(tensors[0].device());
  const DenseGroup group(tensors);
  return stats_rows<Device>(group, tensors[0], static_cast<int64_t>(tensors.size()), group.plan.num_chunks(), norm_type);
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_moments_on(at::TensorList tensors) {
  check_group(tensors, Device::kMomentsOp, Device::kType);
  if (tensors.empty()) return no_rows();
  const typename Device::Guard guard(tensors[0].device());
  const DenseGroup group(tensors);
  return stats_rows<Device>(group, tensors[0], static_cast<int64_t>(tensors.size()), group.plan.num_chunks(), 2.0,
                            true);
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_unit_stats_on(at::TensorList tensors, at::IntArrayRef units,
                                                              double norm_type) {
  check_group(tensors, Device::kUnitStatsOp, Device::kType);
  const int64_t total = check_units(tensors, units, Device::kUnitStatsOp);
  if (tensors.empty()) return no_rows();
  const typename Device::Guard guard(tensors[0].device());
  const UnitGroup group(tensors, units);
  return stats_rows<Device>(group, tensors[0], total, group.plan.num_prows(), norm_type);
}

// The units of `group` times coefs_acc (acc type, on the device; coef_stride 0: one for all).
template <typename Device>
void scale_group(const UnitGroup& group, at::ScalarType dtype, const at::Tensor& coefs_acc, int64_t coef_stride,
                 bool conditional) {
  if (group.plan.num_items() == 0) return;
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_scale<scalar_t>(group.spans, group.plan, static_cast<const acc_of<scalar_t>*>(coefs_acc.data_ptr()),
                           coef_stride, conditional, stream);
  });
}

template <typename Device>
void multi_tensor_scale_on(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  check_group(tensors, Device::kScaleOp, Device::kType);
  check_scale_coef(tensors, coef, Device::kScaleOp);
  if (tensors.empty()) return;
  const typename Device::Guard guard(tensors[0].device());
  const auto dtype = tensors[0].scalar_type();
  const auto coef_acc = coef.reshape({}).to(partial_dtype(dtype));  // no-op when it matches
  // Deciding for the other views would need the host; multiplying them by min(coef, 1) is exact
  // when coef >= 1.
  const auto dense = scale_non_dense_(tensors, conditional ? at::clamp_max(coef_acc, 1.0) : coef_acc);
  if (dense.empty()) return;
  // Every tensor is one unit, all of them with the one coefficient.
  const UnitGroup group(dense, std::vector<int64_t>(dense.size(), 1));
  scale_group<Device>(group, dtype, coef_acc, 0, conditional);
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
  scale_group<Device>(group, tensors[0].scalar_type(), coefs_acc, 1, conditional);
}

template <typename Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> multi_tensor_clamp_on(at::TensorList tensors, double clip_value) {
  check_group(tensors, Device::kClampOp, Device::kType);
  check_clip_value(clip_value, Device::kClampOp);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) {
    auto [f, c] = no_rows();
    return {f, c, at::empty({0}, at::dtype(at::kLong))};
  }
  const typename Device::Guard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  // Neither a clamp nor statistics depend on the order: any dense tensor is a span; the others
  // are clamped in a contiguous copy, copied back.
  std::vector<at::Tensor> dense;
  dense.reserve(n);
  for (const auto& t : tensors) dense.push_back(as_dense(t));
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

template <typename Device>
at::Tensor multi_tensor_exponent_histogram_on(at::TensorList tensors) {
  check_group(tensors, Device::kHistOp, Device::kType);
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

// ---- The optimizer-update ops (update_ops.cuh)

// The call's tensors as five-list spans (absent state: null) and their chunk plan.
struct UpdateGroup {
  std::vector<ListSpan<kUpdateLists>> spans;
  ChunkPlan plan;

  UpdateGroup(at::TensorList params, at::TensorList grads, at::TensorList moment1, at::TensorList moment2,
              at::TensorList moment2_max) {
    std::vector<Span> flat;
    flat.reserve(params.size());
    spans.reserve(params.size());
    const auto ptr = [](const at::Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr(); };
    for (size_t i = 0; i < params.size(); ++i) {
      spans.push_back({{ptr(params[i]), ptr(grads[i]), ptr(moment1[i]), ptr(moment2[i]), ptr(moment2_max[i])},
                       params[i].numel()});
      flat.push_back({ptr(params[i]), params[i].numel()});
    }
    plan = make_chunk_plan(flat);
  }
};

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_update_stats_on(at::TensorList params, at::TensorList grads,
                                                                at::TensorList moment1, at::TensorList moment2,
                                                                at::TensorList moment2_max, const at::Tensor& hyper,
                                                                int64_t rule) {
  check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, Device::kUpdateStatsOp);
  const auto n = static_cast<int64_t>(params.size());
  if (n == 0) {
    return {at::empty({0, kNumUpdateFloatStats}, at::dtype(at::kDouble)),
            at::empty({0, kNumUpdateCountStats}, at::dtype(at::kLong))};
  }
  const typename Device::Guard guard(params[0].device());
  const UpdateGroup group(params, grads, moment1, moment2, moment2_max);
  const auto opts = params[0].options();
  const auto dtype = params[0].scalar_type();
  const int64_t part_rows = std::max<int64_t>(group.plan.num_chunks(), 1);
  auto part_f = Device::empty({part_rows, kNumUpdateFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = Device::empty({part_rows, kNumUpdateCountStats}, opts.dtype(at::kLong));
  auto out_f = Device::empty({n, kNumUpdateFloatStats}, opts.dtype(at::kDouble));
  auto out_c = Device::empty({n, kNumUpdateCountStats}, opts.dtype(at::kLong));
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_update_stats<scalar_t>(group.spans, group.plan, static_cast<UpdateRule>(rule),
                                  hyper.template data_ptr<double>(), static_cast<acc_of<scalar_t>*>(part_f.data_ptr()),
                                  part_c.template data_ptr<int64_t>(), out_f.template data_ptr<double>(),
                                  out_c.template data_ptr<int64_t>(), stream);
  });
  return {out_f, out_c};
}

template <typename Device>
void multi_tensor_update_clip_on(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                                 at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                                 const at::Tensor& coefs, int64_t rule) {
  const char* op = Device::kUpdateClipOp;
  check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, op);
  check_update_coefs(params, hyper, coefs, op);
  const auto n = static_cast<int64_t>(params.size());
  if (n == 0) return;
  const typename Device::Guard guard(params[0].device());
  const UpdateGroup group(params, grads, moment1, moment2, moment2_max);
  if (group.plan.num_chunks() == 0) return;
  const at::Tensor coefs_dense = coefs.contiguous();
  const auto stream = Device::stream();
  dispatch_float(params[0].scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_update_clip<scalar_t>(group.spans, group.plan, static_cast<UpdateRule>(rule),
                                 hyper.template data_ptr<double>(), coefs_dense.template data_ptr<double>(), stream);
  });
}

// ---- The fused optimizer step (step_ops.cuh)

template <typename Device>
std::tuple<at::Tensor, at::Tensor> multi_tensor_optim_step_on(
    at::TensorList params, at::TensorList grads, at::TensorList moment1, at::TensorList moment2,
    at::TensorList moment2_max, const at::Tensor& coefs, int64_t rule, int64_t torch_threads,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& skip,
    const std::optional<at::Tensor>& update_coefs, bool stats, bool write) {
  const char* op = Device::kStepOp;
  check_step_args(params, grads, moment1, moment2, moment2_max, coefs, rule, grad_scale, skip, update_coefs, op);
  // torch's scalar tails are those of its CPU kernels' thread split; the kernels here have none
  TORCH_CHECK(torch_threads == 0, op, ": torch_threads must be 0 for tensors on ", coefs.device(),
              " (the scalar tails it reproduces are those of torch's CPU kernels), got ", torch_threads);
  const auto n = static_cast<int64_t>(params.size());
  const typename Device::Guard guard(coefs.device());
  const auto opts = coefs.options();
  const auto no_rows = [&] {
    return std::tuple<at::Tensor, at::Tensor>{at::zeros({0, kNumUpdateFloatStats}, opts.dtype(at::kDouble)),
                                              at::zeros({0, kNumUpdateCountStats}, opts.dtype(at::kLong))};
  };
  if (n == 0 || (!write && !stats)) return no_rows();
  const UpdateGroup group(params, grads, moment1, moment2, moment2_max);
  const auto dtype = params[0].scalar_type();
  at::Tensor out_f, out_c, part_f, part_c;
  std::tie(out_f, out_c) = no_rows();
  if (stats) {
    const int64_t part_rows = std::max<int64_t>(group.plan.num_chunks(), 1);
    part_f = Device::empty({part_rows, kNumUpdateFloatStats}, opts.dtype(partial_dtype(dtype)));
    part_c = Device::empty({part_rows, kNumUpdateCountStats}, opts.dtype(at::kLong));
    out_f = Device::empty({n, kNumUpdateFloatStats}, opts.dtype(at::kDouble));
    out_c = Device::empty({n, kNumUpdateCountStats}, opts.dtype(at::kLong));
  }
  // The scale and the flag as float64 on the device (no copy when they are already), read by the
  // kernels: the host never reads them.
  const bool per_tensor = grad_scale_per_tensor(grad_scale, n);
  const at::Tensor scale = !grad_scale.has_value() ? at::Tensor()
                           : per_tensor            ? grad_scale->contiguous()
                                                   : grad_scale->reshape({}).to(at::kDouble);
  const at::Tensor flag = skip.has_value() ? skip->reshape({}).to(at::kDouble) : at::Tensor();
  const at::Tensor ucoefs = update_coefs.has_value() ? update_coefs->contiguous() : at::Tensor();
  const auto pointer = [](const at::Tensor& t) { return t.defined() ? t.template const_data_ptr<double>() : nullptr; };
  const auto stream = Device::stream();
  dispatch_float(dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    launch_optim_step<scalar_t>(group.spans, group.plan, static_cast<UpdateRule>(rule), coefs.const_data_ptr<double>(),
                                pointer(scale), per_tensor, pointer(flag), pointer(ucoefs), write,
                                stats ? static_cast<acc_of<scalar_t>*>(part_f.data_ptr()) : nullptr,
                                stats ? part_c.template data_ptr<int64_t>() : nullptr,
                                stats ? out_f.template data_ptr<double>() : nullptr,
                                stats ? out_c.template data_ptr<int64_t>() : nullptr, stream);
  });
  return {out_f, out_c};
}

}  // namespace gradfuse::cuda
