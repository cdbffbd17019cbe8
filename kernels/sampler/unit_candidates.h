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
  // (0-15) set where row 16 j + i is ranked, bit 16 + i where its raw logit
  // goes to entry_logits instead (a per-token entry, which the merge kernel
  // adds at its processed value). A token with neither is in no record and
  // no tail. Null: every token ranked.
  const uint32_t* token_classes = nullptr;
  // token_classes holds one row, by which every row of the launch ranks
  // (rows with one request's shared controls).
  bool token_classes_shared = false;
  // [batch][shard rows] fp32, written at the entry tokens' rows alone;
  // needed where token_classes is set.
  float* entry_logits = nullptr;
};

// Words of UnitCandidates::token_classes per row of a shard of `vocab_rows`.
FS_HOST_DEVICE int64_t UnitClassWordsPerRow(int64_t vocab_rows) {
  return (vocab_rows + 15) / 16;
}

// The epilogue's selection of a unit's five highest keys (distinct but for
// the 0 of a token left out), by sorting networks: each lane sorts its 16
// keys in four groups of four, merges them into its top five, and the lane
// pair merges its two lists. Inserting each key into a running top five
// took 10 min/max a key, and the unit's selection was a third of the fused
// kernel's added instructions at qwen B = 256 (Nsight Compute, H100).

// Compare-exchange, descending: a takes the larger key.
FS_HOST_DEVICE void UnitKeyExchange(uint32_t& a, uint32_t& b) {
  const uint32_t high = a > b ? a : b;
  b = a > b ? b : a;
  a = high;
}

// Sorts four keys descending (five compare-exchanges).
FS_HOST_DEVICE void SortUnitKeys4(uint32_t (&k)[4]) {
  UnitKeyExchange(k[0], k[1]);
  UnitKeyExchange(k[2], k[3]);
  UnitKeyExchange(k[0], k[2]);
  UnitKeyExchange(k[1], k[3]);
  UnitKeyExchange(k[1], k[2]);
}

// Sorts five keys descending whose sequence falls, then rises (c[i] =
// max(a[i], b[4 - i]) of two descending lists): a bitonic merge of eight
// with three keys above all appended, of which only the five
// compare-exchanges that meet two real keys remain.
FS_HOST_DEVICE void SortFallingRisingUnitKeys5(uint32_t (&c)[5]) {
  UnitKeyExchange(c[0], c[4]);  // c[0]: the largest
  UnitKeyExchange(c[4], c[2]);
  UnitKeyExchange(c[1], c[3]);
  UnitKeyExchange(c[4], c[1]);
  UnitKeyExchange(c[2], c[3]);
  const uint32_t second = c[4];
  c[4] = c[3];
  c[3] = c[2];
  c[2] = c[1];
  c[1] = second;
}

// The five largest of two descending lists of four, descending: the five
// largest of two sorted lists are max(a[i], b[4 - i]), the lists padded
// with 0.
FS_HOST_DEVICE void TopFiveUnitKeysOf4And4(const uint32_t (&a)[4],
                                           const uint32_t (&b)[4],
                                           uint32_t (&out)[5]) {
  out[0] = a[0];
  out[1] = a[1] > b[3] ? a[1] : b[3];
  out[2] = a[2] > b[2] ? a[2] : b[2];
  out[3] = a[3] > b[1] ? a[3] : b[1];
  out[4] = b[0];
  SortFallingRisingUnitKeys5(out);
}

// The five largest of two descending lists of five, descending, into a.
FS_HOST_DEVICE void TopFiveUnitKeysOf5And5(uint32_t (&a)[5],
                                           const uint32_t (&b)[5]) {
  for (int i = 0; i < 5; ++i) a[i] = a[i] > b[4 - i] ? a[i] : b[4 - i];
  SortFallingRisingUnitKeys5(a);
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
