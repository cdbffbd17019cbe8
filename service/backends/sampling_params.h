// Validated, wire-independent sampling controls and per-row results: what the
// gRPC layer hands to the batcher and what every backend consumes. Nothing in
// here knows about protobuf or CUDA.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
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
  bool rank = false;       // rank of each sampled token (1 = most likely)
  bool any() const { return sampled || rank || logsumexp || top_n > 0; }
};

// An allowed-token bitmask in xgrammar's layout: bit (t & 31) of word t >> 5,
// 1 = allowed; empty = every token allowed. It owns its words, or views
// words kept alive elsewhere: the request codec views a bitmask sent as
// bytes where the parsed request holds them (the request outlives its
// decoded rows), since copying 19 KB a row at V = 151936, and zeroing the
// copy first, was 12% of decoding 256 rows that each carry one (a
// development host).
class TokenBitmask {
 public:
  TokenBitmask() = default;
  // Owns `words`; implicit, so that a vector or a braced list assigns.
  TokenBitmask(std::vector<uint32_t> words)  // NOLINT(runtime/explicit)
      : owned_(std::move(words)) {}
  TokenBitmask(std::initializer_list<uint32_t> words) : owned_(words) {}
  // Views `words`, which must outlive this bitmask and its copies.
  static TokenBitmask View(absl::Span<const uint32_t> words) {
    TokenBitmask bitmask;
    bitmask.view_ = words;
    bitmask.viewing_ = true;
    return bitmask;
  }

  absl::Span<const uint32_t> words() const {
    return viewing_ ? view_ : absl::MakeConstSpan(owned_);
  }
  bool empty() const { return words().empty(); }
  size_t size() const { return words().size(); }
  const uint32_t* data() const { return words().data(); }
  uint32_t operator[](size_t i) const { return words()[i]; }

  // The words to build a bitmask in place (a view is copied first).
  std::vector<uint32_t>& mutable_words() {
    if (viewing_)
      *this = TokenBitmask(std::vector<uint32_t>(view_.begin(), view_.end()));
    return owned_;
  }
  void assign(size_t count, uint32_t word) {
    mutable_words().assign(count, word);
  }
  void clear() { *this = TokenBitmask(); }

  friend bool operator==(const TokenBitmask& a, const TokenBitmask& b) {
    return a.words() == b.words();
  }
  friend bool operator!=(const TokenBitmask& a, const TokenBitmask& b) {
    return !(a == b);
  }

 private:
  std::vector<uint32_t> owned_;
  absl::Span<const uint32_t> view_;
  bool viewing_ = false;
};

// Temperatures below this sample greedily (vLLM's rule): 1 / T would
// overflow fp32 or scale logits to +-inf, e.g. T = 1e-38.
inline constexpr float kMinSamplingTemperature = 1e-5f;

// Controls of one row; ValidateSamplingParams states their ranges. Defaults
// are "off".
struct SamplingParams {
  float temperature = 1.0f;  // < kMinSamplingTemperature (e.g. 0) = greedy
  int32_t top_k = 0;         // 0 or -1 = off; >= V keeps every token
  float top_p = 1.0f;        // 1 = off
  float min_p = 0.0f;        // 0 = off
  std::vector<TokenBias> logit_bias;
  std::vector<int32_t> banned_token_ids;
  TokenBitmask allowed_bitmask;     // empty = all allowed
  float repetition_penalty = 1.0f;  // 1 = off
  float presence_penalty = 0.0f;    // 0 = off
  float frequency_penalty = 0.0f;   // 0 = off
  std::vector<int32_t> prompt_token_ids;
  std::vector<TokenCount> output_token_counts;
  int32_t n = 1;
  LogprobRequest logprobs;

  bool greedy() const { return temperature < kMinSamplingTemperature; }
  // True when any per-token transform (bias, masks, penalties) is present.
  bool has_token_transforms() const;
};

// What ValidateSamplingParams holds a row to beyond the sampling semantics.
struct SamplingRules {
  // Largest n and logprobs.top_n. The serving layer passes the operator's
  // --max_samples_per_row and --max_top_logprobs; engines cap neither (a
  // row that reached them passed the caps of the daemon that decoded it).
  int32_t max_n = 0;
  int32_t max_top_logprobs = 0;
  // Wire requests (docs/api.md) are also refused what is well defined but
  // almost surely a caller's mistake: a -inf logit_bias (engines take it as
  // a ban; the wire has banned_token_ids for that), an output count of 0
  // (engines skip it), and masks that leave no token (engines report that
  // row as "every token is masked" when they sample it).
  bool wire = false;
  // The name the bitmask's errors give it: the wire field that carried it.
  absl::string_view bitmask_field = "allowed_token_bitmask";

  static SamplingRules Wire(int32_t max_n, int32_t max_top_logprobs);
  static SamplingRules Engine();
};

// The default of --max_top_logprobs, as vLLM's max_logprobs.
inline constexpr int32_t kDefaultMaxTopLogprobs = 20;

// The one check of a row's controls, shared by the request codec and every
// engine (vLLM's semantics):
//   temperature finite, >= 0; top_k >= 0 or -1 (0 and -1 = off, > V = all);
//   top_p in (0, 1]; min_p in [0, 1]; repetition_penalty finite, > 0;
//   presence / frequency_penalty finite; logit_bias finite (or -inf outside
//   the wire); every token id (bias, banned, prompt, output counts) in
//   [0, V); output counts >= 1 (>= 0 outside the wire); allowed_bitmask
//   empty or ceil(V / 32) words; n in [1, max_n]; logprobs.top_n in
//   [0, max_top_logprobs].
// Fields are checked in that order (docs/api.md's); the first violation is
// INVALID_ARGUMENT "<field>: <what was expected>, got <value>", where
// <field> is `field_prefix` + "." + the field as the caller wrote it
// ("row_params[3].top_p"; just "top_p" for an empty prefix).
absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int64_t vocab_size,
                                    absl::string_view field_prefix,
                                    const SamplingRules& rules);

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
  // n, when asked for: 1 + the other tokens whose value in the logprobs'
  // space is >= the sampled token's (ties count against it, as vLLM's).
  std::vector<int32_t> sampled_ranks;
  float logsumexp = 0.0f;              // when asked for
  std::vector<int32_t> top_token_ids;  // top_n, most likely first
  std::vector<float> top_logprobs;
  // Non-empty when this row alone could not be sampled (e.g. every token
  // masked): the request that owns the row fails with INVALID_ARGUMENT and
  // the other rows of the batch are unaffected.
  std::string error;
  // Set when a fast path could not certify exactness and the row took an
  // exact fallback (docs/design.md#exactness-and-refusals); names the
  // reason for the metric
  // flashsampler_exact_fallback_rows_total. Null otherwise.
  const char* exact_fallback = nullptr;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_SAMPLING_PARAMS_H_
