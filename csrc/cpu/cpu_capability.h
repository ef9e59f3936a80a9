// Which build of the CPU kernels runs: "avx2" where the CPU has AVX2 and FMA, else "default".
// GRADFUSE_CPU_CAPABILITY=default (read once) or set_cpu_capability() forces the default build,
// so the tests can run both on one machine.
#pragma once

#include <string>

namespace gradfuse::cpu {

std::string best_cpu_capability();
const std::string& active_cpu_capability();
void set_cpu_capability(const std::string& isa);

}  // namespace gradfuse::cpu
