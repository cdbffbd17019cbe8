// ValidateSamplingParams: each rule refuses its first bad value naming the
// field as the caller wrote it and the range expected, accepts the edges,
// and the wire rules differ from the engine rules only where documented;
// a TokenBitmask's copies own or view its words as it does.
#include "service/backends/sampling_params.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace flashsampler {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int64_t kVocab = 100;
constexpr float kInf = std::numeric_limits<float>::infinity();

absl::Status Wire(const SamplingParams& p) {
  return ValidateSamplingParams(p, kVocab, "row_params[3]",
                                SamplingRules::Wire(16, 20));
}
absl::Status Engine(const SamplingParams& p) {
  return ValidateSamplingParams(p, kVocab, "", SamplingRules::Engine());
}

TEST(ValidateSamplingParamsTest, DefaultsAndEdgesPass) {
  SamplingParams p;
  EXPECT_TRUE(Wire(p).ok());
  p.temperature = 0.0f;
  p.top_k = -1;  // vLLM's "off"
  p.top_p = 1.0f;
  p.min_p = 1.0f;
  p.repetition_penalty = 1e-30f;
  p.logit_bias = {{0, -5.0f}, {99, 5.0f}};
  p.banned_token_ids = {0, 99};
  p.allowed_bitmask.assign(4, ~0u);  // ceil(100 / 32) = 4
  p.n = 16;
  p.logprobs.top_n = 20;
  EXPECT_TRUE(Wire(p).ok()) << Wire(p);
  p.top_k = 1000;  // above V: every token
  EXPECT_TRUE(Wire(p).ok());
  // One allowed token left: 97 of {5, 97}, the other banned twice.
  p.allowed_bitmask = {1u << 5, 0, 0, 1u << 1};
  p.banned_token_ids = {5, 5};
  EXPECT_TRUE(Wire(p).ok()) << Wire(p);
  // Every id but one banned, no bitmask.
  p.allowed_bitmask.clear();
  p.banned_token_ids.clear();
  for (int32_t i = 0; i < kVocab; ++i) {
    if (i != 42) p.banned_token_ids.push_back(i);
  }
  p.banned_token_ids.push_back(0);
  EXPECT_TRUE(Wire(p).ok()) << Wire(p);
}

TEST(ValidateSamplingParamsTest, EachRuleNamesItsFieldAndRange) {
  struct Case {
    std::string want;  // message prefix after "row_params[3]."
    void (*edit)(SamplingParams*);
  };
  const Case cases[] = {
      {"temperature: must be finite and >= 0",
       [](SamplingParams* p) { p->temperature = -0.5f; }},
      {"temperature: must be finite",
       [](SamplingParams* p) { p->temperature = kInf; }},
      {"top_k: must be >= 0, or -1", [](SamplingParams* p) { p->top_k = -2; }},
      {"top_p: must be in (0, 1]", [](SamplingParams* p) { p->top_p = 0.0f; }},
      {"top_p: must be in (0, 1]",
       [](SamplingParams* p) { p->top_p = 1.0001f; }},
      {"min_p: must be in [0, 1]", [](SamplingParams* p) { p->min_p = -0.1f; }},
      {"min_p: must be in [0, 1]",
       [](SamplingParams* p) { p->min_p = std::nanf(""); }},
      {"logit_bias[1].token_id: token id must be in [0, 100), got 100",
       [](SamplingParams* p) {
         p->logit_bias = {{1, 0.0f}, {100, 0.0f}};
       }},
      {"logit_bias[0].bias: must be finite",
       [](SamplingParams* p) {
         p->logit_bias = {{1, -kInf}};
       }},
      {"banned_token_ids[0]: token id must be in [0, 100), got -1",
       [](SamplingParams* p) { p->banned_token_ids = {-1}; }},
      {"allowed_token_bitmask: must be empty or hold ceil(V / 32) = 4",
       [](SamplingParams* p) { p->allowed_bitmask.assign(3, ~0u); }},
      {"allowed_token_bitmask: must leave at least one token",
       [](SamplingParams* p) {
         p->allowed_bitmask = {0, 0, 0, 0xfffffff0u};  // bits past V = 100
       }},
      {"banned_token_ids: must leave at least one token",
       [](SamplingParams* p) {
         for (int32_t i = 0; i < kVocab; ++i) p->banned_token_ids.push_back(i);
       }},
      {"allowed_token_bitmask: must leave at least one token",
       [](SamplingParams* p) {
         p->allowed_bitmask = {1u << 5, 0, 0, (1u << 1) | 0xfffffff0u};
         p->banned_token_ids = {97, 5, 5};  // 97 = 32 * 3 + 1
       }},
      {"repetition_penalty: must be finite and > 0",
       [](SamplingParams* p) { p->repetition_penalty = 0.0f; }},
      {"presence_penalty: must be finite",
       [](SamplingParams* p) { p->presence_penalty = -kInf; }},
      {"frequency_penalty: must be finite",
       [](SamplingParams* p) { p->frequency_penalty = std::nanf(""); }},
      {"prompt_token_ids[0]: token id must be in [0, 100)",
       [](SamplingParams* p) { p->prompt_token_ids = {100}; }},
      {"output_token_counts[0].count: must be >= 1, got 0",
       [](SamplingParams* p) {
         p->output_token_counts = {{3, 0}};
       }},
      {"n: must be in [1, 16], got 0", [](SamplingParams* p) { p->n = 0; }},
      {"n: must be in [1, 16], got 17", [](SamplingParams* p) { p->n = 17; }},
      {"logprobs.top_logprobs: must be in [0, 20], got 21",
       [](SamplingParams* p) { p->logprobs.top_n = 21; }},
      {"logprobs.top_logprobs: must be in [0, 20], got -1",
       [](SamplingParams* p) { p->logprobs.top_n = -1; }},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.edit(&p);
    const absl::Status s = Wire(p);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(s.message()),
                StartsWith("row_params[3]." + c.want));
  }
}

// Engines take what only the wire refuses: a -inf bias is a ban, a zero
// output count is skipped, masks that leave nothing fail when sampled; they
// cap neither n nor top-N. An empty prefix names the bare field.
TEST(ValidateSamplingParamsTest, EngineRulesDifferOnlyWhereDocumented) {
  SamplingParams p;
  p.logit_bias = {{1, -kInf}};
  p.output_token_counts = {{3, 0}};
  p.allowed_bitmask.assign(4, 0u);
  p.n = 1000;
  p.logprobs.top_n = 50;
  EXPECT_TRUE(Engine(p).ok()) << Engine(p);
  EXPECT_FALSE(Wire(p).ok());
  p.logit_bias = {{1, kInf}};
  EXPECT_THAT(std::string(Engine(p).message()),
              StartsWith("logit_bias[0].bias: must be finite or -inf"));
  p = {};
  p.n = 0;
  EXPECT_EQ(Engine(p).message(), "n: must be >= 1, got 0");
  p = {};
  p.output_token_counts = {{3, -1}};
  EXPECT_THAT(std::string(Engine(p).message()),
              HasSubstr("output_token_counts[0].count: must be >= 0"));
}

// top_k = -1 is "off" everywhere: a backend without top_k still serves it.
TEST(ValidateSamplingParamsTest, TopKMinusOneUsesNoControl) {
  SamplingParams p;
  p.top_k = -1;
  EXPECT_EQ(FirstUnsupportedControl(p, {}), "");
  p.top_k = 5;
  EXPECT_EQ(FirstUnsupportedControl(p, {}), "top_k");
}

// A view's copies view the same words; an owned bitmask's copies own theirs;
// writing to a view's words copies them first and leaves the viewed words
// alone.
TEST(TokenBitmaskTest, CopiesViewOrOwnAsTheOriginal) {
  std::vector<uint32_t> words = {1u, 2u, 3u};
  const TokenBitmask view = TokenBitmask::View(words);
  TokenBitmask view_copy = view;
  EXPECT_EQ(view_copy.data(), words.data());
  EXPECT_EQ(view_copy, TokenBitmask({1u, 2u, 3u}));

  const TokenBitmask owned = words;
  const TokenBitmask owned_copy = owned;
  EXPECT_NE(owned.data(), words.data());
  EXPECT_NE(owned_copy.data(), owned.data());
  EXPECT_EQ(owned_copy, owned);

  view_copy.mutable_words()[1] = 7u;
  EXPECT_NE(view_copy.data(), words.data());
  EXPECT_EQ(view_copy, TokenBitmask({1u, 7u, 3u}));
  EXPECT_EQ(words, std::vector<uint32_t>({1u, 2u, 3u}));
  EXPECT_EQ(view, TokenBitmask({1u, 2u, 3u}));

  view_copy.clear();
  EXPECT_TRUE(view_copy.empty());
  EXPECT_TRUE(TokenBitmask::View({}).empty());
}

}  // namespace
}  // namespace flashsampler
