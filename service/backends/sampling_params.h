// Validated, wire-independent sampling controls and per-row results: what the
// gRPC layer hands to the batcher and what every backend consumes. Nothing in
// here knows about protobuf or CUDA.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace flashsampler {

struct TokenBias {
  int32_t token_id = 0;
  float bias = 0.0f;
};

struct TokenCount {
  int32_t token_id = 0;
  int32_t count = 0;
};

struct LogprobRequest {
  bool sampled = false;    // logprob of each sampled token
  bool logsumexp = false;  // logsumexp of the row
  int32_t top_n = 0;       // N most likely tokens; 0 = none
  bool raw = false;        // raw logits instead of the processed distribution
  bool any() const { return sampled || logsumexp || top_n > 0; }
};

// Controls of one row, already range-checked against the model (token ids
// < V, bitmask length ceil(V / 32), ...). Defaults are "off".
struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::vector<TokenBias> logit_bias;
  std::vector<int32_t> banned_token_ids;
  std::vector<uint32_t> allowed_bitmask;  // empty = all allowed
  float repetition_penalty = 1.0f;        // 1 = off
  float presence_penalty = 0.0f;          // 0 = off
  float frequency_penalty = 0.0f;         // 0 = off
  std::vector<int32_t> prompt_token_ids;
  std::vector<TokenCount> output_token_counts;
  int32_t n = 1;
  LogprobRequest logprobs;

  bool greedy() const { return temperature == 0.0f; }
  // True when any per-token transform (bias, masks, penalties) is present.
  bool has_token_transforms() const;
};

// Names of the sampling controls a backend may or may not implement, as they
// appear in SampleRequest (used in UNIMPLEMENTED messages and ModelInfo).
// Returns the first control `params` uses that is not in `supported`, or an
// empty string when every control it uses is supported.
std::string FirstUnsupportedControl(const SamplingParams& params,
                                    const std::vector<std::string>& supported);

// Every control name FirstUnsupportedControl knows, in proto order.
const std::vector<std::string>& AllSamplingControls();

// One row of a batch: its controls (shared by the rows of one request) and
// the noise key. The token is a pure function of (W, h, params, seed, step).
struct RowSpec {
  const SamplingParams* params = nullptr;
  uint64_t seed = 0;
  uint64_t step = 0;
};

struct RowResult {
  std::vector<int32_t> token_ids;       // n samples
  std::vector<float> sampled_logprobs;  // n, when asked for
  float logsumexp = 0.0f;               // when asked for
  std::vector<int32_t> top_token_ids;   // top_n, most likely first
  std::vector<float> top_logprobs;
  // Non-empty when this row alone could not be sampled (e.g. every token
  // masked): the request that owns the row fails with INVALID_ARGUMENT and
  // the other rows of the batch are unaffected.
  std::string error;
  // Set when a fast path could not certify exactness and the row took an
  // exact fallback (DESIGN.md rule 4); names the reason for the metric
  // flashsampler_exact_fallback_total. Null otherwise.
  const char* exact_fallback = nullptr;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_
