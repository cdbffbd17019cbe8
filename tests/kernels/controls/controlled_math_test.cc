// Host tests of the controlled sampler's arithmetic (controlled_math.h), its
// packer (controlled_plan.h) and its per-row algorithm run sequentially
// (controlled_emulation.h) against the CPU reference sampler. No GPU needed.
#include "kernels/controls/controlled_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/controls/controlled_plan.h"
#include "tests/kernels/controls/controlled_emulation.h"
#include "tests/kernels/controls/controlled_test_util.h"

namespace flashsampler {
namespace {

using controls::U128;

std::vector<float> InterestingFloats(uint64_t seed, int random_count) {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          0.5f,
                          -2.5f,
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          controls::kNegInf,
                          controls::kPosInf};
  std::mt19937_64 rng(seed);
  for (int i = 0; i < random_count; ++i) {
    float f = BitsToFloat(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) f = 1.25f;
    v.push_back(f);
  }
  return v;
}

TEST(ControlledMathTest, OrderKeyIsMonotoneAndInvertible) {
  const std::vector<float> values = InterestingFloats(1, 2000);
  for (float a : values) {
    const float fa = controls::FoldZero(a);
    EXPECT_EQ(FloatToBits(controls::KeyValue(controls::OrderKey(fa))),
              FloatToBits(fa));
    for (size_t j = 0; j < 50; ++j) {
      const float b = controls::FoldZero(values[(j * 41) % values.size()]);
      EXPECT_EQ(fa > b, controls::OrderKey(fa) > controls::OrderKey(b))
          << fa << " vs " << b;
    }
  }
}

TEST(ControlledMathTest, PackedKeyOrderIsTheSamplingOrder) {
  std::mt19937_64 rng(2);
  std::uniform_int_distribution<int> small(-3, 3);
  for (int i = 0; i < 20000; ++i) {
    const float a = static_cast<float>(small(rng)) * 0.5f;
    const float b = (i % 5 == 0) ? -a : static_cast<float>(small(rng)) * 0.5f;
    const int32_t ia = static_cast<int32_t>(rng() % 1000);
    const int32_t ib = static_cast<int32_t>(rng() % 1000);
    const bool before = a > b || (a == b && ia < ib);
    EXPECT_EQ(controls::PackedKey(a, ia) > controls::PackedKey(b, ib), before)
        << a << "," << ia << " vs " << b << "," << ib;
    EXPECT_EQ(controls::PackedKeyId(controls::PackedKey(a, ia)), ia);
  }
  // -0 and +0 are one value: the lower id wins.
  EXPECT_GT(controls::PackedKey(-0.0f, 3), controls::PackedKey(0.0f, 4));
  EXPECT_GT(controls::PackedKey(0.0f, 3), controls::PackedKey(-0.0f, 4));
  // Every finite value's key is above 0, the reductions' "none".
  EXPECT_GT(controls::PackedKey(-std::numeric_limits<float>::max(), 0x7ffffffe),
            0u);
}

TEST(ControlledMathTest, NextUpAndNextDownMatchNextafter) {
  for (float f : InterestingFloats(3, 5000)) {
    if (std::isinf(f)) continue;
    EXPECT_EQ(FloatToBits(controls::NextUp(f)),
              FloatToBits(std::nextafter(f, controls::kPosInf)))
        << f;
    EXPECT_EQ(FloatToBits(controls::NextDown(f)),
              FloatToBits(std::nextafter(f, controls::kNegInf)))
        << f;
  }
}

// The CPU's SmallestKept, restated with std::nextafter.
float CpuSmallestKept(float x_max, float min_p) {
  const double log_min_p = std::log(static_cast<double>(min_p));
  auto kept = [&](float f) {
    return static_cast<double>(f) - static_cast<double>(x_max) >= log_min_p;
  };
  float f = static_cast<float>(static_cast<double>(x_max) + log_min_p);
  if (!kept(f)) {
    while (!kept(f)) f = std::nextafter(f, controls::kPosInf);
    return f;
  }
  while (true) {
    const float lower = std::nextafter(f, controls::kNegInf);
    if (lower == controls::kNegInf || !kept(lower)) return f;
    f = lower;
  }
}

TEST(ControlledMathTest, MinPFloorIsTheSmallestKeptFloat) {
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<float> top(-50.0f, 50.0f);
  std::uniform_real_distribution<float> prob(1e-6f, 1.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x_max = (i % 7 == 0) ? 0.0f : top(rng);
    const float min_p = (i % 11 == 0) ? 1.0f : prob(rng);
    const double log_min_p = std::log(static_cast<double>(min_p));
    const float floor = controls::MinPFloor(x_max, log_min_p);
    EXPECT_EQ(FloatToBits(floor), FloatToBits(CpuSmallestKept(x_max, min_p)))
        << x_max << " " << min_p;
    EXPECT_GE(static_cast<double>(floor) - x_max, log_min_p);
    EXPECT_LT(static_cast<double>(controls::NextDown(floor)) - x_max,
              log_min_p);
  }
}

TEST(ControlledMathTest, FixedMassIsTheCpuFormula) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> d(-80.0f, 0.0f);
  EXPECT_EQ(controls::FixedMass(3.0f, 3.0f), uint64_t{1} << 62);
  for (int i = 0; i < 20000; ++i) {
    const float x_max = static_cast<float>(i % 13) - 6.0f;
    const float x = x_max + d(rng);
    const uint64_t cpu = static_cast<uint64_t>(std::ldexp(
        std::exp(static_cast<double>(x) - static_cast<double>(x_max)), 62));
    EXPECT_EQ(controls::FixedMass(x, x_max), cpu);
  }
}

TEST(ControlledMathTest, CeilScaledIsExact) {
  std::mt19937_64 rng(6);
  for (int i = 0; i < 20000; ++i) {
    float p = std::ldexp(static_cast<float>(rng() % (1u << 24)) + 1.0f,
                         -24 - static_cast<int>(rng() % 16));
    if (!(p > 0.0f && p < 1.0f)) p = 0.5f;
    const U128 z = static_cast<U128>(rng() >> (rng() % 40));
    const U128 c = controls::CeilScaled(p, z);
    // p = m * 2^-s exactly; check (c - 1) * 2^s < m z <= c * 2^s.
    int e = 0;
    const float fr = std::frexp(p, &e);
    const U128 m = static_cast<U128>(std::ldexp(fr, 24));
    const int s = 24 - e;  // <= 64 here, so nothing below overflows
    const U128 product = m * z;
    EXPECT_TRUE(product <= (c << s)) << p;
    if (c > 0) {
      EXPECT_TRUE(((c - 1) << s) < product) << p;
    }
  }
  EXPECT_TRUE(controls::CeilScaled(0.5f, 10) == 5);
  EXPECT_TRUE(controls::CeilScaled(0.5f, 11) == 6);
  EXPECT_TRUE(controls::CeilScaled(std::numeric_limits<float>::denorm_min(),
                                   12345) == 1);
  EXPECT_TRUE(controls::CeilScaled(0.25f, 0) == 0);
}

TEST(ControlledMathTest, SpecialLogitFollowsTheCpuOrder) {
  using controls::SpecialLogit;
  // bias, then the repetition penalty (divide positive, multiply negative),
  // then frequency * count and presence.
  EXPECT_EQ(SpecialLogit(2.0f, false, controls::kSpecialHasBias, 1.0f, 0, 1.0f,
                         0.0f, 0.0f),
            3.0f);
  EXPECT_EQ(SpecialLogit(3.0f, false, controls::kSpecialRepeated, 0.0f, 2, 1.5f,
                         0.25f, 0.5f),
            3.0f / 1.5f - 0.5f - 0.5f);
  EXPECT_EQ(SpecialLogit(-3.0f, false, controls::kSpecialRepeated, 0.0f, 0,
                         2.0f, 0.25f, 0.5f),
            -6.0f);
  EXPECT_EQ(SpecialLogit(1.0f, false, controls::kSpecialBanned, 0.0f, 0, 1.0f,
                         0.0f, 0.0f),
            controls::kNegInf);
  EXPECT_EQ(SpecialLogit(1.0f, true, 0, 0.0f, 3, 1.0f, 1.0f, 0.0f),
            controls::kNegInf);
}

// The radix cuts against sorting: every token >= the k-th value of the order
// (top_k, ties at it kept) and the first token whose cumulative mass reaches
// ceil(p * total) (top_p), on values with many ties.
// The entry search the full passes (bans in raw logprobs) and the candidate
// kernels (a chunk's first entry, an id's processed logit) share.
TEST(ControlledMathTest, SpecialLowerBoundFindsTheFirstEntryAtOrAbove) {
  const std::vector<int32_t> ids = {2, 3, 5, 7, 9, 12};
  const std::vector<uint8_t> flags = {0, controls::kSpecialBanned, 0,
                                      0, controls::kSpecialBanned, 0};
  const int64_t end = static_cast<int64_t>(ids.size());
  for (int32_t id = 0; id <= 14; ++id) {
    const int64_t expected =
        std::lower_bound(ids.begin(), ids.end(), id) - ids.begin();
    EXPECT_EQ(controls::SpecialLowerBound(ids.data(), 0, end, id), expected)
        << id;
    EXPECT_EQ(controls::SpecialBanned(ids.data(), flags.data(), 0, end, id),
              id == 3 || id == 9)
        << id;
  }
  // Within a row's range only: [2, 5) holds ids 5, 7, 9.
  EXPECT_EQ(controls::SpecialLowerBound(ids.data(), 2, 5, 0), 2);
  EXPECT_EQ(controls::SpecialLowerBound(ids.data(), 2, 5, 8), 4);
  EXPECT_EQ(controls::SpecialLowerBound(ids.data(), 2, 5, 10), 5);
  EXPECT_FALSE(controls::SpecialBanned(ids.data(), flags.data(), 2, 5, 3));
}

// The rows whose unit tails the fused kernel sums and the merge kernel
// reads: sampled top_p rows that top_k does not bound, top_k's "off"
// spellings (-1, 0, >= V) included.
TEST(ControlledMathTest, UnitTailWantedIsTopPThatTopKDoesNotBound) {
  constexpr int64_t kVocab = 1000;
  EXPECT_TRUE(controls::UnitTailWanted(0.8f, 0, 0.9f, kVocab));
  EXPECT_TRUE(controls::UnitTailWanted(0.8f, -1, 0.9f, kVocab));
  EXPECT_TRUE(controls::UnitTailWanted(1.0f, kVocab, 0.95f, kVocab));
  EXPECT_TRUE(controls::UnitTailWanted(1.0f, kVocab + 7, 0.95f, kVocab));
  EXPECT_FALSE(controls::UnitTailWanted(0.8f, 50, 0.9f, kVocab));
  EXPECT_FALSE(controls::UnitTailWanted(0.8f, kVocab - 1, 0.9f, kVocab));
  EXPECT_FALSE(controls::UnitTailWanted(0.8f, 0, 1.0f, kVocab));  // no top_p
  EXPECT_FALSE(controls::UnitTailWanted(0.0f, 0, 0.9f, kVocab));  // greedy
}

TEST(ControlledMathTest, RadixCutsEqualSortedCuts) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int vocab = 1 + static_cast<int>(rng() % 3000);
    const int levels = 1 + static_cast<int>(rng() % 40);
    std::vector<float> x(vocab);
    for (float& v : x) {
      v = (rng() % 9 == 0)
              ? controls::kNegInf
              : static_cast<float>(static_cast<int>(rng() % levels)) * 0.25f;
    }
    float x_max = controls::kNegInf;
    std::vector<int32_t> order;
    for (int32_t i = 0; i < vocab; ++i) {
      if (x[i] == controls::kNegInf) continue;
      order.push_back(i);
      x_max = std::max(x_max, x[i]);
    }
    if (order.empty()) continue;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return x[a] > x[b] || (x[a] == x[b] && a < b);
    });
    auto member = [](int32_t, float v) { return v != controls::kNegInf; };
    auto keeps = [&](const controls::OrderCut& cut, int32_t i) {
      return controls::CutKeeps(cut, controls::OrderKey(x[i]), i);
    };
    // top_k
    const int64_t k = 1 + static_cast<int64_t>(rng() % (order.size() + 3));
    const controls::OrderCut cut_k =
        testing_controls::EmulateTopKCut(x, member, k);
    const bool cut = k <= static_cast<int64_t>(order.size());
    EXPECT_EQ(cut_k.active, cut);
    for (size_t pos = 0; pos < order.size(); ++pos) {
      const bool want = !cut || x[order[pos]] >= x[order[k - 1]];
      EXPECT_EQ(keeps(cut_k, order[pos]), want)
          << "trial " << trial << " k " << k << " pos " << pos;
    }
    // top_p
    const float p = std::uniform_real_distribution<float>(0.01f, 0.999f)(rng);
    U128 total = 0;
    for (int32_t i : order) total += controls::FixedMass(x[i], x_max);
    const U128 target = controls::CeilScaled(p, total);
    const controls::OrderCut cut_p =
        testing_controls::EmulateSelectCut(true, x, member, x_max, target);
    U128 cum = 0;
    bool reached = false;
    for (int32_t i : order) {
      EXPECT_EQ(keeps(cut_p, i), !reached) << "trial " << trial << " p " << p;
      cum += controls::FixedMass(x[i], x_max);
      reached = reached || cum >= target;
    }
  }
}

TEST(ControlledPlanTest, MergesListsLikeTheCpuPlan) {
  const std::vector<int32_t> bias_ids = {7, 3, 7, 9};
  const std::vector<float> bias_values = {0.1f, -1.0f, 0.2f, 0.5f};
  const std::vector<int32_t> banned = {9, 2};
  const std::vector<int32_t> prompt = {3, 5, 5};
  const std::vector<int32_t> output_ids = {5, 11, 5, 12};
  const std::vector<int32_t> output_counts = {2, 0, 1, 3};
  ControlledRowInput in = testing_controls::InputOfLists(
      bias_ids, bias_values, banned, prompt, output_ids, output_counts);
  in.repetition_penalty = 1.2f;
  in.min_p = 0.1f;
  ControlledPlan plan;
  plan.AddRow(in);
  in.repetition_penalty = 1.0f;  // prompt ids no longer matter
  plan.AddRow(in);
  ASSERT_EQ(plan.rows(), 2);
  const ControlledRow& r0 = plan.row_controls()[0];
  EXPECT_EQ(r0.log_min_p, std::log(static_cast<double>(0.1f)));
  const std::vector<int32_t> ids0(plan.special_ids().begin() + r0.special_begin,
                                  plan.special_ids().begin() + r0.special_end);
  EXPECT_EQ(ids0, (std::vector<int32_t>{2, 3, 5, 7, 9, 12}));
  auto at = [&](const ControlledRow& r, int32_t id) {
    for (int64_t k = r.special_begin; k < r.special_end; ++k) {
      if (plan.special_ids()[k] == id) return k;
    }
    return int64_t{-1};
  };
  const int64_t k7 = at(r0, 7);
  EXPECT_EQ(plan.special_bias()[k7], 0.1f + 0.2f);
  EXPECT_EQ(plan.special_flags()[k7], controls::kSpecialHasBias);
  EXPECT_EQ(plan.special_flags()[at(r0, 9)],
            controls::kSpecialHasBias | controls::kSpecialBanned);
  EXPECT_EQ(plan.special_flags()[at(r0, 3)],
            controls::kSpecialHasBias | controls::kSpecialRepeated);
  EXPECT_EQ(plan.special_count()[at(r0, 5)], 3);
  EXPECT_EQ(plan.special_flags()[at(r0, 5)], controls::kSpecialRepeated);
  EXPECT_EQ(at(r0, 11), -1);  // count 0: no entry
  const ControlledRow& r1 = plan.row_controls()[1];
  EXPECT_EQ(plan.special_flags()[at(r1, 3)], controls::kSpecialHasBias);
  EXPECT_EQ(plan.special_flags()[at(r1, 5)], 0);
  EXPECT_EQ(plan.special_count()[at(r1, 5)], 3);
  EXPECT_EQ(plan.bytes().size() % 256, 0u);
}

// Rows with enough keys for the radix sort: each id's entry is what its
// list entries give in list order (the bias an fp32 sum in bias-list order,
// repeated, banned, the output counts summed), ids ascending, for ids of up
// to 14, 18, 24 and 31 bits (two, two, three and four radix passes; one for
// the trials of ids below 97), with repeats within and across the lists.
TEST(ControlledPlanTest, ManyKeysMergeAsTheListsSay) {
  std::mt19937 rng(5);
  for (int32_t limit : {1 << 14, 151936, 1 << 24, 0x7fffffff}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int32_t top = trial % 2 == 0 ? limit : 97;  // many repeats
      std::uniform_int_distribution<int32_t> id(0, top - 1);
      std::uniform_int_distribution<int> size(0, 80);
      std::uniform_real_distribution<float> value(-2.0f, 2.0f);
      std::vector<int32_t> bias_ids(size(rng));
      std::vector<float> bias_values(bias_ids.size());
      std::vector<int32_t> banned(size(rng) / 8);
      std::vector<int32_t> prompt(size(rng));
      std::vector<int32_t> output_ids(size(rng));
      std::vector<int32_t> output_counts(output_ids.size());
      for (size_t i = 0; i < bias_ids.size(); ++i) {
        bias_ids[i] = id(rng);
        bias_values[i] = value(rng);
      }
      for (int32_t& b : banned) b = id(rng);
      for (int32_t& p : prompt) p = id(rng);
      for (size_t i = 0; i < output_ids.size(); ++i) {
        output_ids[i] = id(rng);
        output_counts[i] = static_cast<int32_t>(rng() % 4);  // 0: no entry
      }
      ControlledRowInput in = testing_controls::InputOfLists(
          bias_ids, bias_values, banned, prompt, output_ids, output_counts);
      in.repetition_penalty = trial % 3 == 0 ? 1.0f : 1.3f;
      const bool penalized = in.repetition_penalty != 1.0f;
      struct Entry {
        uint8_t flags = 0;
        float bias = 0.0f;
        int32_t count = 0;
      };
      std::map<int32_t, Entry> expected;
      for (size_t i = 0; i < bias_ids.size(); ++i) {
        Entry& e = expected[bias_ids[i]];
        e.bias = (e.flags & controls::kSpecialHasBias) ? e.bias + bias_values[i]
                                                       : bias_values[i];
        e.flags |= controls::kSpecialHasBias;
      }
      for (int32_t b : banned) expected[b].flags |= controls::kSpecialBanned;
      if (penalized) {
        for (int32_t p : prompt)
          expected[p].flags |= controls::kSpecialRepeated;
      }
      for (size_t i = 0; i < output_ids.size(); ++i) {
        if (output_counts[i] <= 0) continue;
        Entry& e = expected[output_ids[i]];
        if (penalized) e.flags |= controls::kSpecialRepeated;
        e.count += output_counts[i];
      }
      ControlledPlan plan;
      plan.AddRow(in);
      const ControlledRow& row = plan.row_controls()[0];
      const std::string where =
          "limit " + std::to_string(limit) + ", trial " + std::to_string(trial);
      ASSERT_EQ(row.special_end - row.special_begin,
                static_cast<int64_t>(expected.size()))
          << where;
      int64_t k = row.special_begin;
      for (const auto& [token, e] : expected) {
        EXPECT_EQ(plan.special_ids()[k], token) << where;
        EXPECT_EQ(plan.special_flags()[k], e.flags) << where << " id " << token;
        EXPECT_EQ(plan.special_bias()[k], e.bias) << where << " id " << token;
        EXPECT_EQ(plan.special_count()[k], e.count) << where << " id " << token;
        ++k;
      }
    }
  }
}

// Rows left to the device's merge (AddRows' pending_max_keys): each keeps
// its list entries in list order, with its kind and value, and a region
// with room for its entries, empty until merged; merged by the device's
// rule (stable by id, then entry by entry in list order) they are the host
// merge's entries. Rows repeating a pending row share its record; rows of
// more keys, and rows whose output counts are all 0, merge on the host.
TEST(ControlledPlanTest, PendingRowsKeepTheirListsForTheDevice) {
  constexpr int kRows = 12;
  constexpr size_t kMaxKeys = 150;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> id(0, 60);  // many repeats
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<std::vector<int32_t>> ids(kRows), counts(kRows);
  std::vector<std::vector<float>> values(kRows);
  std::vector<ControlledRowInput> inputs(kRows);
  std::vector<ControlledPlan::RowToAdd> rows(kRows);
  for (int r = 0; r < kRows; ++r) {
    if (r % 4 == 2) continue;  // repeats the row before
    const size_t size = r == 5 ? 40 : (r == 7 ? 10 : 2 + rng() % 30);
    for (size_t i = 0; i < size; ++i) {
      ids[r].push_back(id(rng));
      values[r].push_back(value(rng));
      counts[r].push_back(r == 7 ? 0 : static_cast<int32_t>(rng() % 3));
    }
    ControlledRowInput& in = inputs[r];
    if (r != 7) {  // row 7: output ids alone, every count 0
      in = testing_controls::InputOfLists(ids[r], values[r], ids[r], ids[r],
                                          ids[r], counts[r]);
    } else {
      in.output_ids = ids[r].data();
      in.output_counts = counts[r].data();
      in.num_output = ids[r].size();
    }
    in.repetition_penalty = r % 3 == 0 ? 1.0f : 1.5f;
    rows[r].in = &in;
  }
  ControlledPlan host;
  host.AddRows(rows, testing_controls::InOrder{});
  ControlledPlan plan;
  plan.AddRows(rows, testing_controls::InOrder{}, kMaxKeys);
  ASSERT_EQ(plan.rows(), kRows);
  std::vector<int> pending_of(kRows, -1);
  for (size_t m = 0; m < plan.pending_merges().size(); ++m) {
    const PendingMergeRow& merge = plan.pending_merges()[m];
    for (int r = merge.first_row; r < merge.first_row + merge.rows; ++r) {
      pending_of[r] = static_cast<int>(m);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    const ControlledRow& want = host.row_controls()[r];
    const ControlledRow& row = plan.row_controls()[r];
    const int source = rows[r].in != nullptr ? r : r - 1;
    // Row 5 (more keys than kMaxKeys: 40 in each of 4 lists) and row 7 (no
    // key) merge on the host.
    if (source == 5 || source == 7) {
      EXPECT_EQ(pending_of[r], -1) << "row " << r;
      ASSERT_EQ(row.special_end - row.special_begin,
                want.special_end - want.special_begin)
          << "row " << r;
      continue;
    }
    ASSERT_NE(pending_of[r], -1) << "row " << r;
    const PendingMergeRow& merge = plan.pending_merges()[pending_of[r]];
    EXPECT_EQ(merge.first_row, source) << "row " << r;
    EXPECT_EQ(row.special_end, row.special_begin) << "row " << r;
    // The region: up to the next row's own, or the end of the entries.
    int64_t next = static_cast<int64_t>(plan.special_ids().size());
    for (int later = r + 1; later < kRows; ++later) {
      if (plan.row_controls()[later].special_begin != row.special_begin) {
        next = plan.row_controls()[later].special_begin;
        break;
      }
    }
    EXPECT_GE(next - row.special_begin, want.special_end - want.special_begin)
        << "row " << r;
    // The device's rule on the host.
    std::vector<PendingListEntry> keys(
        plan.pending_entries().begin() + merge.key_begin,
        plan.pending_entries().begin() + merge.key_begin + merge.key_count);
    const uint32_t id_mask = (1u << kPendingKindShift) - 1u;
    std::stable_sort(
        keys.begin(), keys.end(),
        [id_mask](const PendingListEntry& a, const PendingListEntry& b) {
          return (a.id_kind & id_mask) < (b.id_kind & id_mask);
        });
    std::vector<int32_t> got_ids, got_counts;
    std::vector<uint8_t> got_flags;
    std::vector<float> got_bias;
    for (size_t k = 0; k < keys.size();) {
      const uint32_t token = keys[k].id_kind & id_mask;
      uint8_t flags = 0;
      float bias = 0.0f;
      int32_t count = 0;
      for (; k < keys.size() && (keys[k].id_kind & id_mask) == token; ++k) {
        float v;
        std::memcpy(&v, &keys[k].value, sizeof(v));
        const uint32_t kind = keys[k].id_kind >> kPendingKindShift;
        if (kind == kPendingBias) {
          bias = (flags & controls::kSpecialHasBias) ? bias + v : v;
        } else if (kind == kPendingOutput) {
          count += static_cast<int32_t>(keys[k].value);
        }
        flags |= controls::ListEntryFlag(
            kind, inputs[source].repetition_penalty != 1.0f);
      }
      got_ids.push_back(static_cast<int32_t>(token));
      got_flags.push_back(flags);
      got_bias.push_back(bias);
      got_counts.push_back(count);
    }
    auto slice = [&want](const auto& all) {
      return std::vector<typename std::decay_t<decltype(all)>::value_type>(
          all.begin() + want.special_begin, all.begin() + want.special_end);
    };
    EXPECT_EQ(got_ids, slice(host.special_ids())) << "row " << r;
    EXPECT_EQ(got_flags, slice(host.special_flags())) << "row " << r;
    EXPECT_EQ(got_bias, slice(host.special_bias())) << "row " << r;
    EXPECT_EQ(got_counts, slice(host.special_count())) << "row " << r;
  }
  EXPECT_EQ(plan.bytes().size(), plan.byte_size());
}

// The per-row algorithm, run on the host, against the CPU sampler on exact
// small-integer logits: tokens and top ids equal, logprobs within 1e-5.
void EmulationEqualsCpu(int64_t vocab, int rows_per_case) {
  constexpr int kHidden = 32;
  testing_controls::Model model =
      testing_controls::MakeModel(vocab, kHidden, 11);
  ASSERT_NE(model.sampler, nullptr);
  for (const testing_controls::Case& c : testing_controls::Cases(vocab)) {
    testing_controls::CaseBatch batch;
    testing_controls::PrepareCase(model, c, rows_per_case, &batch);
    if (::testing::Test::HasFatalFailure()) return;
    const int rows = batch.rows;
    const std::vector<RowSpec>& specs = batch.specs;
    const std::vector<float>& logits = batch.logits;
    const std::vector<RowResult>& cpu = batch.cpu;
    const ControlledPlan& plan = batch.plan;
    int sampled_rows = 0;
    for (int r = 0; r < rows; ++r) {
      sampled_rows += cpu[r].error.empty() ? 1 : 0;
      const testing_controls::EmulatedRow e = testing_controls::EmulateRow(
          plan, r, logits.data() + static_cast<size_t>(r) * vocab,
          static_cast<int32_t>(vocab));
      testing_controls::ExpectRowEqual(
          cpu[r], e.status, e.token_ids, e.sampled_logprobs, e.sampled_ranks,
          e.logsumexp, e.top_token_ids, e.top_logprobs, *specs[r].params,
          c.name + " V=" + std::to_string(vocab) + " row " + std::to_string(r));
    }
    // Only one_row_all_masked has a failing row.
    EXPECT_EQ(sampled_rows,
              c.name == "one_row_all_masked" ? rows - (rows + 1) / 3 : rows)
        << c.name;
  }
}

TEST(ControlledEmulationTest, EqualsTheCpuSamplerV127) {
  EmulationEqualsCpu(127, 4);
}
TEST(ControlledEmulationTest, EqualsTheCpuSamplerV129) {
  EmulationEqualsCpu(129, 4);
}
TEST(ControlledEmulationTest, EqualsTheCpuSamplerV1000) {
  EmulationEqualsCpu(1000, 4);
}
TEST(ControlledEmulationTest, EqualsTheCpuSamplerV32768) {
  EmulationEqualsCpu(32768, 2);
}

}  // namespace
}  // namespace flashsampler
