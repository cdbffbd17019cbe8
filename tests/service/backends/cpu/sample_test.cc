// Sample step: the cached noise walk gives GumbelNoise bit for bit (in
// order, with jumps, across blocks), MaxGumbelNoise bounds every noise, and
// the offers keep the argmax with ties to the lowest id and prune only
// tokens that cannot win.
#include "service/backends/cpu/sample.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace flashsampler {
namespace cpu {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST(SampleTest, NoiseWalkIsGumbelNoiseBitForBit) {
  for (uint32_t sample : {0u, 3u}) {
    NoiseWalk walk(0x1234567890abcdefull, 77, sample);
    for (int32_t id = 0; id < 3000; ++id) {
      ASSERT_EQ(Bits(walk.Noise(id)),
                Bits(GumbelNoise(0x1234567890abcdefull, 77, sample,
                                 static_cast<uint32_t>(id))))
          << id;
    }
  }
  // Jumps (ids of survivors are sparse) and block boundaries.
  NoiseWalk walk(9, 1, 0);
  for (int32_t id : {5, 15, 16, 17, 63, 64, 1000, 1003, 1004, 99999}) {
    EXPECT_EQ(Bits(walk.Noise(id)), Bits(GumbelNoise(9, 1, 0, id))) << id;
  }
}

TEST(SampleTest, MaxGumbelNoiseBoundsTheNoise) {
  const float bound = MaxGumbelNoise();
  EXPECT_GT(bound, 19.0f);
  EXPECT_LT(bound, 20.0f);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t id = static_cast<uint32_t>(rng() % 200000);
    ASSERT_LT(GumbelNoise(rng(), rng(), 0, id), bound);
  }
}

TEST(SampleTest, OffersKeepTheArgmaxWithTiesToTheLowestId) {
  BestOf greedy;
  OfferGreedy(1.0f, 9, 1.0f, 1.0f, &greedy);
  OfferGreedy(2.0f, 12, 2.0f, 2.0f, &greedy);
  OfferGreedy(2.0f, 4, 2.0f, 2.5f, &greedy);
  OfferGreedy(2.0f, 8, 2.0f, 2.0f, &greedy);
  EXPECT_EQ(greedy.id, 4);
  EXPECT_EQ(greedy.z, 2.5f);

  // Sampling: the winner is the argmax of GumbelScore over the offers.
  const float inv_t = 0.5f;
  const float max_g = MaxGumbelNoise();
  NoiseWalk walk(42, 0, 0);
  BestOf best;
  float want_score = -INFINITY;
  int32_t want_id = -1;
  for (int32_t id = 0; id < 64; ++id) {
    const float l = static_cast<float>(id % 5);
    OfferSample(l, inv_t, id, l * inv_t, l, max_g, &walk, &best);
    const float s = GumbelScore(l, inv_t, GumbelNoise(42, 0, 0, id));
    if (s > want_score) {
      want_score = s;
      want_id = id;
    }
  }
  EXPECT_EQ(best.id, want_id);
  EXPECT_EQ(best.score, want_score);
  // A token whose x + max noise is below the best is never scored.
  BestOf high;
  high.score = 100.0f;
  high.id = 1;
  OfferSample(0.0f, 1.0f, 0, 0.0f, 0.0f, max_g, &walk, &high);
  EXPECT_EQ(high.id, 1);
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
