// Step 5 of the vLLM order: the min_p, top_k and top_p filters, exactly.
// min_p becomes one float floor per row; top_k becomes a value floor (every
// token tied with the k-th largest x stays, as vLLM's sort-and-threshold
// keeps it) and top_p a Cutoff of the sampling order (sampling_order.h),
// found from the candidate buffer when it certifies them, else by an exact
// radix select over the order key whose sums of masses are integers, so the
// cut does not depend on chunking or threads
// (docs/design.md#ties-and-reduction-order).
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_FILTERS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_FILTERS_H_

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "service/backends/cpu/sampling_order.h"

namespace flashsampler {
namespace cpu {

using uint128 = unsigned __int128;

// Radix select over the 32-bit order key: 11 + 11 + 10 bits, three passes,
// 2048 bins at most (48 KB of counts and masses per row).
constexpr int kRadixBits[3] = {11, 11, 10};
constexpr int kRadixShift[3] = {21, 10, 0};

// exp(x - x_max) in [0, 1] as an integer multiple of 2^-62. Sums of these are
// exact and associative in 128 bits (2^31 tokens x 2^62 < 2^93), so the top-p
// cut is the same whatever the chunking or summation order.
inline uint64_t FixedMass(float x, float x_max) {
  const double e =
      std::exp(static_cast<double>(x) - static_cast<double>(x_max));
  return static_cast<uint64_t>(std::ldexp(e, 62));
}

// ceil(p * z), exactly, for p in (0, 1).
uint128 CeilScaled(float p, uint128 z);

// Smallest float f with (double)f - x_max >= ln(min_p): the min_p rule
// becomes one float comparison per token, with the same outcome.
float SmallestKept(float x_max, float min_p);

// A cut of the sampling order: keep x > v; of the tokens with x == v keep all,
// those with id <= max_id, or the first `ranks` of them in id order.
struct Cutoff {
  enum class Ties { kAll, kUpToId, kFirstRanks };
  bool active = false;
  float v = 0.0f;
  Ties ties = Ties::kAll;
  int32_t max_id = 0;
  int64_t ranks = 0;
  // kFirstRanks: number of tokens with x == v in the chunks before chunk c.
  std::vector<int64_t> tie_prefix;

  // Keeps every entry up to and including `last` in the order (top_p).
  static Cutoff UpTo(const Entry& last);
  // Keeps every x >= v, all ties at v included (top_k).
  static Cutoff AtLeast(float v);
};

// Walks one chunk (or the sorted buffer, chunk -1) in id order and applies a
// Cutoff; Keep() must see every allowed token of the chunk, so that tie ranks
// count.
class CutoffCursor {
 public:
  void Start(const Cutoff& cut, int64_t chunk) {
    cut_ = &cut;
    seen_ = (cut.active && cut.ties == Cutoff::Ties::kFirstRanks && chunk >= 0)
                ? cut.tie_prefix[chunk]
                : 0;
  }
  bool Keep(float x, int32_t id) {
    if (!cut_->active || x > cut_->v) return true;
    if (x < cut_->v) return false;
    switch (cut_->ties) {
      case Cutoff::Ties::kAll:
        return true;
      case Cutoff::Ties::kUpToId:
        return id <= cut_->max_id;
      case Cutoff::Ties::kFirstRanks:
        return seen_++ < cut_->ranks;
    }
    return false;
  }

 private:
  const Cutoff* cut_ = nullptr;
  int64_t seen_ = 0;
};

// The top-p cut of a fully known, ordered survivor list: after the shortest
// prefix whose mass reaches ceil(top_p * total). False only for an empty list.
bool TopPCutOfList(const std::vector<Entry>& sorted, float top_p, float x_max,
                   Cutoff* cut);

// Top-p from the buffered prefix once the survivors' total mass gave
// `target`: true (and *cut set) when the prefix, clipped by `cut_k`, reaches
// it; false when the cut lies beyond the buffer.
bool TopPCutOfPrefix(const std::vector<Entry>& sorted, const Cutoff& cut_k,
                     uint128 target, float x_max, Cutoff* cut);

// Radix select of the position where a count (top_k: its value is the
// k-th largest x) or a mass (top_p) summed along the sampling order first
// reaches `target`.
struct RadixSelect {
  bool by_mass = false;
  uint128 target = 0;
  int level = 0;
  uint32_t prefix = 0;  // key bits fixed by the levels done so far
  uint128 above = 0;    // count or mass ranked above the current prefix range
  std::vector<uint64_t> count;
  std::vector<uint128> mass;

  void StartLevel(int new_level);
  // The bin of this level (highest key first) where the running sum from
  // `above` reaches `target`, with *above_bin the sum ranked above that bin;
  // -1 when the whole level sums to less.
  int64_t FindBin(uint128* above_bin) const;
  // Histogram digit of `key` at this level, or -1 when the key lies outside
  // the prefix fixed by the levels before.
  int64_t Digit(uint32_t key) const {
    if (level > 0 && (key >> kRadixShift[level - 1]) != prefix) return -1;
    const uint32_t mask = (1u << kRadixBits[level]) - 1;
    return static_cast<int64_t>((key >> kRadixShift[level]) & mask);
  }
};

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_FILTERS_H_
