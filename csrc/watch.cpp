// gradfuse::ParamWatch: the per-step host work of gradfuse.watch() in C++.
//
// A watched model's parameters are resolved once (in Python); every step this class reads each
// parameter's .grad() (a pointer load, where Python pays an attribute lookup), checks it against
// the plan made on an earlier step (which parameters have a gradient, each group's device and
// dtype, the row order of the result), and calls the registered ops through typed dispatcher
// handles below the autograd keys: the custom ops have no autograd kernel, so a plain call would
// take the boxed autograd fallback and box every tensor of the list. The total norm and the clip
// coefficient are those of common/engine.h (the same ATen ops as gradfuse's Python side, so
// results are bitwise those of gradfuse.stats / gradfuse.clip_). Nothing here waits for the device.
//
// Any difference from the plan (a gradient that became None or appeared, changed dtype or device,
// is a tensor subclass or not dense) makes a call return "no match" without touching anything;
// Python then takes the functional path for that step and makes a new plan.
#include <ATen/ATen.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/engine.h"
#include "cpu/stats_cpu.h"

namespace gradfuse::watch {
namespace {

using StatsFn = std::tuple<at::Tensor, at::Tensor>(at::TensorList, double);
using ScaleFn = void(at::TensorList, const at::Tensor&, bool);

// Looked up on first use: the schemas are registered by gradfuse.cpp's static initialiser,
// whose order relative to this file's is unspecified.
const c10::TypedOperatorHandle<StatsFn>& stats_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gradfuse::multi_tensor_stats", "")
                             .typed<StatsFn>();
  return op;
}

const c10::TypedOperatorHandle<ScaleFn>& scale_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gradfuse::multi_tensor_scale_", "")
                             .typed<ScaleFn>();
  return op;
}

// Functionality that changes what a tensor's elements are (subclasses such as DTensor, lazy
// negation/conjugation, functionalisation, sparse, nested, quantised): the functional path
// handles those gradients.
constexpr c10::DispatchKeySet kNotPlain({
    c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Functionalize,
    c10::DispatchKey::ZeroTensor, c10::DispatchKey::Negative, c10::DispatchKey::Conjugate,
    c10::DispatchKey::Sparse, c10::DispatchKey::SparseCsr, c10::DispatchKey::NestedTensor,
    c10::DispatchKey::Quantized, c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchGradWrapper,
});

bool is_plain_dense(const at::Tensor& t) {
  return !t.key_set().has_any(kNotPlain) && t.layout() == at::kStrided;
}

struct Group {
  c10::Device device;
  at::ScalarType dtype;
  std::vector<int64_t> params;  // indices into ParamWatch::params_, in row order
};

}  // namespace

class ParamWatch : public torch::CustomClassHolder {
 public:
  explicit ParamWatch(std::vector<at::Tensor> params) : params_(std::move(params)) {
    impls_.reserve(params_.size());
    for (const auto& t : params_) impls_.push_back(t.unsafeGetTensorImpl());
  }

  // Makes the plan from the current gradients: `rows` are the indices of the parameters with a
  // gradient, in the order of the rows of the functional path's result (group by group),
  // `total_like` is that result's total norm (its device and dtype are the result's), and
  // `device_types` those the compiled kernels serve ("cpu", "cuda"; elsewhere the functional
  // path runs the reference). Returns false, keeping no plan, when the fast path cannot serve
  // these gradients.
  bool plan(const std::vector<int64_t>& rows, const at::Tensor& total_like,
            const std::vector<std::string>& device_types) {
    groups_.clear();
    absent_.clear();
    const auto n = size();
    std::vector<char> has_row(n, 0);
    for (const int64_t i : rows) {
      if (i < 0 || i >= n || has_row[i]) return reject();
      has_row[i] = 1;
      const at::Tensor& g = grad_of(i);
      if (!g.defined() || !is_plain_dense(g) || !is_supported_float(g.scalar_type())) {
        return reject();
      }
      if (groups_.empty() || groups_.back().device != g.device() ||
          groups_.back().dtype != g.scalar_type()) {
        const auto type = c10::DeviceTypeName(g.device().type(), /*lower_case=*/true);
        if (std::find(device_types.begin(), device_types.end(), type) == device_types.end()) {
          return reject();
        }
        for (const auto& earlier : groups_) {  // a (device, dtype) split over two runs: not ours
          if (earlier.device == g.device() && earlier.dtype == g.scalar_type()) return reject();
        }
        groups_.push_back({g.device(), g.scalar_type(), {}});
      }
      groups_.back().params.push_back(i);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (has_row[i]) continue;
      if (grad_of(i).defined()) return reject();
      absent_.push_back(i);
    }
    if (groups_.empty()) return reject();
    result_device_ = total_like.device();
    result_dtype_ = total_like.scalar_type();
    return true;
  }

  // [floats, counts, total_norm] as gradfuse.stats returns them, or [] when the gradients do not
  // match the plan.
  std::vector<at::Tensor> stats(double norm_type) {
    at::Tensor floats, counts;
    if (!rows(norm_type, floats, counts)) return {};
    return {floats, counts, total_norm(floats, counts, norm_type)};
  }

  // stats, then scales the gradients in place so their total norm is at most max_norm:
  // [floats, counts, total_norm, clip_coef], or [] (nothing touched) on a mismatch.
  std::vector<at::Tensor> clip(double norm_type, double max_norm) {
    at::Tensor floats, counts;
    if (!rows(norm_type, floats, counts)) return {};
    auto total = total_norm(floats, counts, norm_type);
    auto coef = gradfuse::clip_coef(total, max_norm);
    if (!scale(coef)) return {};  // nothing was touched
    return {floats, counts, total, coef};
  }

  // Scales this step's gradients by the coefficient for `total` (a total norm from stats()):
  // [clip_coef], or [] (nothing touched) on a mismatch.
  std::vector<at::Tensor> clip_to(const at::Tensor& total, double max_norm) {
    if (!absent_still_absent()) return {};
    auto coef = gradfuse::clip_coef(total, max_norm);
    if (!scale(coef)) return {};
    return {coef};
  }

  // Scales this step's gradients in place by `coef` (0-d; the scale runs only where it is < 1,
  // as api._scale_): gradfuse.ZClip's coefficient, computed on the device. False (nothing
  // touched) on a mismatch.
  bool scale_by(const at::Tensor& coef) { return scale(coef); }

  // ListWalk (below, for gradfuse.stats / clip_ / clip_grad_norm_ on a list): the parameters of
  // one call, borrowed from the caller's list (which holds them while the call runs, the GIL
  // held), and forgotten when it returns. No reference is taken: a reference count is a write
  // to each TensorImpl's cache line, twice per parameter.
  void borrow_params(std::vector<c10::TensorImpl*>&& impls) { impls_ = std::move(impls); }
  void forget_params() { impls_.clear(); }

 private:
  int64_t size() const { return static_cast<int64_t>(impls_.size()); }

  // Tensor::grad() also asks autograd whether the tensor is a leaf (to warn about non-leaf
  // reads), a virtual call per parameter; the value read is the same.
  const at::Tensor& grad_of(int64_t i) const { return impls_[i]->grad(); }

  // Reading a gradient and handing it to the kernel follows five pointers per parameter
  // (parameter, autograd meta, gradient, storage, data), each a cache miss on a model of
  // thousands of parameters. Prefetching each link a few parameters ahead of the next keeps
  // several misses in flight instead of waiting for each in turn; a prefetch is only a hint.
  void prefetch_ahead(const std::vector<int64_t>& idx, size_t j) const {
    constexpr size_t kAhead = 8;
    const size_t n = idx.size();
    if (j + 5 * kAhead < n) __builtin_prefetch(impls_[idx[j + 5 * kAhead]]);
    if (j + 4 * kAhead < n) {
      if (const auto* meta = impls_[idx[j + 4 * kAhead]]->autograd_meta()) {
        __builtin_prefetch(meta);
        __builtin_prefetch(reinterpret_cast<const char*>(meta) + 64);
      }
    }
    if (j + 3 * kAhead < n) {
      const at::Tensor& g = grad_of(idx[j + 3 * kAhead]);
      if (g.defined()) {
        const auto* impl = reinterpret_cast<const char*>(g.unsafeGetTensorImpl());
        for (size_t offset = 0; offset < sizeof(c10::TensorImpl); offset += 64) {
          __builtin_prefetch(impl + offset);
        }
      }
    }
    // Only plain tensors: a subclass's storage offset may be computed in Python.
    if (j + 2 * kAhead < n) {
      const at::Tensor& g = grad_of(idx[j + 2 * kAhead]);
      if (g.defined() && is_plain_dense(g) && g.has_storage()) {
        __builtin_prefetch(g.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
      }
    }
    if (j + kAhead < n) {
      const at::Tensor& g = grad_of(idx[j + kAhead]);
      if (g.defined() && is_plain_dense(g) && g.has_storage()) {
        try {  // a storage whose data was released throws on access; the kernel will say so
          const auto* data = static_cast<const char*>(
              g.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()->data());
          if (data != nullptr) __builtin_prefetch(data + g.storage_offset() * g.itemsize());
        } catch (const c10::Error&) {
        }
      }
    }
  }

  bool reject() {
    groups_.clear();
    absent_.clear();
    return false;
  }

  // The gradients of every group, when they match the plan.
  bool absent_still_absent() const {
    if (groups_.empty()) return false;
    for (const int64_t i : absent_) {
      if (grad_of(i).defined()) return false;
    }
    return true;
  }

  bool read_grads(std::vector<std::vector<at::Tensor>>& out) const {
    if (!absent_still_absent()) return false;
    out.resize(groups_.size());
    for (size_t k = 0; k < groups_.size(); ++k) {
      const Group& group = groups_[k];
      auto& grads = out[k];
      grads.reserve(group.params.size());
      const auto& idx = group.params;
      for (size_t j = 0; j < idx.size(); ++j) {
        prefetch_ahead(idx, j);
        const at::Tensor& g = grad_of(idx[j]);
        if (!g.defined() || g.scalar_type() != group.dtype || g.device() != group.device ||
            !is_plain_dense(g)) {
          return false;
        }
        grads.push_back(g);
      }
    }
    return true;
  }

  enum class Read { kMismatch, kSpans, kNotDense };

  // One CPU group's gradients read straight into the stats kernels' spans, in the pass that
  // checks them against the plan: no second pass in the op, no reference taken. kNotDense: a
  // gradient is not non-overlapping and dense (the op makes a copy; the tensor path serves it).
  Read read_cpu_inputs(cpu::StatsInputs& in) const {
    if (!absent_still_absent()) return Read::kMismatch;
    const Group& group = groups_[0];
    const auto& idx = group.params;
    in.reserve(idx.size());
    for (size_t j = 0; j < idx.size(); ++j) {
      prefetch_ahead(idx, j);
      const at::Tensor& g = grad_of(idx[j]);
      if (!g.defined() || g.scalar_type() != group.dtype || g.device() != group.device ||
          !is_plain_dense(g)) {
        return Read::kMismatch;
      }
      if (!g.is_non_overlapping_and_dense()) return Read::kNotDense;
      in.append(g.const_data_ptr(), g.numel());
    }
    in.finish(group.dtype);
    return Read::kSpans;
  }

  // Whether the rows may be computed without the dispatcher: one CPU group, and nobody who
  // would see the op's call (a TorchDispatchMode such as FlopCounterMode) is listening.
  bool direct_cpu() const {
    return groups_.size() == 1 && groups_[0].device.is_cpu() &&
           !c10::impl::TorchDispatchModeTLS::any_modes_set();
  }

  // The rows of this step's gradients ([n, 4] floats and counts), or false when the gradients
  // do not match the plan.
  bool rows(double norm_type, at::Tensor& floats, at::Tensor& counts) const {
    if (direct_cpu()) {
      cpu::StatsInputs in;
      const Read read = read_cpu_inputs(in);
      if (read == Read::kMismatch) return false;
      if (read == Read::kSpans) {
        RECORD_FUNCTION("gradfuse::multi_tensor_stats", std::vector<c10::IValue>());
        std::tie(floats, counts) = cpu::stats_of_inputs(in, groups_[0].dtype, norm_type);
        return true;
      }
    }
    std::vector<std::vector<at::Tensor>> grads;
    if (!read_grads(grads)) return false;
    std::tie(floats, counts) = group_stats(grads, norm_type);
    return true;
  }

  // Per-parameter rows, group after group, on the result's device (as api._fused_stats).
  std::tuple<at::Tensor, at::Tensor> group_stats(
      const std::vector<std::vector<at::Tensor>>& grads, double norm_type) const {
    // The ops have no autograd kernel: skip the autograd fallback, which would box the list.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (grads.size() == 1) {
      auto [f, c] = stats_op().call(grads[0], norm_type);
      return {f.to(result_device_), c.to(result_device_)};
    }
    std::vector<at::Tensor> floats, counts;
    for (const auto& g : grads) {
      auto [f, c] = stats_op().call(g, norm_type);
      floats.push_back(f.to(result_device_));
      counts.push_back(c.to(result_device_));
    }
    return {at::cat(floats), at::cat(counts)};
  }

  // The total norm (common/engine.h) in the dtype clip_grad_norm_ returns.
  at::Tensor total_norm(const at::Tensor& floats, const at::Tensor& counts, double p) const {
    return gradfuse::total_norm(floats, counts, p).to(result_dtype_);
  }

  // Scales this step's gradients by `coef` where it is < 1 (the conditional scale op); false
  // (nothing touched) when they do not match the plan. A CPU coefficient that needs no scaling
  // is read here (no sync) and the gradients are not walked at all: the op would return
  // without touching them. Not under a TorchDispatchMode: that reads nothing, as on a GPU.
  bool scale(const at::Tensor& coef) const {
    if (coef.device().is_cpu() && !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
        !needs_scaling(coef.item<double>())) {
      return absent_still_absent();
    }
    std::vector<std::vector<at::Tensor>> grads;
    if (!read_grads(grads)) return false;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (const auto& g : grads) {
      scale_op().call(g, coef.to(g[0].device()), /*conditional=*/true);
    }
    return true;
  }

  std::vector<at::Tensor> params_;  // gradfuse.watch's parameters (none for a ListWalk)
  std::vector<c10::TensorImpl*> impls_;  // params_'s, or a ListWalk call's borrowed ones
  std::vector<Group> groups_;
  std::vector<int64_t> absent_;  // parameters without a gradient when the plan was made
  c10::Device result_device_{c10::DeviceType::CPU};
  at::ScalarType result_dtype_{at::kFloat};
};

// The functional calls' walk (gradfuse/core/walk_cache.py): a plan made from an earlier call on a
// list of parameters or (name, parameter) pairs, and each call's items read from the caller's
// list here, in C++, instead of Python building names, parameters and gradients lists. The plan
// keeps no tensor: a ParamWatch whose parameters are the call's items while it runs (so a cached
// plan keeps no model alive), and the names as Python strings. Every item is checked against the
// plan (its kind, its name, its type: exactly torch.Tensor or nn.Parameter), then the
// ParamWatch checks every gradient as for gradfuse.watch; any difference is "no match" (None),
// and Python takes the functional path for that call.
class __attribute__((visibility("hidden"))) ListWalk {
 public:
  // names[i]: the name of item i when it is a (name, parameter) pair, None when it is a tensor
  // (named "[i]" by gradfuse.core.params); types: the exact parameter types taken.
  ListWalk(pybind11::list names, pybind11::tuple types)
      : names_(std::move(names)), types_(std::move(types)),
        watch_(c10::make_intrusive<ParamWatch>(std::vector<at::Tensor>())) {}

  bool plan(pybind11::handle items, pybind11::list rows, pybind11::handle total_like,
            pybind11::list device_types) {
    Loaded loaded(*this, items);
    if (!loaded.ok) return false;
    std::vector<int64_t> r;
    r.reserve(rows.size());
    for (auto row : rows) r.push_back(row.cast<int64_t>());
    std::vector<std::string> types;
    for (auto t : device_types) types.push_back(t.cast<std::string>());
    planned_ = watch_->plan(r, THPVariable_Unpack(total_like.ptr()), types);
    return planned_;
  }

  // (floats, counts, total_norm) as gradfuse.stats returns them, or None.
  pybind11::object stats(pybind11::handle items, double norm_type) {
    if (!planned_) return pybind11::none();
    Loaded loaded(*this, items);
    if (!loaded.ok) return pybind11::none();
    return wrap(watch_->stats(norm_type));
  }

  // (floats, counts, total_norm, clip_coef) after scaling the gradients, as gradfuse.clip_, or
  // None with nothing touched.
  pybind11::object clip(pybind11::handle items, double norm_type, double max_norm) {
    if (!planned_) return pybind11::none();
    Loaded loaded(*this, items);
    if (!loaded.ok) return pybind11::none();
    return wrap(watch_->clip(norm_type, max_norm));
  }

  // (clip_coef,) after scaling this call's gradients for `total` (from stats on the same items),
  // or None with nothing touched.
  pybind11::object clip_to(pybind11::handle items, pybind11::handle total, double max_norm) {
    if (!planned_) return pybind11::none();
    Loaded loaded(*this, items);
    if (!loaded.ok) return pybind11::none();
    return wrap(watch_->clip_to(THPVariable_Unpack(total.ptr()), max_norm));
  }

 private:
  // The items of a call in the ParamWatch while it runs (released by the destructor, also when
  // a kernel throws).
  struct Loaded {
    Loaded(ListWalk& w, pybind11::handle items) : walk(w) { ok = walk.load(items); }
    ~Loaded() { walk.watch_->forget_params(); }
    ListWalk& walk;
    bool ok = false;
  };

  bool takes_type(PyObject* obj) const {
    auto* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
    for (auto t : types_) {
      if (t.ptr() == type) return true;
    }
    return false;
  }

  bool load(pybind11::handle items) {
    PyObject* seq = items.ptr();
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return false;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n != static_cast<Py_ssize_t>(names_.size())) return false;
    PyObject** item = PySequence_Fast_ITEMS(seq);
    PyObject** names = PySequence_Fast_ITEMS(names_.ptr());
    std::vector<c10::TensorImpl*> impls;
    impls.reserve(n);
    constexpr Py_ssize_t kAhead = 8;  // each item is two dependent misses (pair, tensor object)
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (i + 2 * kAhead < n) __builtin_prefetch(item[i + 2 * kAhead]);
      if (i + kAhead < n) {
        PyObject* ahead = item[i + kAhead];
        if (PyTuple_CheckExact(ahead) && PyTuple_GET_SIZE(ahead) == 2) {
          __builtin_prefetch(PyTuple_GET_ITEM(ahead, 1));
        }
      }
      PyObject* obj = item[i];
      PyObject* name = names[i];
      if (name == Py_None) {  // a tensor, named "[i]"
        if (!takes_type(obj)) return false;
      } else {
        if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return false;
        PyObject* got = PyTuple_GET_ITEM(obj, 0);
        if (got != name && !(PyUnicode_CheckExact(got) && PyUnicode_Compare(got, name) == 0)) {
          return false;
        }
        obj = PyTuple_GET_ITEM(obj, 1);
        if (!takes_type(obj)) return false;
      }
      impls.push_back(THPVariable_Unpack(obj).unsafeGetTensorImpl());
    }
    watch_->borrow_params(std::move(impls));
    return true;
  }

  static pybind11::object wrap(const std::vector<at::Tensor>& out) {
    if (out.empty()) return pybind11::none();
    pybind11::tuple t(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      t[i] = pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(out[i]));
    }
    return t;
  }

  pybind11::list names_;
  pybind11::tuple types_;
  c10::intrusive_ptr<ParamWatch> watch_;
  bool planned_ = false;
};

void bind_list_walk(pybind11::module_& m) {
  pybind11::class_<ListWalk>(m, "ListWalk")
      .def(pybind11::init<pybind11::list, pybind11::tuple>())
      .def("plan", &ListWalk::plan)
      .def("stats", &ListWalk::stats)
      .def("clip", &ListWalk::clip)
      .def("clip_to", &ListWalk::clip_to);
}

TORCH_LIBRARY_FRAGMENT(gradfuse, m) {
  m.class_<ParamWatch>("ParamWatch")
      .def(torch::init<std::vector<at::Tensor>>())
      .def("plan", &ParamWatch::plan)
      .def("stats", &ParamWatch::stats)
      .def("clip", &ParamWatch::clip)
      .def("clip_to", &ParamWatch::clip_to)
      .def("scale_by", &ParamWatch::scale_by);
}

}  // namespace gradfuse::watch
