// The allowed-token bitmask over one tile of logits.
#include "service/backends/cpu/masks.h"

#include "service/backends/cpu/sampling_order.h"

namespace flashsampler {
namespace cpu {

void ApplyAllowedBitmask(const uint32_t* bitmask, int64_t begin, int count,
                         float* l) {
  if (bitmask == nullptr) return;
  for (int c = 0; c < count; ++c) {
    if (!BitmaskAllows(bitmask, begin + c)) l[c] = kNegInf;
  }
}

}  // namespace cpu
}  // namespace flashsampler
