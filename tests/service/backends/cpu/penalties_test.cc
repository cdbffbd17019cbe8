// Penalties step: logit_bias entries add up per id in list order, then a
// masked token is -inf, else repetition (divide positives, multiply
// negatives), frequency x count and presence apply, each in fp32; checked
// against hand-computed values.
#include "service/backends/cpu/penalties.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace flashsampler {
namespace cpu {
namespace {

TEST(PenaltiesTest, CollectsOneSortedEditPerId) {
  SamplingParams p;
  p.logit_bias = {{7, 0.5f}, {2, 1.0f}, {7, 0.25f}};
  p.banned_token_ids = {9};
  p.repetition_penalty = 2.0f;
  p.prompt_token_ids = {2, 4};
  p.output_token_counts = {{4, 2}, {5, 0}, {4, 1}};
  const std::vector<TokenEdit> e = CollectTokenEdits(p);
  ASSERT_EQ(e.size(), 4u);  // ids 2, 4, 7, 9; the zero count adds nothing
  EXPECT_EQ(e[0].id, 2);
  EXPECT_TRUE(e[0].has_bias && e[0].repeated);
  EXPECT_EQ(e[0].bias, 1.0f);
  EXPECT_EQ(e[1].id, 4);
  EXPECT_TRUE(e[1].repeated);
  EXPECT_EQ(e[1].count, 3);
  EXPECT_EQ(e[2].id, 7);
  EXPECT_EQ(e[2].bias, 0.75f);
  EXPECT_FALSE(e[2].repeated);
  EXPECT_EQ(e[3].id, 9);
  EXPECT_TRUE(e[3].banned);
}

TEST(PenaltiesTest, RepetitionOnlyCountsWhenItIsNotOne) {
  SamplingParams p;
  p.prompt_token_ids = {1};
  p.output_token_counts = {{2, 1}};
  const std::vector<TokenEdit> e = CollectTokenEdits(p);
  ASSERT_EQ(e.size(), 1u);  // the prompt id needs no edit at r = 1
  EXPECT_EQ(e[0].id, 2);
  EXPECT_FALSE(e[0].repeated);
  EXPECT_EQ(e[0].count, 1);
}

TEST(PenaltiesTest, HandComputedValues) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  TokenEdit e;
  e.repeated = true;
  e.count = 3;
  // 3 / 2 - 0.5 * 3 - 0.25 = -0.25; -3 * 2 - 1.5 - 0.25 = -7.75.
  EXPECT_EQ(ApplyPenalties(3.0f, e, p), -0.25f);
  EXPECT_EQ(ApplyPenalties(-3.0f, e, p), -7.75f);
  e.count = 0;  // repeated from the prompt only: no frequency or presence
  EXPECT_EQ(ApplyPenalties(3.0f, e, p), 1.5f);
  // Bias comes first: 1 + 2 = 3 is then divided by r.
  TokenEdit b;
  b.id = 5;
  b.has_bias = true;
  b.bias = 2.0f;
  b.repeated = true;
  EXPECT_EQ(EditedLogit(1.0f, b, nullptr, p), 1.5f);
  b.banned = true;
  EXPECT_EQ(EditedLogit(1.0f, b, nullptr, p),
            -std::numeric_limits<float>::infinity());
  b.banned = false;
  const uint32_t mask = ~(1u << 5);  // token 5 disallowed
  EXPECT_EQ(EditedLogit(1.0f, b, &mask, p),
            -std::numeric_limits<float>::infinity());
}

TEST(PenaltiesTest, OnlyEditedTokensOfTheTileChange) {
  SamplingParams p;
  p.logit_bias = {{3, 1.0f}, {10, 1.0f}, {12, -1.0f}};
  const std::vector<TokenEdit> edits = CollectTokenEdits(p);
  std::vector<float> z(4, 2.0f), l(4, 2.0f);  // tokens 9..12
  ApplyTokenEdits(edits, nullptr, p, 9, 4, z.data(), l.data());
  EXPECT_EQ(l, (std::vector<float>{2.0f, 3.0f, 2.0f, 1.0f}));
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
