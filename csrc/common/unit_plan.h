// The work plan of the per-unit ops (per-tensor / per-unit scale, unit statistics, clamp),
// shared by the CPU and CUDA backends, free of ATen.
//
// A tensor of numel elements with `units` units is `units` equal consecutive blocks of
// unit_len = numel / units elements (units = size(0) of a weight: one unit per output row, timm's
// AGC; units = 1: the whole tensor). Work is cut into *items*, each done by one worker (a CPU task
// or a CUDA block), computed per tensor from (numel, units) alone, so no per-unit table is built
// on the host even for 50 257 units of 768 elements (GPT-2's embedding):
//  - split mode (units == 1, or units longer than kChunkElems / 2): each unit is cut into
//    ceil(unit_len / kChunkElems) pieces, one item each, as the chunk plan of chunk_plan.h cuts a
//    tensor (units == 1 gives exactly that plan). A CUDA block streams its piece with all its
//    threads; one coefficient per block.
//  - packed mode (short units): an item holds floor(kChunkElems / unit_len) >= 2 whole units;
//    a CUDA block gives each of its warps whole units in turn (warp w: units w, w + 8, ...), so a
//    768-element unit is one warp's 24 16-byte loads per lane rather than a mostly idle block.
// Statistics leave one partial row per (unit, piece) (packed units: one piece), combined per unit
// in piece order: the result does not depend on thread count or scheduling.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <vector>

#include "chunk_plan.h"

namespace gradfuse {

// One tensor as the per-unit kernels see it: dense elements in the units' (logical) order, its
// unit count, and `row`: the index of its first unit among all units of the call (its first
// coefficient, its first result row).
struct UnitSpan {
  void* data;
  int64_t numel;
  int64_t units;
  int64_t row;
};

struct UnitGeometry {
  int64_t unit_len;  // elements per unit
  int64_t pieces;    // items (and partial rows) per unit: > 1 only in split mode; 0 for empty units
  int64_t per_item;  // units per item: > 1 only in packed mode
  int64_t items;     // items of the tensor

  C10_HOST_DEVICE bool packed() const { return per_item > 1; }
};

C10_HOST_DEVICE inline UnitGeometry unit_geometry(int64_t numel, int64_t units) {
  const int64_t unit_len = units > 0 ? numel / units : 0;
  if (unit_len == 0) return {0, 0, 1, 0};
  if (units == 1 || unit_len > kChunkElems / 2) {
    const int64_t pieces = (unit_len + kChunkElems - 1) / kChunkElems;
    return {unit_len, pieces, 1, units * pieces};
  }
  const int64_t per_item = kChunkElems / unit_len;
  return {unit_len, 1, per_item, (units + per_item - 1) / per_item};
}

// The work of one item.
struct UnitItem {
  int64_t tensor;      // index among the spans (of the table, on CUDA)
  int64_t unit;        // the item's first unit, within the tensor
  int64_t num_units;   // whole units of a packed item; 1 in split mode
  int64_t offset;      // the item's first element, within the tensor
  int64_t n;           // elements of the item (split mode: of the piece)
  int64_t unit_len;
  int64_t prow;        // partial row of the item (split) or of its first unit (packed, one per unit)
  bool packed;
};

// Item `item` (a global id) given the per-tensor arrays of a plan or a CUDA launch table:
// first_item / first_prow have num_tensors + 1 entries (prefix sums).
C10_HOST_DEVICE inline UnitItem locate_unit_item(const int64_t* first_item, const int64_t* first_prow,
                                                 const int64_t* numel, const int64_t* units,
                                                 int64_t num_tensors, int64_t item) {
  const int64_t t = owner_of_chunk(first_item, num_tensors, item);
  const UnitGeometry g = unit_geometry(numel[t], units[t]);
  const int64_t local = item - first_item[t];
  UnitItem r;
  r.tensor = t;
  r.unit_len = g.unit_len;
  r.packed = g.packed();
  if (r.packed) {
    r.unit = local * g.per_item;
    r.num_units = units[t] - r.unit < g.per_item ? units[t] - r.unit : g.per_item;
    r.offset = r.unit * g.unit_len;
    r.n = r.num_units * g.unit_len;
    r.prow = first_prow[t] + r.unit;
  } else {
    r.unit = local / g.pieces;
    r.num_units = 1;
    const int64_t piece_start = (local % g.pieces) * kChunkElems;
    r.offset = r.unit * g.unit_len + piece_start;
    r.n = g.unit_len - piece_start < kChunkElems ? g.unit_len - piece_start : kChunkElems;
    r.prow = first_prow[t] + local;
  }
  return r;
}

struct UnitPlan {
  std::vector<int64_t> first_item;  // n + 1 prefix sums
  std::vector<int64_t> first_prow;  // n + 1 prefix sums: partial rows
  std::vector<int64_t> numel, units, row;

  int64_t num_items() const { return first_item.back(); }
  int64_t num_prows() const { return first_prow.back(); }
  UnitItem locate(int64_t item) const {
    return locate_unit_item(first_item.data(), first_prow.data(), numel.data(), units.data(),
                            static_cast<int64_t>(numel.size()), item);
  }
};

inline UnitPlan make_unit_plan(const std::vector<UnitSpan>& spans) {
  UnitPlan plan;
  const size_t n = spans.size();
  plan.first_item.reserve(n + 1);
  plan.first_prow.reserve(n + 1);
  int64_t items = 0, prows = 0;
  for (const UnitSpan& s : spans) {
    plan.first_item.push_back(items);
    plan.first_prow.push_back(prows);
    plan.numel.push_back(s.numel);
    plan.units.push_back(s.units);
    plan.row.push_back(s.row);
    const UnitGeometry g = unit_geometry(s.numel, s.units);
    items += g.items;
    prows += s.units * g.pieces;
  }
  plan.first_item.push_back(items);
  plan.first_prow.push_back(prows);
  return plan;
}

}  // namespace gradfuse
