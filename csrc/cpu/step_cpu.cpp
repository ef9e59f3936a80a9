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
#include "update_group.h"

// MKL's vector square roots, which torch's CPU sqrt of float and double calls on builds of torch
// with MKL (ATen/cpu/vml.h: VML_HA, within an ulp but not always correctly rounded). libtorch_cpu
// exports them there; elsewhere these weak references are null.
extern "C" {
__attribute__((weak)) void vmsSqrt(int n, const float* a, float* r, long long mode);
__attribute__((weak)) void vmdSqrt(int n, const double* a, double* r, long long mode);
__attribute__((weak)) int MKL_Set_Num_Threads_Local(int n);  // mkl_set_num_threads_local in C (mkl_service.h)
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

// Runs kern on chunks [begin, end) with MKL on this thread alone: torch turns MKL's dynamic
// threading off, so a root call inside the step's own workers would start a team of MKL threads
// per block (measured: the float step 3x slower on two threads).
void run_chunks(StepChunksFn kern, const StepArgs& args, int64_t begin, int64_t end, void* fp, int64_t* cp) {
  const bool mkl = MKL_Set_Num_Threads_Local != nullptr && (args.sqrt_f32 != nullptr || args.sqrt_f64 != nullptr);
  const int before = mkl ? MKL_Set_Num_Threads_Local(1) : 0;
  kern(args, begin, end, fp, cp);
  if (mkl) MKL_Set_Num_Threads_Local(before);
}

StepChunksFn step_kernel_for(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == "avx2") return AVX2::step_chunks;
#endif
  return DEFAULT::step_chunks;
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
  UpdateGroup grp = update_group(params, grads, moment1, moment2, moment2_max);
  const auto dtype = params[0].scalar_type();
  const at::Tensor update_dense = update_coefs.has_value() ? update_coefs->contiguous() : at::Tensor();
  const bool per_tensor = grad_scale_per_tensor(grad_scale, n);
  const at::Tensor scales = per_tensor ? grad_scale->contiguous() : at::Tensor();
  const StepArgs args{grp.params.data(),
                      grp.grads.data(),
                      grp.moment1.data(),
                      grp.moment2.data(),
                      grp.moment2_max.data(),
                      coefs.const_data_ptr<double>(),
                      n,
                      grp.plan.first_chunk.data(),
                      dtype,
                      static_cast<UpdateRule>(rule),
                      torch_threads,
                      grad_scale.has_value(),
                      grad_scale.has_value() && !per_tensor ? grad_scale->to(at::kDouble).item<double>() : 1.0,
                      per_tensor ? scales.const_data_ptr<double>() : nullptr,
                      update_coefs.has_value() ? update_dense.const_data_ptr<double>() : nullptr,
                      write,
                      step_torch_sqrt() ? torch_sqrt_f32 : nullptr,
                      step_torch_sqrt() ? torch_sqrt_f64 : nullptr};
  const StepChunksFn kern = step_kernel_for(active_cpu_capability());
  const int64_t chunks = grp.plan.num_chunks();
  if (!stats) {
    for_chunk_blocks(grp, [&](int64_t b, int64_t e) { run_chunks(kern, args, b, e, nullptr, nullptr); });
    return {out_f, out_c};
  }
  // one partial row per chunk, combined per tensor in chunk order (as the update-stats op)
  auto part_f = at::empty({chunks, kNumUpdateFloatStats}, at::dtype(partial_dtype(dtype)));
  auto part_c = at::empty({chunks, kNumUpdateCountStats}, at::dtype(at::kLong));
  void* fp = part_f.data_ptr();
  int64_t* cp = part_c.data_ptr<int64_t>();
  for_chunk_blocks(grp, [&](int64_t b, int64_t e) { run_chunks(kern, args, b, e, fp, cp); });
  if (dtype == at::kDouble) {
    finalize_update_rows(grp, part_f.const_data_ptr<double>(), cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
  } else {
    finalize_update_rows(grp, part_f.const_data_ptr<float>(), cp, out_f.data_ptr<double>(), out_c.data_ptr<int64_t>());
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
