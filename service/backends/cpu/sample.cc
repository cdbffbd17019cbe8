// The Gumbel noise walk of the CPU sampler and the bound that prunes it.
#include "service/backends/cpu/sample.h"

namespace flashsampler {

float MaxGumbelNoise() {
  // Every noise is -log(E) with E >= the smallest E_min, the top cell's
  // -log(1 - 2^-24) / 16 (AccurateLog is within 1 ulp, so E_min is
  // non-increasing in U up to that): AccurateLog's error at that point and
  // at E is under 4e-6, far inside the 2^-10 added (philox_test checks
  // every block cell and samples of the other slots).
  const float smallest =
      BlockMinExponential(UniformFromBits(0xffffffffu), RoundedDivide{});
  return -AccurateLog(smallest) + 1.0f / 1024.0f;
}

namespace cpu {

float NoiseWalk::Noise(int32_t id) {
  const uint32_t group = static_cast<uint32_t>(id) >> 2;
  const uint32_t block = static_cast<uint32_t>(id) >> kNoiseBlockShift;
  const uint32_t slot = static_cast<uint32_t>(id) & (kNoiseBlockTokens - 1);
  if (block_index_ != block) {
    block_index_ = block;
    block_ = NoiseBlockOf(seed_, step_, sample_, block);
    min_exponential_ = BlockMinExponential(block_.uniform, RoundedDivide{});
  }
  const bool first = slot == block_.first_slot;
  if (!first && group_ != group) {
    group_ = group;
    bits_ = NoiseBits4(seed_, step_, sample_, group);
  }
  return BlockSlotGumbel(min_exponential_, first, first ? 0u : bits_.v[id & 3],
                         RoundedDivide{});
}

}  // namespace cpu
}  // namespace flashsampler
