// CPU-only tests of the tensor-parallel shard layout (kernels/tp/tp_layout.h)
// for 2, 4 and 8 ranks, even and uneven, and of the chi-squared helper the GPU
// tests rely on. Runs in CI without a GPU.
#include "kernels/tp/tp_layout.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/kernels/tp/tp_test_util.h"

namespace flashsampler {
namespace {

constexpr int kTileRows = 128;

TpLayout MustLayout(int64_t vocab, const std::vector<int64_t>& parts,
                    int tile_rows = kTileRows) {
  TpLayout layout;
  std::string error;
  EXPECT_TRUE(MakeTpLayout(vocab, parts, tile_rows, &layout, &error)) << error;
  return layout;
}

// Checks the layout against a brute-force walk over every token and tile.
void ExpectCoversExactly(const TpLayout& layout) {
  std::string error;
  ASSERT_TRUE(ValidateTpLayout(layout, &error)) << error;
  int64_t next_token = 0;
  int64_t next_tile = 0;
  for (int r = 0; r < layout.num_ranks(); ++r) {
    const TpShard& s = layout.shards[r];
    EXPECT_EQ(s.vocab_offset, next_token) << "rank " << r;
    EXPECT_EQ(s.tile_offset, next_tile) << "rank " << r;
    EXPECT_EQ(s.num_tiles,
              (s.vocab_rows + layout.tile_rows - 1) / layout.tile_rows);
    EXPECT_EQ(layout.RankOfToken(s.vocab_offset), r);
    EXPECT_EQ(layout.RankOfToken(s.vocab_offset + s.vocab_rows - 1), r);
    next_token += s.vocab_rows;
    next_tile += s.num_tiles;
  }
  EXPECT_EQ(next_token, layout.vocab_size);
  EXPECT_EQ(next_tile, layout.total_tiles);
  EXPECT_EQ(layout.RankOfToken(-1), -1);
  EXPECT_EQ(layout.RankOfToken(layout.vocab_size), -1);
}

// Every rank's candidate block [offset, offset + tiles * n * B) must tile the
// reducing buffer [0, total_tiles * n * B) with no gap and no overlap.
void ExpectBlocksTileTheBuffer(const TpLayout& layout, int num_samples,
                               int batch) {
  std::vector<int> owner(layout.CandidateCount(num_samples, batch), -1);
  for (int r = 0; r < layout.num_ranks(); ++r) {
    const int64_t begin = layout.CandidateOffset(r, num_samples, batch);
    const int64_t count = layout.shards[r].num_tiles * num_samples * batch;
    ASSERT_LE(begin + count, static_cast<int64_t>(owner.size()));
    for (int64_t i = begin; i < begin + count; ++i) {
      ASSERT_EQ(owner[i], -1) << "rank " << r << " overlaps at " << i;
      owner[i] = r;
    }
  }
  for (size_t i = 0; i < owner.size(); ++i) {
    ASSERT_NE(owner[i], -1) << "gap at candidate " << i;
  }
}

class EvenLayoutTest
    : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(EvenLayoutTest, CoversVocabularyAndBuffer) {
  const auto [ranks, vocab] = GetParam();
  TpLayout layout;
  std::string error;
  ASSERT_TRUE(MakeEvenTpLayout(vocab, ranks, kTileRows, &layout, &error))
      << error;
  ASSERT_EQ(layout.num_ranks(), ranks);
  ExpectCoversExactly(layout);
  // Even: shard sizes differ by at most one row, larger ones first.
  for (int r = 1; r < ranks; ++r) {
    EXPECT_LE(layout.shards[r].vocab_rows, layout.shards[r - 1].vocab_rows);
    EXPECT_GE(layout.shards[r].vocab_rows + 1, layout.shards[0].vocab_rows);
  }
  for (int batch : {1, 7, 256}) {
    for (int samples : {1, 3}) {
      ExpectBlocksTileTheBuffer(layout, samples, batch);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ranks2To8, EvenLayoutTest,
    ::testing::Combine(::testing::Values(2, 4, 8),
                       ::testing::Values(int64_t{8}, int64_t{129},
                                         int64_t{1001}, int64_t{32768},
                                         int64_t{128256}, int64_t{151936})));

TEST(TpLayoutTest, V1001OverTwoIs501And500) {
  const TpLayout layout = MustLayout(1001, {1, 1});
  ASSERT_EQ(layout.num_ranks(), 2);
  EXPECT_EQ(layout.shards[0].vocab_rows, 501);
  EXPECT_EQ(layout.shards[1].vocab_rows, 500);
  EXPECT_EQ(layout.shards[1].vocab_offset, 501);
  // 501 rows = 3 full tiles + 1 partial; 500 rows = 3 + 1.
  EXPECT_EQ(layout.shards[0].num_tiles, 4);
  EXPECT_EQ(layout.shards[1].tile_offset, 4);
  EXPECT_EQ(layout.total_tiles, 8);
  EXPECT_EQ(layout.CandidateOffset(1, 2, 5), 4 * 2 * 5);
  ExpectCoversExactly(layout);
}

TEST(TpLayoutTest, Llama3VocabSplit60_40) {
  const TpLayout layout = MustLayout(128256, {60, 40});
  // floor(128256 * 0.6) = 76953 (76953.6), remainder 1 row to rank 0.
  EXPECT_EQ(layout.shards[0].vocab_rows, 76954);
  EXPECT_EQ(layout.shards[1].vocab_rows, 51302);
  EXPECT_EQ(layout.shards[0].num_tiles, 602);  // ceil(76954 / 128)
  EXPECT_EQ(layout.shards[1].tile_offset, 602);
  EXPECT_EQ(layout.shards[1].num_tiles, 401);  // ceil(51302 / 128)
  EXPECT_EQ(layout.total_tiles, 1003);
  ExpectCoversExactly(layout);
  ExpectBlocksTileTheBuffer(layout, 1, 64);
}

TEST(TpLayoutTest, HalvesOfLlama3VocabAreWholeTiles) {
  const TpLayout layout = MustLayout(128256, {1, 1});
  EXPECT_EQ(layout.shards[0].vocab_rows, 64128);
  EXPECT_EQ(layout.shards[0].num_tiles, 501);
  EXPECT_EQ(layout.CandidateOffset(1, 1, 256), 501 * 256);
}

TEST(TpLayoutTest, UnevenEightRanks) {
  const TpLayout layout = MustLayout(151936, {3, 1, 1, 1, 2, 1, 1, 5});
  ExpectCoversExactly(layout);
  for (int batch : {1, 16, 256}) ExpectBlocksTileTheBuffer(layout, 1, batch);
}

TEST(TpLayoutTest, UnevenFourRanksWithTinyTiles) {
  const TpLayout layout = MustLayout(1001, {7, 1, 1, 1}, /*tile_rows=*/16);
  ExpectCoversExactly(layout);
  ExpectBlocksTileTheBuffer(layout, 4, 3);
}

TEST(TpLayoutTest, OneRowPerRankIsAllowed) {
  const TpLayout layout = MustLayout(8, std::vector<int64_t>(8, 1));
  for (const TpShard& s : layout.shards) {
    EXPECT_EQ(s.vocab_rows, 1);
    EXPECT_EQ(s.num_tiles, 1);
  }
  ExpectCoversExactly(layout);
}

TEST(TpLayoutTest, RejectsImpossibleSplits) {
  TpLayout layout;
  std::string error;
  EXPECT_FALSE(
      MakeTpLayout(7, std::vector<int64_t>(8, 1), kTileRows, &layout, &error));
  EXPECT_NE(error.find("smaller than the number of ranks"), std::string::npos)
      << error;
  EXPECT_FALSE(MakeTpLayout(1000, {1, 0}, kTileRows, &layout, &error));
  EXPECT_FALSE(MakeTpLayout(1000, {}, kTileRows, &layout, &error));
  EXPECT_FALSE(MakeTpLayout(1000, {1, 1}, 0, &layout, &error));
  // 1000 rows split 1000:1: rank 1's share floors to 0 and the one row left
  // over goes to rank 0, so rank 1 would be empty.
  EXPECT_FALSE(MakeTpLayout(1000, {1000, 1}, kTileRows, &layout, &error));
  EXPECT_NE(error.find("no vocabulary rows"), std::string::npos) << error;
}

TEST(TpLayoutTest, ValidateCatchesBrokenLayouts) {
  std::string error;
  TpLayout layout = MustLayout(1001, {1, 1});
  layout.shards[1].vocab_offset += 1;
  EXPECT_FALSE(ValidateTpLayout(layout, &error));
  layout = MustLayout(1001, {1, 1});
  layout.shards[1].tile_offset -= 1;
  EXPECT_FALSE(ValidateTpLayout(layout, &error));
  layout = MustLayout(1001, {1, 1});
  layout.total_tiles += 1;
  EXPECT_FALSE(ValidateTpLayout(layout, &error));
  layout = MustLayout(1001, {1, 1});
  layout.vocab_size += 1;
  EXPECT_FALSE(ValidateTpLayout(layout, &error));
  EXPECT_FALSE(ValidateTpLayout(TpLayout{}, &error));
}

TEST(TpLayoutTest, ParsesSplits) {
  std::vector<int64_t> parts;
  std::string error;
  ASSERT_TRUE(ParseTpSplit("60:40", 2, &parts, &error)) << error;
  EXPECT_EQ(parts, (std::vector<int64_t>{60, 40}));
  ASSERT_TRUE(ParseTpSplit("even", 4, &parts, &error));
  EXPECT_EQ(parts, (std::vector<int64_t>{1, 1, 1, 1}));
  ASSERT_TRUE(ParseTpSplit("", 2, &parts, &error));
  EXPECT_EQ(parts.size(), 2u);
  EXPECT_FALSE(ParseTpSplit("60:40", 4, &parts, &error));
  EXPECT_FALSE(ParseTpSplit("60::40", 2, &parts, &error));
  EXPECT_FALSE(ParseTpSplit("6a:40", 2, &parts, &error));
  EXPECT_FALSE(ParseTpSplit("60:", 2, &parts, &error));
}

// The statistics helper of the GPU chi-squared tests, against table values.
TEST(ChiSquaredHelperTest, SurvivalMatchesTables) {
  using tp_test::ChiSquaredPValue;
  EXPECT_NEAR(ChiSquaredPValue(3.841459, 1), 0.05, 1e-6);
  EXPECT_NEAR(ChiSquaredPValue(18.307038, 10), 0.05, 1e-6);
  EXPECT_NEAR(ChiSquaredPValue(124.342113, 100), 0.05, 1e-6);
  EXPECT_NEAR(ChiSquaredPValue(1063.0, 1000), 0.08151, 1e-4);
  EXPECT_NEAR(ChiSquaredPValue(0.0, 5), 1.0, 1e-12);
  EXPECT_LT(ChiSquaredPValue(200.0, 10), 1e-30);
}

TEST(ChiSquaredHelperTest, PoolsSmallBinsAndDetectsABadFit) {
  // 1000 tokens of which 10 carry 90% of the mass; 10000 draws put ~1 draw
  // on each tail token, so the tail must be pooled into bins of >= 5.
  std::vector<double> probs(1000, 0.1 / 990);
  for (int i = 0; i < 10; ++i) probs[i] = 0.09;
  std::vector<int64_t> exact(1000);
  for (int i = 0; i < 1000; ++i) {
    exact[i] = static_cast<int64_t>(probs[i] * 10000 + 0.5);
  }
  const tp_test::ChiSquaredResult good = tp_test::ChiSquaredTest(probs, exact);
  EXPECT_GT(good.p_value, 0.5);
  EXPECT_LT(good.bins, 1000);  // the tail was pooled
  std::vector<int64_t> skewed = exact;
  skewed[0] += 600;
  skewed[1] -= 600;
  EXPECT_LT(tp_test::ChiSquaredTest(probs, skewed).p_value, 1e-6);
}

TEST(Bf16HelperTest, RoundTripsSmallIntegers) {
  for (int i = -256; i <= 256; ++i) {
    const float x = static_cast<float>(i);
    EXPECT_EQ(tp_test::Bf16ToFloat(tp_test::FloatToBf16(x)), x);
  }
}

}  // namespace
}  // namespace flashsampler
