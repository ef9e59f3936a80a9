// The reduced rows of the statistics ops, StatsAcc (stats_math.h) and UpdateAcc (update_math.h),
// shared by the CPU and CUDA backends, are both made by GRADFUSE_ACC_ROW from their two X-macro
// tables, X(column, member, combine): one member per column (float columns of acc_t, count
// columns of int64_t) and the operations every row needs: combine two partial rows, store and load
// one row of the partial or result tensors, for_each (the CUDA warp shuffle). A row type:
//
//   template <typename acc_t>  // the float members' type: the macro names it acc_t
//   struct MyAcc {
//     GRADFUSE_ACC_ROW(MyAcc, MY_FLOAT_TABLE, MY_COUNT_TABLE)
//     // then what only this row does
//   };
//
// A macro, not a base class template: the members must be declared by name in the row itself, and
// each operation stays one plain statement per column (a generic visitor over the columns, with
// lambdas, computes the same values, but nvcc compiles most kernels to other machine code from it).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace gradfuse {

// max that propagates NaN from either side, like torch.max and vector_norm(ord=inf);
// fmaxf would silently drop it.
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// How two partial rows combine, per column (the third entry of a table: Add or NanMax).
template <typename T>
C10_HOST_DEVICE inline T combine_Add(T a, T b) {
  return a + b;
}
template <typename T>
C10_HOST_DEVICE inline T combine_NanMax(T a, T b) {
  return nan_max(a, b);
}

}  // namespace gradfuse

// One statement per column of a table, for GRADFUSE_ACC_ROW.
#define GRADFUSE_ACC_ROW_FLOAT_MEMBER(column, member, combine) acc_t member = 0;
#define GRADFUSE_ACC_ROW_COUNT_MEMBER(column, member, combine) int64_t member = 0;
#define GRADFUSE_ACC_ROW_COMBINE_FLOAT(column, member, combine) \
  member = ::gradfuse::combine_##combine(member, acc_t(o.member));
#define GRADFUSE_ACC_ROW_COMBINE_COUNT(column, member, combine) \
  member = ::gradfuse::combine_##combine(member, o.member);
#define GRADFUSE_ACC_ROW_STORE_FLOAT(column, member, combine) floats[column] = member;
#define GRADFUSE_ACC_ROW_STORE_COUNT(column, member, combine) counts[column] = member;
#define GRADFUSE_ACC_ROW_LOAD_FLOAT(column, member, combine) s.member = floats[column];
#define GRADFUSE_ACC_ROW_LOAD_COUNT(column, member, combine) s.member = counts[column];
#define GRADFUSE_ACC_ROW_VISIT(column, member, combine) f(member);

// The members and operations of the row type Row<acc_t>, in its body (see above). Every operation
// goes through the columns in table order, floats then counts.
#define GRADFUSE_ACC_ROW(Row, FLOAT_TABLE, COUNT_TABLE)                                          \
  FLOAT_TABLE(GRADFUSE_ACC_ROW_FLOAT_MEMBER)                                                     \
  COUNT_TABLE(GRADFUSE_ACC_ROW_COUNT_MEMBER)                                                     \
                                                                                                 \
  /* Folds in a partial row of any acc type (its floats rounded to acc_t). */                    \
  template <typename other_t>                                                                    \
  C10_HOST_DEVICE inline void combine(const Row<other_t>& o) {                                   \
    FLOAT_TABLE(GRADFUSE_ACC_ROW_COMBINE_FLOAT)                                                  \
    COUNT_TABLE(GRADFUSE_ACC_ROW_COMBINE_COUNT)                                                  \
  }                                                                                              \
                                                                                                 \
  /* One row of the partial / result tensors (numel, after the counts, is the caller's). */      \
  C10_HOST_DEVICE inline void store(acc_t* floats, int64_t* counts) const {                      \
    FLOAT_TABLE(GRADFUSE_ACC_ROW_STORE_FLOAT)                                                    \
    COUNT_TABLE(GRADFUSE_ACC_ROW_STORE_COUNT)                                                    \
  }                                                                                              \
                                                                                                 \
  C10_HOST_DEVICE static inline Row load(const acc_t* floats, const int64_t* counts) {           \
    Row s;                                                                                       \
    FLOAT_TABLE(GRADFUSE_ACC_ROW_LOAD_FLOAT)                                                     \
    COUNT_TABLE(GRADFUSE_ACC_ROW_LOAD_COUNT)                                                     \
    return s;                                                                                    \
  }                                                                                              \
                                                                                                 \
  /* f(member) for every member, in column order (the CUDA warp shuffle). */                     \
  template <typename F>                                                                          \
  C10_HOST_DEVICE inline void for_each(F&& f) {                                                  \
    FLOAT_TABLE(GRADFUSE_ACC_ROW_VISIT)                                                          \
    COUNT_TABLE(GRADFUSE_ACC_ROW_VISIT)                                                          \
  }
