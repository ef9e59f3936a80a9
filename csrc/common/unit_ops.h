// Input checks and preparation shared by the CPU and CUDA clipping ops (issue 17).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "op_checks.h"
#include "unit_plan.h"

namespace gradfuse {

// units[i] must split tensor i into equal blocks: a divisor of its numel (>= 1), or 0 when it is
// empty. Returns sum(units).
inline int64_t check_units(at::TensorList tensors, at::IntArrayRef units, const char* op) {
  TORCH_CHECK(units.size() == tensors.size(), op, ": got ", tensors.size(), " tensors but ",
              units.size(), " unit counts");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel(), u = units[i];
    TORCH_CHECK(u >= 0 && (u > 0 || n == 0) && (u == 0 || n % u == 0), op, ": units[", i, "] = ", u,
                " does not divide tensors[", i, "]'s ", n, " elements into equal blocks (expected a "
                "divisor of numel, >= 1; 0 only for an empty tensor)");
    total += u;
  }
  return total;
}

// The coefficients as the kernels read them: 1-D, one per unit, on the tensors' device, in the
// accumulation type of the data (a no-op when they already are).
inline at::Tensor checked_coefs(const at::Tensor& coefs, int64_t total, const at::Tensor& first,
                                const char* op) {
  TORCH_CHECK(coefs.dim() == 1 && coefs.numel() == total, op, ": coefs must be a 1-D tensor of ",
              total, " coefficients (one per tensor or unit), got shape ", coefs.sizes());
  TORCH_CHECK(at::isFloatingType(coefs.scalar_type()), op, ": coefs must be floating point, got ",
              coefs.scalar_type());
  TORCH_CHECK(coefs.device() == first.device(), op, ": coefs is on ", coefs.device(),
              " but the tensors are on ", first.device());
  return coefs.to(partial_dtype(first.scalar_type())).contiguous();
}

inline void check_clip_value(double v, const char* op) {
  TORCH_CHECK(v >= 0.0, op, ": clip_value must be >= 0 and not NaN, got ", v);
}

// Whether the kernels can take tensor t as a span in its units' order: one flat block, and in
// logical (row-major) order when the units are more than one.
inline bool unit_span_ok(const at::Tensor& t, int64_t units) {
  return units <= 1 ? t.is_non_overlapping_and_dense() : t.is_contiguous();
}

// The tensors of a statistics call as spans: those the kernels cannot take are copied.
struct UnitGroup {
  std::vector<at::Tensor> dense;
  std::vector<UnitSpan> spans;
  UnitPlan plan;
  int64_t total_units = 0;

  UnitGroup(at::TensorList tensors, at::IntArrayRef units) {
    dense.reserve(tensors.size());
    spans.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      dense.push_back(unit_span_ok(t, units[i]) ? t : t.contiguous());
      spans.push_back({dense.back().data_ptr(), t.numel(), units[i], total_units});
      total_units += units[i];
    }
    plan = make_unit_plan(spans);
  }
  UnitGroup() = default;
};

// In-place scaling: tensors the kernels cannot take are scaled by ATen where they live, by
// coefs_acc (already min(coef, 1) when conditional: exact where a kernel would not touch them);
// returns the others as a group for the kernels (rows still index all units of the call).
inline UnitGroup scale_units_elsewhere_(at::TensorList tensors, at::IntArrayRef units,
                                        const at::Tensor& coefs_acc) {
  UnitGroup g;
  int64_t row = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    const int64_t u = units[i];
    if (u > 0 && t.numel() > 0) {
      if (unit_span_ok(t, u)) {
        g.dense.push_back(t);
        g.spans.push_back({t.data_ptr(), t.numel(), u, row});
      } else {
        const auto c = coefs_acc.narrow(0, row, u).unsqueeze(1);
        t.copy_((t.reshape({u, -1}).to(coefs_acc.scalar_type()) * c).view(t.sizes()));
      }
    }
    row += u;
  }
  g.total_units = row;
  g.plan = make_unit_plan(g.spans);
  return g;
}

}  // namespace gradfuse
