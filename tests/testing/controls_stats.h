// The sampling controls' statistical test, shared by the CPU sampler's
// test and the CUDA engine's: an fp64 reference of docs/api.md's order
// (masks, bias, penalties, temperature, min_p, top_k, top_p) over exact
// logits, the logprobs each space asks for, the cases (each control and
// their combinations), and a driver that samples many seeds of one row
// through a backend and checks the samples against the reference.
#ifndef FLASHSAMPLER_TESTS_TESTING_CONTROLS_STATS_H_
#define FLASHSAMPLER_TESTS_TESTING_CONTROLS_STATS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "tests/testing/chi_squared.h"

namespace flashsampler {
namespace controls_stats {

constexpr int kHidden = 128;
constexpr int kRows = 256;         // rows of one batch, each its own seed
constexpr int kSamplesPerRow = 8;  // n
constexpr int kBatches = 16;       // 32,768 samples per case
constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// A test binary runs up to about 90 chi-squared tests: each must reach this
// p-value, so that a correct backend fails one with probability below 1%.
constexpr double kMinPValue = 1e-4;
// A token whose processed logit lies within kMinPMargin of the min_p cut,
// or the mass ranked above which lies within kTopPMargin of top_p, could be
// decided either way by a backend's fp32 arithmetic against the
// reference's fp64 (the logits are exact, 1 / T is exact for the
// temperatures of the top_p cases): such tokens may be drawn, and their
// reference mass must stay below kMaxUndecidedMass, where no chi-squared
// test of these sizes can see it; a case whose boundary holds more has its
// min_p or top_p moved off it (ReferenceFor).
constexpr double kMinPMargin = 1e-4;
constexpr double kTopPMargin = 2e-6;
constexpr double kMaxUndecidedMass = 1e-4;
constexpr double kLogprobTolerance = 1e-3;

// The fp64 reference of one row's controls over exact raw logits, in
// docs/api.md's order.
struct Reference {
  std::vector<double> raw;   // raw logit; -inf where masked or banned
  double raw_lse = 0;        // over the allowed tokens
  std::vector<double> x;     // processed logit; -inf where masked
  std::vector<double> prob;  // the sampled distribution (0: removed)
  int32_t argmax = -1;       // greedy rows' token
  // Tokens at a min_p or top_p boundary (kMinPMargin, kTopPMargin), and
  // their mass under the distribution before that filter.
  std::vector<char> undecided;
  double undecided_mass = 0;
};

inline Reference ReferenceOf(const std::vector<double>& logits,
                             const SamplingParams& p) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  Reference ref;
  std::vector<char> allowed(vocab, 1);
  if (!p.allowed_bitmask.empty()) {
    for (int64_t i = 0; i < vocab; ++i) {
      allowed[i] = (p.allowed_bitmask[i >> 5] >> (i & 31)) & 1u;
    }
  }
  for (int32_t id : p.banned_token_ids) allowed[id] = 0;
  ref.raw.assign(vocab, kNegInf);
  double raw_max = kNegInf;
  for (int64_t i = 0; i < vocab; ++i) {
    if (allowed[i]) ref.raw[i] = logits[i];
    raw_max = std::max(raw_max, ref.raw[i]);
  }
  double raw_sum = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (allowed[i]) raw_sum += std::exp(ref.raw[i] - raw_max);
  }
  ref.raw_lse = raw_max + std::log(raw_sum);

  // Bias, then the penalties on the biased logit.
  std::vector<double> l = ref.raw;
  for (const TokenBias& b : p.logit_bias) {
    if (allowed[b.token_id]) l[b.token_id] += b.bias;
  }
  std::vector<char> seen(vocab, 0);
  std::vector<int64_t> count(vocab, 0);
  for (int32_t id : p.prompt_token_ids) seen[id] = 1;
  for (const TokenCount& c : p.output_token_counts) {
    seen[c.token_id] = 1;
    count[c.token_id] += c.count;
  }
  for (int64_t i = 0; i < vocab; ++i) {
    if (!allowed[i]) continue;
    if (seen[i]) {
      l[i] =
          l[i] > 0 ? l[i] / p.repetition_penalty : l[i] * p.repetition_penalty;
    }
    if (count[i] > 0) {
      l[i] -= static_cast<double>(count[i]) * p.frequency_penalty +
              p.presence_penalty;
    }
  }
  for (int64_t i = 0; i < vocab; ++i) {
    if (allowed[i] && (ref.argmax < 0 || l[i] > l[ref.argmax])) {
      ref.argmax = static_cast<int32_t>(i);
    }
  }
  ref.prob.assign(vocab, 0.0);
  ref.undecided.assign(vocab, 0);
  if (p.greedy()) {
    ref.x = l;
    ref.prob[ref.argmax] = 1.0;
    return ref;
  }

  ref.x.assign(vocab, kNegInf);
  for (int64_t i = 0; i < vocab; ++i) {
    if (allowed[i]) ref.x[i] = l[i] / p.temperature;
  }
  const double x_max = ref.x[ref.argmax];
  std::vector<char> kept = allowed;
  if (p.min_p > 0) {
    const double cut = x_max + std::log(static_cast<double>(p.min_p));
    double total = 0, undecided = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!kept[i]) continue;
      const double mass = std::exp(ref.x[i] - x_max);
      total += mass;
      if (std::fabs(ref.x[i] - cut) < kMinPMargin) {
        ref.undecided[i] = 1;
        undecided += mass;
      }
      kept[i] = ref.x[i] >= cut;
    }
    ref.undecided_mass += undecided / total;
  }
  // Survivors in the order (x descending, id ascending).
  std::vector<int32_t> order;
  for (int64_t i = 0; i < vocab; ++i) {
    if (kept[i]) order.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return ref.x[a] > ref.x[b]; });
  if (p.top_k > 0 && p.top_k < static_cast<int32_t>(order.size())) {
    const double kth = ref.x[order[p.top_k - 1]];
    while (ref.x[order.back()] < kth) order.pop_back();  // ties kept
  }
  if (p.top_p < 1.0f) {
    double total = 0;
    for (int32_t i : order) total += std::exp(ref.x[i] - x_max);
    double above = 0;
    size_t keep = 0;
    for (size_t k = 0; k < order.size(); ++k) {
      const double mass_above = above / total;
      const double mass = std::exp(ref.x[order[k]] - x_max);
      if (k == 0 || mass_above < p.top_p) keep = k + 1;
      if (k > 0 && std::fabs(mass_above - p.top_p) < kTopPMargin) {
        ref.undecided[order[k]] = 1;
        ref.undecided_mass += mass / total;
      }
      above += mass;
    }
    order.resize(keep);
  }
  double total = 0;
  for (int32_t i : order) total += std::exp(ref.x[i] - x_max);
  for (int32_t i : order) ref.prob[i] = std::exp(ref.x[i] - x_max) / total;
  return ref;
}

// The reference with `params`' min_p and top_p moved off a boundary that
// holds kMaxUndecidedMass or more (min_p 1% and top_p 1e-4 a step up;
// logged).
inline Reference ReferenceFor(const std::vector<double>& logits,
                              SamplingParams* params,
                              const std::string& where) {
  Reference ref = ReferenceOf(logits, *params);
  for (int step = 0; step < 50 && ref.undecided_mass >= kMaxUndecidedMass;
       ++step) {
    if (params->min_p > 0) params->min_p *= 1.01f;
    if (params->top_p < 1.0f) {
      params->top_p = std::min(0.9999f, params->top_p + 1e-4f);
    }
    ref = ReferenceOf(logits, *params);
  }
  if (params->min_p > 0 || params->top_p < 1.0f) {
    std::printf("[%s] min_p %.4f, top_p %.4f: %.2g of the mass undecided\n",
                where.c_str(), params->min_p, params->top_p,
                ref.undecided_mass);
  }
  EXPECT_LT(ref.undecided_mass, kMaxUndecidedMass) << where;
  return ref;
}

// Token ids in the order (value descending, id ascending) over the tokens
// with a finite value.
inline std::vector<int32_t> Ranked(const std::vector<double>& value) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] != kNegInf) ids.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return value[a] > value[b]; });
  return ids;
}

// What a row's logprobs must be in the space it asked for: in the raw space
// over the allowed tokens, in the processed one over the survivors.
struct LogprobReference {
  std::vector<double> logprob;  // -inf outside the space's tokens
  // 1 + the other tokens whose value is >= the token's (vLLM's rank).
  std::vector<int32_t> rank;
  std::vector<int32_t> top;  // the top_n most likely, ties to the lowest id
};

inline LogprobReference LogprobReferenceOf(const Reference& ref,
                                           const LogprobRequest& want) {
  const size_t vocab = ref.raw.size();
  std::vector<double> value(vocab, kNegInf);
  LogprobReference out;
  out.logprob.assign(vocab, kNegInf);
  for (size_t i = 0; i < vocab; ++i) {
    if (want.raw && ref.raw[i] != kNegInf) {
      value[i] = ref.raw[i];
      out.logprob[i] = ref.raw[i] - ref.raw_lse;
    } else if (!want.raw && ref.prob[i] > 0) {
      value[i] = ref.x[i];
      out.logprob[i] = std::log(ref.prob[i]);
    }
  }
  const std::vector<int32_t> ranked = Ranked(value);
  out.rank.assign(vocab, 0);
  // Walking down the ranked list, a run of equal values all rank at the
  // run's end.
  for (size_t k = 0; k < ranked.size();) {
    size_t end = k;
    while (end < ranked.size() && value[ranked[end]] == value[ranked[k]]) {
      ++end;
    }
    for (size_t j = k; j < end; ++j) {
      out.rank[ranked[j]] = static_cast<int32_t>(end);
    }
    k = end;
  }
  out.top.assign(ranked.begin(),
                 ranked.begin() +
                     std::min(ranked.size(), static_cast<size_t>(want.top_n)));
  return out;
}

inline void ExpectLogprobs(const RowResult& row, const LogprobRequest& want,
                           const LogprobReference& ref,
                           const std::string& where) {
  if (want.sampled) {
    ASSERT_EQ(row.sampled_logprobs.size(), row.token_ids.size()) << where;
  }
  if (want.rank) {
    ASSERT_EQ(row.sampled_ranks.size(), row.token_ids.size()) << where;
  }
  for (size_t j = 0; j < row.token_ids.size(); ++j) {
    const int32_t token = row.token_ids[j];
    if (want.sampled) {
      EXPECT_NEAR(row.sampled_logprobs[j], ref.logprob[token],
                  kLogprobTolerance)
          << where << ", sample " << j << ", token " << token;
    }
    if (want.rank) {
      EXPECT_EQ(row.sampled_ranks[j], ref.rank[token])
          << where << ", sample " << j << ", token " << token;
    }
  }
  if (want.top_n > 0) {
    EXPECT_EQ(row.top_token_ids, ref.top) << where;
    ASSERT_EQ(row.top_logprobs.size(), row.top_token_ids.size()) << where;
    for (size_t t = 0; t < row.top_token_ids.size(); ++t) {
      EXPECT_NEAR(row.top_logprobs[t], ref.logprob[row.top_token_ids[t]],
                  kLogprobTolerance)
          << where << ", top " << t;
    }
  }
}

struct Case {
  std::string name;
  SamplingParams params;
};

// The controls on their own and combined. Ids for the lists are taken from
// the most likely raw tokens, so that every list changes the distribution.
inline std::vector<Case> Cases(const std::vector<double>& logits) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const std::vector<int32_t> top = Ranked(logits);
  std::vector<uint32_t> even_ids(static_cast<size_t>((vocab + 31) / 32),
                                 0x55555555u);
  auto with = [](float temperature) {
    SamplingParams p;
    p.temperature = temperature;
    p.n = kSamplesPerRow;
    return p;
  };
  auto add_penalties = [&](SamplingParams* p) {
    p->repetition_penalty = 2.0f;
    p->frequency_penalty = 0.5f;
    p->presence_penalty = 0.25f;
    for (int r = 0; r < 4; ++r) p->prompt_token_ids.push_back(top[r]);
    for (int r = 2; r < 8; ++r) {
      p->output_token_counts.push_back({top[r], 1 + r % 3});
    }
  };
  auto add_lists = [&](SamplingParams* p) {
    for (int r = 0; r < 2; ++r) p->logit_bias.push_back({top[r], -1.5f});
    for (int r = 12; r < 16; ++r) p->logit_bias.push_back({top[r], 2.0f});
    p->logit_bias.push_back({top[12], 0.25f});  // entries for one id add up
    p->banned_token_ids = {top[2], top[3]};
    p->allowed_bitmask = even_ids;
  };
  // A case of temperature and the filters alone.
  auto filters = [&](const char* name, float temperature, int32_t top_k,
                     float top_p, float min_p) {
    Case c{name, with(temperature)};
    c.params.top_k = top_k;
    c.params.top_p = top_p;
    c.params.min_p = min_p;
    return c;
  };
  std::vector<Case> cases = {
      filters("temperature 0.7", 0.7f, 0, 1.0f, 0.0f),
      filters("top_k 20", 1.0f, 20, 1.0f, 0.0f),
      filters("top_p 0.8", 1.0f, 0, 0.8f, 0.0f),
      filters("min_p 0.1", 1.0f, 0, 1.0f, 0.1f),
      filters("top_k 30 + top_p 0.9", 1.0f, 30, 0.9f, 0.0f),
      filters("min_p 0.05 + top_p 0.9", 1.0f, 0, 0.9f, 0.05f),
      filters("temperature 1.5 + top_k 10", 1.5f, 10, 1.0f, 0.0f),
      // More survivors than the fast paths keep at large V: the exact
      // fallback there.
      filters("temperature 1.5 + top_k 3000", 1.5f, 3000, 1.0f, 0.0f),
  };
  {
    Case c{"penalties + top_p 0.9", with(1.0f)};
    add_penalties(&c.params);
    c.params.top_p = 0.9f;
    cases.push_back(c);
  }
  {
    Case c{"bias + banned + bitmask", with(1.0f)};
    add_lists(&c.params);
    cases.push_back(c);
  }
  for (bool raw : {true, false}) {
    Case c{raw ? "every control + raw logprobs"
               : "every control + processed logprobs",
           with(0.8f)};
    add_lists(&c.params);
    add_penalties(&c.params);
    c.params.top_k = 40;
    c.params.top_p = 0.9f;
    c.params.min_p = 0.02f;
    c.params.logprobs = {true, false, 5, raw, true};
    cases.push_back(c);
  }
  {
    Case c{"greedy + bias + penalties + bitmask + raw logprobs", with(0.0f)};
    add_lists(&c.params);
    add_penalties(&c.params);
    c.params.logprobs = {true, false, 3, true, true};
    cases.push_back(c);
  }
  {
    // A nucleus of most of the vocabulary: at large V more candidates than
    // the fast paths keep, so these rows take the exact fallback.
    Case c{"flat, top_p 0.99", with(4.0f)};
    c.params.top_p = 0.99f;
    cases.push_back(c);
  }
  return cases;
}

// Five of Cases' parameter sets for one batch whose rows cycle through
// them.
inline std::vector<Case> MixedCases(const std::vector<double>& logits) {
  const std::vector<Case> all = Cases(logits);
  std::vector<Case> mixed;
  for (const char* name :
       {"top_k 20", "min_p 0.05 + top_p 0.9", "penalties + top_p 0.9",
        "bias + banned + bitmask", "every control + raw logprobs"}) {
    for (const Case& c : all) {
      if (c.name == name) mixed.push_back(c);
    }
  }
  return mixed;
}

// kRows copies of one row's hidden states, a batch's input.
inline std::vector<float> RowsOf(const std::vector<float>& hidden) {
  std::vector<float> rows;
  rows.reserve(hidden.size() * kRows);
  for (int r = 0; r < kRows; ++r) {
    rows.insert(rows.end(), hidden.begin(), hidden.end());
  }
  return rows;
}

// A backend's Sample() over kRows rows of one hidden state (RowsOf).
using SampleRows = std::function<absl::Status(const std::vector<RowSpec>&,
                                              std::vector<RowResult>*)>;

// Samples `cases[r % cases.size()]` on the rows of `sample`, kBatches
// times (once where every case is greedy), each row its own seed, and
// checks each
// case's samples: in the reference's support, greedy ones its argmax,
// logprobs where asked, and their counts by chi-squared (printed).
inline void ExpectSamplesFollowTheReference(const SampleRows& sample,
                                            const std::vector<double>& logits,
                                            std::vector<Case> cases,
                                            const std::string& where) {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const size_t sets = cases.size();
  std::vector<Reference> refs;
  std::vector<LogprobReference> logprob_refs;
  for (Case& c : cases) {
    refs.push_back(ReferenceFor(logits, &c.params, where + ", " + c.name));
    logprob_refs.push_back(LogprobReferenceOf(refs.back(), c.params.logprobs));
  }
  std::vector<std::vector<int64_t>> counts(sets,
                                           std::vector<int64_t>(vocab, 0));
  std::vector<int64_t> fallback_rows(sets, 0);
  std::vector<int64_t> set_rows(sets, 0);
  const bool all_greedy =
      std::all_of(cases.begin(), cases.end(),
                  [](const Case& c) { return c.params.greedy(); });
  const int batches = all_greedy ? 1 : kBatches;
  for (int b = 0; b < batches; ++b) {
    std::vector<RowSpec> specs(kRows);
    for (int r = 0; r < kRows; ++r) {
      specs[r] = RowSpec{
          &cases[r % sets].params,
          0x9e3779b97f4a7c15ull * static_cast<uint64_t>(1 + b * kRows + r),
          static_cast<uint64_t>(b)};
    }
    std::vector<RowResult> results;
    const absl::Status status = sample(specs, &results);
    ASSERT_TRUE(status.ok()) << where << ": " << status;
    ASSERT_EQ(results.size(), static_cast<size_t>(kRows)) << where;
    for (int r = 0; r < kRows; ++r) {
      const size_t s = r % sets;
      const RowResult& row = results[r];
      const std::string at =
          absl::StrCat(where, ", ", cases[s].name, ", batch ", b, ", row ", r);
      ASSERT_TRUE(row.error.empty()) << at << ": " << row.error;
      ASSERT_EQ(row.token_ids.size(), static_cast<size_t>(kSamplesPerRow))
          << at;
      ++set_rows[s];
      if (row.exact_fallback != nullptr) ++fallback_rows[s];
      for (int32_t token : row.token_ids) {
        ASSERT_TRUE(token >= 0 && token < vocab) << at << ": " << token;
        // Masked, banned and filtered tokens never appear.
        ASSERT_TRUE(refs[s].prob[token] > 0 || refs[s].undecided[token])
            << at << ": token " << token << " is outside the distribution";
        ++counts[s][token];
      }
      if (cases[s].params.greedy()) {
        for (int32_t token : row.token_ids) {
          EXPECT_EQ(token, refs[s].argmax) << at;
        }
      }
      if (cases[s].params.logprobs.any()) {
        ExpectLogprobs(row, cases[s].params.logprobs, logprob_refs[s], at);
      }
    }
  }
  for (size_t s = 0; s < sets; ++s) {
    if (cases[s].params.greedy()) continue;
    const stats::ChiSquaredResult fit =
        stats::ChiSquaredTest(refs[s].prob, counts[s]);
    const int64_t support =
        std::count_if(refs[s].prob.begin(), refs[s].prob.end(),
                      [](double q) { return q > 0; });
    std::printf(
        "[%s, %s] %lld samples over %lld tokens: chi2 %.1f, %d dof, "
        "p = %.4f; %lld of %lld rows took the exact fallback\n",
        where.c_str(), cases[s].name.c_str(),
        static_cast<long long>(set_rows[s] * kSamplesPerRow),
        static_cast<long long>(support), fit.statistic, fit.dof, fit.p_value,
        static_cast<long long>(fallback_rows[s]),
        static_cast<long long>(set_rows[s]));
    EXPECT_GT(fit.p_value, kMinPValue)
        << where << ", " << cases[s].name << ": chi2 " << fit.statistic
        << " on " << fit.dof << " dof";
  }
}

// The logits W h, exactly (small integers: the backends' fp32 sums are
// exact too).
inline std::vector<double> ExactLogits(const std::vector<float>& w,
                                       int64_t vocab,
                                       const std::vector<float>& hidden) {
  std::vector<double> logits(vocab, 0.0);
  for (int64_t i = 0; i < vocab; ++i) {
    for (int d = 0; d < kHidden; ++d) {
      logits[i] += static_cast<double>(w[i * kHidden + d]) * hidden[d];
    }
  }
  return logits;
}

// Six +-1 coordinates: integer logits in [-18, 18], a spread of about 5.
inline std::vector<float> SparseHidden(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> hidden(kHidden, 0.0f);
  std::vector<int> dims(kHidden);
  std::iota(dims.begin(), dims.end(), 0);
  std::shuffle(dims.begin(), dims.end(), rng);
  for (int k = 0; k < 6; ++k) hidden[dims[k]] = (rng() & 1) ? 1.0f : -1.0f;
  return hidden;
}

}  // namespace controls_stats
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_TESTING_CONTROLS_STATS_H_
