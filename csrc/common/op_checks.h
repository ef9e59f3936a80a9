// Input checks and preparation shared by the CPU and CUDA ops.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "chunk_plan.h"

namespace gradfuse {

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

// Tensors whose elements are one flat block of memory can be reduced as a span; anything else
// (overlapping or gapped views) is copied to a contiguous tensor first. Statistics do not depend
// on element order, so a dense permuted tensor (channels_last, a transpose) needs no copy.
inline at::Tensor as_dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : t.contiguous();
}

// One call's tensors as the kernels of both backends see them: dense tensors (copies of
// non-dense inputs are kept alive here), their spans, and the chunk plan over those spans.
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

inline at::ScalarType partial_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace gradfuse
