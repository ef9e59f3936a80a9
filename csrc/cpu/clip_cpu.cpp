// CPU implementations of the clipping ops (schemas in gradfuse.cpp):
// multi_tensor_unit_stats, multi_tensor_unit_scale_ and multi_tensor_clamp_, over the unit plan
// of common/unit_plan.h (units of 1 give the chunk plan of the stats op).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "../common/engine.h"
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

// Below this many bytes (read and written) per thread a scale runs on the calling thread, as in
// stats_cpu.cpp: waking the pool costs more than it saves.
constexpr int64_t kMinScaleBytesPerThread = 1 << 20;

// Whether any of coefs[row, row + u) makes the conditional scale touch memory.
template <typename acc_t>
bool any_needs_scaling(const acc_t* c, int64_t row, int64_t u) {
  for (int64_t k = row; k < row + u; ++k) {
    if (needs_scaling(c[k])) return true;
  }
  return false;
}

// The host side of the per-unit scale in one pass over the tensor list: the checks of
// check_group / check_units, each tensor's span and its entry of the unit plan. On 10 000 tiny
// tensors each TensorImpl and StorageImpl is a cache miss, so the pass prefetches them a few
// tensors ahead (as read_stats_inputs does), holds no reference to the tensors (the caller's list
// keeps them alive), and with `conditional` leaves out of the plan, without reading their data
// pointer, the tensors none of whose units need scaling. Tensors the kernels cannot take as a
// span are returned in `others` (indices), scaled by ATen.
template <typename acc_t>
void read_scale_inputs(at::TensorList tensors, at::IntArrayRef units, const acc_t* coefs,
                       bool conditional, const char* op, std::vector<UnitSpan>& spans,
                       UnitPlan& plan, std::vector<int64_t>& others, int64_t& bytes) {
  const auto n = static_cast<int64_t>(tensors.size());
  const at::Tensor& first = tensors[0];
  const auto dtype = first.scalar_type();
  const auto device = first.device();
  spans.reserve(n);
  for (auto* v : {&plan.first_item, &plan.first_prow, &plan.numel, &plan.units, &plan.row}) {
    v->reserve(n + 1);
  }
  constexpr int64_t kAhead = 4;
  int64_t row = 0, items = 0, prows = 0, elems = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) {
      const auto* impl = reinterpret_cast<const char*>(tensors[i + 2 * kAhead].unsafeGetTensorImpl());
      for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
        __builtin_prefetch(impl + offset);
      }
    }
    if (i + kAhead < n) {
      const at::Tensor& ahead = tensors[i + kAhead];
      if (ahead.defined()) {
        if (const auto* storage = ahead.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()) {
          __builtin_prefetch(storage);
        }
      }
    }
    const at::Tensor& t = tensors[i];
    if (!t.defined() || t.layout() != at::kStrided || t.scalar_type() != dtype || t.device() != device) {
      check_group(tensors, op, c10::DeviceType::CPU);  // names the tensor and what is wrong
      TORCH_CHECK(false, op, ": tensors[", i, "] is not a dense ", dtype, " tensor on ", device);
    }
    const int64_t numel = t.numel(), u = units[i];
    if (!units_ok(numel, u)) {
      check_units(tensors, units, op);  // the message naming units[i]
      TORCH_CHECK(false, op, ": units[", i, "] = ", u, " does not divide tensors[", i, "]");
    }
    if (u > 0 && numel > 0 && (!conditional || any_needs_scaling(coefs, row, u))) {
      if (unit_span_ok(t, u)) {
        spans.push_back({t.data_ptr(), numel, u, row});
        plan.first_item.push_back(items);
        plan.first_prow.push_back(prows);
        plan.numel.push_back(numel);
        plan.units.push_back(u);
        plan.row.push_back(row);
        const UnitGeometry g = unit_geometry(numel, u);
        items += g.items;
        prows += u * g.pieces;
        elems += numel;
      } else {
        others.push_back(i);
      }
    }
    row += u;
  }
  plan.first_item.push_back(items);
  plan.first_prow.push_back(prows);
  bytes = 2 * elems * static_cast<int64_t>(c10::elementSize(dtype));  // read and written
}

void unit_scale_cpu(at::TensorList tensors, at::IntArrayRef units, const at::Tensor& coefs,
                    bool conditional) {
  constexpr const char* kOp = "gradfuse.multi_tensor_unit_scale_";
  int64_t total = 0;
  bool units_ok = units.size() == tensors.size();
  for (const int64_t u : units) {
    units_ok = units_ok && u >= 0;
    total += u;
  }
  if (!units_ok) {  // the messages of the full checks
    check_group(tensors, kOp, c10::DeviceType::CPU);
    check_units(tensors, units, kOp);
  }
  if (tensors.empty()) return;
  const at::Tensor& first = tensors[0];
  if (!first.defined() || first.layout() != at::kStrided || !is_supported_float(first.scalar_type()) ||
      first.device().type() != c10::DeviceType::CPU) {
    check_group(tensors, kOp, c10::DeviceType::CPU);
    TORCH_CHECK(false, kOp, ": tensors[0] is not a dense floating-point CPU tensor");
  }
  const auto coefs_acc = checked_coefs(coefs, total, first, kOp);
  std::vector<UnitSpan> spans;
  UnitPlan plan;
  std::vector<int64_t> others;
  int64_t bytes = 0;
  if (coefs_acc.scalar_type() == at::kDouble) {
    read_scale_inputs(tensors, units, coefs_acc.const_data_ptr<double>(), conditional, kOp, spans,
                      plan, others, bytes);
  } else {
    read_scale_inputs(tensors, units, coefs_acc.const_data_ptr<float>(), conditional, kOp, spans,
                      plan, others, bytes);
  }
  if (!others.empty()) {
    // Views the kernels cannot take, scaled by ATen where they live by min(coef, 1) when
    // conditional (exact where a kernel would not touch them), as scale_units_elsewhere_ does.
    const auto c_all = conditional ? at::clamp_max(coefs_acc, 1.0) : coefs_acc;
    int64_t row = 0, next = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(tensors.size()) && next < static_cast<int64_t>(others.size()); ++i) {
      const int64_t u = units[i];
      if (i == others[next]) {
        scale_units_with_aten_(tensors[i], u, row, c_all);
        ++next;
      }
      row += u;
    }
  }
  const int64_t num_items = plan.num_items();
  if (num_items == 0) return;
  const UnitArgs args{spans.data(), &plan, first.scalar_type()};
  const auto kern = clip_kernels_for(active_cpu_capability());
  const void* c = coefs_acc.const_data_ptr();
  const int64_t grain = std::max<int64_t>(
      1, (num_items * kMinScaleBytesPerThread + bytes - 1) / std::max<int64_t>(bytes, 1));
  if (num_items <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    kern.scale(args, c, conditional, 0, num_items);
    return;
  }
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
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
