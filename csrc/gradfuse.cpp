// The gradfuse._C extension: op schemas (implemented per backend in cpu/ and cuda/) and what the
// module was built against.
// pybind11 and the op library only: torch/extension.h (all of torch's C++ frontend) more than
// doubled this file's compile time, and nothing here uses it.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include "common/chunk_plan.h"
#include "common/hist_math.h"
#include "common/stats_math.h"
#include "common/update_math.h"
#include "cpu/cpu_capability.h"
#include "cpu/hist_kernels.h"
#include "cpu/step_kernels.h"
#include "generated/build_config.h"  // written by setup.py


TORCH_LIBRARY(gradfuse, m) {
  // Per tensor of one (device, dtype) group: the statistics rows, float64 [n, kNumFloatStats] and
  // int64 [n, kNumCountStats], columns as common/stats_math.h lays them out (GRADFUSE_FLOAT_STATS,
  // GRADFUSE_COUNT_STATS; the power sum is sum |x|^norm_type when norm_type is not 0, 2 or inf).
  // One pass over the data; no host synchronisation.
  m.def("multi_tensor_stats(Tensor[] tensors, float norm_type) -> (Tensor, Tensor)");
  // The rows of multi_tensor_stats(tensors, 2) with the power sum's column (kPowSum) holding the
  // sum of squared deviations from the mean, sum (x - mean)^2, accumulated about a shift taken
  // from the data (common/stats_math.h): the variance without the cancellation of
  // sum x^2 - (sum x)^2 / n. Same single pass.
  m.def("multi_tensor_moments(Tensor[] tensors) -> (Tensor, Tensor)");
  // Multiplies every tensor in place by coef (a one-element tensor on the tensors' device). With
  // conditional=True (clipping) only when coef < 1 or NaN, touching no memory otherwise; the
  // decision is taken on the device. conditional=False always multiplies (AMP unscale + clip).
  m.def("multi_tensor_scale_(Tensor(a!)[] tensors, Tensor coef, bool conditional=True) -> ()");
  // Clipping beyond one global norm: tensor i as units[i] equal consecutive blocks
  // (common/unit_plan.h). Rows of multi_tensor_stats per unit, sum(units) rows each.
  m.def("multi_tensor_unit_stats(Tensor[] tensors, int[] units, float norm_type) -> (Tensor, Tensor)");
  // Unit j of tensor i times its coefficient (coefs: 1-D, sum(units) entries, on the device);
  // conditional: a unit whose coefficient is >= 1 is not touched (decided on the device).
  m.def("multi_tensor_unit_scale_(Tensor(a!)[] tensors, int[] units, Tensor coefs, bool conditional=True) -> ()");
  // Clamps to [-clip_value, clip_value] in place in one pass, as clip_grad_value_; returns the
  // stats rows (norm_type 2) of the values before, and int64 [n]: the elements changed.
  m.def("multi_tensor_clamp_(Tensor(a!)[] tensors, float clip_value) -> (Tensor, Tensor, Tensor)");
  // Per tensor of one (device, dtype) group: int64 [n, 283], how many elements fall in each bin
  // of binary exponents (common/hist_math.h): bin 0 finite non-zero |x| < 2^-149 (float64 only),
  // 1 zeros, 2 + (e + 149) floor(log2|x|) == e for e in [-149, 127], 279 finite |x| >= 2^128
  // (float64 only), 280 +Inf, 281 -Inf, 282 NaN. Exponents from the bits; one pass (a second
  // over chunks holding zeros, subnormals or non-finite values); no host synchronisation.
  m.def("multi_tensor_exponent_histogram(Tensor[] tensors) -> Tensor");
  // The optimizer's side of one (device, dtype) group (common/update_math.h): per tensor, the
  // statistics of the update that optimizer.step() is about to apply (rule 0 SGD, 1 Adam/AdamW),
  // from the weights, gradients and state before the step (an empty state tensor is absent), and
  // the hyper-parameter table hyper (float64 [n, 7], on the device). Rows float64 [n, 4] and int64
  // [n, 5], columns GRADFUSE_UPDATE_FLOAT_STATS / GRADFUSE_UPDATE_COUNT_STATS then numel. One
  // pass; no host synchronisation; writes nothing else.
  m.def("multi_tensor_update_stats(Tensor[] params, Tensor[] grads, Tensor[] moment1, Tensor[] moment2, "
        "Tensor[] moment2_max, Tensor hyper, int rule) -> (Tensor, Tensor)");
  // After optimizer.step(): the update just applied to tensor i, times coefs[i] (float64 [n], on
  // the device) where that is below 1, formed again from the state the step left; tensors whose
  // coefficient is not below 1 (NaN included) are not touched (decided on the device).
  m.def("multi_tensor_update_clip_(Tensor(a!)[] params, Tensor[] grads, Tensor[] moment1, Tensor[] moment2, "
        "Tensor[] moment2_max, Tensor hyper, Tensor coefs, int rule) -> ()");
  // The optimizer's step itself (common/step_math.h): torch's SGD (rule 0) or Adam/AdamW (rule 1)
  // step of every tensor, bit for bit, in one pass: weights and state updated in place from the
  // gradients, with the table coefs (float64 [n, 12], on the device) holding the scalars torch
  // forms in Python. torch_threads: the thread count of the torch step reproduced (a 16-bit
  // `add` rounds differently in torch's scalar tails; 0: none, the only value CUDA takes: the
  // tails are those of torch's CPU kernels). Optional, each on the device and
  // never read by the host on a GPU: grad_scale (every gradient times it as read, rounded to its
  // dtype, as a scaling pass before the step would), skip (nonzero: nothing is written), update_coefs (float64 [n]: tensor i's update
  // times update_coefs[i] where that is below 1). stats: also the update-statistics rows of
  // multi_tensor_update_stats (else [0, k]); write=False: the statistics only.
  m.def("multi_tensor_optim_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] moment1, "
        "Tensor(c!)[] moment2, Tensor(d!)[] moment2_max, Tensor coefs, int rule, int torch_threads, "
        "Tensor? grad_scale=None, Tensor? skip=None, Tensor? update_coefs=None, bool stats=False, "
        "bool write=True) -> (Tensor, Tensor)");
}

namespace gradfuse::watch {
// csrc/watch.cpp: the list walk of gradfuse.core.walk_cache
void bind_list_walk(pybind11::module_& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  gradfuse::watch::bind_list_walk(m);
  m.def("build_info", [] {
    pybind11::dict d;
    d["torch_version"] = GRADFUSE_TORCH_VERSION;
    d["cuda_version"] = std::string(GRADFUSE_CUDA_VERSION);
    d["cuda_archs"] = std::string(GRADFUSE_CUDA_ARCHS);
#ifdef GRADFUSE_WITH_CUDA
    d["with_cuda"] = true;
#else
    d["with_cuda"] = false;
#endif
    d["chunk_elems"] = gradfuse::kChunkElems;
    d["histogram_bins"] = gradfuse::kNumHistBins;
    // The statistics rows' column names, in order (gradfuse/ops/layout.py must agree).
    pybind11::list float_stats, count_stats;
#define GRADFUSE_NAME_OF(column, member, combine) #member,
    for (const char* name : {GRADFUSE_FLOAT_STATS(GRADFUSE_NAME_OF)}) float_stats.append(name);
    for (const char* name : {GRADFUSE_COUNT_STATS(GRADFUSE_NAME_OF) "numel"}) count_stats.append(name);
    d["stats_layout"] = pybind11::make_tuple(float_stats, count_stats);
    // The optimizer-update rows' column names, in order (gradfuse/ops/layout.py must agree).
    pybind11::list update_float, update_count;
    for (const char* name : {GRADFUSE_UPDATE_FLOAT_STATS(GRADFUSE_NAME_OF)}) update_float.append(name);
    for (const char* name : {GRADFUSE_UPDATE_COUNT_STATS(GRADFUSE_NAME_OF) "numel"}) update_count.append(name);
    d["update_stats_layout"] = pybind11::make_tuple(update_float, update_count);
#undef GRADFUSE_NAME_OF
    d["best_cpu_capability"] = gradfuse::cpu::best_cpu_capability();
    d["step_torch_sqrt"] = gradfuse::cpu::step_torch_sqrt_available();
#ifdef GRADFUSE_HAVE_AVX2_HISTOGRAM
    d["histogram_avx512"] = gradfuse::cpu::histogram_avx512_available();
#else
    d["histogram_avx512"] = false;
#endif
    return d;
  });
  m.def("cpu_capability", [] { return gradfuse::cpu::active_cpu_capability(); },
        "The build of the CPU kernels in use: 'avx2' or 'default'.");
  m.def("set_cpu_capability", &gradfuse::cpu::set_cpu_capability,
        "Force the CPU kernels: 'default' or 'avx2'.");
  m.def("step_torch_sqrt", &gradfuse::cpu::step_torch_sqrt,
        "Whether the CPU optimizer step takes torch's float/double sqrt (MKL's) rather than a correctly rounded one.");
  m.def("set_step_torch_sqrt", &gradfuse::cpu::set_step_torch_sqrt,
        "True (the default): the CPU optimizer step takes torch's sqrt where it is MKL's; False: a correctly rounded "
        "one, as the CUDA kernels.");
#ifdef GRADFUSE_HAVE_AVX2_HISTOGRAM
  m.def("histogram_avx512", &gradfuse::cpu::histogram_avx512,
        "Whether the AVX2 histogram kernels count with their AVX-512 loop.");
  m.def("set_histogram_avx512", &gradfuse::cpu::set_histogram_avx512,
        "Use (True, where build_info()['histogram_avx512']) or not the AVX-512 histogram loop.");
#else
  m.def("histogram_avx512", [] { return false; });
  m.def("set_histogram_avx512", [](bool on) {
    TORCH_CHECK(!on, "this build has no AVX-512 histogram loop");
  });
#endif
}
