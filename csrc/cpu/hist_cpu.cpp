// CPU implementation of gradfuse::multi_tensor_exponent_histogram: the two passes of
// common/hist_math.h over the chunk plan of the statistics (common/chunk_plan.h), one partial
// histogram per chunk, combined per tensor in chunk order (integer counts: the result does not
// depend on the thread count or the schedule).
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

template <typename L>
void histogram_chunks(const DenseGroup& group, int64_t begin, int64_t end, int32_t* partials,
                      bool avx2) {
  HistHotFields hot;  // carried from chunk to chunk of this worker
  const auto& first = group.plan.first_chunk;
  const int64_t num_tensors = static_cast<int64_t>(group.spans.size());
  int64_t t = owner_of_chunk(first.data(), num_tensors, begin);
  for (int64_t c = begin; c < end; ++c) {
    while (first[t + 1] <= c) ++t;
    const int64_t offset = (c - first[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, group.spans[t].numel - offset);
    const char* x = static_cast<const char*>(group.spans[t].data) +
                    offset * static_cast<int64_t>(sizeof(typename L::Bits));
    int32_t* out = partials + c * kNumHistBins;
    if (!(avx2 && histogram_chunk_avx2<L>(x, n, out, &hot))) histogram_chunk<L>(x, n, out);
  }
}

at::Tensor multi_tensor_exponent_histogram_cpu(at::TensorList tensors) {
  constexpr const char* kOp = "gradfuse.multi_tensor_exponent_histogram";
  check_group(tensors, kOp, c10::DeviceType::CPU);
  const auto n = static_cast<int64_t>(tensors.size());
  auto out = at::zeros({n, kNumHistBins}, at::TensorOptions().dtype(at::kLong));
  if (n == 0) return out;
  const DenseGroup group(tensors);
  const int64_t num_chunks = group.plan.num_chunks();
  auto partials = at::empty({std::max<int64_t>(num_chunks, 1), kNumHistBins}, at::TensorOptions().dtype(at::kInt));
  int32_t* part = partials.data_ptr<int32_t>();
  const auto dtype = tensors[0].scalar_type();
  const bool avx2 = active_cpu_capability() == "avx2";
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    switch (dtype) {
      case at::kHalf: return histogram_chunks<Fp16Layout>(group, begin, end, part, avx2);
      case at::kBFloat16: return histogram_chunks<Bf16Layout>(group, begin, end, part, avx2);
      case at::kFloat: return histogram_chunks<Fp32Layout>(group, begin, end, part, avx2);
      case at::kDouble: return histogram_chunks<Fp64Layout>(group, begin, end, part, avx2);
      default: break;  // checked above
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  const auto& first = group.plan.first_chunk;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t* row = o + t * kNumHistBins;
      for (int64_t c = first[t]; c < first[t + 1]; ++c) {  // in chunk order
        const int32_t* p = part + c * kNumHistBins;
        for (int b = 0; b < kNumHistBins; ++b) row[b] += p[b];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_exponent_histogram", &multi_tensor_exponent_histogram_cpu);
}

}  // namespace gradfuse::cpu
