// Masks step: the allowed-token bitmask sends exactly the disallowed tokens
// of a tile to -inf (bit id % 32 of word id / 32), and a banned id is masked
// whatever the bitmask says.
#include "service/backends/cpu/masks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace flashsampler {
namespace cpu {
namespace {

TEST(MasksTest, BitmaskSendsExactlyTheDisallowedTokensToMinusInfinity) {
  // Allowed: ids 1, 31, 32, 40 and 70 of a 71-token vocabulary.
  std::vector<uint32_t> mask(3, 0u);
  for (int id : {1, 31, 32, 40, 70}) mask[id / 32] |= 1u << (id % 32);
  // A tile of tokens 30..69 (begin not a multiple of 32).
  std::vector<float> l(40);
  for (int c = 0; c < 40; ++c) l[c] = static_cast<float>(c);
  ApplyAllowedBitmask(mask.data(), 30, 40, l.data());
  for (int c = 0; c < 40; ++c) {
    const int id = 30 + c;
    const bool allowed = id == 31 || id == 32 || id == 40;
    if (allowed) {
      EXPECT_EQ(l[c], static_cast<float>(c)) << id;
    } else {
      EXPECT_TRUE(std::isinf(l[c]) && l[c] < 0) << id;
    }
  }
  EXPECT_TRUE(BitmaskAllows(mask.data(), 70));
  EXPECT_FALSE(BitmaskAllows(mask.data(), 69));
}

TEST(MasksTest, NullBitmaskAllowsEverythingAndBansStillMask) {
  std::vector<float> l = {1.0f, 2.0f};
  ApplyAllowedBitmask(nullptr, 0, 2, l.data());
  EXPECT_EQ(l, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_TRUE(BitmaskAllows(nullptr, 123456));
  EXPECT_FALSE(MaskedOut(false, nullptr, 5));
  EXPECT_TRUE(MaskedOut(true, nullptr, 5));
  const uint32_t all = ~0u;
  EXPECT_TRUE(MaskedOut(true, &all, 5));
  const uint32_t none = 0u;
  EXPECT_TRUE(MaskedOut(false, &none, 5));
}

}  // namespace
}  // namespace cpu
}  // namespace flashsampler
