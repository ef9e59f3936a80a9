// The host-side engine shared by the CPU backend, the CUDA backend (and its emulation) and
// csrc/watch.cpp: the ops' argument checks, the preparation of their inputs (spans and work
// plans), and what is computed from the per-tensor rows: the total norm of order p and the clip
// coefficient. Each exists here once; the per-element arithmetic is in stats_math.h.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "chunk_plan.h"
#include "stats_math.h"
#include "step_math.h"
#include "unit_plan.h"
#include "update_math.h"

namespace gradfuse {

// ---- Argument checks

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Checks that `tensors` form one (device, dtype) group of dense floating-point tensors.
inline void check_group(at::TensorList tensors, const char* op, c10::DeviceType device_type) {
  if (tensors.empty()) return;
  const auto& first = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
                "; only dense (strided) tensors are supported");
    TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": tensors[", i, "] has dtype ",
                t.scalar_type(), "; expected float16, bfloat16, float32 or float64");
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), op, ": tensors[", i, "] has dtype ",
                t.scalar_type(), " but tensors[0] has ", first.scalar_type(),
                "; call once per (device, dtype) group");
    TORCH_CHECK(t.device().type() == device_type && t.device() == first.device(), op,
                ": tensors[", i, "] is on ", t.device(), " but tensors[0] is on ", first.device());
  }
}

// The one coefficient of multi_tensor_scale_: one element, on the tensors' device.
inline void check_scale_coef(at::TensorList tensors, const at::Tensor& coef, const char* op) {
  TORCH_CHECK(coef.numel() == 1 && (tensors.empty() || coef.device() == tensors[0].device()), op,
              ": coef must be a one-element tensor on ", tensors.empty() ? coef.device() : tensors[0].device(),
              ", got shape ", coef.sizes(), " on ", coef.device());
}

// units[i] must split tensor i into equal blocks: a divisor of its numel (>= 1), or 0 when it is
// empty.
inline bool units_ok(int64_t numel, int64_t u) {
  return u >= 0 && (u > 0 || numel == 0) && (u == 0 || numel % u == 0);
}

// Checks every units[i] (units_ok); returns sum(units).
inline int64_t check_units(at::TensorList tensors, at::IntArrayRef units, const char* op) {
  TORCH_CHECK(units.size() == tensors.size(), op, ": got ", tensors.size(), " tensors but ",
              units.size(), " unit counts");
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel(), u = units[i];
    TORCH_CHECK(units_ok(n, u), op, ": units[", i, "] = ", u, " does not divide tensors[", i, "]'s ",
                n, " elements into equal blocks (expected a divisor of numel, >= 1; 0 only for an "
                "empty tensor)");
    total += u;
  }
  return total;
}

inline at::ScalarType partial_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
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

// "shape [4, 5], dtype Float on cpu[, not contiguous][, layout ...]", as the reference
// (gradfuse/ops/update_reference.py) describes a tensor in its messages.
inline std::string describe_tensor(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape " << t.sizes() << ", dtype " << t.scalar_type() << " on " << t.device();
  if (t.layout() == at::kStrided && !t.is_contiguous()) os << ", not contiguous";
  if (t.layout() != at::kStrided) os << ", layout " << t.layout();
  return os.str();
}

// The argument checks of multi_tensor_update_stats / multi_tensor_update_clip_, in the
// reference's order and with its messages: a known rule; state lists as long as params; one
// (device, dtype) group of dense contiguous parameters; gradients like them; state entries like
// their parameter or empty (absent); the hyper-parameter table float64 [n, kNumHyper] on the
// parameters' device.
inline void check_update_lists(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                               at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& table,
                               int64_t rule, const char* op) {
  TORCH_CHECK(rule == static_cast<int64_t>(UpdateRule::kSGD) || rule == static_cast<int64_t>(UpdateRule::kAdam),
              op, ": rule must be 0 (SGD) or 1 (Adam, AdamW), got ", rule);
  const size_t n = params.size();
  const std::pair<const char*, at::TensorList> lists[] = {
      {"grads", grads}, {"moment1", moment1}, {"moment2", moment2}, {"moment2_max", moment2_max}};
  for (const auto& [name, list] : lists) {
    TORCH_CHECK(list.size() == n, op, ": ", name, " has ", list.size(), " tensors but params has ", n);
  }
  const auto device = n ? params[0].device() : table.device();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.layout() == at::kStrided && is_supported_float(p.scalar_type()) && p.is_contiguous(), op,
                ": params[", i, "] must be a dense contiguous float16, bfloat16, float32 or float64 tensor, got ",
                describe_tensor(p));
    TORCH_CHECK(p.scalar_type() == params[0].scalar_type() && p.device() == device, op, ": params[", i, "] is ",
                p.scalar_type(), " on ", p.device(), " but params[0] is ", params[0].scalar_type(), " on ", device);
    for (size_t k = 0; k < 4; ++k) {
      const auto& [name, list] = lists[k];
      const bool may_be_absent = k > 0;
      const at::Tensor& t = list[i];
      if (may_be_absent && t.numel() == 0 && t.layout() == at::kStrided) continue;
      TORCH_CHECK(t.layout() == at::kStrided && t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() &&
                      t.device() == p.device() && t.is_contiguous(),
                  op, ": ", name, "[", i, "] must be contiguous with params[", i, "]'s shape ", p.sizes(),
                  " and dtype ", p.scalar_type(), " on ", p.device(), may_be_absent ? " (or empty: absent)" : "",
                  ", got ", describe_tensor(t));
    }
  }
}

// A per-tensor table of float64 [n, columns] on the parameters' device.
inline void check_table(at::TensorList params, const at::Tensor& table, int64_t columns, const char* name,
                        const char* op) {
  const auto n = static_cast<int64_t>(params.size());
  const auto device = n ? params[0].device() : table.device();
  TORCH_CHECK(table.scalar_type() == at::kDouble && table.dim() == 2 && table.size(0) == n &&
                  table.size(1) == columns && table.device() == device && table.is_contiguous(),
              op, ": ", name, " must be a contiguous float64 [", n, ", ", columns, "] tensor on ", device, ", got ",
              describe_tensor(table));
}

inline void check_update_args(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                              at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                              int64_t rule, const char* op) {
  check_update_lists(params, grads, moment1, moment2, moment2_max, hyper, rule, op);
  check_table(params, hyper, kNumHyper, "hyper", op);
}

// Whether multi_tensor_optim_step_'s grad_scale is one per tensor (float64 [n], n > 1) rather
// than one for all (one element).
inline bool grad_scale_per_tensor(const std::optional<at::Tensor>& grad_scale, int64_t n) {
  return grad_scale.has_value() && n > 1 && grad_scale->scalar_type() == at::kDouble && grad_scale->dim() == 1 &&
         grad_scale->size(0) == n;
}

// The arguments of multi_tensor_optim_step_: the lists as the update ops take them, with Adam's
// two moments present for every non-empty parameter; the table float64 [n, kNumStepCoefs]; a
// gradient scale of one element or float64 [n], a skip flag of one element, and update
// coefficients float64 [n], all on the parameters' device where given.
inline void check_step_args(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                            at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& coefs,
                            int64_t rule, const std::optional<at::Tensor>& grad_scale,
                            const std::optional<at::Tensor>& skip, const std::optional<at::Tensor>& update_coefs,
                            const char* op) {
  check_update_lists(params, grads, moment1, moment2, moment2_max, coefs, rule, op);
  check_table(params, coefs, kNumStepCoefs, "coefs", op);
  const auto n = static_cast<int64_t>(params.size());
  const auto device = n ? params[0].device() : coefs.device();
  if (rule == static_cast<int64_t>(UpdateRule::kAdam)) {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(params[i].numel() == 0 || (moment1[i].numel() > 0 && moment2[i].numel() > 0), op,
                  ": Adam's step needs moment1[", i, "] and moment2[", i, "] (exp_avg, exp_avg_sq), got ",
                  describe_tensor(moment1[i]), " and ", describe_tensor(moment2[i]));
    }
  }
  TORCH_CHECK(!grad_scale.has_value() ||
                  ((grad_scale->numel() == 1 || grad_scale_per_tensor(grad_scale, n)) && grad_scale->device() == device),
              op, ": grad_scale must be a one-element tensor or a float64 [", n, "] tensor on ", device, ", got ",
              describe_tensor(*grad_scale));
  TORCH_CHECK(!skip.has_value() || (skip->numel() == 1 && skip->device() == device), op,
              ": skip must be a one-element tensor on ", device, ", got ", describe_tensor(*skip));
  TORCH_CHECK(!grad_scale.has_value() || at::isFloatingType(grad_scale->scalar_type()), op,
              ": grad_scale must be a floating-point tensor, got ", describe_tensor(*grad_scale));
  TORCH_CHECK(!update_coefs.has_value() || (update_coefs->scalar_type() == at::kDouble && update_coefs->dim() == 1 &&
                                            update_coefs->size(0) == n && update_coefs->device() == device),
              op, ": update_coefs must be a float64 [", n, "] tensor on ", device, ", got ",
              describe_tensor(*update_coefs));
}

// multi_tensor_update_clip_'s coefficients: float64 [n] on the parameters' device (the kernels
// read a contiguous copy).
inline void check_update_coefs(at::TensorList params, const at::Tensor& hyper, const at::Tensor& coefs,
                               const char* op) {
  const auto n = static_cast<int64_t>(params.size());
  const auto device = n ? params[0].device() : hyper.device();
  TORCH_CHECK(coefs.scalar_type() == at::kDouble && coefs.dim() == 1 && coefs.size(0) == n && coefs.device() == device,
              op, ": coefs must be a float64 [", n, "] tensor on ", device, ", got ", describe_tensor(coefs));
}

// ---- Inputs as the kernels of both backends see them

// Tensors whose elements are one flat block of memory can be reduced as a span; anything else
// (overlapping or gapped views) is copied to a contiguous tensor first. Statistics do not depend
// on element order, so a dense permuted tensor (channels_last, a transpose) needs no copy.
inline at::Tensor as_dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : t.contiguous();
}

// One call's tensors: dense tensors (copies of non-dense inputs are kept alive here), their
// spans, and the chunk plan over those spans.
struct DenseGroup {
  std::vector<at::Tensor> dense;
  std::vector<Span> spans;
  ChunkPlan plan;

  explicit DenseGroup(at::TensorList tensors) {
    dense.reserve(tensors.size());
    spans.reserve(tensors.size());
    for (const auto& t : tensors) {
      dense.push_back(as_dense(t));
      // Strides are never negative in PyTorch, so the element at index 0 of a dense tensor is
      // its lowest-addressed one.
      spans.push_back({dense.back().data_ptr(), dense.back().numel()});
    }
    plan = make_chunk_plan(spans);
  }
};

// The in-place scale kernels need one dense block per tensor; other views are multiplied by
// ATen where they live. Returns the dense ones, still to be scaled by the kernels.
inline std::vector<at::Tensor> scale_non_dense_(at::TensorList tensors, const at::Tensor& coef) {
  std::vector<at::Tensor> dense;
  for (const auto& t : tensors) {
    if (t.is_non_overlapping_and_dense()) dense.push_back(t); else t.mul_(coef.to(t.scalar_type()));
  }
  return dense;
}

// Whether the kernels can take tensor t as a span in its units' order: one flat block, and in
// logical (row-major) order when the units are more than one.
inline bool unit_span_ok(const at::Tensor& t, int64_t units) {
  return units <= 1 ? t.is_non_overlapping_and_dense() : t.is_contiguous();
}

// The tensors of a per-unit call as spans: those the kernels cannot take are copied.
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

// Unit j of tensor t (units u) times coefs_acc[row + j], by ATen, for the views the kernels
// cannot take.
inline void scale_units_with_aten_(const at::Tensor& t, int64_t u, int64_t row, const at::Tensor& coefs_acc) {
  const auto c = coefs_acc.narrow(0, row, u).unsqueeze(1);
  t.copy_((t.reshape({u, -1}).to(coefs_acc.scalar_type()) * c).view(t.sizes()));
}

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
        scale_units_with_aten_(t, u, row, coefs_acc);
      }
    }
    row += u;
  }
  g.total_units = row;
  g.plan = make_unit_plan(g.spans);
  return g;
}

// ---- From per-tensor rows to the total norm and the clip coefficient

// The total norm of order p >= 0 over every tensor whose rows (floats, counts of
// multi_tensor_stats) are given, in float64, op for op as gradfuse's Python side computes it
// (gradfuse.core.norms: norm_accumulator then root), so that both give the same bits. As
// torch.nn.utils composes per-tensor norms: p = inf is the largest max |x| (NaN propagates; no
// rows: 0), p = 0 the count of tensors with a non-zero element (NaN counts as non-zero), other p
// the root of the summed power sums (p = 2: of the sums of squares). The rows hold no minimum:
// negative orders and -inf are not theirs to compute.
inline at::Tensor total_norm(const at::Tensor& floats, const at::Tensor& counts, double p) {
  TORCH_CHECK(p >= 0.0, "gradfuse: the total norm from kernel rows needs norm_type >= 0, got ", p);
  if (p == 2.0) return floats.select(1, kSumSq).sum().sqrt();
  if (std::isinf(p)) return floats.size(0) ? floats.select(1, kMaxAbs).amax() : floats.new_zeros({});
  if (p == 0.0) return (counts.select(1, kNumel) - counts.select(1, kZeroCount)).gt(0).sum().to(at::kDouble);
  const auto acc = floats.select(1, kPowSum).sum();
  return p == 1.0 ? acc : acc.pow(1.0 / p);
}

// torch.nn.utils.clip_grad_norm_'s coefficient min(max_norm / (total + 1e-6), 1), op for op as
// the Python side computes it (`float / tensor` is `tensor.reciprocal() * float`).
inline at::Tensor clip_coef(const at::Tensor& total, double max_norm) {
  return at::clamp((total + 1e-6).reciprocal() * max_norm, std::nullopt, 1.0);
}

}  // namespace gradfuse
