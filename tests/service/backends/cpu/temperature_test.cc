// Temperature step: 1 / T is rounded to fp32 once per row and multiplied in
// (the GPU does the same), greedy rows scale by 1, and -0 becomes +0.
#include "service/backends/cpu/temperature.h"

#include <gtest/gtest.h>

#include <cmath>

namespace flashsampler {
namespace cpu {
namespace {

TEST(TemperatureTest, ReciprocalRoundedOnceThenMultiplied) {
  SamplingParams p;
  for (float t : {0.7f, 1.0f, 1.3f, 0.01f, 3.0f}) {
    p.temperature = t;
    const float inv = InverseTemperature(p);
    EXPECT_EQ(inv, static_cast<float>(1.0 / static_cast<double>(t))) << t;
    for (float l : {1.0f, -2.5f, 17.125f}) {
      // fl(l * fl(1 / T)): exact product in double, rounded once.
      const float want =
          static_cast<float>(static_cast<double>(l) * static_cast<double>(inv));
      EXPECT_EQ(ScaleLogit(l, inv), want) << t << " " << l;
    }
  }
  // Not l / T: at T = 0.7 the two differ for l = 5 (1 ulp).
  p.temperature = 0.7f;
  EXPECT_NE(ScaleLogit(5.0f, InverseTemperature(p)), 5.0f / 0.7f);
}

TEST(TemperatureTest, GreedyScalesByOneAndZeroHasOneSign) {
  SamplingParams p;
  p.temperature = 0.0f;
  EXPECT_EQ(InverseTemperature(p), 1.0f);
  // Below 1e-5 a row is greedy (vLLM's rule): 1 / T never reaches fp32's
  // overflow (1 / 1e-38 scaled logits to +-inf).
  for (float t : {1e-38f, 1e-30f, 9.9e-6f}) {
    p.temperature = t;
    EXPECT_TRUE(p.greedy()) << t;
    EXPECT_EQ(InverseTemperature(p), 1.0f) << t;
  }
  p.temperature = 1e-5f;
  EXPECT_FALSE(p.greedy());
  EXPECT_EQ(InverseTemperature(p), 1.0f / 1e-5f);
  const float x = ScaleLogit(-0.0f, 2.0f);
  EXPECT_EQ(x, 0.0f);
  EXPECT_FALSE(std::signbit(x));
  EXPECT_EQ(ScaleLogit(-std::numeric_limits<float>::infinity(), 0.5f),
            -std::numeric_limits<float>::infinity());
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
