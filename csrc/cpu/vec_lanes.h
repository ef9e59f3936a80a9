// Lane-wise helpers of the CPU kernels that form optimizer updates (update_kernels_impl.h,
// step_kernels_impl.h), inside their instruction set's namespace: included by a kernel file after
// CPU_CAPABILITY is defined.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace gradfuse::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// update_math.h's mul_rn, lane-wise: a * b rounded on its own. The empty asm statement takes the
// product as an opaque register (memory for the generic vector), so the compiler cannot contract
// it with the addition that follows into an FMA (g++ contracts vector arithmetic on an FMA target).
template <typename acc_t>
inline Vectorized<acc_t> vec_mul_rn(const Vectorized<acc_t>& a, const Vectorized<acc_t>& b) {
  Vectorized<acc_t> product = a * b;
#if defined(CPU_CAPABILITY_AVX2) && defined(__GNUC__)
  if constexpr (std::is_same_v<acc_t, float>) {
    __m256 r = product;
    __asm__("" : "+x"(r));
    return Vectorized<acc_t>(r);
  } else {
    __m256d r = product;
    __asm__("" : "+x"(r));
    return Vectorized<acc_t>(r);
  }
#elif defined(__GNUC__)
  __asm__("" : "+m"(product));
  return product;
#else
  return product;
#endif
}

template <typename acc_t>
inline acc_t lane_sum(const Vectorized<acc_t>& v) {
  acc_t b[Vectorized<acc_t>::size()];
  v.store(b);
  acc_t t = 0;
  for (int i = 0; i < Vectorized<acc_t>::size(); ++i) t += b[i];  // in lane order
  return t;
}

template <typename acc_t>
inline int64_t lane_count(const Vectorized<acc_t>& v) {
  acc_t b[Vectorized<acc_t>::size()];
  v.store(b);
  int64_t t = 0;
  for (int i = 0; i < Vectorized<acc_t>::size(); ++i) t += static_cast<int64_t>(b[i]);  // exact: <= 2^24
  return t;
}

}  // namespace
}  // namespace gradfuse::cpu::CPU_CAPABILITY
