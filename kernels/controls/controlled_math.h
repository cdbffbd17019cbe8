// The per-token arithmetic of the controlled sampler, shared by its CUDA
// kernel and the host tests: the logit transforms, the sampling-order keys,
// the top-p fixed-point masses and the radix-select bin logic. Each function
// restates one rule of service/backends/cpu/cpu_sampler.h with the same IEEE
// operations, so that host and device results agree bit for bit.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_MATH_H_
#define FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_MATH_H_

#include <cstdint>
#include <limits>

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

#include "kernels/controls/controlled_types.h"
#include "kernels/noise/philox.h"

namespace flashsampler {
namespace controls {

// Top-p masses are summed exactly in 128 bits: 2^31 tokens x 2^62 < 2^93.
using U128 = unsigned __int128;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// Flags of one merged per-token control entry (ControlledSpecial).
constexpr uint8_t kSpecialHasBias = 1u;
constexpr uint8_t kSpecialBanned = 2u;
// In prompt ids or output ids, and the row's repetition penalty is not 1.
constexpr uint8_t kSpecialRepeated = 4u;

// The flag a row's list entry of `kind` (kPendingBias .. kPendingOutput)
// gives its id's merged entry: a bias entry HasBias, a banned id Banned, a
// prompt id Repeated (listed only under a repetition penalty), an output id
// Repeated where the row's repetition penalty is not 1. The host's merge
// and the device's share it; the bias sum and the output counts are theirs.
FS_HOST_DEVICE uint8_t ListEntryFlag(uint32_t kind, bool penalized) {
  switch (kind) {
    case kPendingBias:
      return kSpecialHasBias;
    case kPendingBanned:
      return kSpecialBanned;
    case kPendingPrompt:
      return kSpecialRepeated;
    default:
      return penalized ? kSpecialRepeated : uint8_t{0};
  }
}

// Radix select: 4 levels of 8 bits over a 32-bit key, 256 bins per level.
constexpr int kRadixLevels = 4;
constexpr int kRadixBins = 256;

FS_HOST_DEVICE bool IsNan(float x) { return x != x; }

FS_HOST_DEVICE bool IsFinite(float x) {
  return x == x && x != kPosInf && x != kNegInf;
}

// Order-preserving map of a float (never NaN here) to uint32: a > b as floats
// iff OrderKey(a) > OrderKey(b), for every pair except -0 / +0, which callers
// fold into +0 first (they are one value of the sampling order).
FS_HOST_DEVICE uint32_t OrderKey(float x) {
  const uint32_t bits = FloatToBits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

FS_HOST_DEVICE float KeyValue(uint32_t key) {
  return BitsToFloat((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// +0 for either zero, x otherwise.
FS_HOST_DEVICE float FoldZero(float x) { return x == 0.0f ? 0.0f : x; }

// (value, id) as one 64-bit key whose unsigned order is the sampling order:
// higher value first, then lower id (ids are < 2^31, so ~id keeps the low
// word's order reversed). A max-reduction over these keys is the argmax with
// ties to the lowest id, and 0 is below every key of a finite value.
FS_HOST_DEVICE uint64_t PackedKey(float value, int32_t id) {
  return (static_cast<uint64_t>(OrderKey(FoldZero(value))) << 32) |
         static_cast<uint64_t>(~static_cast<uint32_t>(id));
}

FS_HOST_DEVICE int32_t PackedKeyId(uint64_t key) {
  return static_cast<int32_t>(~static_cast<uint32_t>(key));
}

FS_HOST_DEVICE float PackedKeyValue(uint64_t key) {
  return KeyValue(static_cast<uint32_t>(key >> 32));
}

// x = l * (1 / T) with -0 folded into +0 (the CPU's Transform).
FS_HOST_DEVICE float ScaledLogit(float l, float inv_temperature) {
  return FoldZero(FS_FMUL(l, inv_temperature));
}

// The processed logit l of a token that has a merged control entry, from its
// raw logit z (the CPU's Transform, per token): bias (already summed in list
// order), then ban or bitmask -> -inf, else repetition, frequency and
// presence penalties, each one rounded fp32 operation.
FS_HOST_DEVICE float SpecialLogit(float z, bool disallowed, uint8_t flags,
                                  float bias, int32_t count,
                                  float repetition_penalty,
                                  float frequency_penalty,
                                  float presence_penalty) {
  float v = z;
  if (flags & kSpecialHasBias) v = FS_FADD(v, bias);
  if ((flags & kSpecialBanned) || disallowed) return kNegInf;
  if (flags & kSpecialRepeated) {
    v = v > 0.0f ? FS_FDIV(v, repetition_penalty)
                 : FS_FMUL(v, repetition_penalty);
  }
  if (count > 0) {
    v = FS_FSUB(v, FS_FMUL(frequency_penalty, static_cast<float>(count)));
    v = FS_FSUB(v, presence_penalty);
  }
  return v;
}

// True when the row's bitmask (null = every token allowed) disallows `id`.
FS_HOST_DEVICE bool Disallowed(const uint32_t* bitmask, int32_t id) {
  return bitmask != nullptr &&
         ((bitmask[static_cast<uint32_t>(id) >> 5] >> (id & 31)) & 1u) == 0;
}

// The first of a row's merged entries [begin, end) of `ids` (strictly
// ascending) whose id is >= `id`; `end` when there is none.
FS_HOST_DEVICE int64_t SpecialLowerBound(const int32_t* ids, int64_t begin,
                                         int64_t end, int32_t id) {
  int64_t lo = begin;
  int64_t hi = end;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ids[mid] < id) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// True when `id` has an entry among a row's merged entries [begin, end) of
// `ids` (strictly ascending) and that entry bans it.
FS_HOST_DEVICE bool SpecialBanned(const int32_t* ids, const uint8_t* flags,
                                  int64_t begin, int64_t end, int32_t id) {
  const int64_t at = SpecialLowerBound(ids, begin, end, id);
  return at < end && ids[at] == id && (flags[at] & kSpecialBanned) != 0;
}

// The value a raw logprob is taken over (vLLM's raw_logprobs): the raw logit
// z after the masks alone, -inf for a bitmask-disallowed or banned token;
// logit_bias (even -inf), penalties and temperature do not apply. `x` is the
// token's processed logit: a banned token's is -inf, so only those search
// the row's entries.
FS_HOST_DEVICE float MaskedRawLogit(float z, float x, bool disallowed,
                                    const int32_t* ids, const uint8_t* flags,
                                    int64_t begin, int64_t end, int32_t id) {
  if (disallowed) return kNegInf;
  if (x == kNegInf && SpecialBanned(ids, flags, begin, end, id)) return kNegInf;
  return z;
}

// exp(x - x_max) in [0, 1] as an integer multiple of 2^-62, as the CPU
// computes it (exp in double, scaled by 2^62 exactly, truncated). The device
// uses CUDA's double exp (within 1 ulp) where the CPU uses glibc's (within
// 0.52 ulp): a mass may differ by one unit in the 53rd bit, and a top-p cut
// moves only when the cumulative mass lies that close to ceil(p * total)
// (controlled_sampler_gpu_test counts such disagreements over 2^20 values).
FS_HOST_DEVICE uint64_t FixedMass(float x, float x_max) {
  const double d = static_cast<double>(x) - static_cast<double>(x_max);
#if defined(__CUDA_ARCH__)
  const double e = ::exp(d);
#else
  const double e = std::exp(d);
#endif
  return static_cast<uint64_t>(e * 4611686018427387904.0);  // 2^62, exact
}

// ceil(p * z) exactly, for p in (0, 1): p is an integer times a power of two
// (its fp32 mantissa and exponent), so the product is an exact 128-bit
// integer shifted right. Same value as the CPU's CeilScaled.
FS_HOST_DEVICE U128 CeilScaled(float p, U128 z) {
  const uint32_t bits = FloatToBits(p);
  const uint32_t biased = (bits >> 23) & 0xffu;
  uint64_t mantissa = bits & 0x7fffffu;
  int shift = 149;  // subnormal: p = mantissa * 2^-149
  if (biased != 0) {
    mantissa |= 0x800000u;
    shift = 150 - static_cast<int>(biased);  // p = mantissa * 2^-shift
  }
  if (mantissa == 0 || z == 0) return 0;
  // mantissa < 2^24 and z < 2^93: the product fits in 117 bits.
  const U128 product = static_cast<U128>(mantissa) * z;
  if (shift >= 128) return 1;  // 0 < p * z < 1
  const U128 quotient = product >> shift;
  const U128 remainder = product & ((static_cast<U128>(1) << shift) - 1);
  return quotient + (remainder != 0 ? 1 : 0);
}

// The next float towards +inf / -inf (std::nextafter for finite inputs).
FS_HOST_DEVICE float NextUp(float f) {
  if (f == kPosInf) return f;
  if (f == 0.0f) return BitsToFloat(0x00000001u);
  const uint32_t bits = FloatToBits(f);
  return BitsToFloat(f > 0.0f ? bits + 1 : bits - 1);
}

FS_HOST_DEVICE float NextDown(float f) {
  if (f == kNegInf) return f;
  if (f == 0.0f) return BitsToFloat(0x80000001u);
  const uint32_t bits = FloatToBits(f);
  return BitsToFloat(f > 0.0f ? bits - 1 : bits + 1);
}

// Smallest float f with (double)f - x_max >= log_min_p (the min_p rule as one
// float comparison). `log_min_p` is std::log((double)min_p) computed on the
// host (ControlledRow::log_min_p), so the floor equals the CPU's even where
// CUDA's double log would round differently.
FS_HOST_DEVICE float MinPFloor(float x_max, double log_min_p) {
  const double top = static_cast<double>(x_max);
  float f = static_cast<float>(top + log_min_p);
  if (!(static_cast<double>(f) - top >= log_min_p)) {
    while (!(static_cast<double>(f) - top >= log_min_p)) f = NextUp(f);
    return f;
  }
  while (true) {
    const float lower = NextDown(f);
    if (lower == kNegInf || !(static_cast<double>(lower) - top >= log_min_p))
      return f;
    f = lower;
  }
}

// Whether the merge kernel reads a row's unit tails (the mass of the logits
// each unit left out, UnitCandidates::tail_inv_temperature): a sampled row
// (temperature > 0) with top_p that top_k does not bound. Every other row
// is decided from its candidates alone, so the fused kernel is given 0 for
// it and sums no tail. Top_k 50 + top_p 0.9 + min_p 0.05 at qwen B = 256
// took 556-566 us against 648-667 with every row's tail (fused and merge
// kernels, H100, alternating runs in one call; 4-8 us of it the merge
// kernel's gather).
FS_HOST_DEVICE bool UnitTailWanted(float temperature, int32_t top_k,
                                   float top_p, int64_t vocab) {
  const bool top_k_bounds = top_k > 0 && top_k < vocab;
  return temperature != 0.0f && top_p < 1.0f && !top_k_bounds;
}

// An upper bound on every value GumbelNoise takes (the CPU's MaxGumbelNoise:
// the noise at the top cell of a block's uniform, about 19.4, plus 2^-10).
// A token with fl(x + bound) below a score already reached cannot win.
FS_HOST_DEVICE float MaxGumbelNoiseBound() {
  const float smallest =
      BlockMinExponential(UniformFromBits(0xffffffffu), RoundedDivide{});
  return FS_FADD(-AccurateLog(smallest), 1.0f / 1024.0f);
}

// Radix digit of `key` at `level` (level 0 = the top 8 bits).
FS_HOST_DEVICE uint32_t RadixDigit(uint32_t key, int level) {
  return (key >> (24 - 8 * level)) & 0xffu;
}

// True when the bits of `key` above `level` equal `prefix` (the digits chosen
// at the levels before).
FS_HOST_DEVICE bool RadixPrefixMatches(uint32_t key, int level,
                                       uint32_t prefix) {
  return level == 0 || (key >> (32 - 8 * level)) == prefix;
}

// One radix-select level, descending: scans the bins from the highest digit
// and returns the first one at which the weight ranked above (`*above`, the
// weight of keys above the current prefix range, plus the bins scanned)
// reaches `target`, or -1 when the whole range falls short. On success
// `*above` becomes the weight ranked above the chosen bin.
template <typename BinWeight>
FS_HOST_DEVICE int FindDigit(BinWeight bin_weight, U128 target, U128* above) {
  U128 cum = *above;
  for (int digit = kRadixBins - 1; digit >= 0; --digit) {
    const U128 w = bin_weight(digit);
    if (cum + w >= target) {
      *above = cum;
      return digit;
    }
    cum += w;
  }
  return -1;
}

// How many of `ties` equal-weight tokens (each `unit`) the cut keeps once the
// weight ranked above them is `above`: ceil((target - above) / unit), capped
// at `ties` (then every tie stays).
FS_HOST_DEVICE uint64_t TiesNeeded(U128 target, U128 above, U128 unit,
                                   uint64_t ties) {
  const U128 needed = (target - above + unit - 1) / unit;
  return needed >= ties ? ties : static_cast<uint64_t>(needed);
}

// A cut of the sampling order: keep key > v, and of key == v the ids <=
// max_id (top_k keeps every tie: max_id = 2^31 - 1). Inactive cuts keep
// everything.
struct OrderCut {
  bool active;
  uint32_t key;
  int32_t max_id;
};

FS_HOST_DEVICE bool CutKeeps(const OrderCut& cut, uint32_t key, int32_t id) {
  return !cut.active || key > cut.key || (key == cut.key && id <= cut.max_id);
}

}  // namespace controls
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_MATH_H_
