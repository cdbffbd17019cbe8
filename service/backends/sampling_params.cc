// Helpers on the wire-independent sampling controls: the mapping from "controls
// a row uses" to names a backend can refuse.
#include "service/backends/sampling_params.h"

namespace flashsampler {

bool SamplingParams::has_token_transforms() const {
  return !logit_bias.empty() || !banned_token_ids.empty() ||
         !allowed_bitmask.empty() || repetition_penalty != 1.0f ||
         presence_penalty != 0.0f || frequency_penalty != 0.0f;
}

const std::vector<std::string>& AllSamplingControls() {
  static const auto* const kControls = new std::vector<std::string>{
      "temperature",
      "top_k",
      "top_p",
      "min_p",
      "logit_bias",
      "banned_token_ids",
      "allowed_token_bitmask",
      "repetition_penalty",
      "presence_penalty",
      "frequency_penalty",
      "n",
      "logprobs.sampled_logprob",
      "logprobs.row_logsumexp",
      "logprobs.top_logprobs",
      "logprobs.space",
  };
  return *kControls;
}

namespace {

bool Contains(const std::vector<std::string>& names, const char* name) {
  for (const std::string& s : names) {
    if (s == name) return true;
  }
  return false;
}

}  // namespace

std::string FirstUnsupportedControl(const SamplingParams& p,
                                    const std::vector<std::string>& supported) {
  // Each entry: is the control in use (not at its "off" value)?
  const struct {
    const char* name;
    bool used;
  } kUses[] = {
      {"temperature", p.temperature != 1.0f},
      {"top_k", p.top_k != 0},
      {"top_p", p.top_p != 1.0f},
      {"min_p", p.min_p != 0.0f},
      {"logit_bias", !p.logit_bias.empty()},
      {"banned_token_ids", !p.banned_token_ids.empty()},
      {"allowed_token_bitmask", !p.allowed_bitmask.empty()},
      {"repetition_penalty", p.repetition_penalty != 1.0f},
      {"presence_penalty", p.presence_penalty != 0.0f},
      {"frequency_penalty", p.frequency_penalty != 0.0f},
      {"n", p.n != 1},
      {"logprobs.sampled_logprob", p.logprobs.sampled},
      {"logprobs.row_logsumexp", p.logprobs.logsumexp},
      {"logprobs.top_logprobs", p.logprobs.top_n != 0},
      {"logprobs.space", p.logprobs.raw},
  };
  for (const auto& use : kUses) {
    if (use.used && !Contains(supported, use.name)) return use.name;
  }
  return "";
}

}  // namespace flashsampler
