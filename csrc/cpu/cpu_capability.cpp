#include "cpu_capability.h"

#include <c10/util/Exception.h>

#include <cstdlib>

#include "stats_kernels.h"

namespace gradfuse::cpu {
namespace {

std::string& capability_slot() {
  static std::string isa = [] {
    const char* env = std::getenv("GRADFUSE_CPU_CAPABILITY");
    if (env == nullptr || *env == '\0') return best_cpu_capability();
    std::string want(env);
    TORCH_CHECK(want == "default" || want == "avx2",
                "GRADFUSE_CPU_CAPABILITY must be 'default' or 'avx2', got '", want, "'");
    TORCH_CHECK(want == "default" || best_cpu_capability() == "avx2",
                "GRADFUSE_CPU_CAPABILITY=avx2 but this CPU or build has no AVX2 kernels");
    return want;
  }();
  return isa;
}

}  // namespace

std::string best_cpu_capability() {
#ifdef GRADFUSE_HAVE_AVX2_KERNELS
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    return "avx2";
  }
#endif
  return "default";
}

const std::string& active_cpu_capability() { return capability_slot(); }

void set_cpu_capability(const std::string& isa) {
  TORCH_CHECK(isa == "default" || isa == "avx2",
              "cpu capability must be 'default' or 'avx2', got '", isa, "'");
  TORCH_CHECK(isa == "default" || best_cpu_capability() == "avx2",
              "cannot select avx2: this CPU or build has no AVX2 kernels");
  capability_slot() = isa;
}

}  // namespace gradfuse::cpu
