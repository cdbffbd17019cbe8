// The fused kernel's unit candidates: for each row, the highest logits of
// every 32-token unit of the vocabulary with a bound on the rest, written by
// the stage-1 epilogue instead of the [B, V] fp32 logits, and read by the
// controlled sampler's merge kernel (kernels/controls/). Plain data, free of
// CUDA headers.
//
// Unit u of a shard holds shard rows 128 (u / 4) + 16 (u % 4) + {0..15} and
// the same + 64: the 32 rows one epilogue warp of the wgmma kernel holds of
// a 128-row tile. For each (row, unit) the kernel writes the unit's logits
// whose order keys, the low 5 bits aside, are above its 5th highest's (at
// most kUnitCandidates; a unit of at most four finite logits writes them
// all), that 5th highest key with its low 5 bits set as the bound on the
// rest, and, where asked, the rest's mass below the bound. Each row also
// gets the highest bound and the highest key over all its units, so that
// the merge kernel knows, before it reads a unit, which candidates are
// above every unit's bound.
#ifndef FLASHSAMPLER_KERNELS_SAMPLER_UNIT_CANDIDATES_H_
#define FLASHSAMPLER_KERNELS_SAMPLER_UNIT_CANDIDATES_H_

#include <cstdint>

#include "kernels/noise/philox.h"  // FS_HOST_DEVICE

namespace flashsampler {

constexpr int kUnitTokens = 32;
constexpr int kUnitsPerTile = 4;  // of the kernel's 128-row tiles
// Candidates per unit. The row's bound is the highest of its units'
// bounds, so how many tokens lie above it depends on their ranks alone
// (i.i.d. tokens, median of 20 draws): about 2,200 per row at qwen's V
// with 4 and 490 with 2; 720 and 200 at V = 32771; 150 and 42 at
// V = 4099. 2 made the fused kernel's selection and the merge kernel's
// gather cheaper (qwen top_k + top_p + min_p 476 / 480 against 481 /
// 483 us at B = 64 / 128, H100, two calls each), but left top_k 20 rows at
// V = 4099 uncertified, as it would a top_p nucleus of a few hundred
// tokens at any V.
constexpr int kUnitCandidates = 4;
// UnitRecord::slots byte of an unused slot.
constexpr uint8_t kUnitNoSlot = 0xff;
// UnitRecord::bound of a unit with a logit that is not finite.
constexpr uint32_t kUnitNonFinite = 0xffffffffu;

// One (row, unit) record: 32 bytes, one sector, so that the epilogue's lane
// pairs write whole sectors and the merge kernel reads a row's records as
// one contiguous run.
//
// raws: the candidates' raw logits (0 in an unused slot). slots: byte k is
// candidate k's unit-local index 0..31, or kUnitNoSlot. bound: an order key
// (the float's bits made monotone, +0 for -0) at or above every logit left
// out, 0 when none was; kUnitNonFinite when a logit is NaN or infinite
// (the record's other fields then mean nothing, and the row's bound is
// kUnitNonFinite, its maximum: the merge kernel takes no such row). tail:
// the sum over the left-out logits l of exp(l / T - b / T), b the bound's
// value, in fp32, for rows whose UnitCandidates::tail_inv_temperature is
// positive; negative for the others.
struct alignas(32) UnitRecord {
  float raws[kUnitCandidates];
  uint32_t slots;
  uint32_t bound;
  float tail;
  uint32_t unused;
};
static_assert(sizeof(UnitRecord) == 32, "a record is one 32-byte sector");

// Device arrays of one launch. Records are row-major: (row b, unit u) at
// b * UnitsPerRow(shard rows) + u.
struct UnitCandidates {
  UnitRecord* records = nullptr;  // [batch][units], 32-byte aligned
  // [batch] each row's highest unit bound and highest candidate key (the
  // row's largest logit's order key where row_bound is not kUnitNonFinite),
  // atomic maxima: zero before the launch. The controlled sampler's merge
  // kernel reads them and sets them back to zero.
  uint32_t* row_bound = nullptr;
  uint32_t* row_top = nullptr;
  // [batch] 1 / T of each row whose tail mass is wanted, 0 (or a null
  // array) for none.
  const float* tail_inv_temperature = nullptr;
  // Optional [batch][UnitClassWordsPerRow(shard rows)]: which tokens the
  // units rank. Word j of a row covers shard rows 16 j .. 16 j + 15: bit i
  // (0-15) set where row 16 j + i is ranked (allowed, with no per-token
  // entry), bit 16 + i where its raw logit goes to entry_logits instead (a
  // per-token entry, which the merge kernel adds at its processed value).
  // A token with neither is masked: in no record, no tail. Null: every
  // token ranked.
  const uint32_t* token_classes = nullptr;
  // [batch][shard rows] fp32, written at the entry tokens' rows alone;
  // needed where token_classes is set.
  float* entry_logits = nullptr;
};

// Words of UnitCandidates::token_classes per row of a shard of `vocab_rows`.
FS_HOST_DEVICE int64_t UnitClassWordsPerRow(int64_t vocab_rows) {
  return (vocab_rows + 15) / 16;
}

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
