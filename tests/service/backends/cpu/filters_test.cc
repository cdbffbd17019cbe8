// Filters step: the min_p floor against an fp64 check of every float near
// it, exact ceil(p * z), the fixed-point masses, the order key, Cutoff tie
// handling (kUpToId, kFirstRanks across chunks, kAll for top_k), the top-p cut
// of a list, and a full radix select of a count against a sort.
#include "service/backends/cpu/filters.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace flashsampler {
namespace cpu {
namespace {

TEST(FiltersTest, SmallestKeptIsTheExactMinPFloor) {
  for (float x_max : {0.0f, 3.5f, -7.25f, 100.0f}) {
    for (float min_p : {1.0f, 0.5f, 0.1f, 1e-3f, 1e-30f}) {
      const float f = SmallestKept(x_max, min_p);
      const double log_min_p = std::log(static_cast<double>(min_p));
      auto kept = [&](float v) {
        return static_cast<double>(v) - static_cast<double>(x_max) >= log_min_p;
      };
      EXPECT_TRUE(kept(f)) << x_max << " " << min_p;
      EXPECT_FALSE(kept(std::nextafter(f, -INFINITY))) << x_max << " " << min_p;
    }
  }
  EXPECT_EQ(SmallestKept(2.0f, 1.0f), 2.0f);  // min_p = 1 keeps only the max
}

TEST(FiltersTest, CeilScaledIsExact) {
  EXPECT_EQ(static_cast<uint64_t>(CeilScaled(0.5f, 10)), 5u);
  EXPECT_EQ(static_cast<uint64_t>(CeilScaled(0.5f, 11)), 6u);
  EXPECT_EQ(static_cast<uint64_t>(CeilScaled(0.25f, 1)), 1u);
  EXPECT_EQ(static_cast<uint64_t>(CeilScaled(0.25f, 0)), 0u);
  // p = fl(0.1) = 13421773 * 2^-27: ceil(p * 2^27) = 13421773 exactly.
  EXPECT_EQ(static_cast<uint64_t>(CeilScaled(0.1f, uint128{1} << 27)),
            13421773u);
  const uint128 big = (uint128{1} << 90) + 3;
  EXPECT_TRUE(CeilScaled(0.5f, big) == (uint128{1} << 89) + 2);
}

TEST(FiltersTest, FixedMassAndOrderKey) {
  EXPECT_EQ(FixedMass(1.5f, 1.5f), uint64_t{1} << 62);
  EXPECT_NEAR(std::ldexp(static_cast<double>(FixedMass(0.0f, 1.0f)), -62),
              std::exp(-1.0), 1e-15);
  const float xs[] = {-INFINITY, -3.0f, -1e-30f, 0.0f, 1e-30f, 2.0f, INFINITY};
  for (size_t i = 0; i + 1 < std::size(xs); ++i) {
    EXPECT_LT(OrderKey(xs[i]), OrderKey(xs[i + 1])) << xs[i];
    EXPECT_EQ(KeyValue(OrderKey(xs[i])), xs[i]);
  }
}

TEST(FiltersTest, CutoffTiesGoToTheLowestIdsAcrossChunks) {
  Cutoff up_to = Cutoff::UpTo({2.0f, 7});
  CutoffCursor c;
  c.Start(up_to, 0);
  EXPECT_TRUE(c.Keep(3.0f, 100));
  EXPECT_TRUE(c.Keep(2.0f, 7));
  EXPECT_FALSE(c.Keep(2.0f, 8));
  EXPECT_FALSE(c.Keep(1.0f, 0));

  // Keep the first 3 tokens of value 2 in id order; chunk 0 holds 2 of them.
  Cutoff ranks;
  ranks.active = true;
  ranks.v = 2.0f;
  ranks.ties = Cutoff::Ties::kFirstRanks;
  ranks.ranks = 3;
  ranks.tie_prefix = {0, 2};
  c.Start(ranks, 1);
  EXPECT_TRUE(c.Keep(2.0f, 50));   // third tie
  EXPECT_FALSE(c.Keep(2.0f, 51));  // fourth
  EXPECT_TRUE(c.Keep(2.5f, 52));
}

// top_k's cut is a value threshold: every tie of the k-th value stays,
// whatever its id or chunk.
TEST(FiltersTest, AtLeastKeepsEveryTieOfTheValue) {
  const Cutoff at_least = Cutoff::AtLeast(2.0f);
  EXPECT_TRUE(at_least.active);
  EXPECT_EQ(at_least.ties, Cutoff::Ties::kAll);
  for (int64_t chunk : {-1, 0, 3}) {
    CutoffCursor c;
    c.Start(at_least, chunk);
    EXPECT_TRUE(c.Keep(3.0f, 100));
    EXPECT_TRUE(c.Keep(2.0f, 0));
    EXPECT_TRUE(c.Keep(2.0f, 7));
    EXPECT_TRUE(c.Keep(2.0f, 123456));
    EXPECT_FALSE(c.Keep(std::nextafter(2.0f, 0.0f), 1));
  }
}

TEST(FiltersTest, TopPCutOfListIsTheShortestPrefixReachingP) {
  // Masses 1, 1/2, 1/4, 1/8 (x = 0, -ln 2, ...): total 15/8.
  const double ln2 = std::log(2.0);
  std::vector<Entry> sorted;
  for (int i = 0; i < 4; ++i)
    sorted.push_back({static_cast<float>(-i * ln2), 10 + i});
  // Targets ceil(p * 15/8): p = 0.5 -> 0.94 (one token), 0.6 -> 1.13 (two),
  // 0.9 -> 1.69 (three), 1 -> all four; every margin is far above rounding.
  const struct {
    float p;
    int32_t last;
  } cases[] = {{0.5f, 10}, {0.6f, 11}, {0.9f, 12}, {1.0f, 13}};
  for (const auto& c : cases) {
    Cutoff cut;
    ASSERT_TRUE(TopPCutOfList(sorted, c.p, 0.0f, &cut));
    EXPECT_EQ(cut.max_id, c.last) << c.p;
    EXPECT_EQ(cut.v, sorted[c.last - 10].x);
    EXPECT_EQ(cut.ties, Cutoff::Ties::kUpToId);
  }
  Cutoff none;
  EXPECT_FALSE(TopPCutOfList({}, 0.5f, 0.0f, &none));
}

TEST(FiltersTest, RadixSelectOfACountMatchesASort) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(5000);
  for (float& v : x) v = std::round(normal(rng) * 64.0f) / 64.0f;  // ties
  for (uint64_t k : {1u, 17u, 2500u, 4999u}) {
    RadixSelect sel;
    sel.target = k;
    sel.StartLevel(0);
    int64_t found = -1;
    while (true) {
      for (float v : x) {
        const int64_t d = sel.Digit(OrderKey(v));
        if (d >= 0) ++sel.count[d];
      }
      uint128 above = 0;
      found = sel.FindBin(&above);
      ASSERT_GE(found, 0);
      sel.above = above;
      sel.prefix =
          (sel.prefix << kRadixBits[sel.level]) | static_cast<uint32_t>(found);
      if (sel.level == 2) break;
      sel.StartLevel(sel.level + 1);
    }
    std::vector<float> sorted = x;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    EXPECT_EQ(KeyValue(sel.prefix), sorted[k - 1]) << k;
    // `above` counts the tokens strictly above the cut value.
    const int64_t strictly_above = std::count_if(
        x.begin(), x.end(), [&](float v) { return v > sorted[k - 1]; });
    EXPECT_EQ(static_cast<int64_t>(sel.above), strictly_above);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
