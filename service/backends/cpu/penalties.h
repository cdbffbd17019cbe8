// Steps 1 and 3 of the vLLM order: logit_bias on the raw logit, then (for
// tokens the masks keep) repetition, frequency and presence penalties, in
// fp32. Only the few tokens a row names are touched, so a row carries its
// per-token controls as one id-sorted list of TokenEdits.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_PENALTIES_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_PENALTIES_H_

#include <cstdint>
#include <vector>

#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace cpu {

// Everything a row's controls say about one token id.
struct TokenEdit {
  int32_t id = 0;
  bool has_bias = false;
  float bias = 0.0f;      // sum of the token's logit_bias entries, list order
  bool banned = false;    // in banned_token_ids
  bool repeated = false;  // in prompt ids or output ids, with r != 1
  int32_t count = 0;      // summed output count
};

// The TokenEdits of `params`, sorted by id, one per id.
std::vector<TokenEdit> CollectTokenEdits(const SamplingParams& params);

// Repetition penalty r on a repeated token (l > 0 ? l / r : l * r), then
// l -= frequency * count and l -= presence for a token already generated.
float ApplyPenalties(float l, const TokenEdit& edit, const SamplingParams& p);

// The processed logit of an edited token: z + bias, -inf when masked
// (masks.h), else the penalties.
float EditedLogit(float z, const TokenEdit& edit, const uint32_t* bitmask,
                  const SamplingParams& p);

// l[c] = EditedLogit(z[c], ...) for each edited token in [begin, begin +
// count); other entries of l are left as they are.
void ApplyTokenEdits(const std::vector<TokenEdit>& edits,
                     const uint32_t* bitmask, const SamplingParams& p,
                     int64_t begin, int count, const float* z, float* l);

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_PENALTIES_H_
