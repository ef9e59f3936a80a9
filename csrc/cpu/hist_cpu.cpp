// CPU implementation of gradfuse::multi_tensor_exponent_histogram: the two passes of
// common/hist_math.h over the chunk plan of the statistics (common/chunk_plan.h), one partial
// histogram per chunk, combined per tensor in chunk order (integer counts: the result does not
// depend on the thread count or the schedule).
//
// Pass 1 is one load, a shift, an AND and an increment per element. Its cost is the increment:
// consecutive elements mostly share a few rows (gradients span ~10 binary exponents, and a
// constant tensor only one), so a single histogram would chain each increment on the store of
// the previous one to the same counter (store-to-load forwarding, ~5 cycles). Four histograms
// taken in turn break the chain; they are summed at the end of the chunk. That is the default
// build's loop (and float64's).
//
// The AVX2 loop (float32, bfloat16, float16; issue 19's bandwidth target) halves the increments:
// it counts PAIRS of exponent fields. One vector step turns 16 elements into 8 indices
// field(a) | field(b) << 8 (shifts, ANDs and an OR on 32-bit lanes: for 16-bit dtypes a and b
// are the two halves of a lane, for float32 lane k of two consecutive vectors), stored to a small
// buffer; a scalar loop then does one 16-bit increment per index in a 256 x 256 pair table (four
// copies taken in turn, as above). At the end of the chunk the table's used square
// [lo, hi] x [lo, hi] (lo, hi: the smallest and largest field seen, a byte-wise min / max of the
// indices) is folded into the chunk's rows, each pair counting once for field(a) and once for
// field(b), and set back to zero, so the table (per thread, zero between chunks) costs
// (hi - lo + 1)^2 reads per chunk, not 65 536. Counts stay exact: at most 32 768 pairs per chunk
// fit a 16-bit counter. Pass 2 is unchanged.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define GRADFUSE_HIST_AVX2 1
#endif

#include "../common/chunk_plan.h"
#include "../common/hist_math.h"
#include "../common/op_checks.h"
#include "cpu_capability.h"

namespace gradfuse::cpu {
namespace {

constexpr int kWays = 8;

template <typename L>
inline typename L::Bits load_bits(const char* p, int64_t i) {
  typename L::Bits b;
  std::memcpy(&b, p + i * static_cast<int64_t>(sizeof(b)), sizeof(b));
  return b;
}

template <typename L>
void exact_bins(const char* x, int64_t n, int32_t* out);

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
  exact_bins<L>(x, n, out);
}

// Pass 2: zeros, subnormals, Inf and NaN (and for float64 whatever lies outside the bins'
// exponents) get their exact bins. The chunk was just read: it comes from the cache.
template <typename L>
void exact_bins(const char* x, int64_t n, int32_t* out) {
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

#if defined(GRADFUSE_HIST_AVX2)
// The pair-counting loop (see the header comment).
constexpr int kPairWays = 4;
constexpr int64_t kPairEntries = 1 << 16;  // index field(a) | field(b) << 8
constexpr int kPairBatch = 16;             // vector steps (of 8 indices) per batch of increments

// This thread's pair tables, all zero between chunks.
inline uint16_t* pair_table() {
  thread_local std::unique_ptr<uint16_t[]> table(new uint16_t[kPairWays * kPairEntries]());
  return table.get();
}

// The 8 pair indices of 16 elements at p.
template <typename L>
__attribute__((target("avx2"))) inline __m256i pair_indices(const char* p) {
  using B = typename L::Bits;
  static_assert(L::kExponentBits <= 8, "a field must fit a byte");
  const __m256i lo_mask = _mm256_set1_epi32(L::kMaxField), hi_mask = _mm256_set1_epi32(L::kMaxField << 8);
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (sizeof(B) == 2) {  // a 32-bit lane: element a in bits 0..15, b in 16..31
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v0, L::kMantissaBits), lo_mask),
                           _mm256_and_si256(_mm256_srli_epi32(v0, L::kMantissaBits + 8), hi_mask));
  } else {  // lane k of the two vectors
    static_assert(sizeof(B) == 4 && L::kMantissaBits > 8, "");
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v0, L::kMantissaBits), lo_mask),
                           _mm256_and_si256(_mm256_srli_epi32(v1, L::kMantissaBits - 8), hi_mask));
  }
}

// Pass 1 of x[0, n) into out (zeroed by the caller) through the pair table t.
template <typename L>
__attribute__((target("avx2"))) void pair_count_chunk(const char* x, int64_t n, int32_t* out, uint16_t* t) {
  using B = typename L::Bits;
  static_assert(!L::kClamp, "");
  constexpr int64_t kStep = 16;  // elements per vector step
  alignas(32) uint32_t idx[8 * kPairBatch];
  alignas(32) uint16_t idx16[8 * kPairBatch];
  __m256i vmin = _mm256_set1_epi32(-1), vmax = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + kStep * kPairBatch <= n; i += kStep * kPairBatch) {
    // Two steps' indices packed to 16 bits (in another order, which counting ignores): one
    // 64-bit load then gives four of them.
#pragma GCC unroll 2
    for (int g = 0; g < kPairBatch; g += 2) {
      const __m256i v0 = pair_indices<L>(x + (i + g * kStep) * static_cast<int64_t>(sizeof(B)));
      const __m256i v1 = pair_indices<L>(x + (i + (g + 1) * kStep) * static_cast<int64_t>(sizeof(B)));
      vmin = _mm256_min_epu8(vmin, _mm256_min_epu8(v0, v1));
      vmax = _mm256_max_epu8(vmax, _mm256_max_epu8(v0, v1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(idx16 + 8 * g), _mm256_packus_epi32(v0, v1));
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8 * kPairBatch; k += kPairWays) {
      uint64_t q;
      std::memcpy(&q, idx16 + k, sizeof(q));
      ++t[q & 0xffff];
      ++t[kPairEntries + ((q >> 16) & 0xffff)];
      ++t[2 * kPairEntries + ((q >> 32) & 0xffff)];
      ++t[3 * kPairEntries + (q >> 48)];
    }
  }
  for (; i + kStep <= n; i += kStep) {
    const __m256i v = pair_indices<L>(x + i * static_cast<int64_t>(sizeof(B)));
    vmin = _mm256_min_epu8(vmin, v);
    vmax = _mm256_max_epu8(vmax, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), v);
    for (int k = 0; k < 8; k += kPairWays) {
      ++t[idx[k]];
      ++t[kPairEntries + idx[k + 1]];
      ++t[2 * kPairEntries + idx[k + 2]];
      ++t[3 * kPairEntries + idx[k + 3]];
    }
  }
  for (; i < n; ++i) ++out[hot_row<L>(load_bits<L>(x, i))];
  if (n < kStep) return;  // the table was not used
  // The fields seen: bytes 0 and 1 of every lane (bytes 2 and 3 are 0 and left out).
  alignas(32) uint8_t bmin[32], bmax[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bmin), vmin);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bmax), vmax);
  int lo = 255, hi = 0;
  for (int k = 0; k < 32; k += 4) {
    lo = std::min({lo, static_cast<int>(bmin[k]), static_cast<int>(bmin[k + 1])});
    hi = std::max({hi, static_cast<int>(bmax[k]), static_cast<int>(bmax[k + 1])});
  }
  uint32_t first[256];  // counts of field(a) = f, summed over field(b)
  std::memset(first, 0, sizeof(first));
  for (int b = lo; b <= hi; ++b) {
    uint16_t* r0 = t + (b << 8);
    uint16_t* r1 = r0 + kPairEntries;
    uint16_t* r2 = r1 + kPairEntries;
    uint16_t* r3 = r2 + kPairEntries;
    uint32_t second = 0;
    for (int a = lo; a <= hi; ++a) {
      const uint32_t c = static_cast<uint32_t>(r0[a]) + r1[a] + r2[a] + r3[a];
      second += c;
      first[a] += c;
    }
    const size_t len = static_cast<size_t>(hi - lo + 1) * sizeof(uint16_t);
    std::memset(r0 + lo, 0, len);
    std::memset(r1 + lo, 0, len);
    std::memset(r2 + lo, 0, len);
    std::memset(r3 + lo, 0, len);
    out[b + L::kRowOffset] += static_cast<int32_t>(second);
  }
  for (int a = lo; a <= hi; ++a) out[a + L::kRowOffset] += static_cast<int32_t>(first[a]);
}

// Both passes over one chunk, pass 1 by pair counting.
template <typename L>
void histogram_chunk_pairs(const char* x, int64_t n, int32_t* out) {
  std::memset(out, 0, kNumHistBins * sizeof(int32_t));
  pair_count_chunk<L>(x, n, out, pair_table());
  exact_bins<L>(x, n, out);
}
#endif

template <typename L, bool kPairs>
void histogram_chunks(const DenseGroup& group, int64_t begin, int64_t end, int32_t* partials) {
  const auto& first = group.plan.first_chunk;
  const int64_t num_tensors = static_cast<int64_t>(group.spans.size());
  int64_t t = owner_of_chunk(first.data(), num_tensors, begin);
  for (int64_t c = begin; c < end; ++c) {
    while (first[t + 1] <= c) ++t;
    const int64_t offset = (c - first[t]) * kChunkElems;
    const int64_t n = std::min(kChunkElems, group.spans[t].numel - offset);
    const char* x = static_cast<const char*>(group.spans[t].data) +
                    offset * static_cast<int64_t>(sizeof(typename L::Bits));
#if defined(GRADFUSE_HIST_AVX2)
    if constexpr (kPairs) {
      histogram_chunk_pairs<L>(x, n, partials + c * kNumHistBins);
      continue;
    }
#endif
    histogram_chunk<L>(x, n, partials + c * kNumHistBins);
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
  const bool pairs = active_cpu_capability() == "avx2";  // the AVX2 pair loop (not float64)
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    switch (dtype) {
      case at::kHalf:
        return pairs ? histogram_chunks<Fp16Layout, true>(group, begin, end, part)
                     : histogram_chunks<Fp16Layout, false>(group, begin, end, part);
      case at::kBFloat16:
        return pairs ? histogram_chunks<Bf16Layout, true>(group, begin, end, part)
                     : histogram_chunks<Bf16Layout, false>(group, begin, end, part);
      case at::kFloat:
        return pairs ? histogram_chunks<Fp32Layout, true>(group, begin, end, part)
                     : histogram_chunks<Fp32Layout, false>(group, begin, end, part);
      case at::kDouble: return histogram_chunks<Fp64Layout, false>(group, begin, end, part);
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
