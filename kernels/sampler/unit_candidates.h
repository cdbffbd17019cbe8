// The fused kernel's unit candidates: for each row, the highest logits of
// every 32-token unit of the vocabulary with a bound on the rest, written by
// the stage-1 epilogue instead of the [B, V] fp32 logits, and read by the
// controlled sampler's candidate path (kernels/controls/). Plain data, free
// of CUDA headers.
//
// Unit u of a shard holds shard rows 128 (u / 4) + 16 (u % 4) + {0..15} and
// the same + 64: the 32 rows one epilogue warp of the wgmma kernel holds of
// a 128-row tile. For each (row, unit) the kernel writes the unit's logits
// whose order keys, the low 5 bits aside, are above its 5th highest's (at
// most kUnitCandidates; a unit of at most four finite logits writes them
// all), that 5th highest key with its low 5 bits set as the bound on the
// rest, and, where asked, the rest's mass below the bound.
#ifndef FLASHSAMPLER_KERNELS_SAMPLER_UNIT_CANDIDATES_H_
#define FLASHSAMPLER_KERNELS_SAMPLER_UNIT_CANDIDATES_H_

#include <cstdint>

#include "kernels/noise/philox.h"  // FS_HOST_DEVICE

namespace flashsampler {

constexpr int kUnitTokens = 32;
constexpr int kUnitsPerTile = 4;  // of the kernel's 128-row tiles
constexpr int kUnitCandidates = 4;
// UnitCandidates::slots value of an unused slot.
constexpr uint8_t kUnitNoSlot = 0xff;
// UnitSummary::bound of a unit with a logit that is not finite.
constexpr uint32_t kUnitNonFinite = 0xffffffffu;

// bound: an order key (the float's bits made monotone, +0 for -0) at or
// above every logit left out, 0 when none was; kUnitNonFinite when a logit
// is NaN or infinite (non-finite logits are never candidates). tail: the sum
// over the left-out logits l of exp(l / T - b / T), b the bound's value, in
// fp32, for rows whose UnitCandidates::tail_inv_temperature is positive;
// negative for the others.
struct UnitSummary {
  uint32_t bound;
  float tail;
};

// Device arrays of one launch, unit-major: record (unit u, row b) at
// u * row_stride + b, units = 4 x the shard's 128-row tiles, so that the
// kernel's stores of consecutive rows are contiguous.
struct UnitCandidates {
  // [units][row_stride][kUnitCandidates] the candidates' raw logits (0 in
  // an unused slot), 16-byte aligned.
  float* raws = nullptr;
  // [units][row_stride][kUnitCandidates] unit-local index 0..31, or
  // kUnitNoSlot; 4-byte aligned.
  uint8_t* slots = nullptr;
  UnitSummary* summaries = nullptr;  // [units][row_stride]
  int64_t row_stride = 0;            // >= the launch's batch
  // [batch] 1 / T of each row whose tail mass is wanted, 0 (or a null
  // array) for none.
  const float* tail_inv_temperature = nullptr;
};

// Units per row of a shard of `vocab_rows` rows.
FS_HOST_DEVICE int64_t UnitsPerRow(int64_t vocab_rows) {
  return (vocab_rows + 127) / 128 * kUnitsPerTile;
}

// The shard row of slot `slot` (0..31) of unit `unit`: the unit's first 16
// rows, then the 16 rows 64 further on.
FS_HOST_DEVICE int64_t UnitSlotRow(int64_t unit, int slot) {
  return unit / kUnitsPerTile * 128 + unit % kUnitsPerTile * 16 +
         (slot < 16 ? slot : 64 + slot - 16);
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_SAMPLER_UNIT_CANDIDATES_H_
