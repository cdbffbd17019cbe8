// The shared noise (kernels/noise/philox.h): Philox4x32-10 against the
// published Random123 known-answer vectors, the uniform mapping strictly inside
// (0, 1) at the extremes of the counter space, AccurateLog's accuracy over the
// range the Gumbel transform uses, the noise blocks' construction and
// statistics, and the Gumbel helpers' mutual consistency.
#include "kernels/noise/philox.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "service/backends/cpu/cpu_sampler.h"

namespace flashsampler {
namespace {

void ExpectPhilox(Philox4x32 counter, uint32_t key0, uint32_t key1,
                  Philox4x32 want) {
  const Philox4x32 got = Philox4x32_10(counter, key0, key1);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got.v[i], want.v[i]) << "word " << i;
  }
}

// Random123's kat_vectors for philox4x32_10.
TEST(PhiloxTest, MatchesRandom123KnownAnswers) {
  ExpectPhilox({{0, 0, 0, 0}}, 0, 0,
               {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
  ExpectPhilox({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
               0xffffffffu, 0xffffffffu,
               {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
  ExpectPhilox({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
               0xa4093822u, 0x299f31d0u,
               {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(PhiloxTest, NoiseBits4KeysBySeedAndCountsTokenGroupSampleStep) {
  const uint64_t seed = 0x299f31d0a4093822ull;
  const uint64_t step = 0x0370734413198a2eull;
  const Philox4x32 got = NoiseBits4(seed, step, 0x85a308d3u, 0x243f6a88u);
  const Philox4x32 want = {
      {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(got.v[i], want.v[i]);
}

TEST(PhiloxTest, UniformEndpointsAreTheDocumentedCellMidpoints) {
  EXPECT_EQ(UniformFromBits(0u), std::ldexp(1.0f, -24));
  EXPECT_EQ(UniformFromBits(0xffffffffu), 1.0f - std::ldexp(1.0f, -24));
  EXPECT_EQ(UniformFromBits(1u << 9), 3.0f * std::ldexp(1.0f, -24));
  EXPECT_EQ(UniformFromBits(0x1ffu),
            std::ldexp(1.0f, -24));  // low 9 bits dropped
  EXPECT_EQ(UniformFromBits(0x80000000u), 0.5f + std::ldexp(1.0f, -24));
}

// 10^8 uniforms (2.5 x 10^7 Philox calls) with every counter word near 0 or
// near 2^32 - 1, for seeds 0 and ~0: all strictly inside (0, 1), all giving
// finite Gumbel noise inside the documented range.
TEST(PhiloxTest, UniformsStayStrictlyInsideZeroOneAtCounterExtremes) {
  constexpr int kCallsPerCorner =
      781250;  // x 16 corners x 2 seeds x 4 words = 10^8
  const float lowest = std::ldexp(1.0f, -24);
  const float highest = 1.0f - std::ldexp(1.0f, -24);
  const float gumbel_min = GumbelFromUniform(lowest);
  const float gumbel_max = GumbelFromUniform(highest);
  int64_t draws = 0;
  int64_t bad = 0;
  float min_u = 1.0f, max_u = 0.0f;
  for (uint64_t seed : {uint64_t{0}, ~uint64_t{0}}) {
    for (int corner = 0; corner < 16; ++corner) {
      auto word = [corner](int w, uint32_t offset) {
        return ((corner >> w) & 1) ? 0xffffffffu - offset : offset;
      };
      for (int i = 0; i < kCallsPerCorner; ++i) {
        const uint32_t a = static_cast<uint32_t>(i) & 1023u;
        const uint32_t b = static_cast<uint32_t>(i) >> 10;
        const Philox4x32 counter{
            {word(0, a), word(1, b), word(2, a ^ b), word(3, (a * 7) & 63)}};
        const Philox4x32 bits =
            Philox4x32_10(counter, static_cast<uint32_t>(seed),
                          static_cast<uint32_t>(seed >> 32));
        for (uint32_t v : bits.v) {
          const float u = UniformFromBits(v);
          min_u = std::min(min_u, u);
          max_u = std::max(max_u, u);
          bad += !(u > 0.0f && u < 1.0f);
          ++draws;
        }
      }
    }
  }
  EXPECT_EQ(draws, 100000000);
  EXPECT_EQ(bad, 0);
  EXPECT_GE(min_u, lowest);
  EXPECT_LE(max_u, highest);
  EXPECT_TRUE(std::isfinite(gumbel_min));
  EXPECT_TRUE(std::isfinite(gumbel_max));
  EXPECT_GT(gumbel_min, -2.9f);
  EXPECT_LT(gumbel_max, 16.7f);
}

// Distance from `got` to the exact value, in units in the last place of the
// float nearest the exact value.
double UlpError(float got, double exact) {
  const float nearest = static_cast<float>(exact);
  const float up =
      std::nextafter(std::abs(nearest), std::numeric_limits<float>::infinity());
  const double ulp =
      static_cast<double>(up) - std::abs(static_cast<double>(nearest));
  return std::abs(static_cast<double>(got) - exact) / ulp;
}

// AccurateLog is applied to the 2^23 uniforms u and then to -log(u) in
// [6e-8, 16.7]. Both sets are swept exhaustively; a coarser sweep covers the
// rest of the normal range.
TEST(PhiloxTest, AccurateLogIsWithinOneUlpOverTheRangeUsed) {
  double worst = 0.0;
  for (uint32_t cell = 0; cell < (1u << 23); ++cell) {
    const float u = UniformFromBits(cell << 9);
    const float log_u = AccurateLog(u);
    worst = std::max(worst, UlpError(log_u, std::log(static_cast<double>(u))));
    const float t = -log_u;
    worst = std::max(
        worst, UlpError(AccurateLog(t), std::log(static_cast<double>(t))));
  }
  EXPECT_LE(worst, 1.0);
  double worst_wide = 0.0;
  for (uint32_t bits = 0x00800000u; bits < 0x7f800000u; bits += 97) {
    const float x = BitsToFloat(bits);
    worst_wide = std::max(
        worst_wide, UlpError(AccurateLog(x), std::log(static_cast<double>(x))));
  }
  EXPECT_LE(worst_wide, 1.0);
  EXPECT_EQ(AccurateLog(1.0f), 0.0f);
}

// GumbelNoise is the block construction of philox.h: the block's call gives
// the first slot and E_min, the other slots add their token word's
// exponential.
TEST(PhiloxTest, GumbelNoiseIsTheBlockConstruction) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 100000; ++i) {
    const uint64_t seed = rng(), step = rng();
    const uint32_t sample = static_cast<uint32_t>(rng() % 16);
    const uint32_t token = static_cast<uint32_t>(rng() % 0x7fffffffu);
    const NoiseBlock block = NoiseBlockOf(seed, step, sample, token >> 4);
    ASSERT_LT(block.first_slot, kNoiseBlockTokens);
    const double min_exponential =
        -static_cast<double>(AccurateLog(block.uniform)) / 16.0;
    const bool first = (token & 15u) == block.first_slot;
    const float v = UniformFromBits(
        NoiseBits4(seed, step, sample, token >> 2).v[token & 3]);
    const double want =
        first ? -std::log(min_exponential)
              : -std::log(min_exponential - std::log(static_cast<double>(v)));
    ASSERT_NEAR(GumbelNoise(seed, step, sample, token), want,
                1e-5 * std::max(1.0, std::fabs(want)))
        << token;
  }
}

// BlockNoise is GumbelNoise slot by slot, bit for bit.
TEST(PhiloxTest, BlockNoiseEqualsGumbelNoiseOfEachSlot) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 5000; ++i) {
    const uint64_t seed = rng(), step = rng();
    const uint32_t sample = static_cast<uint32_t>(rng() % 16);
    const uint32_t block = static_cast<uint32_t>(rng() % (1u << 27));
    float noise[kNoiseBlockTokens];
    BlockNoise(seed, step, sample, block, noise);
    for (uint32_t slot = 0; slot < kNoiseBlockTokens; ++slot) {
      ASSERT_EQ(FloatToBits(noise[slot]),
                FloatToBits(GumbelNoise(seed, step, sample,
                                        kNoiseBlockTokens * block + slot)))
          << block << " " << slot;
    }
  }
}

// The first slot holds the block's largest noise (the bound the kernels
// prune whole blocks with), and the block's word is the documented one.
TEST(PhiloxTest, FirstSlotHoldsTheBlocksLargestNoise) {
  std::mt19937_64 rng(2);
  for (int i = 0; i < 20000; ++i) {
    const uint64_t seed = rng(), step = rng();
    const uint32_t block_index = static_cast<uint32_t>(rng() % (1u << 27));
    const NoiseBlock block = NoiseBlockOf(seed, step, 0, block_index);
    const float top =
        GumbelNoise(seed, step, 0, 16 * block_index + block.first_slot);
    for (uint32_t slot = 0; slot < kNoiseBlockTokens; ++slot) {
      ASSERT_LE(GumbelNoise(seed, step, 0, 16 * block_index + slot), top);
    }
    // The block's word is word block % 4 of its group's call (block / 4),
    // whose counter carries the flag that no token group has.
    const uint32_t word =
        Philox4x32_10(
            {{kNoiseBlockCounterFlag | (block_index >> 2), 0,
              static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32)}},
            static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32))
            .v[block_index & 3];
    ASSERT_EQ(block.first_slot, word % 16);
    ASSERT_EQ(FloatToBits(block.uniform), FloatToBits(UniformFromBits(word)));
  }
}

// The CPU sampler prunes with MaxGumbelNoise(). Checked exhaustively: every
// one of the 2^23 cells as a block's uniform (its first slot's noise, and
// another slot's with v in the top cell, the largest that slot can take),
// and as a token's uniform under the smallest E_min (where another slot's
// noise is largest). GumbelFromUniform, which PruneBounds brackets, is
// non-decreasing over every cell.
TEST(PhiloxTest, MaxGumbelNoiseBoundsEveryCell) {
  const float bound = MaxGumbelNoise();
  const float smallest_min =
      BlockMinExponential(UniformFromBits(0xffffffffu), RoundedDivide{});
  float previous = -std::numeric_limits<float>::infinity();
  bool monotone = true;
  float largest = -std::numeric_limits<float>::infinity();
  for (uint32_t cell = 0; cell < (1u << 23); ++cell) {
    const float u = UniformFromBits(cell << 9);
    const float min_exponential = BlockMinExponential(u, RoundedDivide{});
    const float first =
        BlockSlotGumbel(min_exponential, true, 0u, RoundedDivide{});
    const float other_top =
        BlockSlotGumbel(min_exponential, false, 0xffffffffu, RoundedDivide{});
    const float other =
        BlockSlotGumbel(smallest_min, false, cell << 9, RoundedDivide{});
    ASSERT_LE(first, bound) << cell;
    ASSERT_LE(other_top, bound) << cell;
    ASSERT_LE(other, bound) << cell;
    largest = std::max({largest, first, other_top, other});
    const float g = GumbelFromUniform(u);
    monotone = monotone && g >= previous;
    previous = g;
  }
  EXPECT_TRUE(monotone);
  // The bound is tight to its margin: about 19.4, the top cell's first slot.
  EXPECT_NEAR(bound, largest, 1.0 / 512.0);
  EXPECT_NEAR(bound, 19.4, 0.1);
}

// The block construction's statistics over 2 x 10^5 blocks: the first slot
// is uniform over the 16 slots (chi-squared, 15 degrees of freedom, p =
// 0.001 cut at 37.70), the block's largest noise is Gumbel(ln 16, 1) (mean
// gamma + ln 16, variance pi^2 / 6: standard errors 0.0029 and 0.010), and
// neighbouring slots are uncorrelated (standard error 0.0022).
TEST(PhiloxTest, NoiseBlocksHaveTheStatisticsOfSixteenGumbels) {
  const int blocks = 200000;
  std::vector<int64_t> first_count(kNoiseBlockTokens, 0);
  double max_sum = 0.0, max_sum_sq = 0.0;
  double pair_sum = 0.0, a_sum = 0.0, b_sum = 0.0, a_sq = 0.0, b_sq = 0.0;
  int64_t pairs = 0;
  for (int i = 0; i < blocks; ++i) {
    const uint32_t block_index = static_cast<uint32_t>(i);
    ++first_count[NoiseBlockOf(99, 5, 1, block_index).first_slot];
    double largest = -1e30;
    double previous = 0.0;
    for (uint32_t slot = 0; slot < kNoiseBlockTokens; ++slot) {
      const double g = GumbelNoise(99, 5, 1, 16 * block_index + slot);
      largest = std::max(largest, g);
      if (slot % 2 == 1) {
        pair_sum += previous * g;
        a_sum += previous;
        b_sum += g;
        a_sq += previous * previous;
        b_sq += g * g;
        ++pairs;
      }
      previous = g;
    }
    max_sum += largest;
    max_sum_sq += largest * largest;
  }
  const double expected = static_cast<double>(blocks) / kNoiseBlockTokens;
  double chi2 = 0.0;
  for (int64_t c : first_count) {
    chi2 += (c - expected) * (c - expected) / expected;
  }
  EXPECT_LT(chi2, 37.70);
  const double max_mean = max_sum / blocks;
  EXPECT_NEAR(max_mean, 0.5772156649 + std::log(16.0), 0.015);
  EXPECT_NEAR(max_sum_sq / blocks - max_mean * max_mean, M_PI * M_PI / 6.0,
              0.05);
  const double n = static_cast<double>(pairs);
  const double covariance = pair_sum / n - (a_sum / n) * (b_sum / n);
  const double correlation =
      covariance / std::sqrt((a_sq / n - (a_sum / n) * (a_sum / n)) *
                             (b_sq / n - (b_sum / n) * (b_sum / n)));
  EXPECT_NEAR(correlation, 0.0, 0.011);
}

// Sanity of the whole chain: Gumbel(0, 1) has mean Euler's gamma and
// variance pi^2 / 6 (10^6 draws: standard errors 0.0013 and 0.0046).
TEST(PhiloxTest, GumbelNoiseHasGumbelMoments) {
  double sum = 0.0, sum_sq = 0.0;
  const int n = 1000000;
  for (int i = 0; i < n; ++i) {
    const double g = GumbelNoise(12345, 7, 0, static_cast<uint32_t>(i));
    sum += g;
    sum_sq += g * g;
  }
  const double mean = sum / n;
  const double variance = sum_sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5772156649, 0.007);
  EXPECT_NEAR(variance, M_PI * M_PI / 6.0, 0.025);
}

}  // namespace
}  // namespace flashsampler
