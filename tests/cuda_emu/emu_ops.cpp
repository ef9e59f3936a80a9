// The emulated CUDA backend, for tests: torch.ops.gradfuse_emu.* take CPU tensors and run the ops'
// glue (csrc/cuda/ops.h) and the real kernels (csrc/cuda/*_ops.cuh, csrc/cuda/multi_tensor.cuh)
// through the CUDA emulation of cuda_emu.h. Built on demand by the tests
// (tests/cuda_emu/__init__.py), with csrc/ (or a planted-bug copy of it) on the include path.
//
// gradfuse_emu.selftest(name) runs small kernels that check the emulator itself: the semantics of
// shuffles, votes, barriers and atomics, and that divergent warp operations, deadlocks and invalid
// launches are reported instead of hanging.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cuda_emu.h"

#define GRADFUSE_LAUNCH(kernel, grid, block, stream, ...) ::cuda_emu::launch(kernel, grid, block, __VA_ARGS__)
#include "cuda/ops.h"

namespace gradfuse::cuda {
namespace {

struct Emulated {
  static constexpr c10::DeviceType kType = c10::DeviceType::CPU;
  static constexpr const char* kStatsOp = "gradfuse_emu.multi_tensor_stats";
  static constexpr const char* kMomentsOp = "gradfuse_emu.multi_tensor_moments";
  static constexpr const char* kScaleOp = "gradfuse_emu.multi_tensor_scale_";
  static constexpr const char* kUnitStatsOp = "gradfuse_emu.multi_tensor_unit_stats";
  static constexpr const char* kUnitScaleOp = "gradfuse_emu.multi_tensor_unit_scale_";
  static constexpr const char* kClampOp = "gradfuse_emu.multi_tensor_clamp_";
  static constexpr const char* kHistOp = "gradfuse_emu.multi_tensor_exponent_histogram";
  static constexpr const char* kUpdateStatsOp = "gradfuse_emu.multi_tensor_update_stats";
  static constexpr const char* kUpdateClipOp = "gradfuse_emu.multi_tensor_update_clip_";
  static constexpr const char* kStepOp = "gradfuse_emu.multi_tensor_optim_step_";
  struct Guard {
    explicit Guard(c10::Device) {}
  };
  static int stream() { return 0; }  // launches run to completion in order
  // Where the GPU leaves uninitialised memory: NaN and a recognisable count.
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
    if (opts.dtype() == at::kLong) return at::full(sizes, int64_t{0x7a7a7a7a7a7a7a7a}, opts);
    return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), opts);
  }
};

}  // namespace
}  // namespace gradfuse::cuda

namespace selftest {

constexpr int kCols = 10;

// Every warp operation the emulator offers, checked against CUDA's definitions by the tests.
__global__ void warp_ops(int64_t* out) {
  const int t = threadIdx.x, lane = t % 32;
  int64_t* row = out + (blockIdx.x * blockDim.x + t) * kCols;
  row[0] = __shfl_sync(0xffffffffu, t, (lane * 7) % 32);
  row[1] = __shfl_up_sync(0xffffffffu, t, 3);
  row[2] = __shfl_down_sync(0xffffffffu, t, 5);
  row[3] = __shfl_xor_sync(0xffffffffu, t, 9);
  row[4] = __shfl_down_sync(0xffffffffu, t, 5, 8);
  row[5] = __shfl_xor_sync(0xffffffffu, int64_t{t} << 40, 1, 16) >> 40;  // 8-byte values
  row[6] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  row[7] = __any_sync(0xffffffffu, t == 40) + 2 * __all_sync(0xffffffffu, t < 48);
  // Only the even lanes take part: a mask that leaves out the others.
  row[8] = lane % 2 == 0 ? __shfl_sync(0x55555555u, t, (lane + 2) % 32) : -1;
  // Across warps through shared memory: correct only with the barrier.
  __shared__ int64_t slot[1024];
  slot[t] = int64_t{t} * t;
  __syncthreads();
  row[9] = slot[blockDim.x - 1 - t];
}

// Every thread of every block adds 1: exact only if the adds are atomic across worker threads.
__global__ void atomics(float* f, unsigned long long* u) {
  atomicAdd(f, 1.0f);
  atomicAdd(u, 1ull);
}

// The order in which the threads of the grid run: each takes the next number as it starts (with one
// worker thread, CUDA_EMU_THREADS=1: thread order, block after block; reversed under
// CUDA_EMU_SCHEDULE=reverse).
__global__ void arrival_order(int64_t* out, unsigned long long* counter) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = static_cast<int64_t>(atomicAdd(counter, 1ull));
}

// Planted bugs: each must make the launch throw, naming the block.
__global__ void divergent_shuffle() {
  if (threadIdx.x % 32 < 16) __shfl_down_sync(0xffffffffu, 1, 1);
}
__global__ void barrier_in_divergent_code() {
  if (threadIdx.x % 32 < 16) __syncthreads(); else __shfl_down_sync(0xffffffffu, 1, 1);
}
__global__ void mismatched_warp_ops() {
  if (threadIdx.x % 2) __ballot_sync(0xffffffffu, 1); else __shfl_xor_sync(0xffffffffu, 1, 1);
}
__global__ void reads_lane_outside_mask() { __shfl_sync(0x0000ffffu, 1, 20); }
struct Huge {
  char bytes[40000];
};
__global__ void huge_argument(Huge) {}

at::Tensor run(const std::string& name) {
  if (name == "warp_ops") {
    const dim3 grid(2), block(64);
    auto out = at::full({grid.x * block.x, kCols}, int64_t{-7}, at::kLong);
    cuda_emu::launch(warp_ops, grid, block, out.data_ptr<int64_t>());
    return out;
  }
  if (name == "atomics") {
    auto f = at::zeros({1}, at::kFloat);
    auto u = at::zeros({1}, at::kLong);
    cuda_emu::launch(atomics, 64, 256, f.data_ptr<float>(), reinterpret_cast<unsigned long long*>(u.data_ptr<int64_t>()));
    return at::cat({f.to(at::kLong), u});
  }
  if (name == "arrival_order") {
    auto out = at::full({3 * 64}, int64_t{-1}, at::kLong);
    auto counter = at::zeros({1}, at::kLong);
    cuda_emu::launch(arrival_order, 3, 64, out.data_ptr<int64_t>(),
                     reinterpret_cast<unsigned long long*>(counter.data_ptr<int64_t>()));
    return out;
  }
  if (name == "divergent_shuffle") cuda_emu::launch(divergent_shuffle, 3, 64);
  else if (name == "barrier_in_divergent_code") cuda_emu::launch(barrier_in_divergent_code, 2, 64);
  else if (name == "mismatched_warp_ops") cuda_emu::launch(mismatched_warp_ops, 1, 32);
  else if (name == "reads_lane_outside_mask") cuda_emu::launch(reads_lane_outside_mask, 1, 32);
  else if (name == "empty_grid") cuda_emu::launch(divergent_shuffle, 0, 32);
  else if (name == "too_many_threads") cuda_emu::launch(divergent_shuffle, 1, 1025);
  else if (name == "huge_argument") cuda_emu::launch(huge_argument, 1, 32, Huge{});
  else TORCH_CHECK(false, "gradfuse_emu.selftest: no test named '", name, "'");
  return at::empty({0}, at::kLong);
}

}  // namespace selftest

TORCH_LIBRARY(gradfuse_emu, m) {
  m.def("multi_tensor_stats(Tensor[] tensors, float norm_type) -> (Tensor, Tensor)");
  m.def("multi_tensor_moments(Tensor[] tensors) -> (Tensor, Tensor)");
  m.def("multi_tensor_scale_(Tensor(a!)[] tensors, Tensor coef, bool conditional=True) -> ()");
  m.def("multi_tensor_exponent_histogram(Tensor[] tensors) -> Tensor");
  m.def("selftest(str name) -> Tensor", &selftest::run);
  m.def("max_tensors_per_launch() -> int", []() -> int64_t { return gradfuse::cuda::kMaxTensorsPerLaunch; });
  // The per-unit ops and their launch-table sizes.
  m.def("multi_tensor_unit_stats(Tensor[] tensors, int[] units, float norm_type) -> (Tensor, Tensor)");
  m.def("multi_tensor_unit_scale_(Tensor(a!)[] tensors, int[] units, Tensor coefs, bool conditional=True) -> ()");
  m.def("multi_tensor_clamp_(Tensor(a!)[] tensors, float clip_value) -> (Tensor, Tensor, Tensor)");
  m.def("unit_table_sizes() -> int[]", []() -> std::vector<int64_t> {
    return {gradfuse::cuda::kSmallTableTensors, gradfuse::cuda::kMaxUnitTensorsPerLaunch};
  });
  // The optimizer-update ops and their (five-list) launch-table sizes.
  m.def("multi_tensor_update_stats(Tensor[] params, Tensor[] grads, Tensor[] moment1, Tensor[] moment2, "
        "Tensor[] moment2_max, Tensor hyper, int rule) -> (Tensor, Tensor)");
  m.def("multi_tensor_update_clip_(Tensor(a!)[] params, Tensor[] grads, Tensor[] moment1, Tensor[] moment2, "
        "Tensor[] moment2_max, Tensor hyper, Tensor coefs, int rule) -> ()");
  // The fused optimizer step, on the same tables.
  m.def("multi_tensor_optim_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] moment1, "
        "Tensor(c!)[] moment2, Tensor(d!)[] moment2_max, Tensor coefs, int rule, int torch_threads, "
        "Tensor? grad_scale=None, Tensor? skip=None, Tensor? update_coefs=None, bool stats=False, "
        "bool write=True) -> (Tensor, Tensor)");
  m.def("list_table_sizes() -> int[]", []() -> std::vector<int64_t> {
    return {gradfuse::cuda::kSmallTableTensors, gradfuse::cuda::kMaxListTensorsPerLaunch};
  });
}

TORCH_LIBRARY_IMPL(gradfuse_emu, CPU, m) {
  using gradfuse::cuda::Emulated;
  m.impl("multi_tensor_stats", &gradfuse::cuda::multi_tensor_stats_on<Emulated>);
  m.impl("multi_tensor_moments", &gradfuse::cuda::multi_tensor_moments_on<Emulated>);
  m.impl("multi_tensor_scale_", &gradfuse::cuda::multi_tensor_scale_on<Emulated>);
  m.impl("multi_tensor_unit_stats", &gradfuse::cuda::multi_tensor_unit_stats_on<Emulated>);
  m.impl("multi_tensor_unit_scale_", &gradfuse::cuda::multi_tensor_unit_scale_on<Emulated>);
  m.impl("multi_tensor_clamp_", &gradfuse::cuda::multi_tensor_clamp_on<Emulated>);
  m.impl("multi_tensor_exponent_histogram", &gradfuse::cuda::multi_tensor_exponent_histogram_on<Emulated>);
  m.impl("multi_tensor_update_stats", &gradfuse::cuda::multi_tensor_update_stats_on<Emulated>);
  m.impl("multi_tensor_update_clip_", &gradfuse::cuda::multi_tensor_update_clip_on<Emulated>);
  m.impl("multi_tensor_optim_step_", &gradfuse::cuda::multi_tensor_optim_step_on<Emulated>);
}
