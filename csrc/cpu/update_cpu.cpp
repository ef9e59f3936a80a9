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

// The spans of each list of a checked call (absent or empty tensors: {nullptr, 0}) and the chunk
// plan of the parameters.
struct UpdateGroup {
  std::vector<Span> params, grads, moment1, moment2, moment2_max;
  ChunkPlan plan;
  int64_t bytes = 0;
};

UpdateGroup checked_update_group(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                                 at::TensorList moment2, at::TensorList moment2_max, const at::Tensor& hyper,
                                 int64_t rule, const char* op) {
  check_update_args(params, grads, moment1, moment2, moment2_max, hyper, rule, op);
  const size_t n = params.size();
  UpdateGroup g;
  const int64_t elem = n ? static_cast<int64_t>(c10::elementSize(params[0].scalar_type())) : 0;
  const auto span_of = [](const at::Tensor& t) {
    return t.numel() > 0 ? Span{t.data_ptr(), t.numel()} : Span{nullptr, 0};
  };
  for (auto* v : {&g.params, &g.grads, &g.moment1, &g.moment2, &g.moment2_max}) v->reserve(n);
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

// Bytes per block of chunks that a thread takes at a time.
constexpr int64_t kBlockBytes = 4 << 20;

// Calls f(begin, end) over every chunk of the plan, once per chunk. A small call runs on the
// calling thread; otherwise the chunks are cut into blocks of about kBlockBytes, which the threads
// take in turn from a shared counter (as the stats op: on a shared machine a descheduled thread
// holding a fixed half of the call would hold up the whole call). Each chunk writes its own
// partial row or weights, so the results depend neither on the thread count nor on the order.
template <typename F>
void for_chunks(const UpdateGroup& g, F&& f) {
  const int64_t chunks = g.plan.num_chunks();
  const int64_t bytes = std::max<int64_t>(g.bytes, 1);
  const int64_t block = std::max<int64_t>(1, (chunks * kBlockBytes + bytes - 1) / bytes);
  const int64_t num_blocks = (chunks + block - 1) / block;
  if (g.bytes < 2 * kMinBytesPerThread || num_blocks <= 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    if (chunks > 0) f(int64_t{0}, chunks);
    return;
  }
  std::atomic<int64_t> next_block{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_blocks);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next_block.fetch_add(1); b < num_blocks; b = next_block.fetch_add(1)) {
      f(b * block, std::min(chunks, (b + 1) * block));
    }
  });
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
  for_chunks(g, [&](int64_t begin, int64_t end) { kern.stats(args, begin, end, fp, cp); });
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
  for_chunks(g, [&](int64_t begin, int64_t end) { kern.clip(args, c, begin, end); });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_update_stats", &multi_tensor_update_stats_cpu);
  m.impl("multi_tensor_update_clip_", &multi_tensor_update_clip_cpu);
}

}  // namespace gradfuse::cpu
