// CUDA emulation for g++: enough of CUDA C++ to compile gradfuse's device code unchanged and run
// it on the CPU, for tests on machines without a GPU.
//
// Execution model (cuda_emu.cpp): blocks run independently on worker threads, one block at a
// time per worker; the threads of a block are cooperative fibers that switch only at
// __syncthreads and at warp operations (shuffles, votes, __syncwarp). Barriers and shuffles
// therefore have exact CUDA semantics, and one reached by only part of its block or warp is
// reported as a deadlock naming the block, instead of hanging. __shared__ variables are static
// thread_local: shared by the threads of the block a worker runs, one copy per instantiation.
//
// Not modelled: races between the threads of a block under real scheduling (a fiber runs until
// it waits), the memory model, timing, nvcc's FMA contraction and fast-math approximations,
// __launch_bounds__ limits, dynamic shared memory, dynamic parallelism.
//
// Launch with cuda_emu::launch(kernel, grid, block, args...) where CUDA writes
// kernel<<<grid, block>>>(args...); it runs the whole grid before returning and throws
// std::runtime_error on a deadlock, a divergent warp operation or an invalid launch.
#pragma once

// libstdc++'s <math.h> brings std::pow(float, float), std::fabs(float) & co. into the global
// namespace, as nvcc's math headers do: `::pow(float, float)` is powf on the device, and must not
// silently become the double pow here.
#include <math.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

static_assert(std::is_same_v<decltype(::pow(1.0f, 1.0f)), float>, "::pow(float, float) must be float");
static_assert(std::is_same_v<decltype(::fabs(1.0f)), float>, "::fabs(float) must be float");

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static thread_local
#define __grid_constant__
#define __launch_bounds__(...)
// __restrict__ is a g++ keyword already.

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
constexpr int warpSize = 32;

// Set by the scheduler before it resumes a fiber.
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

// CUDA's global min/max overloads (the host has none for integers; min(float) is fminf).
#define CUDA_EMU_MINMAX(T)                                  \
  inline T min(T a, T b) { return b < a ? b : a; }          \
  inline T max(T a, T b) { return a < b ? b : a; }
CUDA_EMU_MINMAX(int)
CUDA_EMU_MINMAX(unsigned)
CUDA_EMU_MINMAX(long)
CUDA_EMU_MINMAX(unsigned long)
CUDA_EMU_MINMAX(long long)
CUDA_EMU_MINMAX(unsigned long long)
#undef CUDA_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

namespace cuda_emu {

enum class WarpOp : int { kShfl, kShflUp, kShflDown, kShflXor, kBallot, kAll, kAny, kSyncWarp };

// Runtime (cuda_emu.cpp).
void syncthreads();
// Every lane of `mask` must call the same op with the same mask; returns this lane's result.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width);
using Thunk = void (*)(void* ctx);
// Runs thunk(ctx) in every thread of every block; throws std::runtime_error on a failure.
void run_grid(dim3 grid, dim3 block, Thunk thunk, void* ctx, const void* kernel, size_t param_bytes);

template <typename T>
uint64_t to_bits(const T& v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <typename T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Bytes the kernel's parameters take in CUDA's argument buffer (each aligned as its type).
template <typename... Params>
constexpr size_t param_bytes() {
  size_t n = 0;
  ((n = (n + alignof(Params) - 1) / alignof(Params) * alignof(Params) + sizeof(Params)), ...);
  return n;
}

// kernel<<<grid, block>>>(args...): arguments convert to the parameter types once, as CUDA
// copies them into the argument buffer; every thread then gets its own by-value copy.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
  using Tuple = std::tuple<std::decay_t<Params>...>;
  struct Ctx {
    void (*kernel)(Params...);
    Tuple params;
  } ctx{kernel, Tuple(std::forward<Args>(args)...)};
  run_grid(grid, block, [](void* c) {
    auto* ctx = static_cast<Ctx*>(c);
    std::apply(ctx->kernel, ctx->params);
  }, &ctx, reinterpret_cast<const void*>(kernel), param_bytes<std::decay_t<Params>...>());
}

}  // namespace cuda_emu

inline void __syncthreads() { cuda_emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emu::warp_collective(cuda_emu::WarpOp::kSyncWarp, mask, 0, 0, warpSize);
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() {}  // the threads of a block share one OS thread

#define CUDA_EMU_SHUFFLE(name, op, Arg)                                                        \
  template <typename T>                                                                        \
  T name(unsigned mask, T var, Arg arg, int width = warpSize) {                                \
    return cuda_emu::from_bits<T>(cuda_emu::warp_collective(cuda_emu::WarpOp::op, mask,        \
                                                            cuda_emu::to_bits(var),            \
                                                            static_cast<int>(arg), width));    \
  }
CUDA_EMU_SHUFFLE(__shfl_sync, kShfl, int)
CUDA_EMU_SHUFFLE(__shfl_up_sync, kShflUp, unsigned)
CUDA_EMU_SHUFFLE(__shfl_down_sync, kShflDown, unsigned)
CUDA_EMU_SHUFFLE(__shfl_xor_sync, kShflXor, int)
#undef CUDA_EMU_SHUFFLE

inline unsigned __ballot_sync(unsigned mask, int pred) {
  return static_cast<unsigned>(cuda_emu::warp_collective(cuda_emu::WarpOp::kBallot, mask, pred != 0, 0, warpSize));
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(cuda_emu::warp_collective(cuda_emu::WarpOp::kAll, mask, pred != 0, 0, warpSize));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(cuda_emu::warp_collective(cuda_emu::WarpOp::kAny, mask, pred != 0, 0, warpSize));
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }

// Blocks run concurrently on worker threads.
template <typename T>
T atomicAdd(T* address, T val) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
  } else {
    T old, sum;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    do sum = old + val;
    while (!__atomic_compare_exchange(address, &old, &sum, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
  }
}
template <typename T>
T atomicCAS(T* address, T compare, T val) {
  __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
template <typename T>
T __ldg(const T* p) {
  return *p;
}
