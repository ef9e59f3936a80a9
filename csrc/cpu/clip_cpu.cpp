// CPU implementations of the clipping ops of issue 17 (schemas in gradfuse.cpp):
// multi_tensor_unit_stats, multi_tensor_unit_scale_ and multi_tensor_clamp_, over the unit plan
// of common/unit_plan.h (units of 1 give the chunk plan of the stats op).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "../common/unit_ops.h"
#include "clip_kernels.h"
#include "cpu_capability.h"

namespace gradfuse::cpu {
namespace {

struct ClipKernels {
  UnitStatsItemsFn stats;
  UnitScaleItemsFn scale;
  ClampItemsFn clamp;
};

ClipKernels clip_kernels_for(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx2") return {AVX2::unit_stats_items, AVX2::unit_scale_items, AVX2::clamp_items};
#endif
  return {DEFAULT::unit_stats_items, DEFAULT::unit_scale_items, DEFAULT::clamp_items};
}

// Combines the partial rows of every unit, in piece order, in double; `clamped_parts` (one per
// partial row), when given, summed per unit into clamped_out.
template <typename acc_t>
void finalize_units(const UnitPlan& plan, const acc_t* fp, const int64_t* cp, double* out_f,
                    int64_t* out_c, const int64_t* clamped_parts = nullptr,
                    int64_t* clamped_out = nullptr) {
  const auto n = static_cast<int64_t>(plan.numel.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const UnitGeometry g = unit_geometry(plan.numel[t], plan.units[t]);
      for (int64_t u = 0; u < plan.units[t]; ++u) {
        StatsAcc<double> s;
        int64_t clamped = 0;
        for (int64_t k = 0; k < g.pieces; ++k) {
          const int64_t r = plan.first_prow[t] + u * g.pieces + k;
          s.combine(StatsAcc<acc_t>::load(fp + r * kNumFloatStats, cp + r * kNumCountStats));
          if (clamped_parts) clamped += clamped_parts[r];
        }
        const int64_t row = plan.row[t] + u;
        s.store(out_f + row * kNumFloatStats, out_c + row * kNumCountStats);
        out_c[row * kNumCountStats + kNumel] = g.unit_len;
        if (clamped_out) clamped_out[row] = clamped;
      }
    }
  });
}

template <typename F>
void finalize_for(at::ScalarType dtype, const at::Tensor& part_f, F&& f) {
  if (dtype == at::kDouble) f(part_f.data_ptr<double>()); else f(part_f.data_ptr<float>());
}

std::tuple<at::Tensor, at::Tensor> unit_stats_cpu(at::TensorList tensors, at::IntArrayRef units,
                                                  double norm_type) {
  constexpr const char* kOp = "gradfuse.multi_tensor_unit_stats";
  check_group(tensors, kOp, c10::DeviceType::CPU);
  const int64_t total = check_units(tensors, units, kOp);
  auto out_f = at::empty({total, kNumFloatStats}, at::dtype(at::kDouble));
  auto out_c = at::empty({total, kNumCountStats}, at::dtype(at::kLong));
  if (total == 0) return {out_f, out_c};
  const UnitGroup group(tensors, units);
  const auto dtype = tensors[0].scalar_type();
  const UnitArgs args{group.spans.data(), &group.plan, dtype};
  auto part_f = at::empty({group.plan.num_prows(), kNumFloatStats}, at::dtype(partial_dtype(dtype)));
  auto part_c = at::empty({group.plan.num_prows(), kNumCountStats}, at::dtype(at::kLong));
  const auto kern = clip_kernels_for(active_cpu_capability());
  const PowMode mode = pow_mode_for(norm_type);
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  at::parallel_for(0, group.plan.num_items(), 1, [&](int64_t begin, int64_t end) {
    kern.stats(args, mode, norm_type, begin, end, fp, cp);
  });
  finalize_for(dtype, part_f, [&](const auto* f) {
    finalize_units(group.plan, f, cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
  });
  return {out_f, out_c};
}

void unit_scale_cpu(at::TensorList tensors, at::IntArrayRef units, const at::Tensor& coefs,
                    bool conditional) {
  constexpr const char* kOp = "gradfuse.multi_tensor_unit_scale_";
  check_group(tensors, kOp, c10::DeviceType::CPU);
  const int64_t total = check_units(tensors, units, kOp);
  if (tensors.empty()) return;
  const auto coefs_acc = checked_coefs(coefs, total, tensors[0], kOp);
  const UnitGroup group = scale_units_elsewhere_(
      tensors, units, conditional ? at::clamp_max(coefs_acc, 1.0) : coefs_acc);
  if (group.plan.num_items() == 0) return;
  const UnitArgs args{group.spans.data(), &group.plan, tensors[0].scalar_type()};
  const auto kern = clip_kernels_for(active_cpu_capability());
  const void* c = coefs_acc.data_ptr();
  at::parallel_for(0, group.plan.num_items(), 1, [&](int64_t begin, int64_t end) {
    kern.scale(args, c, conditional, begin, end);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clamp_cpu(at::TensorList tensors, double clip_value) {
  constexpr const char* kOp = "gradfuse.multi_tensor_clamp_";
  check_group(tensors, kOp, c10::DeviceType::CPU);
  check_clip_value(clip_value, kOp);
  const auto n = static_cast<int64_t>(tensors.size());
  auto out_f = at::empty({n, kNumFloatStats}, at::dtype(at::kDouble));
  auto out_c = at::empty({n, kNumCountStats}, at::dtype(at::kLong));
  auto clamped = at::empty({n}, at::dtype(at::kLong));
  if (n == 0) return {out_f, out_c, clamped};
  // Order does not matter to a clamp or to statistics: any dense tensor is a span. Others are
  // clamped in a contiguous copy, written back.
  std::vector<at::Tensor> dense;
  dense.reserve(n);
  for (const auto& t : tensors) dense.push_back(t.is_non_overlapping_and_dense() ? t : t.contiguous());
  const std::vector<int64_t> ones(n, 1);
  const UnitGroup group(dense, ones);
  const auto dtype = tensors[0].scalar_type();
  const UnitArgs args{group.spans.data(), &group.plan, dtype};
  const int64_t prows = group.plan.num_prows();
  auto part_f = at::empty({prows, kNumFloatStats}, at::dtype(partial_dtype(dtype)));
  auto part_c = at::empty({prows, kNumCountStats}, at::dtype(at::kLong));
  auto part_clamped = at::empty({prows}, at::dtype(at::kLong));
  const auto kern = clip_kernels_for(active_cpu_capability());
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  int64_t* kp = part_clamped.data_ptr<int64_t>();
  at::parallel_for(0, group.plan.num_items(), 1, [&](int64_t begin, int64_t end) {
    kern.clamp(args, clip_value, begin, end, fp, cp, kp);
  });
  finalize_for(dtype, part_f, [&](const auto* f) {
    finalize_units(group.plan, f, cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>(), kp,
                   clamped.data_ptr<int64_t>());
  });
  for (int64_t i = 0; i < n; ++i) {
    if (!dense[i].is_same(tensors[i])) tensors[i].copy_(dense[i]);
  }
  return {out_f, out_c, clamped};
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_unit_stats", &unit_stats_cpu);
  m.impl("multi_tensor_unit_scale_", &unit_scale_cpu);
  m.impl("multi_tensor_clamp_", &clamp_cpu);
}

}  // namespace gradfuse::cpu
