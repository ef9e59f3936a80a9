// CUDA implementations of gradfuse::multi_tensor_stats and gradfuse::multi_tensor_scale_.
//
// One launch covers up to kMaxTensorsPerLaunch tensors, whatever their sizes: their addresses,
// sizes and chunk ids travel in the kernel argument (CUDA >= 12.1 allows 32 KB), each block
// finds its (tensor, chunk) by binary search over that table (chunk_plan.h, shared with the CPU).
// Statistics are reduced in two stages with no float atomics, so results are bitwise stable:
// one block per chunk writes a partial row, then one warp per tensor combines that tensor's rows
// in chunk order, in double. Nothing here waits for the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/chunk_plan.h"
#include "../common/op_checks.h"
#include "../common/stats_math.h"

namespace gradfuse::cuda {
namespace {

constexpr int kStatsThreads = 256;
constexpr int kFinalizeWarps = 4;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
// 3 x 8 bytes per tensor + header: 30 KB of the 32 KB kernel-argument space.
constexpr int kMaxTensorsPerLaunch = 1280;

struct LaunchTable {
  int64_t num_tensors;
  void* data[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t first_chunk[kMaxTensorsPerLaunch + 1];  // global chunk ids (ChunkPlan)
};
static_assert(sizeof(LaunchTable) <= 32000, "LaunchTable must fit the 32 KB kernel argument");

template <typename scalar_t>
using acc_of = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

struct ChunkRef {
  int64_t tensor;  // index in the table
  int64_t offset;  // first element of the chunk
  int64_t n;       // elements in the chunk
};

__device__ inline ChunkRef locate_chunk(const LaunchTable& table) {
  const int64_t chunk = table.first_chunk[0] + blockIdx.x;
  const int64_t t = owner_of_chunk(table.first_chunk, table.num_tensors, chunk);
  const int64_t offset = (chunk - table.first_chunk[t]) * kChunkElems;
  return {t, offset, ::min(kChunkElems, table.numel[t] - offset)};
}

template <typename acc_t>
__device__ inline StatsAcc<acc_t> shfl_down(const StatsAcc<acc_t>& s, int delta) {
  StatsAcc<acc_t> o;
  o.sum = __shfl_down_sync(0xffffffffu, s.sum, delta);
  o.sumsq = __shfl_down_sync(0xffffffffu, s.sumsq, delta);
  o.maxabs = __shfl_down_sync(0xffffffffu, s.maxabs, delta);
  o.powsum = __shfl_down_sync(0xffffffffu, s.powsum, delta);
  o.nan = __shfl_down_sync(0xffffffffu, s.nan, delta);
  o.inf = __shfl_down_sync(0xffffffffu, s.inf, delta);
  o.zero = __shfl_down_sync(0xffffffffu, s.zero, delta);
  return o;
}

// Fixed-shape tree over the warp: lane 0 ends with the result, the same every run.
template <typename acc_t>
__device__ inline void warp_reduce(StatsAcc<acc_t>& s) {
#pragma unroll
  for (int delta = 16; delta > 0; delta /= 2) s.combine(shfl_down(s, delta));
}

template <typename scalar_t, PowMode mode>
__global__ void __launch_bounds__(kStatsThreads)
stats_kernel(const __grid_constant__ LaunchTable table, acc_of<scalar_t> p,
             acc_of<scalar_t>* __restrict__ part_f, int64_t* __restrict__ part_c) {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const ChunkRef ref = locate_chunk(table);
  const scalar_t* __restrict__ x = static_cast<const scalar_t*>(table.data[ref.tensor]) + ref.offset;
  StatsAcc<acc_t> s;
  int64_t i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    // Aligned fast path: kUnroll independent 16-byte loads per thread, then the arithmetic.
    const P* xp = reinterpret_cast<const P*>(x);
    const int64_t packs = ref.n / P::kSize;
    constexpr int64_t kStride = int64_t(kStatsThreads) * kUnroll;
    int64_t base = 0;
    for (; base + kStride <= packs; base += kStride) {
      P buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = xp[base + u * kStatsThreads + threadIdx.x];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) s.template add<mode>(static_cast<acc_t>(buf[u].v[k]), p);
      }
    }
    for (int64_t j = base + threadIdx.x; j < packs; j += kStatsThreads) {
      const P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) s.template add<mode>(static_cast<acc_t>(v.v[k]), p);
    }
    i = packs * P::kSize;
  }
  // Misaligned views and tails, element by element.
  for (int64_t j = i + threadIdx.x; j < ref.n; j += kStatsThreads) {
    s.template add<mode>(static_cast<acc_t>(x[j]), p);
  }

  warp_reduce(s);
  __shared__ acc_t warp_f[kStatsThreads / 32][kNumFloatStats];
  __shared__ int64_t warp_c[kStatsThreads / 32][kNumCountStats];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) s.store(warp_f[warp], warp_c[warp]);
  __syncthreads();
  if (threadIdx.x == 0) {
    StatsAcc<acc_t> total = StatsAcc<acc_t>::load(warp_f[0], warp_c[0]);
    for (int w = 1; w < kStatsThreads / 32; ++w) total.combine(StatsAcc<acc_t>::load(warp_f[w], warp_c[w]));
    const int64_t chunk = table.first_chunk[0] + blockIdx.x;
    total.store(part_f + chunk * kNumFloatStats, part_c + chunk * kNumCountStats);
  }
}

// One warp per tensor of the table: lane l takes chunks l, l+32, ... in order, then a fixed tree.
template <typename acc_t>
__global__ void __launch_bounds__(kFinalizeWarps * 32)
finalize_kernel(const __grid_constant__ LaunchTable table, int64_t tensor_base,
                const acc_t* __restrict__ part_f, const int64_t* __restrict__ part_c,
                double* __restrict__ out_f, int64_t* __restrict__ out_c) {
  const int64_t t = int64_t(blockIdx.x) * kFinalizeWarps + threadIdx.x / 32;
  if (t >= table.num_tensors) return;
  const int lane = threadIdx.x % 32;
  StatsAcc<double> s;
  for (int64_t c = table.first_chunk[t] + lane; c < table.first_chunk[t + 1]; c += 32) {
    s.combine(StatsAcc<acc_t>::load(part_f + c * kNumFloatStats, part_c + c * kNumCountStats));
  }
  warp_reduce(s);
  if (lane == 0) {
    const int64_t row = tensor_base + t;
    s.store(out_f + row * kNumFloatStats, out_c + row * kNumCountStats);
    out_c[row * kNumCountStats + kNumel] = table.numel[t];
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kStatsThreads)
scale_kernel(const __grid_constant__ LaunchTable table, const acc_of<scalar_t>* __restrict__ coef_ptr,
             bool conditional) {
  using acc_t = acc_of<scalar_t>;
  using P = Pack<scalar_t>;
  const acc_t coef = *coef_ptr;
  if (conditional && !needs_scaling(coef)) return;  // decided on the device: no traffic on unclipped steps
  const ChunkRef ref = locate_chunk(table);
  scalar_t* __restrict__ x = static_cast<scalar_t*>(table.data[ref.tensor]) + ref.offset;
  int64_t i = 0;
  if (reinterpret_cast<uintptr_t>(x) % sizeof(P) == 0) {
    P* xp = reinterpret_cast<P*>(x);
    const int64_t packs = ref.n / P::kSize;
    for (int64_t j = threadIdx.x; j < packs; j += kStatsThreads) {
      P v = xp[j];
#pragma unroll
      for (int k = 0; k < P::kSize; ++k) v.v[k] = scale_element<scalar_t, acc_t>(v.v[k], coef);
      xp[j] = v;
    }
    i = packs * P::kSize;
  }
  for (int64_t j = i + threadIdx.x; j < ref.n; j += kStatsThreads) x[j] = scale_element<scalar_t, acc_t>(x[j], coef);
}

// Splits the dense tensors into launch tables of at most kMaxTensorsPerLaunch tensors each and
// calls launch(table, first tensor index, chunks in the table) for each table with work in it.
template <typename F>
void for_each_table(const std::vector<at::Tensor>& dense, const ChunkPlan& plan, F&& launch) {
  const int64_t n = static_cast<int64_t>(dense.size());
  for (int64_t base = 0; base < n; base += kMaxTensorsPerLaunch) {
    LaunchTable table;
    table.num_tensors = std::min<int64_t>(kMaxTensorsPerLaunch, n - base);
    for (int64_t k = 0; k < table.num_tensors; ++k) {
      table.data[k] = span_start(dense[base + k]);
      table.numel[k] = dense[base + k].numel();
      table.first_chunk[k] = plan.first_chunk[base + k];
    }
    table.first_chunk[table.num_tensors] = plan.first_chunk[base + table.num_tensors];
    const int64_t chunks = table.first_chunk[table.num_tensors] - table.first_chunk[0];
    launch(table, base, chunks);
  }
}

template <typename scalar_t>
void launch_stats(const std::vector<at::Tensor>& dense, const ChunkPlan& plan, PowMode mode,
                  double p, at::Tensor& part_f, at::Tensor& part_c, at::Tensor& out_f,
                  at::Tensor& out_c, cudaStream_t stream) {
  using acc_t = acc_of<scalar_t>;
  for_each_table(dense, plan, [&](const LaunchTable& table, int64_t base, int64_t chunks) {
    if (chunks > 0) {
      const auto grid = static_cast<unsigned>(chunks);
      auto* pf = part_f.data_ptr<acc_t>();
      auto* pc = part_c.data_ptr<int64_t>();
      switch (mode) {
        case PowMode::kNone: stats_kernel<scalar_t, PowMode::kNone><<<grid, kStatsThreads, 0, stream>>>(table, acc_t(p), pf, pc); break;
        case PowMode::kAbs: stats_kernel<scalar_t, PowMode::kAbs><<<grid, kStatsThreads, 0, stream>>>(table, acc_t(p), pf, pc); break;
        case PowMode::kPow: stats_kernel<scalar_t, PowMode::kPow><<<grid, kStatsThreads, 0, stream>>>(table, acc_t(p), pf, pc); break;
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    // Tensors without elements still get their (zero) row from the finalise step.
    const auto blocks = static_cast<unsigned>((table.num_tensors + kFinalizeWarps - 1) / kFinalizeWarps);
    finalize_kernel<acc_t><<<blocks, kFinalizeWarps * 32, 0, stream>>>(
        table, base, part_f.data_ptr<acc_t>(), part_c.data_ptr<int64_t>(),
        out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
void launch_scale(const std::vector<at::Tensor>& dense, const ChunkPlan& plan,
                  const at::Tensor& coef, bool conditional, cudaStream_t stream) {
  using acc_t = acc_of<scalar_t>;
  for_each_table(dense, plan, [&](const LaunchTable& table, int64_t, int64_t chunks) {
    if (chunks == 0) return;
    scale_kernel<scalar_t><<<static_cast<unsigned>(chunks), kStatsThreads, 0, stream>>>(
        table, coef.data_ptr<acc_t>(), conditional);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kDouble: return f(double{});
    case at::kHalf: return f(c10::Half{});
    case at::kBFloat16: return f(c10::BFloat16{});
    default: TORCH_CHECK(false, "gradfuse: unsupported dtype ", t);
  }
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_stats_cuda(at::TensorList tensors, double norm_type) {
  check_group(tensors, "gradfuse.multi_tensor_stats", c10::DeviceType::CUDA);
  const auto n = static_cast<int64_t>(tensors.size());
  if (n == 0) {
    return {at::empty({0, kNumFloatStats}, at::dtype(at::kDouble)), at::empty({0, kNumCountStats}, at::dtype(at::kLong))};
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const auto opts = tensors[0].options();
  std::vector<at::Tensor> dense;
  dense.reserve(n);
  for (const auto& t : tensors) dense.push_back(as_dense(t));
  const ChunkPlan plan = make_chunk_plan(numels_of(dense));
  const auto dtype = tensors[0].scalar_type();
  auto part_f = at::empty({std::max<int64_t>(plan.num_chunks(), 1), kNumFloatStats}, opts.dtype(partial_dtype(dtype)));
  auto part_c = at::empty({std::max<int64_t>(plan.num_chunks(), 1), kNumCountStats}, opts.dtype(at::kLong));
  auto out_f = at::empty({n, kNumFloatStats}, opts.dtype(at::kDouble));
  auto out_c = at::empty({n, kNumCountStats}, opts.dtype(at::kLong));
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch_float(dtype, [&](auto tag) {
    launch_stats<decltype(tag)>(dense, plan, pow_mode_for(norm_type), norm_type, part_f, part_c, out_f, out_c, stream);
  });
  return {out_f, out_c};
}

void multi_tensor_scale_cuda(at::TensorList tensors, const at::Tensor& coef, bool conditional) {
  check_group(tensors, "gradfuse.multi_tensor_scale_", c10::DeviceType::CUDA);
  if (tensors.empty()) return;
  TORCH_CHECK(coef.numel() == 1 && coef.device() == tensors[0].device(),
              "gradfuse.multi_tensor_scale_: coef must be a one-element tensor on ",
              tensors[0].device(), ", got shape ", coef.sizes(), " on ", coef.device());
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const auto dtype = tensors[0].scalar_type();
  const auto coef_acc = coef.reshape({}).to(partial_dtype(dtype));  // no-op when it matches
  std::vector<at::Tensor> dense;
  for (const auto& t : tensors) {
    if (t.is_non_overlapping_and_dense()) {
      dense.push_back(t);
    } else {
      // Deciding would need the host; multiplying by min(coef, 1) is exact when coef >= 1.
      t.mul_((conditional ? at::clamp_max(coef_acc, 1.0) : coef_acc).to(dtype));
    }
  }
  if (dense.empty()) return;
  const ChunkPlan plan = make_chunk_plan(numels_of(dense));
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  dispatch_float(dtype, [&](auto tag) {
    launch_scale<decltype(tag)>(dense, plan, coef_acc, conditional, stream);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradfuse, CUDA, m) {
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cuda);
}

}  // namespace gradfuse::cuda
