// The CPU side shared by the ops that walk weight, gradient and optimizer state together
// (multi_tensor_update_stats, multi_tensor_update_clip_, multi_tensor_optim_step_): the spans of
// their five lists, how the chunks are shared among the threads, and how a tensor's chunk rows are
// combined.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "../common/chunk_plan.h"
#include "../common/update_math.h"

namespace gradfuse::cpu {

// Below this many bytes per thread a call runs on the calling thread: waking the other threads
// (and waiting for all of them at the end, which on a busy machine can mean waiting for a
// descheduled one) costs more than it saves.
inline constexpr int64_t kMinBytesPerThread = 1 << 20;
// Bytes per block of chunks that a thread takes at a time.
inline constexpr int64_t kBlockBytes = 4 << 20;

// The spans of each list (absent or empty tensors: {nullptr, 0}), the bytes a pass moves, and the
// chunk plan of the parameters.
struct UpdateGroup {
  std::vector<Span> params, grads, moment1, moment2, moment2_max;
  ChunkPlan plan;
  int64_t bytes = 0;
};

// The group of lists already checked (check_update_args / check_step_args).
inline UpdateGroup update_group(at::TensorList params, at::TensorList grads, at::TensorList moment1,
                                at::TensorList moment2, at::TensorList moment2_max) {
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

// Calls f(begin, end) over every chunk of the plan, once per chunk. A small call runs on the
// calling thread; otherwise the chunks are cut into blocks of about kBlockBytes, which the threads
// take in turn from a shared counter (as the stats op: on a shared machine a descheduled thread
// holding a fixed half of the call would hold up the whole call). Each chunk writes its own
// partial row or elements, so the results depend neither on the thread count nor on the order.
template <typename F>
void for_chunk_blocks(const UpdateGroup& g, F&& f) {
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

// Combines each tensor's chunk rows, in chunk order, in double, into its row of out_f / out_c.
template <typename acc_t>
void finalize_update_rows(const UpdateGroup& g, const acc_t* fp, const int64_t* cp, double* out_f, int64_t* out_c) {
  const auto n = static_cast<int64_t>(g.params.size());
  for (int64_t t = 0; t < n; ++t) {
    UpdateAcc<double> s;
    for (int64_t c = g.plan.first_chunk[t]; c < g.plan.first_chunk[t + 1]; ++c) {
      s.combine(UpdateAcc<acc_t>::load(fp + c * kNumUpdateFloatStats, cp + c * kNumUpdateCountStats));
    }
    s.store(out_f + t * kNumUpdateFloatStats, out_c + t * kNumUpdateCountStats);
    out_c[t * kNumUpdateCountStats + kUpdateNumel] = g.params[t].numel;
  }
}

}  // namespace gradfuse::cpu
