// CPU implementation of the fused optimizer step (schema in gradfuse.cpp): one pass over the
// chunk plan of the parameters reading weight, gradient and state once and writing them once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/engine.h"
#include "../common/step_math.h"
#include "cpu_capability.h"
#include "step_kernels.h"

// MKL's vector square roots, which torch's CPU sqrt of float and double calls on builds of torch
// with MKL (ATen/cpu/vml.h: VML_HA, within an ulp but not always correctly rounded). libtorch_cpu
// exports them there; elsewhere these weak references are null.
extern "C" {
__attribute__((weak)) void vmsSqrt(int n, const float* a, float* r, long long mode);
__attribute__((weak)) void vmdSqrt(int n, const double* a, double* r, long long mode);
}

namespace gradfuse::cpu {
namespace {

// ATen/cpu/vml.h's mode: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE.
constexpr long long kTorchVmlMode = 0x2 | 0x140000 | 0x100;

void torch_sqrt_f32(int64_t n, const float* x, float* out) {
  vmsSqrt(static_cast<int>(n), x, out, kTorchVmlMode);
}

void torch_sqrt_f64(int64_t n, const double* x, double* out) {
  vmdSqrt(static_cast<int>(n), x, out, kTorchVmlMode);
}

std::atomic<bool> use_torch_sqrt{true};

StepChunksFn step_kernel_for(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx2") return AVX2::step_chunks;
#endif
  return DEFAULT::step_chunks;
}

// Below this many bytes per thread a call runs on the calling thread.
constexpr int64_t kMinBytesPerThread = 1 << 20;
// Bytes per block of chunks that a thread takes at a time.
constexpr int64_t kBlockBytes = 4 << 20;

// Calls f(begin, end) over every chunk, once each, in blocks that the threads take in turn from a
// shared counter; every chunk writes only its own elements and partial row, so the results
// depend neither on the thread count nor on the order.
template <typename F>
void for_step_chunks(int64_t chunks, int64_t bytes, F&& f) {
  bytes = std::max<int64_t>(bytes, 1);
  const int64_t block = std::max<int64_t>(1, (chunks * kBlockBytes + bytes - 1) / bytes);
  const int64_t num_blocks = (chunks + block - 1) / block;
  if (bytes < 2 * kMinBytesPerThread || num_blocks <= 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
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

std::tuple<at::Tensor, at::Tensor> multi_tensor_optim_step_cpu(
    at::TensorList params, at::TensorList grads, at::TensorList moment1, at::TensorList moment2,
    at::TensorList moment2_max, const at::Tensor& coefs, int64_t rule, int64_t torch_threads,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& skip,
    const std::optional<at::Tensor>& update_coefs, bool stats, bool write) {
  constexpr const char* kOp = "multi_tensor_optim_step_";
  check_step_args(params, grads, moment1, moment2, moment2_max, coefs, rule, grad_scale, skip, update_coefs, kOp);
  const auto n = static_cast<int64_t>(params.size());
  auto out_f = at::zeros({stats ? n : 0, kNumUpdateFloatStats}, at::dtype(at::kDouble));
  auto out_c = at::zeros({stats ? n : 0, kNumUpdateCountStats}, at::dtype(at::kLong));
  // a skipped step writes nothing; its statistics are those of the step it did not take
  if (skip.has_value() && skip->to(at::kDouble).item<double>() != 0.0) write = false;
  if (n == 0 || (!write && !stats)) return {out_f, out_c};
  std::vector<Span> p(n), g(n), m(n), v(n), x(n);
  const auto span_of = [](const at::Tensor& t) {
    return t.numel() > 0 ? Span{t.data_ptr(), t.numel()} : Span{nullptr, 0};
  };
  int64_t bytes = 0;
  const auto dtype = params[0].scalar_type();
  for (int64_t i = 0; i < n; ++i) {
    p[i] = span_of(params[i]);
    g[i] = span_of(grads[i]);
    m[i] = span_of(moment1[i]);
    v[i] = span_of(moment2[i]);
    x[i] = span_of(moment2_max[i]);
    int64_t arrays = 2;
    for (const Span* s : {&m[i], &v[i], &x[i]}) arrays += s->numel > 0;
    bytes += params[i].numel() * static_cast<int64_t>(c10::elementSize(dtype)) * arrays;
  }
  const ChunkPlan plan = make_chunk_plan(p);
  const at::Tensor update_dense = update_coefs.has_value() ? update_coefs->contiguous() : at::Tensor();
  const StepArgs args{p.data(),
                      g.data(),
                      m.data(),
                      v.data(),
                      x.data(),
                      coefs.const_data_ptr<double>(),
                      n,
                      plan.first_chunk.data(),
                      dtype,
                      static_cast<UpdateRule>(rule),
                      torch_threads,
                      grad_scale.has_value(),
                      grad_scale.has_value() ? grad_scale->to(at::kDouble).item<double>() : 1.0,
                      update_coefs.has_value() ? update_dense.const_data_ptr<double>() : nullptr,
                      write,
                      step_torch_sqrt() ? torch_sqrt_f32 : nullptr,
                      step_torch_sqrt() ? torch_sqrt_f64 : nullptr};
  const StepChunksFn kern = step_kernel_for(active_cpu_capability());
  const int64_t chunks = plan.num_chunks();
  if (!stats) {
    for_step_chunks(chunks, bytes, [&](int64_t b, int64_t e) { kern(args, b, e, nullptr, nullptr); });
    return {out_f, out_c};
  }
  // one partial row per chunk, combined per tensor in chunk order (as the update-stats op)
  auto part_f = at::empty({chunks, kNumUpdateFloatStats}, at::dtype(partial_dtype(dtype)));
  auto part_c = at::empty({chunks, kNumUpdateCountStats}, at::dtype(at::kLong));
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  for_step_chunks(chunks, bytes, [&](int64_t b, int64_t e) { kern(args, b, e, fp, cp); });
  double* of = out_f.data_ptr<double>();
  int64_t* oc = out_c.data_ptr<int64_t>();
  const auto finalize = [&](const auto* pf) {
    using acc_t = std::remove_const_t<std::remove_pointer_t<decltype(pf)>>;
    for (int64_t t = 0; t < n; ++t) {
      UpdateAcc<double> s;
      for (int64_t c = plan.first_chunk[t]; c < plan.first_chunk[t + 1]; ++c) {
        s.combine(UpdateAcc<acc_t>::load(pf + c * kNumUpdateFloatStats, cp + c * kNumUpdateCountStats));
      }
      s.store(of + t * kNumUpdateFloatStats, oc + t * kNumUpdateCountStats);
      oc[t * kNumUpdateCountStats + kUpdateNumel] = p[t].numel;
    }
  };
  if (dtype == at::kDouble) {
    finalize(part_f.const_data_ptr<double>());
  } else {
    finalize(part_f.const_data_ptr<float>());
  }
  return {out_f, out_c};
}

}  // namespace

bool step_torch_sqrt_available() {
  return vmsSqrt != nullptr && vmdSqrt != nullptr;
}

bool step_torch_sqrt() {
  return use_torch_sqrt.load() && step_torch_sqrt_available();
}

void set_step_torch_sqrt(bool on) {
  use_torch_sqrt.store(on);
}

TORCH_LIBRARY_IMPL(gradfuse, CPU, m) {
  m.impl("multi_tensor_optim_step_", &multi_tensor_optim_step_cpu);
}

}  // namespace gradfuse::cpu
