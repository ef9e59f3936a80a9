// CPU implementation of gradfuse::multi_tensor_exponent_histogram: the two passes of
// common/hist_math.h over the chunk plan of the statistics (common/chunk_plan.h); each worker sums
// its chunks' histograms per tensor and adds them to the tensor's row when it moves on (integer
// counts: the result does not depend on the thread count or the schedule; no partial row per
// chunk, which for GPT-2 small's gradients was 2.3 MB at each call).
//
// Pass 1 is one load, a shift, an AND and an increment per element. Its cost is the increment:
// consecutive elements mostly share a few rows (gradients span ~10 binary exponents, and a
// constant tensor only one), so a single histogram would chain each increment on the store of
// the previous one to the same counter (store-to-load forwarding, ~5 cycles). Four histograms
// taken in turn break the chain; they are summed at the end of the chunk. (No SIMD: AVX2 has no
// scatter, and the row arithmetic is 2 of the ~4 instructions per element.) This loop is the
// "default" CPU capability's; on AVX2 CPUs hist_avx2.cpp counts the few hot exponent fields in
// vector registers instead (benchmarks/RESULTS.md), for float32 / bfloat16 / float16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/chunk_plan.h"
#include "../common/hist_math.h"
#include "../common/engine.h"
#include "cpu_capability.h"
#include "hist_kernels.h"

namespace gradfuse::cpu {
namespace {

constexpr int kWays = 8;

template <typename L>
inline typename L::Bits load_bits(const char* p, int64_t i) {
  typename L::Bits b;
  std::memcpy(&b, p + i * static_cast<int64_t>(sizeof(b)), sizeof(b));
  return b;
}

// Counts x[0, n) (n <= kChunkElems) into out[kNumHistBins].
template <typename L>
void histogram_chunk(const char* x, int64_t n, int32_t* out) {
  alignas(64) int32_t h[kWays][kNumHistBins];
  std::memset(h, 0, sizeof(h));
  int64_t i = 0;
  for (; i + kWays <= n; i += kWays) {
#pragma GCC unroll 8
    for (int w = 0; w < kWays; ++w) ++h[w][hot_row<L>(load_bits<L>(x, i + w))];
  }
  for (; i < n; ++i) ++h[0][hot_row<L>(load_bits<L>(x, i))];
  for (int b = 0; b < kNumHistBins; ++b) { int32_t s = 0; for (int w = 0; w < kWays; ++w) s += h[w][b]; out[b] = s; }
  // Pass 2: zeros, subnormals, Inf and NaN (and for float64 whatever lies outside the bins'
  // exponents) get their exact bins. The chunk was just read: it comes from the cache.
  if (out[L::kLowRow] != 0 || out[L::kHighRow] != 0) {
    for (int64_t j = 0; j < n; ++j) {
      const auto bits = load_bits<L>(x, j);
      const int row = hot_row<L>(bits);
      if (needs_exact_bin<L>(row)) {
        --out[row];
        ++out[exponent_bin<L>(bits)];
      }
    }
  }
}

// The AVX2 kernel of layout L where there is one (float64 has none): false otherwise.
template <typename L>
bool histogram_chunk_avx2(const char* x, int64_t n, int32_t* out, HistHotFields* hot) {
#ifdef GRADFUSE_HAVE_AVX2_HISTOGRAM
  if constexpr (std::is_same_v<L, Fp32Layout>) return histogram_chunk_avx2_fp32(x, n, out, hot), true;
  if constexpr (std::is_same_v<L, Bf16Layout>) return histogram_chunk_avx2_bf16(x, n, out, hot), true;
  if constexpr (std::is_same_v<L, Fp16Layout>) return histogram_chunk_avx2_fp16(x, n, out, hot), true;
#endif
  return false;
}

// Adds a worker's counts of one tensor to its row of the result (other workers may add theirs).
inline void add_to_row(const int64_t* counts, int64_t* row) {
  for (int b = 0; b < kNumHistBins; ++b) {
    if (counts[b] != 0) std::atomic_ref<int64_t>(row[b]).fetch_add(counts[b], std::memory_order_relaxed);
  }
}

template <typename L>
void histogram_chunks(const DenseGroup& group, int64_t begin, int64_t end, int64_t* rows, bool avx2) {
  HistHotFields hot;  // carried from chunk to chunk of this worker
  const auto& first = group.plan.first_chunk;
  const int64_t num_tensors = static_cast<int64_t>(group.spans.size());
  int64_t t = owner_of_chunk(first.data(), num_tensors, begin);
  alignas(64) int32_t chunk[kNumHistBins];
  alignas(64) int64_t tensor[kNumHistBins] = {};  // this worker's counts of tensor t so far
  for (int64_t c = begin; c < end; ++c) {
    if (first[t + 1] <= c) {
      add_to_row(tensor, rows + t * kNumHistBins);
      std::fill(tensor, tensor + kNumHistBins, int64_t{0});
      while (first[t + 1] <= c) ++t;
    }
    const int64_t offset = (c - first[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, group.spans[t].numel - offset);
    const char* x = static_cast<const char*>(group.spans[t].data) +
                    offset * static_cast<int64_t>(sizeof(typename L::Bits));
    if (!(avx2 && histogram_chunk_avx2<L>(x, n, chunk, &hot))) histogram_chunk<L>(x, n, chunk);
    for (int b = 0; b < kNumHistBins; ++b) tensor[b] += chunk[b];
  }
  if (begin < end) add_to_row(tensor, rows + t * kNumHistBins);
}

at::Tensor multi_tensor_exponent_histogram_cpu(at::TensorList tensors) {
  constexpr const char* kOp = "gradfuse.multi_tensor_exponent_histogram";
  check_group(tensors, kOp, c10::DeviceType::CPU);
  const auto n = static_cast<int64_t>(tensors.size());
  auto out = at::zeros({n, kNumHistBins}, at::TensorOptions().dtype(at::kLong));
  if (n == 0) return out;
  const DenseGroup group(tensors);
  const int64_t num_chunks = group.plan.num_chunks();
  int64_t* rows = out.data_ptr<int64_t>();
  const auto dtype = tensors[0].scalar_type();
  const bool avx2 = active_cpu_capability() == "avx2";
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    switch (dtype) {
      case at::kHalf: return histogram_chunks<Fp16Layout>(group, begin, end, rows, avx2);
      case at::kBFloat16: return histogram_chunks<Bf16Layout>(group, begin, end, rows, avx2);
      case at::kFloat: return histogram_chunks<Fp32Layout>(group, begin, end, rows, avx2);
      case at::kDouble: return histogram_chunks<Fp64Layout>(group, begin, end, rows, avx2);
      default: break;  // checked above
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_exponent_histogram", &multi_tensor_exponent_histogram_cpu);
}

}  // namespace gradfuse::cpu
