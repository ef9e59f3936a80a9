// CPU implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "../common/chunk_plan.h"
#include "../common/op_checks.h"
#include "cpu_capability.h"
#include "kernels.h"

namespace gradfuse::cpu {
namespace {

struct Kernels {
  StatsChunksFn stats;
  ScaleChunksFn scale;
};

Kernels kernels_for(const std::string& isa) {
#ifdef GRADFUSE_HAVE_AVX2_KERNELS
  if (isa == "avx2") return {AVX2::stats_chunks, AVX2::scale_chunks};
#endif
  return {DEFAULT::stats_chunks, DEFAULT::scale_chunks};
}

ChunkArgs chunk_args(const DenseGroup& group, at::ScalarType dtype) {
  return {group.spans.data(), static_cast<int64_t>(group.spans.size()),
          group.plan.first_chunk.data(), dtype};
}

// Combines the chunk partials of every tensor, in chunk order, in double.
template <typename acc_t>
void finalize(const DenseGroup& group, const acc_t* fp, const int64_t* cp, double* out_f,
              int64_t* out_c, int64_t num_tensors) {
  const ChunkPlan& plan = group.plan;
  at::parallel_for(0, num_tensors, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      StatsAcc<double> s;
      for (int64_t c = plan.first_chunk[t]; c < plan.first_chunk[t + 1]; ++c) {
        s.combine(StatsAcc<acc_t>::load(fp + c * kNumFloatStats, cp + c * kNumCountStats));
      }
      s.store(out_f + t * kNumFloatStats, out_c + t * kNumCountStats);
      out_c[t * kNumCountStats + kNumel] = group.spans[t].numel;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_cpu(at::TensorList tensors,
                                                          double norm_type) {
  check_group(tensors, "gradfuse.multi_tensor_stats", c10::DeviceType::CPU);
  const auto n = static_cast<int64_t>(tensors.size());
  auto out_f = at::empty({n, kNumFloatStats}, at::TensorOptions().dtype(at::kDouble));
  auto out_c = at::empty({n, kNumCountStats}, at::TensorOptions().dtype(at::kLong));
  if (n == 0) return {out_f, out_c};

  const DenseGroup group(tensors);
  const auto dtype = tensors[0].scalar_type();
  const auto args = chunk_args(group, dtype);
  const int64_t num_chunks = group.plan.num_chunks();
  auto part_f = at::empty({num_chunks, kNumFloatStats}, at::TensorOptions().dtype(partial_dtype(dtype)));
  auto part_c = at::empty({num_chunks, kNumCountStats}, at::TensorOptions().dtype(at::kLong));
  const PowMode mode = pow_mode_for(norm_type);
  const auto kern = kernels_for(active_cpu_capability());
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    kern.stats(args, mode, norm_type, begin, end, fp, cp);
  });
  if (dtype == at::kDouble) {
    finalize<double>(group, part_f.data_ptr<double>(), cp, out_f.data_ptr<double>(),
                     out_c.data_ptr<int64_t>(), n);
  } else {
    finalize<float>(group, part_f.data_ptr<float>(), cp, out_f.data_ptr<double>(),
                    out_c.data_ptr<int64_t>(), n);
  }
  return {out_f, out_c};
}

void multi_tensor_scale_cpu(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  check_group(tensors, "gradfuse.multi_tensor_scale_", c10::DeviceType::CPU);
  TORCH_CHECK(coef.numel() == 1 && coef.device().is_cpu(),
              "gradfuse.multi_tensor_scale_: coef must be a one-element CPU tensor, got shape ",
              coef.sizes(), " on ", coef.device());
  const double c = coef.item<double>();
  if (tensors.empty() || (conditional && !needs_scaling(c))) return;  // no traffic when nothing to do

  const auto dense = scale_non_dense_(tensors, coef);
  if (dense.empty()) return;
  const DenseGroup group(dense);
  const auto args = chunk_args(group, dense[0].scalar_type());
  const auto kern = kernels_for(active_cpu_capability());
  at::parallel_for(0, group.plan.num_chunks(), 1, [&](int64_t begin, int64_t end) {
    kern.scale(args, c, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cpu);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cpu);
}

}  // namespace gradfuse::cpu
