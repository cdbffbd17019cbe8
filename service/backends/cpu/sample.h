// Step 6 of the vLLM order: the exact Gumbel-max sample with the noise shared
// with the GPU kernels (kernels/noise/philox.h, docs/design.md#noise): sample
// j of a row is the argmax over the survivors of GumbelScore(l, 1 / T,
// GumbelNoise(seed, step, j, id)), ties to the lowest id; greedy rows take
// the argmax of l without noise.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLE_H_

#include <cstdint>

#include "kernels/noise/philox.h"
#include "service/backends/cpu/sampling_order.h"

namespace flashsampler {

// An upper bound on every value GumbelNoise takes (about 19.4: the largest
// noise of a block, at the top cell of its uniform, plus 2^-10); a token whose
// fl(x + this) is below the best score so far cannot win, so its noise need
// not be computed.
float MaxGumbelNoise();

namespace cpu {

// The best candidate of one sample so far.
struct BestOf {
  float score = kNegInf;
  int32_t id = kNoToken;
  float x = 0.0f;  // processed, temperature-scaled logit of `id`
  float z = 0.0f;  // raw logit of `id`
};

// GumbelNoise(seed, step, sample, id) for one sample walking ids upwards:
// the Philox calls of a noise block and of a 4-token group are made once,
// when the walk enters them.
class NoiseWalk {
 public:
  NoiseWalk(uint64_t seed, uint64_t step, uint32_t sample)
      : seed_(seed), step_(step), sample_(sample) {}
  float Noise(int32_t id);

 private:
  uint64_t seed_;
  uint64_t step_;
  uint32_t sample_;
  uint32_t group_ = 0xffffffffu;
  Philox4x32 bits_{};
  uint32_t block_index_ = 0xffffffffu;
  NoiseBlock block_{};
  float min_exponential_ = 0.0f;
};

// Greedy: keeps the token of highest l, lowest id on ties.
inline void OfferGreedy(float l, int32_t id, float x, float z, BestOf* best) {
  if (CandidateBetter(l, id, best->score, best->id)) *best = {l, id, x, z};
}

// Offers token `id` (processed logit l, scaled x, raw z) to one sample.
// Exact pruning: fl(x + g) <= fl(x + max_gumbel) < best means it cannot win,
// and its noise is never computed.
inline void OfferSample(float l, float inv_t, int32_t id, float x, float z,
                        float max_gumbel, NoiseWalk* noise, BestOf* best) {
  if (x + max_gumbel < best->score) return;
  const float score = GumbelScore(l, inv_t, noise->Noise(id));
  if (CandidateBetter(score, id, best->score, best->id))
    *best = {score, id, x, z};
}

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_SAMPLE_H_
