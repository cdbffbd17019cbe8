// Logprobs step: the online log-sum-exp against fp64 log(sum(exp)), merges
// equal to one pass whatever the split, -inf skipped, and logprobs rounded
// once from double.
#include "service/backends/cpu/logprobs.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace flashsampler {
namespace cpu {
namespace {

TEST(LogprobsTest, LseMatchesFp64AndMergesAnyWay) {
  std::mt19937 rng(1);
  std::normal_distribution<double> normal(0.0, 8.0);
  std::vector<double> v(1000);
  for (double& x : v) x = normal(rng);
  double m = -INFINITY;
  for (double x : v) m = std::max(m, x);
  double sum = 0.0;
  for (double x : v) sum += std::exp(x - m);
  const double want = m + std::log(sum);
  Lse all;
  for (double x : v) all.Add(x);
  EXPECT_NEAR(all.Value(), want, 1e-12);
  for (size_t split : {1u, 10u, 333u, 999u}) {
    Lse a, b;
    for (size_t i = 0; i < v.size(); ++i) (i < split ? a : b).Add(v[i]);
    a.Merge(b);
    EXPECT_NEAR(a.Value(), want, 1e-12) << split;
  }
}

TEST(LogprobsTest, MinusInfinityIsSkippedAndEmptyIsMinusInfinity) {
  Lse empty;
  EXPECT_EQ(empty.Value(), -INFINITY);
  empty.Add(-INFINITY);
  EXPECT_EQ(empty.Value(), -INFINITY);
  Lse two;
  two.Add(std::log(2.0));
  two.Add(-INFINITY);
  two.Add(std::log(6.0));
  EXPECT_NEAR(two.Value(), std::log(8.0), 1e-15);
  Lse merged;
  merged.Merge(empty);
  merged.Merge(two);
  EXPECT_EQ(merged.Value(), two.Value());
}

TEST(LogprobsTest, LogprobsRoundOnceFromDouble) {
  const double lse = std::log(3.0);
  EXPECT_EQ(Logprob(0.0f, lse), static_cast<float>(-std::log(3.0)));
  RowResult out;
  FillTopLogprobs({{2.0f, 5}, {1.0f, 2}}, 2.5, &out);
  EXPECT_EQ(out.top_token_ids, (std::vector<int32_t>{5, 2}));
  EXPECT_EQ(out.top_logprobs, (std::vector<float>{-0.5f, -1.5f}));
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
