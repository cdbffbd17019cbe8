// logit_bias and the repetition / frequency / presence penalties of the few
// tokens a row names.
#include "service/backends/cpu/penalties.h"

#include <algorithm>
#include <map>

#include "service/backends/cpu/masks.h"
#include "service/backends/cpu/sampling_order.h"

namespace flashsampler {
namespace cpu {

std::vector<TokenEdit> CollectTokenEdits(const SamplingParams& p) {
  std::map<int32_t, TokenEdit> edits;
  auto at = [&](int32_t id) -> TokenEdit& {
    TokenEdit& e = edits[id];
    e.id = id;
    return e;
  };
  for (const TokenBias& b : p.logit_bias) {
    TokenEdit& e = at(b.token_id);
    e.bias = e.has_bias ? e.bias + b.bias : b.bias;
    e.has_bias = true;
  }
  for (int32_t id : p.banned_token_ids) at(id).banned = true;
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : p.prompt_token_ids) at(id).repeated = true;
  }
  for (const TokenCount& tc : p.output_token_counts) {
    if (tc.count <= 0) continue;
    TokenEdit& e = at(tc.token_id);
    e.repeated = e.repeated || p.repetition_penalty != 1.0f;
    e.count += tc.count;
  }
  std::vector<TokenEdit> out;
  out.reserve(edits.size());
  for (auto& [id, e] : edits) out.push_back(e);
  return out;
}

float ApplyPenalties(float l, const TokenEdit& edit, const SamplingParams& p) {
  float v = l;
  if (edit.repeated) {
    v = v > 0.0f ? v / p.repetition_penalty : v * p.repetition_penalty;
  }
  if (edit.count > 0) {
    v = v - p.frequency_penalty * static_cast<float>(edit.count);
    v = v - p.presence_penalty;
  }
  return v;
}

float EditedLogit(float z, const TokenEdit& edit, const uint32_t* bitmask,
                  const SamplingParams& p) {
  float v = z;
  if (edit.has_bias) v = v + edit.bias;
  if (MaskedOut(edit.banned, bitmask, edit.id)) return kNegInf;
  return ApplyPenalties(v, edit, p);
}

void ApplyTokenEdits(const std::vector<TokenEdit>& edits,
                     const uint32_t* bitmask, const SamplingParams& p,
                     int64_t begin, int count, const float* z, float* l) {
  if (edits.empty()) return;
  auto it = std::lower_bound(
      edits.begin(), edits.end(), begin,
      [](const TokenEdit& e, int64_t id) { return e.id < id; });
  for (; it != edits.end() && it->id < begin + count; ++it) {
    const int c = static_cast<int>(it->id - begin);
    l[c] = EditedLogit(z[c], *it, bitmask, p);
  }
}

}  // namespace cpu
}  // namespace flashsampler
