// The exponent histogram's chunk kernels for AVX2 CPUs, chosen at run time by
// hist_cpu.cpp (cpu_capability "avx2"); the default loop in hist_cpu.cpp stays for other CPUs.
// Where the CPU also has AVX512BW, AVX512_BITALG and GFNI, the same chunk driver counts its
// window with count_block512 (64 elements per step) instead of count_block.
//
// The default loop costs one read-modify-write of a counter per element (~1.2 ns per element
// on the 2-core EPYC VM, about twice a read of the same bytes for 2-byte dtypes). Gradients put
// most elements into a few exponent fields (uniform(-1, 1): 1/2, 1/4, 1/8, ... in the fields
// just below 1; a normal distribution ~99% in eight binades; a constant tensor in one), so here:
//
//  - 32 elements at a time are reduced to 32 bytes of exponent fields (a shift, an AND and
//    unsigned-saturating packs: the fields are <= 255, and lane order does not matter for counts);
//  - a window of eight consecutive "hot" fields [lo, lo + 8) is counted in byte counters: d =
//    field - lo, then compare-and-subtract per k = 0..7 (vpcmpeqb, vpsubb), emptied into 64-bit
//    totals (vpsadbw) every block of 64 vectors (< 255 per lane);
//  - min(d, 7) == d (unsigned) marks the lanes in the window; the others' masks are stored and,
//    after the block's loop, those elements (rare) are read again by lane index and counted one
//    by one (movemask, bit loop), so the vector loop has no branch.
//
// The window comes from the previous chunk of the same worker (its whole histogram), or, for
// a worker's first chunk and after a block where more than 1/16 of the lanes missed them, from a
// sample: the next 256 elements counted by the scalar loop. When the window covers less
// than 7/8 of a sample (exponents spread over many binades), the next 2048 elements go through a
// scalar loop (four histograms in turn, as hist_cpu.cpp's) and another sample is taken after.
// Pass 2 (only for chunks with a count in the lumped low / high row) is vectorized as well: zeros
// are counted by compare-and-subtract, and only subnormals, Inf and NaN go to exponent_bin().
// The counts are those of common/hist_math.h; the tests compare them with torch.frexp.
//
// Each function that uses AVX2 carries the target attribute (no file-wide pragma): the inline
// functions of the shared headers instantiated here stay default-ISA code for the linker.
#include "hist_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../common/chunk_plan.h"
#include "../common/hist_math.h"

#define GF_HIST_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))
#if defined(__GNUC__) && !defined(__clang__)
#define GF_SCHED_PRESSURE __attribute__((optimize("sched-pressure", "schedule-insns"), noinline))
#else
#define GF_SCHED_PRESSURE
#endif
// AVX-512 (BW for bytes and masks, BITALG for vpopcntb, GFNI for the bit transpose) where the
// compiler can emit it; chosen at run time (histogram_avx512_available()).
#if defined(__GNUC__) && (__GNUC__ >= 9 || defined(__clang__))
#define GF_HIST_HAVE_AVX512 1
#define GF_HIST_AVX512 __attribute__((target("avx512f,avx512bw,avx512bitalg,gfni,avx2,bmi,bmi2,popcnt")))
#define GF_HIST_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512bitalg,gfni,avx2,bmi,bmi2,popcnt"), always_inline)) inline
#endif
#define GF_HIST_AVX2_INLINE __attribute__((target("avx2,bmi,bmi2,popcnt"), always_inline)) inline

namespace gradfuse::cpu {
namespace {

constexpr int kMaxHot = sizeof(HistHotFields::field);  // fields a carry can hold
constexpr int kVec = 32;            // elements per vector of fields (one byte each)
constexpr int kBlockVecs = 64;      // vectors per block (byte counters: at most 64 per lane)
constexpr int kSample = 256;        // elements counted to choose the hot fields
constexpr int kScalarRun = 2048;    // elements counted by the scalar loop when they cover too little

template <typename L>
inline int field_of(const char* x, int64_t i) {
  typename L::Bits b;
  std::memcpy(&b, x + i * static_cast<int64_t>(sizeof(b)), sizeof(b));
  return static_cast<int>((b >> L::kMantissaBits) & typename L::Bits(L::kMaxField));
}

// The window of kHot consecutive fields [lo, lo + kHot) of cnt[0, nf) with the largest total:
// its fields into `field` (lo, lo + 1, ...), that total returned. A window, not the kHot largest
// counts anywhere: one subtraction and one unsigned minimum tell whether a lane is in it, where
// eight ORs of the compares told whether it was among eight fields. Gradients' exponents
// cluster (uniform: the fields just below 1; normal: around the scale; a constant: one field).
template <int kHot>
inline int64_t choose_window(const int32_t* cnt, int nf, uint8_t* field) {
  int64_t sum = 0;
  for (int f = 0; f < kHot; ++f) sum += cnt[f];
  int64_t best = sum;
  int lo = 0;
  for (int f = kHot; f < nf; ++f) {
    sum += cnt[f] - cnt[f - kHot];
    if (sum > best) { best = sum; lo = f - kHot + 1; }
  }
  for (int k = 0; k < kHot; ++k) field[k] = static_cast<uint8_t>(lo + k);
  return best;
}

// The element (0..31) whose field load_fields() puts into byte lane i: the packs interleave
// their inputs per 128-bit half (8 bytes of the first input, 8 of the second, per half).
struct LaneTable { uint8_t at[kVec]; };
template <typename L>
constexpr LaneTable lane_elements() {
  LaneTable t{};
  for (int i = 0; i < kVec; ++i) {
    const int j = i & 7, q = i >> 3;  // byte i: element j of pack input (q & 1), half (q >> 1)
    if constexpr (sizeof(typename L::Bits) == 2) {
      t.at[i] = static_cast<uint8_t>(16 * (q & 1) + 8 * (q >> 1) + j);
    } else {
      // 16-bit lane l = j + 8 * (q >> 1) of pack32 result (q & 1): its element r of input
      // (s & 1) in half (s >> 1), with r = l & 3, s = l >> 2; inputs 2 * (q & 1) + (s & 1).
      const int l = j + 8 * (q >> 1), r = l & 3, s = l >> 2;
      t.at[i] = static_cast<uint8_t>(8 * (2 * (q & 1) + (s & 1)) + 4 * (s >> 1) + r);
    }
  }
  return t;
}
template <typename L>
constexpr LaneTable kLaneElem = lane_elements<L>();

// 32 elements from p as 32 bytes of exponent fields (lane i: element kLaneElem<L>.at[i]).
template <typename L>
GF_HIST_AVX2_INLINE __m256i load_fields(const char* p) {
  const auto* v = reinterpret_cast<const __m256i*>(p);
  if constexpr (sizeof(typename L::Bits) == 4) {
    // sign and field (<= 511) per 32-bit lane, packed to 16 bits, the sign masked off there.
    const __m256i m = _mm256_set1_epi16(L::kMaxField);
    const __m256i a0 = _mm256_srli_epi32(_mm256_loadu_si256(v + 0), L::kMantissaBits);
    const __m256i a1 = _mm256_srli_epi32(_mm256_loadu_si256(v + 1), L::kMantissaBits);
    const __m256i a2 = _mm256_srli_epi32(_mm256_loadu_si256(v + 2), L::kMantissaBits);
    const __m256i a3 = _mm256_srli_epi32(_mm256_loadu_si256(v + 3), L::kMantissaBits);
    return _mm256_packus_epi16(_mm256_and_si256(_mm256_packus_epi32(a0, a1), m),
                               _mm256_and_si256(_mm256_packus_epi32(a2, a3), m));
  } else {
    static_assert(sizeof(typename L::Bits) == 2, "16- or 32-bit dtypes only");
    const __m256i m = _mm256_set1_epi16(L::kMaxField);
    const __m256i a0 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(v + 0), L::kMantissaBits), m);
    const __m256i a1 = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(v + 1), L::kMantissaBits), m);
    return _mm256_packus_epi16(a0, a1);
  }
}

GF_HIST_AVX2_INLINE int64_t hsum_epi64(__m256i v) {
  const __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

// Counts nvec (<= kBlockVecs) vectors of 32 elements from x: lanes holding a field of the window
// [lo, lo + 8) into tot[k] for field lo + k, the others into h. Returns how many lanes were not
// in the window.
// Register pressure decides the speed here (16 vector registers): the byte counters are eight
// named variables, the constants memory operands, and the loop has no branch (each vector's
// mask of lanes out of the window is stored, and those lanes are counted after the loop).
// GCC 12's default schedule still stored all eight counters on every vector (8 stores among 48
// instructions per 32 bf16 elements); register-pressure-aware scheduling (its own, GCC only;
// not inlined then) keeps them in registers (44, no store).
template <typename L>
GF_HIST_AVX2 GF_SCHED_PRESSURE int64_t count_block(const char* x, int64_t nvec, uint8_t lo_field,
                                                   int64_t* tot, int32_t* h) {
  constexpr int64_t kStride = kVec * static_cast<int64_t>(sizeof(typename L::Bits));
  const __m256i lo = _mm256_set1_epi8(static_cast<char>(lo_field));
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m256i last = _mm256_set1_epi8(7);
  uint32_t out_lanes[kBlockVecs];  // per vector, its lanes out of the window
  uint32_t any_out = 0;
  for (int64_t v = 0; v < nvec; ++v) {
    const __m256i d = _mm256_sub_epi8(load_fields<L>(x + v * kStride), lo);  // field - lo, mod 256
#define GF_COUNT_HOT(k) a##k = _mm256_sub_epi8(a##k, _mm256_cmpeq_epi8(d, _mm256_set1_epi8(k)));
    GF_COUNT_HOT(0) GF_COUNT_HOT(1) GF_COUNT_HOT(2) GF_COUNT_HOT(3)
    GF_COUNT_HOT(4) GF_COUNT_HOT(5) GF_COUNT_HOT(6) GF_COUNT_HOT(7)
#undef GF_COUNT_HOT
    const __m256i in_window = _mm256_cmpeq_epi8(_mm256_min_epu8(d, last), d);
    const uint32_t m = ~static_cast<uint32_t>(_mm256_movemask_epi8(in_window));
    out_lanes[v] = m;
    any_out |= m;
  }
  const __m256i z = _mm256_setzero_si256();
#define GF_EMPTY_COUNTER(k) tot[k] += hsum_epi64(_mm256_sad_epu8(a##k, z));
  GF_EMPTY_COUNTER(0) GF_EMPTY_COUNTER(1) GF_EMPTY_COUNTER(2) GF_EMPTY_COUNTER(3)
  GF_EMPTY_COUNTER(4) GF_EMPTY_COUNTER(5) GF_EMPTY_COUNTER(6) GF_EMPTY_COUNTER(7)
#undef GF_EMPTY_COUNTER
  int64_t missed = 0;
  if (any_out == 0) return 0;
  // The vectors with such lanes, listed without a branch: a branch per vector mispredicts when
  // a fraction of them have one (normally distributed values: about a third).
  uint8_t with_out[kBlockVecs];
  int n_with = 0;
  for (int v = 0; v < nvec; ++v) {
    with_out[n_with] = static_cast<uint8_t>(v);
    n_with += out_lanes[v] != 0;
  }
  for (int j = 0; j < n_with; ++j) {
    // the element of each such lane, read again by its index
    const int v = with_out[j];
    const char* xv = x + v * kStride;
    missed += _mm_popcnt_u32(out_lanes[v]);
    for (uint32_t m = out_lanes[v]; m != 0; m = _blsr_u32(m)) ++h[field_of<L>(xv, kLaneElem<L>.at[_tzcnt_u32(m)])];
  }
  return missed;
}

#ifdef GF_HIST_HAVE_AVX512
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_epi32() (a self-initialised variable),
// which -Wall reports as used uninitialized at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// 64 elements from p as 64 bytes of exponent fields, in some lane order (only counted, and the
// fields of lanes out of the window stored and counted one by one: the order never matters).
template <typename L>
GF_HIST_AVX512_INLINE __m512i load_fields512(const char* p) {
  const auto* v = reinterpret_cast<const __m512i*>(p);
  const __m512i m = _mm512_set1_epi16(L::kMaxField);
  if constexpr (sizeof(typename L::Bits) == 4) {
    const __m512i a0 = _mm512_srli_epi32(_mm512_loadu_si512(v + 0), L::kMantissaBits);
    const __m512i a1 = _mm512_srli_epi32(_mm512_loadu_si512(v + 1), L::kMantissaBits);
    const __m512i a2 = _mm512_srli_epi32(_mm512_loadu_si512(v + 2), L::kMantissaBits);
    const __m512i a3 = _mm512_srli_epi32(_mm512_loadu_si512(v + 3), L::kMantissaBits);
    return _mm512_packus_epi16(_mm512_and_si512(_mm512_packus_epi32(a0, a1), m),
                               _mm512_and_si512(_mm512_packus_epi32(a2, a3), m));
  } else {
    const __m512i a0 = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(v + 0), L::kMantissaBits), m);
    const __m512i a1 = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(v + 1), L::kMantissaBits), m);
    return _mm512_packus_epi16(a0, a1);
  }
}

// count_block with AVX-512 (BW, BITALG, GFNI): ngroups (<= kBlockGroups) groups of 64 elements.
// Per group, d = field - lo; the lanes with d < 8 get the byte 1 << d (a vpshufb table), the
// others 0; an affine transform over GF(2) with the matrix of the eight bytes of each 64-bit
// lane (vgf2p8affineqb) transposes those bytes' bits, so that byte k of a 64-bit lane holds bit
// k of each of its eight bytes, and vpopcntb turns that into how many of the eight hold field
// lo + k. Six vector instructions (subtract, min, vpshufb, vgf2p8affineqb, vpopcntb, add) count
// 64 elements, where count_block takes 17 (its subtract, 8 compares, 8 subtracts) for 32. The
// byte counters (at most 8 per group) are emptied every kBlockGroups groups. Lanes out of the
// window: the group's fields and mask are stored, and counted after the loop as in count_block.
constexpr int kBlockGroups = 31;  // 31 * 8 = 248 < 256
template <typename L>
GF_HIST_AVX512 int64_t count_block512(const char* x, int64_t ngroups, uint8_t lo_field, int64_t* tot,
                                      int32_t* h) {
  constexpr int64_t kStride = 64 * static_cast<int64_t>(sizeof(typename L::Bits));
  const __m512i lo = _mm512_set1_epi8(static_cast<char>(lo_field));
  const __m512i eight = _mm512_set1_epi8(8);
  const __m512i one_hot = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0));
  const __m512i bit_k = _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ULL));  // byte k: 1 << k
  __m512i acc = _mm512_setzero_si512();
  alignas(64) uint8_t fields[kBlockGroups][64];
  uint64_t out_lanes[kBlockGroups];
  uint64_t any_out = 0;
  for (int64_t g = 0; g < ngroups; ++g) {
    const __m512i f = load_fields512<L>(x + g * kStride);
    const __m512i d = _mm512_sub_epi8(f, lo);
    const __m512i bits = _mm512_shuffle_epi8(one_hot, _mm512_min_epu8(d, eight));
    // result byte k of each 64-bit lane, bit i: parity(bits.byte[7 - i] & (1 << k))
    const __m512i by_field = _mm512_gf2p8affine_epi64_epi8(bit_k, bits, 0);
    acc = _mm512_add_epi8(acc, _mm512_popcnt_epi8(by_field));
    const uint64_t m = ~static_cast<uint64_t>(_mm512_cmplt_epu8_mask(d, eight));
    out_lanes[g] = m;
    any_out |= m;
    _mm512_store_si512(fields[g], f);
  }
  // byte 8q + k of acc counts field lo + k: widened to 16 bits and halved three times (sums of
  // at most 8 * 248), the eight words are the counts of the block
  const __m512i w = _mm512_add_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(acc)),
                                     _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(acc, 1)));
  const __m256i w2 = _mm256_add_epi16(_mm512_castsi512_si256(w), _mm512_extracti64x4_epi64(w, 1));
  alignas(16) uint16_t c[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(c),
                  _mm_add_epi16(_mm256_castsi256_si128(w2), _mm256_extracti128_si256(w2, 1)));
  for (int k = 0; k < 8; ++k) tot[k] += c[k];
  if (any_out == 0) return 0;
  uint8_t with_out[kBlockGroups];  // listed without a branch, as in count_block
  int n_with = 0;
  for (int g = 0; g < ngroups; ++g) {
    with_out[n_with] = static_cast<uint8_t>(g);
    n_with += out_lanes[g] != 0;
  }
  int64_t missed = 0;
  for (int j = 0; j < n_with; ++j) {
    const int g = with_out[j];
    missed += _mm_popcnt_u64(out_lanes[g]);
    for (uint64_t m = out_lanes[g]; m != 0; m = _blsr_u64(m)) ++h[fields[g][_tzcnt_u64(m)]];
  }
  return missed;
}
#pragma GCC diagnostic pop
#endif  // GF_HIST_HAVE_AVX512

// Pass 2 (common/hist_math.h), for a chunk with a count in the lumped low or high row: zeros
// counted in vector lanes and moved to kBinZero at the end; subnormals, Inf, NaN (and nothing
// else: every other element has a hot row that is its bin) one by one through exponent_bin().
template <typename L>
GF_HIST_AVX2 void exact_pass(const char* x, int64_t n, int32_t* out) {
  using B = typename L::Bits;
  constexpr int kLanes = 32 / static_cast<int>(sizeof(B));
  int64_t zeros = 0;
  int64_t i = 0;
  if constexpr (sizeof(B) == 4) {
    const __m256i fm = _mm256_set1_epi32(static_cast<int>(uint32_t(L::kMaxField) << L::kMantissaBits));
    const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i z = _mm256_setzero_si256();
    __m256i nz = z;
    for (; i + kLanes <= n; i += kLanes) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * 4));
      const __m256i e = _mm256_and_si256(v, fm);
      const __m256i special = _mm256_or_si256(_mm256_cmpeq_epi32(e, z), _mm256_cmpeq_epi32(e, fm));
      const __m256i zero = _mm256_cmpeq_epi32(_mm256_and_si256(v, mag), z);
      nz = _mm256_sub_epi32(nz, zero);
      uint32_t m = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(zero, special))));
      for (; m != 0; m = _blsr_u32(m)) {
        B bits;
        std::memcpy(&bits, x + (i + _tzcnt_u32(m)) * 4, 4);
        --out[hot_row<L>(bits)];
        ++out[exponent_bin<L>(bits)];
      }
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), nz);
    for (int k = 0; k < 8; ++k) zeros += lanes[k];
  } else {
    const __m256i fm = _mm256_set1_epi16(static_cast<int16_t>(L::kMaxField << L::kMantissaBits));
    const __m256i mag = _mm256_set1_epi16(0x7FFF);
    const __m256i z = _mm256_setzero_si256();
    __m256i nz = z;  // at most kChunkElems / 16 = 4096 per 16-bit lane
    for (; i + kLanes <= n; i += kLanes) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * 2));
      const __m256i e = _mm256_and_si256(v, fm);
      const __m256i special = _mm256_or_si256(_mm256_cmpeq_epi16(e, z), _mm256_cmpeq_epi16(e, fm));
      const __m256i zero = _mm256_cmpeq_epi16(_mm256_and_si256(v, mag), z);
      nz = _mm256_sub_epi16(nz, zero);
      uint32_t m = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_andnot_si256(zero, special))) & 0x55555555u;
      for (; m != 0; m = _blsr_u32(m)) {
        B bits;
        std::memcpy(&bits, x + (i + (_tzcnt_u32(m) >> 1)) * 2, 2);
        --out[hot_row<L>(bits)];
        ++out[exponent_bin<L>(bits)];
      }
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_madd_epi16(nz, _mm256_set1_epi16(1)));
    for (int k = 0; k < 8; ++k) zeros += lanes[k];
  }
  out[L::kLowRow] -= static_cast<int32_t>(zeros);
  out[kBinZero] += static_cast<int32_t>(zeros);
  for (; i < n; ++i) {
    B bits;
    std::memcpy(&bits, x + i * static_cast<int64_t>(sizeof(B)), sizeof(B));
    const int row = hot_row<L>(bits);
    if (needs_exact_bin<L>(row)) {
      --out[row];
      ++out[exponent_bin<L>(bits)];
    }
  }
}

// kWide: AVX-512 groups of 64 (count_block512), else AVX2 vectors of 32 (count_block).
template <typename L, int kHot, bool kWide>
GF_HIST_AVX2 void histogram_chunk(const char* x, int64_t n, int32_t* out, HistHotFields* carry) {
  constexpr int64_t kStep = kWide ? 64 : kVec;  // elements per vector
  constexpr int kFields = L::kMaxField + 1;
  constexpr int64_t kElemBytes = sizeof(typename L::Bits);
  alignas(64) int32_t h[kFields];   // counts per exponent field
  alignas(64) int32_t h4[4][kFields];  // the scalar loop's four histograms, zeroed when first used
  bool h4_used = false;
  std::memset(h, 0, sizeof(h));
  uint8_t field[kHot];
  std::memcpy(field, carry->field, kHot);
  bool need_sample = !carry->valid;
  int64_t tot[kHot] = {};  // counts of the window's fields field[k]

  int64_t pos = 0;
  while (n - pos >= kStep) {
    if (need_sample) {
      need_sample = false;
      for (int k = 0; k < kHot; ++k) {  // the totals belong to the fields they were counted for
        h[field[k]] += static_cast<int32_t>(tot[k]);
        tot[k] = 0;
      }
      int32_t s[kFields];
      std::memset(s, 0, sizeof(s));
      const int64_t end = std::min<int64_t>(n, pos + kSample);
      for (int64_t i = pos; i < end; ++i) ++s[field_of<L>(x, i)];
      for (int f = 0; f < kFields; ++f) h[f] += s[f];
      const int64_t covered = choose_window<kHot>(s, kFields, field);
      if (covered * 8 < (end - pos) * 7) {  // spread over many fields: the scalar loop, then look again
        const int64_t run_end = std::min<int64_t>(n, end + kScalarRun);
        if (!h4_used) { std::memset(h4, 0, sizeof(h4)); h4_used = true; }
        int64_t i = end;
        for (; i + 4 <= run_end; i += 4) {
          ++h4[0][field_of<L>(x, i)];
          ++h4[1][field_of<L>(x, i + 1)];
          ++h4[2][field_of<L>(x, i + 2)];
          ++h4[3][field_of<L>(x, i + 3)];
        }
        for (; i < run_end; ++i) ++h4[0][field_of<L>(x, i)];
        pos = run_end;
        need_sample = true;
      } else {
        pos = end;
      }
      continue;
    }
    int64_t nvec, missed;
    if constexpr (kWide) {
#ifdef GF_HIST_HAVE_AVX512
      nvec = std::min<int64_t>(kBlockGroups, (n - pos) / kStep);
      missed = count_block512<L>(x + pos * kElemBytes, nvec, field[0], tot, h);
#endif
    } else {
      nvec = std::min<int64_t>(kBlockVecs, (n - pos) / kStep);
      missed = count_block<L>(x + pos * kElemBytes, nvec, field[0], tot, h);
    }
    pos += nvec * kStep;
    if (missed * 16 > nvec * kStep) need_sample = true;
  }
  for (; pos < n; ++pos) ++h[field_of<L>(x, pos)];
  for (int k = 0; k < kHot; ++k) h[field[k]] += static_cast<int32_t>(tot[k]);
  if (h4_used) {
    for (int f = 0; f < kFields; ++f) h[f] += h4[0][f] + h4[1][f] + h4[2][f] + h4[3][f];
  }
  carry->valid = true;  // the next chunk starts with this one's hottest fields
  choose_window<kHot>(h, kFields, carry->field);

  std::memset(out, 0, kNumHistBins * sizeof(int32_t));
  for (int f = 0; f < kFields; ++f) out[hot_row<L>(static_cast<typename L::Bits>(
      static_cast<typename L::Bits>(f) << L::kMantissaBits))] += h[f];
  if (out[L::kLowRow] != 0 || out[L::kHighRow] != 0) exact_pass<L>(x, n, out);
}

// Eight hot fields (count_block's eight counters): 12 and 16, measured as the eight largest
// counts anywhere, cost ~1.5x on uniform and constant values and were no faster on randn * 1e-3;
// a window of eight replaced them (1.4-2.1x faster on bf16, one thread).
constexpr int kHot = 8;
static_assert(kHot <= kMaxHot, "the carry holds the hot fields");

bool& avx512_slot() {
  static bool on = [] {
    const char* env = std::getenv("GRADFUSE_HISTOGRAM_AVX512");  // "0": the AVX2 loop
    return histogram_avx512_available() && !(env != nullptr && std::string(env) == "0");
  }();
  return on;
}

template <typename L>
void dispatch(const char* x, int64_t n, int32_t* out, HistHotFields* hot) {
#ifdef GF_HIST_HAVE_AVX512
  if (avx512_slot()) return histogram_chunk<L, kHot, true>(x, n, out, hot);
#endif
  histogram_chunk<L, kHot, false>(x, n, out, hot);
}

}  // namespace

bool histogram_avx512_available() {
#ifdef GF_HIST_HAVE_AVX512
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bitalg") && __builtin_cpu_supports("gfni");
#else
  return false;
#endif
}
bool histogram_avx512() { return avx512_slot(); }
void set_histogram_avx512(bool on) {
  TORCH_CHECK(!on || histogram_avx512_available(),
              "the AVX-512 histogram loop needs AVX512BW, AVX512_BITALG and GFNI, which this CPU or build lacks");
  avx512_slot() = on;
}

void histogram_chunk_avx2_fp32(const char* x, int64_t n, int32_t* out, HistHotFields* hot) {
  dispatch<Fp32Layout>(x, n, out, hot);
}
void histogram_chunk_avx2_bf16(const char* x, int64_t n, int32_t* out, HistHotFields* hot) {
  dispatch<Bf16Layout>(x, n, out, hot);
}
void histogram_chunk_avx2_fp16(const char* x, int64_t n, int32_t* out, HistHotFields* hot) {
  dispatch<Fp16Layout>(x, n, out, hot);
}

}  // namespace gradfuse::cpu

#endif  // x86-64
