// CPU implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/engine.h"
#include "cpu_capability.h"
#include "stats_kernels.h"
#include "stats_cpu.h"

namespace gradfuse::cpu {
namespace {

struct Kernels {
  StatsChunksFn stats;
  ScaleChunksFn scale;
  StatsTensorsFn stats_tensors;
};

Kernels kernels_for(const std::string& isa) {
#ifdef GRADFUSE_HAVE_AVX2_KERNELS
  if (isa == "avx2") return {AVX2::stats_chunks, AVX2::scale_chunks, AVX2::stats_tensors};
#endif
  return {DEFAULT::stats_chunks, DEFAULT::scale_chunks, DEFAULT::stats_tensors};
}

// read_stats_inputs reads one call's inputs in one pass over the tensor list (the checks of
// check_group, the spans and the chunk plan of DenseGroup): on 10 000 tiny tensors each
// TensorImpl and StorageImpl is a cache miss, so the pass prefetches them a few tensors ahead, and
// it holds no reference (an atomic increment and decrement) to tensors that are already dense.
StatsInputs read_stats_inputs(at::TensorList tensors, const char* op) {
  const auto n = static_cast<int64_t>(tensors.size());
  const at::Tensor& first = tensors[0];
  const bool first_ok = first.defined() && is_supported_float(first.scalar_type()) &&
                        first.device().type() == c10::DeviceType::CPU;
  const auto dtype = first_ok ? first.scalar_type() : at::kFloat;
  const auto device = first_ok ? first.device() : c10::Device(c10::DeviceType::CPU);
  StatsInputs in;
  in.reserve(n);
  constexpr int64_t kAhead = 4;
  for (int64_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) {
      const auto* impl = reinterpret_cast<const char*>(tensors[i + 2 * kAhead].unsafeGetTensorImpl());
      for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
        __builtin_prefetch(impl + offset);
      }
    }
    if (i + kAhead < n) {
      if (const auto* storage = tensors[i + kAhead].unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()) {
        __builtin_prefetch(storage);
      }
    }
    const at::Tensor& t = tensors[i];
    if (!first_ok || !t.defined() || t.layout() != at::kStrided || t.scalar_type() != dtype ||
        t.device() != device) {
      check_group(tensors, op, c10::DeviceType::CPU);  // names the tensor and what is wrong
      TORCH_CHECK(false, op, ": tensors[", i, "] is not a dense ", dtype, " tensor on ", device);
    }
    const void* data;
    if (t.is_non_overlapping_and_dense()) {
      data = t.const_data_ptr();
    } else {
      in.copies.push_back(t.contiguous());
      data = in.copies.back().const_data_ptr();
    }
    in.append(data, t.numel());
  }
  in.finish(dtype);
  return in;
}

// Below this many bytes per thread a set is reduced on the calling thread: waking the other
// threads (and waiting for all of them at the end, which on a busy machine can mean waiting for
// a descheduled one) costs more than it saves.
constexpr int64_t kMinBytesPerThread = 1 << 20;
// Bytes per block of chunks that a thread takes at a time (stats_of_inputs).
constexpr int64_t kBlockBytes = 4 << 20;

// The shift of a kMoments pass over span (the kernels' tensor_shift).
double shift_of(const Span& span, at::ScalarType dtype) {
  if (span.numel == 0) return 0.0;
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "gradfuse_shift", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    return static_cast<double>(moment_shift<acc_t>(static_cast<const scalar_t*>(span.data), span.numel));
  });
}

// Combines the chunk partials of tensor t, in chunk order, in double (as the kernels combine the
// chunks of a tensor that lies in one range).
template <typename acc_t>
void finalize_tensor(const StatsInputs& in, int64_t t, const acc_t* fp, const int64_t* cp,
                     PowMode mode, at::ScalarType dtype, double* out_f, int64_t* out_c) {
  StatsAcc<double> s;
  for (int64_t c = in.first_chunk[t]; c < in.first_chunk[t + 1]; ++c) {
    s.combine(StatsAcc<acc_t>::load(fp + c * kNumFloatStats, cp + c * kNumCountStats));
  }
  if (mode == PowMode::kMoments) s.finish_moments(shift_of(in.spans[t], dtype), in.spans[t].numel);
  s.store(out_f + t * kNumFloatStats, out_c + t * kNumCountStats);
  out_c[t * kNumCountStats + kNumel] = in.spans[t].numel;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> stats_of_inputs(const StatsInputs& in, at::ScalarType dtype,
                                                   double norm_type, bool moments) {
  const auto n = static_cast<int64_t>(in.spans.size());
  auto out_f = at::empty({n, kNumFloatStats}, at::TensorOptions().dtype(at::kDouble));
  auto out_c = at::empty({n, kNumCountStats}, at::TensorOptions().dtype(at::kLong));
  const ChunkArgs args{in.spans.data(), n, in.first_chunk.data(), dtype};
  const int64_t num_chunks = in.first_chunk.back();
  const PowMode mode = moments ? PowMode::kMoments : pow_mode_for(norm_type);
  const auto kern = kernels_for(active_cpu_capability());
  double* of = out_f.data_ptr<double>();
  int64_t* oc = out_c.data_ptr<int64_t>();
  // Chunks per thread such that each gets at least kMinBytesPerThread: a small set is one range
  // on the calling thread, and then the kernel writes every tensor's row itself.
  const int64_t grain = std::max<int64_t>(
      1, (num_chunks * kMinBytesPerThread + in.bytes - 1) / std::max<int64_t>(in.bytes, 1));
  if (num_chunks <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    kern.stats_tensors(args, mode, norm_type, 0, num_chunks, nullptr, nullptr, of, oc);
    return {out_f, out_c};
  }
  // One parallel region: the chunks are cut into blocks of about kBlockBytes, which the threads
  // take in turn from a shared counter (not one fixed range per thread: on a shared machine a
  // descheduled thread would hold the whole call up while the other idles). Each block writes
  // the rows of the tensors that lie in it, and the chunk partials of the (at most two) tensors
  // that cross its ends; those are combined here. The blocks do not depend on the thread count,
  // nor the results on the order the blocks are taken.
  auto part_f = at::empty({num_chunks, kNumFloatStats}, at::TensorOptions().dtype(partial_dtype(dtype)));
  auto part_c = at::empty({num_chunks, kNumCountStats}, at::TensorOptions().dtype(at::kLong));
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  const int64_t block = std::max<int64_t>(
      1, (num_chunks * kBlockBytes + in.bytes - 1) / std::max<int64_t>(in.bytes, 1));
  const int64_t num_blocks = (num_chunks + block - 1) / block;
  std::atomic<int64_t> next_block{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), num_blocks);
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next_block.fetch_add(1); b < num_blocks; b = next_block.fetch_add(1)) {
      kern.stats_tensors(args, mode, norm_type, b * block, std::min(num_chunks, (b + 1) * block), fp, cp, of, oc);
    }
  });
  std::vector<int64_t> range_ends;
  for (int64_t b = 1; b < num_blocks; ++b) range_ends.push_back(b * block);
  std::sort(range_ends.begin(), range_ends.end());
  int64_t last = -1;
  for (const int64_t e : range_ends) {
    const int64_t t = owner_of_chunk(in.first_chunk.data(), n, e);  // owns chunk e
    if (in.first_chunk[t] == e || t == last) continue;  // starts at e: not split
    last = t;
    if (dtype == at::kDouble) {
      finalize_tensor(in, t, static_cast<const double*>(fp), cp, mode, dtype, of, oc);
    } else {
      finalize_tensor(in, t, static_cast<const float*>(fp), cp, mode, dtype, of, oc);
    }
  }
  return {out_f, out_c};
}

namespace {

std::tuple<at::Tensor, at::Tensor> stats_rows_cpu(at::TensorList tensors, double norm_type,
                                                  bool moments, const char* op) {
  if (tensors.empty()) {
    return {at::empty({0, kNumFloatStats}, at::TensorOptions().dtype(at::kDouble)),
            at::empty({0, kNumCountStats}, at::TensorOptions().dtype(at::kLong))};
  }
  const StatsInputs in = read_stats_inputs(tensors, op);
  return stats_of_inputs(in, tensors[0].scalar_type(), norm_type, moments);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_cpu(at::TensorList tensors, double norm_type) {
  return stats_rows_cpu(tensors, norm_type, false, "gradfuse.multi_tensor_stats");
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_moments_cpu(at::TensorList tensors) {
  return stats_rows_cpu(tensors, 2.0, true, "gradfuse.multi_tensor_moments");
}

// check_group's checks in one pass that prefetches each TensorImpl a few tensors ahead (as
// read_stats_inputs does): on 10 000 tiny tensors each is a cache miss, and a conditional scale
// that touches nothing is this pass and a read of the coefficient. On a failure, check_group
// raises its error naming the tensor (its checks and these fail on the same tensors).
void check_scale_group(at::TensorList tensors, const char* op) {
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) return;
  const at::Tensor& first = tensors[0];
  const bool first_ok = first.defined() && is_supported_float(first.scalar_type()) &&
                        first.device().type() == c10::DeviceType::CPU;
  const auto dtype = first_ok ? first.scalar_type() : at::kFloat;
  const auto device = first_ok ? first.device() : c10::Device(c10::DeviceType::CPU);
  constexpr int64_t kAhead = 8;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const auto* impl = reinterpret_cast<const char*>(tensors[i + kAhead].unsafeGetTensorImpl());
      for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
        __builtin_prefetch(impl + offset);
      }
    }
    const at::Tensor& t = tensors[i];
    if (!first_ok || !t.defined() || t.layout() != at::kStrided || t.scalar_type() != dtype ||
        t.device() != device) {
      check_group(tensors, op, c10::DeviceType::CPU);
      TORCH_CHECK(false, op, ": tensors[", i, "] is not a dense ", dtype, " tensor on ", device);
    }
  }
}

void multi_tensor_scale_cpu(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  constexpr const char* kOp = "gradfuse.multi_tensor_scale_";
  check_scale_group(tensors, kOp);
  check_scale_coef(tensors, coef, kOp);
  const double c = coef.item<double>();
  if (tensors.empty() || (conditional && !needs_scaling(c))) return;  // no traffic when nothing to do

  // As scale_non_dense_ and DenseGroup, without a reference to each tensor: views that are not
  // one dense block are multiplied by ATen where they live, the others become the kernels' spans.
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  int64_t elems = 0;
  for (const auto& t : tensors) {
    if (t.is_non_overlapping_and_dense()) {
      spans.push_back({t.data_ptr(), t.numel()});
      elems += t.numel();
    } else {
      t.mul_(coef.to(t.scalar_type()));
    }
  }
  if (spans.empty()) return;
  const ChunkPlan plan = make_chunk_plan(spans);
  const auto dtype = tensors[0].scalar_type();
  const ChunkArgs args{spans.data(), static_cast<int64_t>(spans.size()), plan.first_chunk.data(), dtype};
  const auto kern = kernels_for(active_cpu_capability());
  const int64_t num_chunks = plan.num_chunks();
  // Chunks per thread such that each reads and writes at least kMinBytesPerThread: a small set is
  // scaled on the calling thread. Each element's result does not depend on the split.
  const int64_t bytes = 2 * elems * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t grain = std::max<int64_t>(
      1, (num_chunks * kMinBytesPerThread + bytes - 1) / std::max<int64_t>(bytes, 1));
  if (num_chunks <= grain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    kern.scale(args, c, 0, num_chunks);
    return;
  }
  at::parallel_for(0, num_chunks, grain, [&](int64_t begin, int64_t end) {
    kern.scale(args, c, begin, end);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cpu);
  m.impl("multi_tensor_moments", &multi_tensor_moments_cpu);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cpu);
}

}  // namespace gradfuse::cpu
