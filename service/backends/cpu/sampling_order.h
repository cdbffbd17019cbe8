// The order every CPU sampling step agrees on: tokens by processed logit x
// descending, then id ascending (docs/design.md#ties-and-reduction-order),
// its order-preserving 32-bit key, and a buffer of the best entries.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLING_ORDER_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLING_ORDER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels/noise/philox.h"

namespace flashsampler {
namespace cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// A token of a row in the sampling order: higher x first, then lower id.
struct Entry {
  float x;
  int32_t id;
};

inline bool Before(const Entry& a, const Entry& b) {
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

// Order-preserving map of a float (never NaN here) to uint32.
inline uint32_t OrderKey(float x) {
  const uint32_t bits = FloatToBits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float KeyValue(uint32_t key) {
  return BitsToFloat((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The best `capacity` entries offered so far (unordered until TakeSorted).
// Amortized O(1) per offer: grows to 2 x capacity, then nth_element trims.
class TopBuffer {
 public:
  void Reset(size_t capacity) {
    capacity_ = capacity;
    full_ = false;
    items_.clear();
  }
  size_t capacity() const { return capacity_; }

  void Offer(float x, int32_t id) {
    if (capacity_ == 0) return;
    const Entry e{x, id};
    if (full_ && !Before(e, worst_)) return;
    items_.push_back(e);
    if (items_.size() >= 2 * capacity_) Trim();
  }

  void Absorb(const TopBuffer& other) {
    for (const Entry& e : other.items_) Offer(e.x, e.id);
  }

  std::vector<Entry> TakeSorted() {
    Trim();
    std::sort(items_.begin(), items_.end(), Before);
    full_ = false;
    return std::move(items_);
  }

 private:
  void Trim() {
    if (items_.size() > capacity_) {
      std::nth_element(items_.begin(), items_.begin() + capacity_, items_.end(),
                       Before);
      items_.resize(capacity_);
    }
    if (capacity_ > 0 && items_.size() == capacity_) {
      full_ = true;
      worst_ = *std::max_element(items_.begin(), items_.end(), Before);
    }
  }

  size_t capacity_ = 0;
  bool full_ = false;
  Entry worst_{0.0f, 0};
  std::vector<Entry> items_;
};

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLING_ORDER_H_
