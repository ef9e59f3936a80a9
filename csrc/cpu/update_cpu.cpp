// CPU implementations of the optimizer-update ops (schemas in gradfuse.cpp):
// multi_tensor_update_stats and multi_tensor_update_clip_, over the chunk plan of the parameters.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <vector>

#include "../common/engine.h"
#include "../common/update_math.h"
#include "cpu_capability.h"
#include "update_group.h"
#include "update_kernels.h"

namespace gradfuse::cpu {
namespace {

struct UpdateKernels {
  UpdateStatsChunksFn stats;
  UpdateClipChunksFn clip;
};

UpdateKernels update_kernels_for(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx2") return {AVX2::update_stats_chunks, AVX2::update_clip_chunks};
#endif
  return {DEFAULT::update_stats_chunks, DEFAULT::update_clip_chunks};
}

UpdateGroup checked_update_group(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                                 at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                                 int64_t rule, const char* op) {
  check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, op);
  return update_group(params, grads, moment1, moment2, moment2_max);
}

UpdateArgs update_args(const UpdateGroup& g, const at::Tensor& hyper, at::ScalarType dtype, int64_t rule) {
  return {g.params.data(),  g.grads.data(), g.moment1.data(), g.moment2.data(), g.moment2_max.data(),
          hyper.const_data_ptr<double>(), static_cast<int64_t>(g.params.size()), g.plan.first_chunk.data(),
          dtype, static_cast<UpdateRule>(rule)};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_update_stats_cpu(at::TensorList params, at::TensorList grads,
                                                                 at::TensorList moment1, at::TensorList moment2,
                                                                 at::TensorList moment2_max, const at::Tensor& hyper,
                                                                 int64_t rule) {
  constexpr const char* kOp = "multi_tensor_update_stats";
  const UpdateGroup g = checked_update_group(params, grads, moment1, moment2, moment2_max, hyper, rule, kOp);
  const auto n = static_cast<int64_t>(params.size());
  auto out_f = at::empty({n, kNumUpdateFloatStats}, at::dtype(at::kDouble));
  auto out_c = at::empty({n, kNumUpdateCountStats}, at::dtype(at::kLong));
  if (n == 0) return {out_f, out_c};
  const auto dtype = params[0].scalar_type();
  const int64_t num_chunks = g.plan.num_chunks();
  // One partial row per chunk (a few bytes per 65 536 elements), combined per tensor in chunk
  // order: the rows do not depend on the thread count.
  auto part_f = at::empty({num_chunks, kNumUpdateFloatStats}, at::dtype(partial_dtype(dtype)));
  auto part_c = at::empty({num_chunks, kNumUpdateCountStats}, at::dtype(at::kLong));
  const UpdateArgs args = update_args(g, hyper, dtype, rule);
  const auto kern = update_kernels_for(active_cpu_capability());
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  for_chunk_blocks(g, [&](int64_t begin, int64_t end) { kern.stats(args, begin, end, fp, cp); });
  if (dtype == at::kDouble) {
    finalize_update_rows(g, part_f.const_data_ptr<double>(), cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
  } else {
    finalize_update_rows(g, part_f.const_data_ptr<float>(), cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
  }
  return {out_f, out_c};
}

void multi_tensor_update_clip_cpu(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                                  at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                                  const at::Tensor& coefs, int64_t rule) {
  constexpr const char* kOp = "multi_tensor_update_clip_";
  const UpdateGroup g = checked_update_group(params, grads, moment1, moment2, moment2_max, hyper, rule, kOp);
  const auto n = static_cast<int64_t>(params.size());
  check_update_coefs(params, hyper, coefs, kOp);
  if (n == 0 || g.plan.num_chunks() == 0) return;
  const auto dtype = params[0].scalar_type();
  const UpdateArgs args = update_args(g, hyper, dtype, rule);
  const auto kern = update_kernels_for(active_cpu_capability());
  const at::Tensor coefs_dense = coefs.contiguous();
  const double* c = coefs_dense.const_data_ptr<double>();
  for_chunk_blocks(g, [&](int64_t begin, int64_t end) { kern.clip(args, c, begin, end); });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_update_stats", &multi_tensor_update_stats_cpu);
  m.impl("multi_tensor_update_clip_", &multi_tensor_update_clip_cpu);
}

}  // namespace gradfuse::cpu
