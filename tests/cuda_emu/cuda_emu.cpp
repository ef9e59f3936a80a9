// The runtime of the CUDA emulation (see cuda_emu.h). The blocks of a grid are shared out among
// worker threads (CUDA_EMU_THREADS, default one per core); a worker runs one block at a time, each
// thread of the block a fiber on its own stack, resuming ready fibers in thread order until every
// thread has returned. A fiber gives up the CPU only when it waits at __syncthreads or in a warp
// operation that not all of its lanes have reached yet. CUDA_EMU_SCHEDULE=reverse takes the blocks
// from the last one down and resumes the fibers from the last thread down: a kernel whose result
// depends on the order of blocks, or on which thread of a block runs first between two barriers,
// gives another result.
#include "cuda_emu.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if !defined(__x86_64__) || defined(CUDA_EMU_UCONTEXT)
#define CUDA_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

#ifndef CUDA_EMU_USE_UCONTEXT
// Saves the callee-saved registers on the current stack, stores the stack pointer in *save_sp,
// switches to load_sp and restores the registers saved there: a function call that returns on
// another stack. Several times faster than swapcontext, which also saves the signal mask.
extern "C" void cuda_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl cuda_emu_switch
  .hidden cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch, .-cuda_emu_switch
)");
#endif

namespace cuda_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // a kernel frame holds a copy of a 30 KB argument
constexpr size_t kGuardBytes = 4096;        // an overflow faults instead of corrupting a neighbour
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kMaxParamBytes = 32764;    // CUDA >= 12.1

struct Context {
#ifdef CUDA_EMU_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

enum class State : uint8_t { kReady, kAtBarrier, kInWarpOp, kExited };

struct Fiber {
  Context ctx;
  char* stack = nullptr;  // lowest usable address
  State state = State::kReady;
  uint3 tid{};
};

struct Warp {
  unsigned arrived = 0;  // lanes waiting in the pending operation
  unsigned gone = 0;     // lanes that have exited or do not exist
  WarpOp op{};
  unsigned mask = 0;
  int width = 0;
  uint64_t value[32]{};
  int arg[32]{};
  uint64_t result[32]{};
};

const char* op_name(WarpOp op) {
  static const char* const names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                      "__shfl_xor_sync", "__ballot_sync", "__all_sync",
                                      "__any_sync", "__syncwarp"};
  return names[static_cast<int>(op)];
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// "0-15, 32-47" for sorted ids.
std::string ranges(const std::vector<int>& ids) {
  std::string out;
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ids[i]);
    if (j > i) out += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> lanes_of(unsigned bits) {
  std::vector<int> ids;
  for (int l = 0; l < 32; ++l) if (bits >> l & 1u) ids.push_back(l);
  return ids;
}

// The fiber stacks of one worker thread, kept for the next launch: mapping and first touching
// them costs more than running a small block.
struct StackPool {
  std::vector<char*> stacks;
  char* get(size_t i) {
    while (stacks.size() <= i) {
      void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) throw std::runtime_error("cuda_emu: cannot map a fiber stack");
      mprotect(p, kGuardBytes, PROT_NONE);
      stacks.push_back(static_cast<char*>(p) + kGuardBytes);
    }
    return stacks[i];
  }
  ~StackPool() {
    for (char* s : stacks) munmap(s - kGuardBytes, kStackBytes + kGuardBytes);
  }
};

// The block being run by this OS thread.
struct Block {
  Thunk thunk = nullptr;
  void* ctx = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int current = -1;
  int alive = 0;
  int at_barrier = 0;
  std::string error;
  Context scheduler;
#if defined(__SANITIZE_ADDRESS__)
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

thread_local Block* t_block = nullptr;

std::mutex g_pools_mutex;
std::vector<std::unique_ptr<StackPool>> g_free_pools;

std::unique_ptr<StackPool> take_pool() {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  if (g_free_pools.empty()) return std::make_unique<StackPool>();
  auto pool = std::move(g_free_pools.back());
  g_free_pools.pop_back();
  return pool;
}

void return_pool(std::unique_ptr<StackPool> pool) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  g_free_pools.push_back(std::move(pool));
}

void switch_context(Context& from, Context& to) {
#ifdef CUDA_EMU_USE_UCONTEXT
  swapcontext(&from.uc, &to.uc);
#else
  cuda_emu_switch(&from.sp, to.sp);
#endif
}

// Fiber -> scheduler. `exiting`: this fiber will never be resumed.
void to_scheduler(Fiber& f, bool exiting) {
  Block& b = *t_block;
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake_stack, b.scheduler_stack, b.scheduler_stack_size);
  switch_context(f.ctx, b.scheduler);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  (void)exiting;
  switch_context(f.ctx, b.scheduler);
#endif
}

// Scheduler -> fiber i, until it waits or exits.
void resume(Block& b, int i) {
  Fiber& f = b.fibers[i];
  b.current = i;
  threadIdx = f.tid;
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, f.stack, kStackBytes);
  switch_context(b.scheduler, f.ctx);
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
  switch_context(b.scheduler, f.ctx);
#endif
  b.current = -1;
}

Block& running_block(const char* what) {
  if (t_block == nullptr || t_block->current < 0) {
    std::fprintf(stderr, "cuda_emu: %s called outside a kernel\n", what);
    std::abort();
  }
  return *t_block;
}

// Stops the block: the scheduler throws `msg` from the launch.
[[noreturn]] void fail(Block& b, const std::string& msg) {
  const Fiber& f = b.fibers[b.current];
  b.error = "thread (" + std::to_string(f.tid.x) + "," + std::to_string(f.tid.y) + "," +
            std::to_string(f.tid.z) + "): " + msg;
  to_scheduler(b.fibers[b.current], true);
  __builtin_unreachable();
}

void release_barrier(Block& b) {
  for (Fiber& f : b.fibers) if (f.state == State::kAtBarrier) f.state = State::kReady;
  b.at_barrier = 0;
}

void thread_exit(Block& b) {
  Fiber& f = b.fibers[b.current];
  f.state = State::kExited;
  --b.alive;
  Warp& w = b.warps[b.current / 32];
  const unsigned bit = 1u << (b.current % 32);
  w.gone |= bit;
  if (w.arrived != 0 && (w.mask & bit)) {
    fail(b, "exited while lanes " + ranges(lanes_of(w.arrived)) + " of its warp wait for it in " +
                op_name(w.op) + " (mask " + hex(w.mask) + "): divergent warp operation");
  }
  // Threads that have exited count as arrived at __syncthreads, as on the GPU.
  if (b.at_barrier > 0 && b.at_barrier == b.alive) release_barrier(b);
  to_scheduler(f, true);
}

void fiber_main() {
  Block& b = *t_block;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
  std::string exception;  // fail() outside the handler: this stack is abandoned, not unwound
  try {
    b.thunk(b.ctx);
  } catch (const std::exception& e) {
    exception = e.what();
  }
  if (!exception.empty()) fail(b, "exception: " + exception);
  thread_exit(b);
}

// ASan's shadow of a reused stack still marks the redzones of the frames its previous fiber left
// without returning (the exit path; every frame of a fiber stopped by an error).
void unpoison_stack(const Fiber& f, size_t top_bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(f.stack + kStackBytes - top_bytes, top_bytes);
#else
  (void)f, (void)top_bytes;
#endif
}

void start_fiber(Fiber& f) {
  unpoison_stack(f, 16 * 1024);
#ifdef CUDA_EMU_USE_UCONTEXT
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = kStackBytes;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main, 0);
#else
  // What cuda_emu_switch pops: six registers, then fiber_main as the return address; above it a
  // null return address for fiber_main, which never returns. fiber_main starts with
  // rsp % 16 == 8, as after a call.
  auto* sp = reinterpret_cast<uintptr_t*>(f.stack + kStackBytes);
  *--sp = 0;
  *--sp = reinterpret_cast<uintptr_t>(&fiber_main);
  for (int r = 0; r < 6; ++r) *--sp = 0;
  f.ctx.sp = sp;
#endif
}

std::string describe_waits(const Block& b) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t i = 0; i < b.fibers.size(); ++i) {
    std::string what;
    switch (b.fibers[i].state) {
      case State::kAtBarrier: what = "wait at __syncthreads"; break;
      case State::kExited: what = "have exited"; break;
      case State::kInWarpOp: {
        const Warp& w = b.warps[i / 32];
        what = std::string("wait in ") + op_name(w.op) + " (mask " + hex(w.mask) + ")";
        break;
      }
      case State::kReady: what = "are ready"; break;
    }
    auto g = groups.begin();
    while (g != groups.end() && g->first != what) ++g;
    if (g == groups.end()) groups.push_back({what, {int(i)}}); else g->second.push_back(int(i));
  }
  std::string out;
  for (const auto& g : groups) out += "; threads " + ranges(g.second) + " " + g.first;
  return out;
}

// CUDA_EMU_SCHEDULE=reverse: blocks and the threads of a block in reverse order.
bool reversed_schedule() {
  static const bool reversed = [] {
    const char* env = std::getenv("CUDA_EMU_SCHEDULE");
    return env != nullptr && std::string(env) == "reverse";
  }();
  return reversed;
}

void run_block(Block& b) {
  for (size_t i = 0; i < b.fibers.size(); ++i) {
    b.fibers[i].state = State::kReady;
    start_fiber(b.fibers[i]);
  }
  for (Warp& w : b.warps) w = Warp{};
  const int n = static_cast<int>(b.fibers.size());
  if (n % 32) b.warps.back().gone = ~0u << (n % 32);  // lanes of a partial warp that do not exist
  b.alive = n;
  b.at_barrier = 0;
  while (b.alive > 0) {
    bool progressed = false;
    const bool reversed = reversed_schedule();
    for (int j = 0; j < n; ++j) {
      const int i = reversed ? n - 1 - j : j;
      if (b.fibers[i].state != State::kReady) continue;
      resume(b, i);
      progressed = true;
      if (!b.error.empty()) return;
    }
    if (!progressed) {
      b.error = "deadlock (a barrier or warp operation not reached by all its threads)" + describe_waits(b);
      return;
    }
  }
}

std::string kernel_name(const void* kernel) {
  Dl_info info{};
  if (dladdr(kernel, &info) && info.dli_sname) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string name = status == 0 ? demangled : info.dli_sname;
    std::free(demangled);
    return name;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "kernel at %p", kernel);
  return buf;
}

template <typename D>  // dim3 or uint3
std::string dims(D d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// What the worker threads of one launch share. Blocks are independent, so each worker runs the
// next block not yet taken; the error reported is that of the first failing block.
struct Launch {
  dim3 grid, block;
  Thunk thunk;
  void* ctx;
  uint64_t num_blocks;
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  uint3 failed_block{};
  uint64_t failed_index = ~uint64_t{0};
  std::string error;

  void fail(uint64_t index, uint3 where, const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (index < failed_index) failed_index = index, failed_block = where, error = what;
    failed = true;
  }
};

// CUDA_EMU_THREADS, else one per core.
unsigned worker_threads() {
  static const unsigned n = [] {
    const char* env = std::getenv("CUDA_EMU_THREADS");
    const int v = env ? std::atoi(env) : int(std::thread::hardware_concurrency());
    return unsigned(std::max(v, 1));
  }();
  return n;
}

void run_blocks(Launch& launch) {
  auto stacks = take_pool();
  const dim3 grid = launch.grid, block = launch.block;
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  Block b;
  b.thunk = launch.thunk;
  b.ctx = launch.ctx;
  b.fibers.resize(threads);
  b.warps.resize((threads + 31) / 32);
  uint64_t i = 0;
  try {
    for (uint64_t t = 0; t < threads; ++t) {
      b.fibers[t].stack = stacks->get(t);
      b.fibers[t].tid = {unsigned(t % block.x), unsigned(t / block.x % block.y), unsigned(t / (block.x * block.y))};
    }
    gridDim = grid;
    blockDim = block;
    t_block = &b;
    while (!launch.failed && (i = launch.next++) < launch.num_blocks) {
      if (reversed_schedule()) i = launch.num_blocks - 1 - i;
      blockIdx = {unsigned(i % grid.x), unsigned(i / grid.x % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y))};
      run_block(b);
      if (!b.error.empty()) {
        for (const Fiber& f : b.fibers) unpoison_stack(f, kStackBytes);
        launch.fail(i, blockIdx, b.error);
      }
    }
  } catch (const std::exception& e) {
    launch.fail(i, blockIdx, e.what());
  }
  t_block = nullptr;
  return_pool(std::move(stacks));
}

}  // namespace

void syncthreads() {
  Block& b = running_block("__syncthreads");
  Fiber& f = b.fibers[b.current];
  if (++b.at_barrier == b.alive) {  // the last one to arrive goes on without waiting
    release_barrier(b);
    return;
  }
  f.state = State::kAtBarrier;
  to_scheduler(f, false);
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width) {
  Block& b = running_block(op_name(op));
  const int lane = b.current % 32;
  const unsigned bit = 1u << lane;
  Warp& w = b.warps[b.current / 32];
  const auto call = [&] { return std::string(op_name(op)) + " (mask " + hex(mask) + ")"; };  // for errors
  if (!(mask & bit)) fail(b, "calls " + call() + " with a mask that leaves out its own lane " + std::to_string(lane));
  if (mask & w.gone) {
    fail(b, "calls " + call() + " naming lanes " + ranges(lanes_of(mask & w.gone)) +
                " that have exited or do not exist: divergent warp operation");
  }
  if (width <= 0 || width > 32 || (width & (width - 1))) fail(b, "calls " + call() + " with width " + std::to_string(width));
  if (w.arrived == 0) {
    w.op = op;
    w.mask = mask;
    w.width = width;
  } else if (w.op != op || w.mask != mask || w.width != width) {
    fail(b, "calls " + call() + " while lanes " + ranges(lanes_of(w.arrived)) + " of its warp wait in " +
                op_name(w.op) + " (mask " + hex(w.mask) + "): divergent warp operation");
  }
  w.value[lane] = value;
  w.arg[lane] = arg;
  w.arrived |= bit;
  if (w.arrived != mask) {
    b.fibers[b.current].state = State::kInWarpOp;
    to_scheduler(b.fibers[b.current], false);
    return w.result[lane];
  }
  // The last lane to arrive computes every lane's result (before anyone can arrive again).
  const bool vote = op == WarpOp::kBallot || op == WarpOp::kAll || op == WarpOp::kAny;
  unsigned ballot = 0;
  for (int l = 0; l < 32; ++l) if ((mask >> l & 1u) && w.value[l]) ballot |= 1u << l;
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    const int first = l & ~(width - 1), a = w.arg[l];
    int src = l;
    switch (op) {
      case WarpOp::kShfl: src = first + (a & (width - 1)); break;
      case WarpOp::kShflUp: src = (l - first) >= a ? l - a : l; break;
      case WarpOp::kShflDown: src = (l - first) + a < width ? l + a : l; break;
      case WarpOp::kShflXor: src = (l ^ a) < first + width ? (l ^ a) : l; break;
      default: break;
    }
    if (!vote && op != WarpOp::kSyncWarp && !(mask >> src & 1u)) {
      fail(b, "completes " + call() + " in which lane " + std::to_string(l) + " reads lane " +
                  std::to_string(src) + ", which is not in the mask (undefined on the GPU)");
    }
    w.result[l] = op == WarpOp::kBallot ? ballot
                  : op == WarpOp::kAll  ? (ballot == mask)
                  : op == WarpOp::kAny  ? (ballot != 0)
                                        : w.value[src];
  }
  for (int l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) && l != lane) b.fibers[b.current - lane + l].state = State::kReady;
  }
  w.arrived = 0;
  return w.result[lane];
}

void run_grid(dim3 grid, dim3 block, Thunk thunk, void* ctx, const void* kernel, size_t param_bytes) {
  const auto launch_error = [&](const std::string& what) {
    return std::runtime_error("cuda_emu: invalid launch of " + kernel_name(kernel) + " with grid " +
                              dims(grid) + ", block " + dims(block) + ": " + what);
  };
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64) {
    throw launch_error("a block has 1 to 1024 threads (z at most 64)");
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    throw launch_error("grid dimensions are 1 to 2^31-1 (x), 65535 (y, z)");
  }
  if (param_bytes > kMaxParamBytes) {
    throw launch_error("kernel parameters take " + std::to_string(param_bytes) + " bytes, more than " +
                       std::to_string(kMaxParamBytes));
  }
  if (t_block != nullptr) throw launch_error("a kernel cannot launch another in the emulator");

  Launch launch{grid, block, thunk, ctx, uint64_t(grid.x) * grid.y * grid.z};
  const unsigned workers = static_cast<unsigned>(std::min<uint64_t>(worker_threads(), launch.num_blocks));
  std::vector<std::thread> helpers;
  for (unsigned w = 1; w < workers; ++w) helpers.emplace_back(run_blocks, std::ref(launch));
  run_blocks(launch);
  for (auto& t : helpers) t.join();
  if (launch.failed) {
    throw std::runtime_error("cuda_emu: " + kernel_name(kernel) + ", block " + dims(launch.failed_block) +
                             " of grid " + dims(grid) + ", " + dims(block) + " threads: " + launch.error);
  }
}

}  // namespace cuda_emu
