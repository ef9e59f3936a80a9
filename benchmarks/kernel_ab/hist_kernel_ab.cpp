// Single-thread A/B of the AVX2 exponent-histogram chunk kernel: the working tree's
// csrc/cpu/hist_avx2.cpp (namespace gf_new) against the same file of an older commit (gf_old),
// both compiled by hist_run.sh. Per value distribution, 8M elements (32 MB fp32 / 16 MB bf16)
// counted chunk by chunk as hist_cpu.cpp does, old, new (with its AVX-512 loop where the CPU has
// one, and again with its AVX2 loop) and a read of the same bytes (a plain 4-accumulator AVX2
// sum) interleaved; medians of CPU time; the counts of old and new must agree.
// "cache": 256K elements, reread 32 times (the in-cache compute rate).
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define DECLARE(ns)                                                                        \
  namespace ns::cpu {                                                                      \
  struct HistHotFields { bool valid = false; uint8_t field[16] = {}; };                    \
  void histogram_chunk_avx2_fp32(const char*, int64_t, int32_t*, HistHotFields*);          \
  void histogram_chunk_avx2_bf16(const char*, int64_t, int32_t*, HistHotFields*);          \
  }
DECLARE(gf_old)
DECLARE(gf_new)
namespace gf_new::cpu {
bool histogram_avx512_available();
void set_histogram_avx512(bool on);
}

constexpr int64_t kChunk = 65536;  // common/chunk_plan.h kChunkElems
constexpr int kBins = 283;         // common/hist_math.h kNumHistBins
static int g_repeat = 1;
static double g_sink = 0;

static double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

template <class Hot, class F>
static double histogram(F fn, const char* x, int64_t n, int esz, std::vector<int64_t>& total) {
  Hot hot;
  std::vector<int32_t> out(kBins);
  total.assign(kBins, 0);
  const double t0 = cpu_seconds();
  for (int r = 0; r < g_repeat; ++r)
    for (int64_t i = 0; i < n; i += kChunk) {
      fn(x + i * esz, std::min(kChunk, n - i), out.data(), &hot);
      for (int b = 0; b < kBins; ++b) total[b] += out[b];
    }
  return (cpu_seconds() - t0) / g_repeat;
}

__attribute__((target("avx2"))) static double read_sum(const char* x, int64_t bytes) {
  const double t0 = cpu_seconds();
  for (int r = 0; r < g_repeat; ++r) {
    const float* p = reinterpret_cast<const float*>(x);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i + 32 <= bytes / 4; i += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(p + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(p + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(p + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(p + i + 24));
    }
    float b[8];
    _mm256_storeu_ps(b, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    g_sink += b[0];
  }
  return (cpu_seconds() - t0) / g_repeat;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15;
  const bool in_cache = argc > 2 && std::string(argv[2]) == "cache";
  const int64_t n = in_cache ? (256 << 10) : (8 << 20);
  if (in_cache) g_repeat = 32;
  std::printf("%s, %d rounds, one thread, CPU time; GB/s of the input bytes\n",
              in_cache ? "256K elements reread 32 times (in cache)" : "8M elements (out of cache)", reps);
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(-1, 1);
  const char* names[] = {"uniform(-1, 1)", "randn * 1e-3", "constant 0.25", "randn * 2^(-20..19)"};
  for (int d = 0; d < 4; ++d) {
    std::vector<float> f(n);
    for (int64_t i = 0; i < n; ++i)
      f[i] = d == 0 ? uniform(gen) : d == 1 ? normal(gen) * 1e-3f : d == 2 ? 0.25f
             : normal(gen) * std::ldexp(1.f, static_cast<int>(i / kChunk % 40) - 20);
    std::vector<uint16_t> bf(n);
    for (int64_t i = 0; i < n; ++i) {
      uint32_t b;
      std::memcpy(&b, &f[i], 4);
      bf[i] = static_cast<uint16_t>(b >> 16);  // truncation: any bf16 values will do
    }
    for (int dt = 0; dt < 2; ++dt) {
      const int esz = dt == 0 ? 4 : 2;
      const char* x = dt == 0 ? reinterpret_cast<const char*>(f.data()) : reinterpret_cast<const char*>(bf.data());
      std::vector<double> t_old, t_new, t_new2, t_read;
      std::vector<int64_t> c_old, c_new, c_new2;
      const bool wide = gf_new::cpu::histogram_avx512_available();
      for (int r = 0; r < reps; ++r) {
        auto fo = dt == 0 ? gf_old::cpu::histogram_chunk_avx2_fp32 : gf_old::cpu::histogram_chunk_avx2_bf16;
        auto fn = dt == 0 ? gf_new::cpu::histogram_chunk_avx2_fp32 : gf_new::cpu::histogram_chunk_avx2_bf16;
        t_old.push_back(histogram<gf_old::cpu::HistHotFields>(fo, x, n, esz, c_old));
        gf_new::cpu::set_histogram_avx512(wide);
        t_new.push_back(histogram<gf_new::cpu::HistHotFields>(fn, x, n, esz, c_new));
        gf_new::cpu::set_histogram_avx512(false);
        t_new2.push_back(histogram<gf_new::cpu::HistHotFields>(fn, x, n, esz, c_new2));
        t_read.push_back(read_sum(x, n * esz));
        if (c_old != c_new || c_old != c_new2) {
          std::printf("counts differ: %s %s\n", names[d], dt == 0 ? "fp32" : "bf16");
          return 1;
        }
      }
      const double gb = n * esz / 1e9;
      std::printf("%-20s %s  old %6.2f  new %6.2f (%s)  new/old %.2fx  new, AVX2 loop %6.2f  read %6.2f  new %3.0f%% of read\n",
                  names[d], dt == 0 ? "fp32" : "bf16", gb / median(t_old), gb / median(t_new),
                  wide ? "AVX-512 loop" : "AVX2 loop", median(t_old) / median(t_new), gb / median(t_new2),
                  gb / median(t_read), 100 * median(t_read) / median(t_new));
    }
  }
  return g_sink == 42.0;
}
