// The unit candidates' key selection (kernels/sampler/unit_candidates.h) on
// the host: the sorting networks the fused kernel's epilogue runs, against
// std::sort, on random keys with ties at 0 (tokens left out) and on every
// order of four keys.
#include "kernels/sampler/unit_candidates.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace flashsampler {
namespace {

std::vector<uint32_t> Descending(std::vector<uint32_t> keys) {
  std::sort(keys.begin(), keys.end(), std::greater<uint32_t>());
  return keys;
}

// Distinct keys as the epilogue makes them (the slot in the low 5 bits),
// some replaced by 0 with probability `left_out`.
std::vector<uint32_t> RandomKeys(std::mt19937& rng, int count,
                                 double left_out) {
  std::uniform_int_distribution<uint32_t> high(0, (1u << 27) - 1);
  std::bernoulli_distribution zero(left_out);
  std::vector<uint32_t> keys(count);
  for (int i = 0; i < count; ++i) {
    keys[i] = zero(rng) ? 0u : (high(rng) << 5) | static_cast<uint32_t>(i);
  }
  return keys;
}

TEST(UnitCandidatesTest, SortUnitKeys4SortsEveryOrderOfFourKeys) {
  std::array<uint32_t, 4> values = {3, 7, 7, 11};  // with a tie
  std::sort(values.begin(), values.end());
  do {
    uint32_t k[4] = {values[0], values[1], values[2], values[3]};
    SortUnitKeys4(k);
    EXPECT_EQ(std::vector<uint32_t>(k, k + 4),
              Descending({values.begin(), values.end()}));
  } while (std::next_permutation(values.begin(), values.end()));
}

// The epilogue's whole selection of a unit: each lane's 16 keys in runs of
// four, then the pair's two top fives.
TEST(UnitCandidatesTest, TheUnitsTopFiveIsTheFiveLargestKeys) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 20000; ++trial) {
    const double left_out = (trial % 5) * 0.25;  // 0 .. all left out
    const std::vector<uint32_t> keys = RandomKeys(rng, 32, left_out);
    uint32_t lanes[2][5];
    for (int lane = 0; lane < 2; ++lane) {
      uint32_t first_run[4];
      uint32_t pair_top[5];
      for (int q = 0; q < 4; ++q) {
        uint32_t run[4];
        for (int k = 0; k < 4; ++k) run[k] = keys[16 * lane + 4 * q + k];
        SortUnitKeys4(run);
        if (q % 2 == 0) {
          std::copy(run, run + 4, first_run);
        } else if (q == 1) {
          TopFiveUnitKeysOf4And4(first_run, run, lanes[lane]);
        } else {
          TopFiveUnitKeysOf4And4(first_run, run, pair_top);
          TopFiveUnitKeysOf5And5(lanes[lane], pair_top);
        }
      }
      const std::vector<uint32_t> lane_keys =
          Descending({keys.begin() + 16 * lane, keys.begin() + 16 * lane + 16});
      EXPECT_EQ(std::vector<uint32_t>(lanes[lane], lanes[lane] + 5),
                std::vector<uint32_t>(lane_keys.begin(), lane_keys.begin() + 5))
          << "trial " << trial << ", lane " << lane;
    }
    TopFiveUnitKeysOf5And5(lanes[0], lanes[1]);
    const std::vector<uint32_t> all = Descending(keys);
    EXPECT_EQ(std::vector<uint32_t>(lanes[0], lanes[0] + 5),
              std::vector<uint32_t>(all.begin(), all.begin() + 5))
        << "trial " << trial;
  }
}

}  // namespace
}  // namespace flashsampler
