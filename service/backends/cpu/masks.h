// Step 2 of the vLLM order (after logit_bias): the allowed-token bitmask and
// the banned ids send a token's logit to -inf. Bit (id & 31) of word id / 32
// set = allowed; a null bitmask allows every token.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_MASKS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_MASKS_H_

#include <cstdint>

namespace flashsampler {
namespace cpu {

inline bool BitmaskAllows(const uint32_t* bitmask, int64_t id) {
  return bitmask == nullptr || ((bitmask[id >> 5] >> (id & 31)) & 1u) != 0;
}

// True when a token is removed from the row: banned, or not in the bitmask.
inline bool MaskedOut(bool banned, const uint32_t* bitmask, int64_t id) {
  return banned || !BitmaskAllows(bitmask, id);
}

// l[c] = -inf for each token begin + c (c < count) the bitmask disallows.
void ApplyAllowedBitmask(const uint32_t* bitmask, int64_t begin, int count,
                         float* l);

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_MASKS_H_
