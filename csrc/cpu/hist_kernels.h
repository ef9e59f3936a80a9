// The exponent histogram's per-chunk kernels with AVX2 (hist_avx2.cpp), chosen at run time by
// hist_cpu.cpp when the active CPU capability is "avx2". They count a chunk into the same
// kNumHistBins rows as hist_cpu.cpp's default loop (common/hist_math.h: pass 1 by exponent field,
// pass 2 only for a chunk with a count in the lumped low / high row).
#pragma once

#include <cstdint>

namespace gradfuse::cpu {

// The fields counted in vector registers, carried from one chunk to the next of the same worker
// (consecutive chunks mostly come from one tensor, with one distribution of exponents).
struct HistHotFields {
  bool valid = false;
  uint8_t field[16] = {};
};

#if defined(__x86_64__) || defined(_M_X64)
#define GRADFUSE_HAVE_AVX2_HISTOGRAM 1
// Counts x[0, n) (n <= kChunkElems) into out[kNumHistBins] (every row written).
void histogram_chunk_avx2_fp32(const char* x, int64_t n, int32_t* out, HistHotFields* hot);
void histogram_chunk_avx2_bf16(const char* x, int64_t n, int32_t* out, HistHotFields* hot);
void histogram_chunk_avx2_fp16(const char* x, int64_t n, int32_t* out, HistHotFields* hot);
// Their counting loop with AVX-512 (64 elements per step) where the CPU has AVX512BW,
// AVX512_BITALG and GFNI (histogram_avx512_available()); on by default there, off with
// GRADFUSE_HISTOGRAM_AVX512=0 (read once) or set_histogram_avx512(false), so the tests run both.
bool histogram_avx512_available();
bool histogram_avx512();
void set_histogram_avx512(bool on);
#endif

}  // namespace gradfuse::cpu
