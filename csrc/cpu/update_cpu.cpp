// CPU implementations of the optimizer-update ops (schemas in gradfuse.cpp):
// multi_tensor_update_stats and multi_tensor_update_clip_, over the chunk plan of the parameters.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "../common/engine.h"
#include "../common/update_math.h"
#include "cpu_capability.h"
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

// Below this many bytes per thread a call runs on the calling thread (as the stats op).
constexpr int64_t kMinBytesPerThread = 1 << 20;

// Checks that entry i of `list` is a tensor like params[i]: same shape, dtype and device,
// contiguous. `may_be_absent`: an empty tensor (numel 0) stands for a missing state.
void check_like_param(at::TensorList list, const char* name, at::TensorList params, size_t i, bool may_be_absent,
                      const char* op) {
  const at::Tensor& t = list[i];
  const at::Tensor& p = params[i];
  TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
  if (may_be_absent && t.numel() == 0) return;
  const bool ok = t.layout() == at::kStrided && t.sizes() == p.sizes() && t.scalar_type() == p.scalar_type() &&
                  t.device() == p.device() && t.is_contiguous();
  TORCH_CHECK(ok, op, ": ", name, "[", i, "] must be contiguous with params[", i, "]'s shape ", p.sizes(),
              " and dtype ", p.scalar_type(), ", got shape ", t.sizes(), ", dtype ", t.scalar_type(), ", device ",
              t.device(), t.layout() == at::kStrided && !t.is_contiguous() ? ", not contiguous" : "");
}

// The checks of both ops; returns the chunk plan's spans of each list.
struct UpdateGroup {
  std::vector<Span> params, grads, moment1, moment2, moment2_max;
  ChunkPlan plan;
  int64_t bytes = 0;
};

UpdateGroup check_update_args(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                              at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                              int64_t rule, const char* op) {
  const size_t n = params.size();
  const std::pair<const char*, at::TensorList> lists[] = {
      {"grads", grads}, {"moment1", moment1}, {"moment2", moment2}, {"moment2_max", moment2_max}};
  for (const auto& [name, list] : lists) {
    TORCH_CHECK(list.size() == n, op, ": expected ", n, " ", name, " (one per params), got ", list.size());
  }
  TORCH_CHECK(rule == static_cast<int64_t>(UpdateRule::kSGD) || rule == static_cast<int64_t>(UpdateRule::kAdam),
              op, ": rule must be 0 (SGD) or 1 (Adam), got ", rule);
  const auto device = n ? params[0].device() : c10::Device(c10::DeviceType::CPU);
  TORCH_CHECK(hyper.scalar_type() == at::kDouble && hyper.dim() == 2 && hyper.size(0) == static_cast<int64_t>(n) &&
                  hyper.size(1) == kNumHyper && hyper.device() == device && hyper.is_contiguous(),
              op, ": hyper must be a contiguous float64 tensor of shape [", n, ", ", static_cast<int>(kNumHyper),
              "] on ", device, ", got shape ", hyper.sizes(), ", dtype ", hyper.scalar_type(), ", device ",
              hyper.device(), hyper.is_contiguous() ? "" : ", not contiguous");
  UpdateGroup g;
  if (n == 0) {
    g.plan = make_chunk_plan(g.params);
    return g;
  }
  const at::Tensor& first = params[0];
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.layout() == at::kStrided && is_supported_float(p.scalar_type()) && p.device().type() == c10::DeviceType::CPU,
                op, ": params[", i, "] must be a dense float16, bfloat16, float32 or float64 CPU tensor, got ",
                p.layout(), " ", p.scalar_type(), " on ", p.device());
    TORCH_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(), op, ": params[", i,
                "] is ", p.scalar_type(), " on ", p.device(), " but params[0] is ", first.scalar_type(), " on ",
                first.device(), "; call once per (device, dtype) group");
    TORCH_CHECK(p.is_contiguous(), op, ": params[", i, "] must be contiguous, got strides ", p.strides(),
                " for shape ", p.sizes());
    check_like_param(grads, "grads", params, i, false, op);
    check_like_param(moment1, "moment1", params, i, true, op);
    check_like_param(moment2, "moment2", params, i, true, op);
    check_like_param(moment2_max, "moment2_max", params, i, true, op);
  }
  const auto span_of = [](const at::Tensor& t) {
    return t.numel() > 0 ? Span{t.data_ptr(), t.numel()} : Span{nullptr, 0};
  };
  for (auto* v : {&g.params, &g.grads, &g.moment1, &g.moment2, &g.moment2_max}) v->reserve(n);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(first.scalar_type()));
  for (size_t i = 0; i < n; ++i) {
    g.params.push_back(span_of(params[i]));
    g.grads.push_back(span_of(grads[i]));
    g.moment1.push_back(span_of(moment1[i]));
    g.moment2.push_back(span_of(moment2[i]));
    g.moment2_max.push_back(span_of(moment2_max[i]));
    int64_t arrays = 2;
    for (const Span* s : {&g.moment1.back(), &g.moment2.back(), &g.moment2_max.back()}) arrays += s->numel > 0;
    g.bytes += params[i].numel() * elem * arrays;
  }
  g.plan = make_chunk_plan(g.params);
  return g;
}

UpdateArgs update_args(const UpdateGroup& g, const at::Tensor& hyper, at::ScalarType dtype, int64_t rule) {
  return {g.params.data(),  g.grads.data(), g.moment1.data(), g.moment2.data(), g.moment2_max.data(),
          hyper.const_data_ptr<double>(), static_cast<int64_t>(g.params.size()), g.plan.first_chunk.data(),
          dtype, static_cast<UpdateRule>(rule)};
}

// Chunks per task such that each gets at least kMinBytesPerThread.
int64_t grain_of(const UpdateGroup& g) {
  const int64_t chunks = g.plan.num_chunks();
  return std::max<int64_t>(1, (chunks * kMinBytesPerThread + g.bytes - 1) / std::max<int64_t>(g.bytes, 1));
}

template <typename acc_t>
void finalize_update_rows(const UpdateGroup& g, const acc_t* fp, const int64_t* cp, double* out_f, int64_t* out_c) {
  const auto n = static_cast<int64_t>(g.params.size());
  for (int64_t t = 0; t < n; ++t) {
    UpdateAcc<double> s;
    for (int64_t c = g.plan.first_chunk[t]; c < g.plan.first_chunk[t + 1]; ++c) {  // in chunk order
      s.combine(UpdateAcc<acc_t>::load(fp + c * kNumUpdateFloatStats, cp + c * kNumUpdateCountStats));
    }
    s.store(out_f + t * kNumUpdateFloatStats, out_c + t * kNumUpdateCountStats);
    out_c[t * kNumUpdateCountStats + kUpdateNumel] = g.params[t].numel;
  }
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_update_stats_cpu(at::TensorList params, at::TensorList grads,
                                                                 at::TensorList moment1, at::TensorList moment2,
                                                                 at::TensorList moment2_max, const at::Tensor& hyper,
                                                                 int64_t rule) {
  constexpr const char* kOp = "multi_tensor_update_stats";
  const UpdateGroup g = check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, kOp);
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
  at::parallel_for(0, num_chunks, grain_of(g), [&](int64_t begin, int64_t end) {
    kern.stats(args, begin, end, fp, cp);
  });
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
  const UpdateGroup g = check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, kOp);
  const auto n = static_cast<int64_t>(params.size());
  const auto device = n ? params[0].device() : c10::Device(c10::DeviceType::CPU);
  TORCH_CHECK(coefs.scalar_type() == at::kDouble && coefs.dim() == 1 && coefs.size(0) == n &&
                  coefs.device() == device && coefs.is_contiguous(),
              kOp, ": coefs must be a contiguous float64 tensor of shape [", n, "] on ", device, ", got shape ",
              coefs.sizes(), ", dtype ", coefs.scalar_type(), ", device ", coefs.device(),
              coefs.is_contiguous() ? "" : ", not contiguous");
  if (n == 0 || g.plan.num_chunks() == 0) return;
  const auto dtype = params[0].scalar_type();
  const UpdateArgs args = update_args(g, hyper, dtype, rule);
  const auto kern = update_kernels_for(active_cpu_capability());
  const double* c = coefs.const_data_ptr<double>();
  at::parallel_for(0, g.plan.num_chunks(), grain_of(g), [&](int64_t begin, int64_t end) {
    kern.clip(args, c, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_update_stats", &multi_tensor_update_stats_cpu);
  m.impl("multi_tensor_update_clip_", &multi_tensor_update_clip_cpu);
}

}  // namespace gradfuse::cpu
