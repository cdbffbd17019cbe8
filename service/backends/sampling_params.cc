// Helpers on the wire-independent sampling controls: the one validation of
// their ranges, and the mapping from "controls a row uses" to names a
// backend can refuse.
#include "service/backends/sampling_params.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/field_violation.h"

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
      "logprobs.sampled_rank",
  };
  return *kControls;
}

namespace {

constexpr int32_t kNoCap = std::numeric_limits<int32_t>::max();

// Formats a float so that NaN and infinities read plainly in messages.
std::string FloatStr(float v) { return absl::StrFormat("%g", v); }

class FieldChecker {
 public:
  FieldChecker(absl::string_view prefix, int64_t vocab)
      : prefix_(prefix), vocab_(vocab) {}

  std::string Name(absl::string_view field) const {
    return prefix_.empty() ? std::string(field)
                           : absl::StrCat(prefix_, ".", field);
  }
  absl::Status Invalid(absl::string_view field,
                       absl::string_view expected) const {
    return FieldViolationError(Name(field), expected);
  }
  bool InVocab(int64_t id) const { return id >= 0 && id < vocab_; }
  absl::Status TokenId(absl::string_view field, int64_t id) const {
    if (InVocab(id)) return absl::OkStatus();
    return Invalid(
        field, absl::StrCat("token id must be in [0, ", vocab_, "), got ", id));
  }
  absl::Status Finite(absl::string_view field, float v) const {
    if (std::isfinite(v)) return absl::OkStatus();
    return Invalid(field, absl::StrCat("must be finite, got ", FloatStr(v)));
  }
  absl::Status Range(absl::string_view field, int64_t v, int64_t lo,
                     int64_t hi) const {
    if (v >= lo && v <= hi) return absl::OkStatus();
    return Invalid(
        field, hi == kNoCap
                   ? absl::StrCat("must be >= ", lo, ", got ", v)
                   : absl::StrCat("must be in [", lo, ", ", hi, "], got ", v));
  }

 private:
  absl::string_view prefix_;
  int64_t vocab_;
};

// True when every list entry passes its check, in branch-free passes the
// compiler vectorizes; the checks that name an entry run only where one
// fails. Entry by entry, the lists took 0.37 us of the 0.38 us check of a
// row with 64 bias entries and 64 prompt and output ids (a development
// host), and the CUDA engine checks each row of a batch again.
bool ListsPass(const SamplingParams& p, int64_t vocab, bool wire) {
  // Ids in [0, V) as unsigned: a negative id is above any V.
  const uint32_t limit = static_cast<uint32_t>(
      std::min<int64_t>(vocab, std::numeric_limits<uint32_t>::max()));
  const float inf = std::numeric_limits<float>::infinity();
  uint32_t bad = 0;
  if (wire) {
    for (const TokenBias& b : p.logit_bias) {
      bad |= (static_cast<uint32_t>(b.token_id) >= limit) |
             !(std::fabs(b.bias) < inf);
    }
  } else {
    for (const TokenBias& b : p.logit_bias) {
      bad |= (static_cast<uint32_t>(b.token_id) >= limit) | (b.bias != b.bias) |
             (b.bias == inf);
    }
  }
  for (int32_t id : p.banned_token_ids) {
    bad |= static_cast<uint32_t>(id) >= limit;
  }
  for (int32_t id : p.prompt_token_ids) {
    bad |= static_cast<uint32_t>(id) >= limit;
  }
  const int32_t min_count = wire ? 1 : 0;
  for (const TokenCount& c : p.output_token_counts) {
    bad |= (static_cast<uint32_t>(c.token_id) >= limit) | (c.count < min_count);
  }
  return bad == 0;
}

// Bitmask and banned ids together must leave a token of [0, V) allowed.
// Without a copy of the bitmask (19 KB a row at V = 151936): each banned id
// bans at most one allowed token, so the walk over the allowed tokens ends
// by the (banned + 1)-th.
bool LeavesAToken(const SamplingParams& p, int64_t vocab) {
  std::vector<int32_t> banned = p.banned_token_ids;
  std::sort(banned.begin(), banned.end());
  banned.erase(std::unique(banned.begin(), banned.end()), banned.end());
  if (p.allowed_bitmask.empty()) {
    return static_cast<int64_t>(banned.size()) < vocab;  // ids are in [0, V)
  }
  const int64_t words = (vocab + 31) / 32;
  for (int64_t w = 0; w < words; ++w) {
    uint32_t allowed = p.allowed_bitmask[static_cast<size_t>(w)];
    if (w == words - 1 && vocab % 32 != 0) {
      allowed &= (1u << (vocab % 32)) - 1u;
    }
    for (; allowed != 0; allowed &= allowed - 1) {
      const int32_t id = static_cast<int32_t>(32 * w + __builtin_ctz(allowed));
      if (!std::binary_search(banned.begin(), banned.end(), id)) return true;
    }
  }
  return false;
}

}  // namespace

SamplingRules SamplingRules::Wire(int32_t max_n, int32_t max_top_logprobs) {
  SamplingRules rules;
  rules.max_n = max_n;
  rules.max_top_logprobs = max_top_logprobs;
  rules.wire = true;
  return rules;
}

SamplingRules SamplingRules::Engine() {
  SamplingRules rules;
  rules.max_n = kNoCap;
  rules.max_top_logprobs = kNoCap;
  return rules;
}

absl::Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size,
                                    absl::string_view field_prefix,
                                    const SamplingRules& rules) {
  const FieldChecker check(field_prefix, vocab_size);
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return check.Invalid(
        "temperature",
        absl::StrCat("must be finite and >= 0 (0 = greedy), got ",
                     FloatStr(p.temperature)));
  }
  if (p.top_k < -1) {
    return check.Invalid(
        "top_k",
        absl::StrCat("must be >= 0, or -1 (0 and -1 = off), got ", p.top_k));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return check.Invalid(
        "top_p",
        absl::StrCat("must be in (0, 1] (1 = off), got ", FloatStr(p.top_p)));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return check.Invalid(
        "min_p",
        absl::StrCat("must be in [0, 1] (0 = off), got ", FloatStr(p.min_p)));
  }
  // The lists' entries are checked first and named only when one fails:
  // building each entry's name took 10 us a row with 64 bias entries and 64
  // prompt and output ids (a development host).
  const bool lists_pass = ListsPass(p, vocab_size, rules.wire);
  for (size_t i = 0; !lists_pass && i < p.logit_bias.size(); ++i) {
    const TokenBias& b = p.logit_bias[i];
    const bool bias_ok =
        rules.wire ? std::isfinite(b.bias)
                   : !std::isnan(b.bias) &&
                         b.bias != std::numeric_limits<float>::infinity();
    if (bias_ok && check.InVocab(b.token_id)) continue;
    const std::string name = absl::StrCat("logit_bias[", i, "]");
    if (absl::Status s = check.TokenId(name + ".token_id", b.token_id);
        !s.ok()) {
      return s;
    }
    if (rules.wire) {
      if (absl::Status s = check.Finite(name + ".bias", b.bias); !s.ok())
        return s;
    } else if (std::isnan(b.bias) ||
               b.bias == std::numeric_limits<float>::infinity()) {
      return check.Invalid(name + ".bias",
                           absl::StrCat("must be finite or -inf (a ban), got ",
                                        FloatStr(b.bias)));
    }
  }
  for (size_t i = 0; !lists_pass && i < p.banned_token_ids.size(); ++i) {
    if (check.InVocab(p.banned_token_ids[i])) continue;
    if (absl::Status s = check.TokenId(
            absl::StrCat("banned_token_ids[", i, "]"), p.banned_token_ids[i]);
        !s.ok()) {
      return s;
    }
  }
  const int64_t words = (vocab_size + 31) / 32;
  if (!p.allowed_bitmask.empty() &&
      static_cast<int64_t>(p.allowed_bitmask.size()) != words) {
    return check.Invalid(rules.bitmask_field,
                         absl::StrCat("must be empty or hold ceil(V / 32) = ",
                                      words, " int32 words (V = ", vocab_size,
                                      "), got ", p.allowed_bitmask.size()));
  }
  // Sampling from an empty set has no answer.
  if (rules.wire &&
      (!p.allowed_bitmask.empty() || !p.banned_token_ids.empty()) &&
      !LeavesAToken(p, vocab_size)) {
    return check.Invalid(
        p.allowed_bitmask.empty() ? "banned_token_ids" : rules.bitmask_field,
        "must leave at least one token of the vocabulary "
        "allowed");
  }
  if (!std::isfinite(p.repetition_penalty) || p.repetition_penalty <= 0.0f) {
    return check.Invalid("repetition_penalty",
                         absl::StrCat("must be finite and > 0 (1 = off), got ",
                                      FloatStr(p.repetition_penalty)));
  }
  if (absl::Status s = check.Finite("presence_penalty", p.presence_penalty);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = check.Finite("frequency_penalty", p.frequency_penalty);
      !s.ok()) {
    return s;
  }
  for (size_t i = 0; !lists_pass && i < p.prompt_token_ids.size(); ++i) {
    if (check.InVocab(p.prompt_token_ids[i])) continue;
    if (absl::Status s = check.TokenId(
            absl::StrCat("prompt_token_ids[", i, "]"), p.prompt_token_ids[i]);
        !s.ok()) {
      return s;
    }
  }
  for (size_t i = 0; !lists_pass && i < p.output_token_counts.size(); ++i) {
    const TokenCount& c = p.output_token_counts[i];
    if (check.InVocab(c.token_id) && c.count >= (rules.wire ? 1 : 0)) {
      continue;
    }
    const std::string name = absl::StrCat("output_token_counts[", i, "]");
    if (absl::Status s = check.TokenId(name + ".token_id", c.token_id);
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            check.Range(name + ".count", c.count, rules.wire ? 1 : 0, kNoCap);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = check.Range("n", p.n, 1, rules.max_n); !s.ok()) return s;
  return check.Range("logprobs.top_logprobs", p.logprobs.top_n, 0,
                     rules.max_top_logprobs);
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
      {"top_k", p.top_k > 0},
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
      {"logprobs.sampled_rank", p.logprobs.rank},
  };
  for (const auto& use : kUses) {
    if (use.used && !Contains(supported, use.name)) return use.name;
  }
  return "";
}

}  // namespace flashsampler
