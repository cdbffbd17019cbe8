// The CUDA engine's host glue for the controlled path, without a GPU: row
// checks give the CPU sampler's messages, the engine's limits refuse one row
// naming the field, the SamplingParams -> packer conversion packs what the
// controlled sampler's own tests pack, and batches over the staging budget
// split into row chunks that each fit.
#include "service/backends/cuda/controlled_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_types.h"
#include "service/backends/cpu/cpu_sampler.h"
#include "service/backends/sampling_params.h"
#include "tests/kernels/controls/controlled_test_util.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kVocab = 100;
constexpr int kHidden = 8;

std::vector<SamplingParams> InvalidRows() {
  std::vector<SamplingParams> rows;
  auto with = [&rows](auto edit) {
    SamplingParams p;
    edit(p);
    rows.push_back(p);
  };
  with([](SamplingParams& p) { p.temperature = -1.0f; });
  with([](SamplingParams& p) {
    p.temperature = std::numeric_limits<float>::infinity();
  });
  with([](SamplingParams& p) { p.top_k = -2; });
  with([](SamplingParams& p) { p.top_p = 0.0f; });
  with([](SamplingParams& p) { p.min_p = 1.5f; });
  with([](SamplingParams& p) { p.repetition_penalty = 0.0f; });
  with([](SamplingParams& p) {
    p.presence_penalty = std::numeric_limits<float>::quiet_NaN();
  });
  with([](SamplingParams& p) { p.n = 0; });
  with([](SamplingParams& p) { p.logprobs.top_n = -1; });
  with([](SamplingParams& p) { p.logit_bias = {{kVocab, 1.0f}}; });
  with([](SamplingParams& p) {
    p.logit_bias = {{3, std::numeric_limits<float>::infinity()}};
  });
  with([](SamplingParams& p) { p.banned_token_ids = {5, -1}; });
  with([](SamplingParams& p) { p.prompt_token_ids = {kVocab + 7}; });
  with([](SamplingParams& p) { p.output_token_counts = {{4, -3}}; });
  with([](SamplingParams& p) { p.allowed_bitmask.assign(3, ~0u); });
  return rows;
}

TEST(ControlledRowsTest, RowChecksGiveTheCpuSamplersMessages) {
  testing_controls::Model model =
      testing_controls::MakeModel(kVocab, kHidden, 3);
  ASSERT_NE(model.sampler, nullptr);
  const std::vector<SamplingParams> rows = InvalidRows();
  std::vector<RowSpec> specs(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) specs[i].params = &rows[i];
  const std::vector<float> hidden =
      testing_controls::MakeHidden(static_cast<int>(rows.size()), kHidden, 4);
  std::vector<RowResult> cpu;
  EXPECT_EQ(model.sampler
                ->Sample(hidden.data(), static_cast<int>(rows.size()),
                         specs.data(), &cpu)
                .code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(cpu.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const absl::Status status = ValidateCudaRow(rows[i], kVocab);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << i;
    ASSERT_FALSE(cpu[i].error.empty()) << i;
    EXPECT_EQ(std::string(status.message()), cpu[i].error) << "row " << i;
  }
  EXPECT_TRUE(ValidateCudaRow(SamplingParams(), kVocab).ok());
}

TEST(ControlledRowsTest, EngineLimitsRefuseTheRowNamingTheField) {
  SamplingParams many;
  many.n = kCudaMaxSamples + 1;
  EXPECT_THAT(ValidateCudaRow(many, kVocab).message(),
              HasSubstr("n must be <= 64"));
  many.n = kCudaMaxSamples;
  EXPECT_TRUE(ValidateCudaRow(many, kVocab).ok());

  SamplingParams top;
  top.logprobs.top_n = kCudaMaxTopLogprobs + 1;
  EXPECT_THAT(ValidateCudaRow(top, kVocab).message(),
              HasSubstr("logprobs.top_logprobs must be <= 256"));
  top.logprobs.top_n = kCudaMaxTopLogprobs;
  EXPECT_TRUE(ValidateCudaRow(top, kVocab).ok());

  // Packed lists beyond the 16 MB staging: 13 bytes an entry (a row of
  // more than kPendingMaxKeys is merged on the host, its entries not packed
  // as they come as well).
  const size_t limit = kControlledPlanBudgetBytes - kControlledPlanLayoutSlack;
  const size_t fits = (limit - sizeof(ControlledRow)) / 13;
  SamplingParams banned;
  banned.banned_token_ids.assign(fits, 7);
  EXPECT_LE(ControlledRowBytesBound(banned), limit);
  EXPECT_TRUE(ValidateCudaRow(banned, kVocab).ok());
  banned.banned_token_ids.push_back(7);
  const absl::Status refused = ValidateCudaRow(banned, kVocab);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              HasSubstr(absl::StrCat("banned_token_ids (", fits + 1, ")")));
  EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("at most ", limit)));

  // Prompt ids count only with a repetition penalty (the packer skips them
  // otherwise).
  SamplingParams prompt;
  prompt.prompt_token_ids.assign(fits + 1, 3);
  prompt.top_k = 5;
  EXPECT_TRUE(ValidateCudaRow(prompt, kVocab).ok());
  prompt.repetition_penalty = 1.1f;
  EXPECT_THAT(ValidateCudaRow(prompt, kVocab).message(),
              HasSubstr("prompt_token_ids"));
}

TEST(ControlledRowsTest, OnlyControlsBeyondTemperatureAndNNeedTheSampler) {
  SamplingParams plain;
  plain.temperature = 0.3f;
  plain.n = 8;
  EXPECT_FALSE(NeedsControlledSampler(plain));
  std::vector<SamplingParams> controlled(9);
  controlled[0].top_k = 3;
  controlled[1].top_p = 0.9f;
  controlled[2].min_p = 0.1f;
  controlled[3].logit_bias = {{1, 2.0f}};
  controlled[4].banned_token_ids = {2};
  controlled[5].allowed_bitmask.assign(4, ~0u);
  controlled[6].repetition_penalty = 1.2f;
  controlled[7].frequency_penalty = 0.5f;
  controlled[8].logprobs.logsumexp = true;
  for (size_t i = 0; i < controlled.size(); ++i) {
    EXPECT_TRUE(NeedsControlledSampler(controlled[i])) << i;
  }
}

TEST(ControlledRowsTest, UnitCandidatesServeClosedSetsAndGreedyRows) {
  constexpr int64_t kVocab = 1000;
  SamplingParams filters;
  filters.temperature = 0.7f;
  filters.top_k = 50;
  filters.top_p = 0.9f;
  filters.min_p = 0.05f;
  filters.n = 4;
  EXPECT_TRUE(ServedFromUnitCandidates(filters, kVocab));
  EXPECT_TRUE(ServedFromUnitCandidates(SamplingParams(), kVocab));
  // Transforms and logprobs under a filter that closes the set.
  std::vector<SamplingParams> served(9, filters);
  served[0].logit_bias = {{1, 2.0f}};
  served[1].banned_token_ids = {2};
  served[2].allowed_bitmask.assign(32, ~0u);
  served[3].repetition_penalty = 1.2f;
  served[4].presence_penalty = 0.5f;
  served[5].frequency_penalty = 0.5f;
  served[6].logprobs.sampled = true;
  served[7].logprobs.top_n = 2;
  // Raw logprobs: the units' tails hold the mass at T = 1.
  served[8].logprobs.sampled = true;
  served[8].logprobs.raw = true;
  for (size_t i = 0; i < served.size(); ++i) {
    EXPECT_TRUE(ServedFromUnitCandidates(served[i], kVocab)) << i;
    for (int filter = 0; filter < 3; ++filter) {
      // Each filter closes the set alone; but top_p alone sums the units'
      // tails at 1 / T, which a raw row's mass at T = 1 cannot share, and
      // which leave a bitmask's masked tokens out only where the token
      // classes hold the bitmask.
      SamplingParams one = served[i];
      one.top_k = filter == 0 ? 50 : 0;
      one.top_p = filter == 1 ? 0.9f : 1.0f;
      one.min_p = filter == 2 ? 0.05f : 0.0f;
      EXPECT_EQ(ServedFromUnitCandidates(one, kVocab), !(i == 8 && filter == 1))
          << i << " " << filter;
      EXPECT_EQ(NeedsBitmaskInClasses(one, kVocab), i == 2 && filter == 1)
          << i << " " << filter;
    }
  }
  // Raw logprobs on a bitmask row: the units' raw mass must leave the
  // masked tokens out, whatever the filters.
  SamplingParams masked_raw = served[2];
  masked_raw.logprobs.top_n = 2;
  masked_raw.logprobs.raw = true;
  EXPECT_TRUE(ServedFromUnitCandidates(masked_raw, kVocab));
  EXPECT_TRUE(NeedsBitmaskInClasses(masked_raw, kVocab));
  masked_raw.logprobs.raw = false;  // processed: over the survivors alone
  EXPECT_FALSE(NeedsBitmaskInClasses(masked_raw, kVocab));
  masked_raw.logprobs.raw = true;
  masked_raw.allowed_bitmask.clear();
  EXPECT_FALSE(NeedsBitmaskInClasses(masked_raw, kVocab));
  // Entries: bias, bans, prompt ids under a repetition penalty, output
  // counts; not a bitmask, nor a penalty without ids.
  for (size_t i = 0; i < served.size(); ++i) {
    EXPECT_EQ(HasTokenEntries(served[i]), i <= 1) << i;
  }
  SamplingParams history = filters;
  history.repetition_penalty = 1.2f;
  history.prompt_token_ids = {3, 4};
  EXPECT_TRUE(HasTokenEntries(history));
  history = filters;
  history.prompt_token_ids = {3, 4};  // no repetition penalty: no entries
  EXPECT_FALSE(HasTokenEntries(history));
  history.output_token_counts = {{5, 2}};
  EXPECT_TRUE(HasTokenEntries(history));
  SamplingParams greedy_bias;
  greedy_bias.temperature = 0.0f;
  greedy_bias.logit_bias = {{1, 2.0f}};
  EXPECT_TRUE(ServedFromUnitCandidates(greedy_bias, kVocab));
  SamplingParams greedy_raw = greedy_bias;
  greedy_raw.logprobs.logsumexp = true;
  greedy_raw.logprobs.raw = true;
  EXPECT_TRUE(ServedFromUnitCandidates(greedy_raw, kVocab));

  std::vector<SamplingParams> need_logits(7, filters);
  // Raw logprobs with no closing filter, and with top_p alone.
  need_logits[0].top_k = 0;
  need_logits[0].top_p = 1.0f;
  need_logits[0].min_p = 0.0f;
  need_logits[0].logprobs.sampled = true;
  need_logits[0].logprobs.raw = true;
  need_logits[1].top_k = 0;
  need_logits[1].logprobs.top_n = 2;
  need_logits[1].logprobs.raw = true;
  // Processed logprobs of a greedy row: every token at T = 1.
  need_logits[2] = greedy_bias;
  need_logits[2].logprobs.logsumexp = true;
  // Sampled rows with transforms or logprobs and no closing filter: top_k
  // at or above V is off.
  for (int i = 3; i < 6; ++i) {
    need_logits[i].top_k = i == 3 ? 0 : kVocab + (i - 4);
    need_logits[i].top_p = 1.0f;
    need_logits[i].min_p = 0.0f;
  }
  need_logits[3].logit_bias = {{1, 2.0f}};
  need_logits[4].logprobs.sampled = true;
  need_logits[5].allowed_bitmask.assign(32, ~0u);
  // Raw logprobs with a bitmask and top_p alone: one tail a unit.
  need_logits[6].top_k = 0;
  need_logits[6].logprobs.top_n = 2;
  need_logits[6].logprobs.raw = true;
  need_logits[6].allowed_bitmask.assign(32, ~0u);
  for (size_t i = 0; i < need_logits.size(); ++i) {
    EXPECT_FALSE(ServedFromUnitCandidates(need_logits[i], kVocab)) << i;
  }
}

// Regression: T = 1e-38 reached the kernel as a temperature (1 / T scaled
// logits to +-inf) and gave a wrong token. Rows SamplingParams::greedy()
// calls greedy (T < 1e-5) reach it as temperature 0, its greedy rule; 1e-5
// and above pass unchanged.
TEST(ControlledRowsTest, TinyTemperatureFailedOnCpuAndGaveWrongTokenOnCuda) {
  ControlledRowLists lists;
  for (float t : {0.0f, 1e-38f, 1e-30f, 9.9e-6f, 1e-5f, 0.7f}) {
    SamplingParams p;
    p.temperature = t;
    const RowSpec spec{&p, 1, 2};
    const ControlledRowInput in = ControlledInputFrom(spec, &lists);
    EXPECT_EQ(in.temperature, t < 1e-5f ? 0.0f : t) << t;
    EXPECT_EQ(p.greedy(), t < 1e-5f) << t;
    EXPECT_TRUE(ValidateCudaRow(p, kVocab).ok()) << t;
  }
}

// top_k = -1 is "off" (vLLM), as ValidateSamplingParams has it; -2 is not.
TEST(ControlledRowsTest, TopKMinusOneIsOff) {
  SamplingParams p;
  p.top_k = -1;
  EXPECT_TRUE(ValidateCudaRow(p, kVocab).ok());
  EXPECT_FALSE(NeedsControlledSampler(p));
  p.top_k = -2;
  EXPECT_FALSE(ValidateCudaRow(p, kVocab).ok());
}

// One ControlledRowLists reused over rows and rounds packs byte for byte
// what fresh lists per row pack (tests/kernels/controls/
// controlled_test_util.h's PlanOf), for every case the controlled sampler's
// tests sweep.
TEST(ControlledRowsTest, ConversionPacksWhatTheControlledSamplerTestsPack) {
  const std::vector<testing_controls::Case> cases =
      testing_controls::Cases(kVocab);
  for (const testing_controls::Case& c : cases) {
    const std::vector<RowSpec> specs = testing_controls::Specs(c, 9, 5);
    ControlledPlan plan;
    ControlledRowLists lists;
    for (int round = 0; round < 2; ++round) {
      plan.Clear();
      for (const RowSpec& spec : specs) {
        plan.AddRow(ControlledInputFrom(spec, &lists));
      }
      const ControlledPlan expected = testing_controls::PlanOf(specs);
      ASSERT_EQ(plan.rows(), expected.rows()) << c.name;
      for (int r = 0; r < plan.rows(); ++r) {
        const ControlledRow& got = plan.row_controls()[r];
        const ControlledRow& want = expected.row_controls()[r];
        EXPECT_TRUE(got.temperature == want.temperature &&
                    got.top_k == want.top_k && got.top_p == want.top_p &&
                    got.min_p == want.min_p &&
                    got.log_min_p == want.log_min_p &&
                    got.repetition_penalty == want.repetition_penalty &&
                    got.frequency_penalty == want.frequency_penalty &&
                    got.presence_penalty == want.presence_penalty &&
                    got.seed == want.seed && got.step == want.step &&
                    got.n == want.n && got.top_n == want.top_n &&
                    got.logprob_flags == want.logprob_flags &&
                    got.special_begin == want.special_begin &&
                    got.special_end == want.special_end &&
                    got.bitmask_offset == want.bitmask_offset)
            << c.name << " row " << r;
      }
      EXPECT_EQ(plan.special_ids(), expected.special_ids()) << c.name;
      EXPECT_EQ(plan.special_flags(), expected.special_flags()) << c.name;
      EXPECT_EQ(plan.special_bias(), expected.special_bias()) << c.name;
      EXPECT_EQ(plan.special_count(), expected.special_count()) << c.name;
      EXPECT_EQ(plan.bitmask(), expected.bitmask()) << c.name;
      EXPECT_EQ(plan.max_samples(), expected.max_samples()) << c.name;
      EXPECT_EQ(plan.max_top_n(), expected.max_top_n()) << c.name;
      // WriteBytes writes bytes() whatever the buffer held.
      const std::vector<unsigned char> bytes = plan.bytes();
      EXPECT_EQ(plan.byte_size(), bytes.size()) << c.name;
      std::vector<unsigned char> written(plan.byte_size(), 0xee);
      plan.WriteBytes(written.data());
      EXPECT_EQ(written, bytes) << c.name;
    }
    // The bound holds for each row.
    for (const RowSpec& spec : specs) {
      ControlledPlan one;
      one.AddRow(ControlledInputFrom(spec, &lists));
      EXPECT_LE(one.byte_size(), ControlledRowBytesBound(*spec.params) +
                                     kControlledPlanLayoutSlack)
          << c.name;
    }
  }
}

// PackControlledRows: rows whose params are the row before's (a request's
// broadcast params) share that row's packed entries and bitmask, and every
// row reads what packing each row afresh gives it: the same controls and
// noise key, the same entries at its range, the same bitmask words at its
// offset. A refused row rides along with the given params.
TEST(ControlledRowsTest, RowsOfOneParamsShareTheirPackedControls) {
  const size_t words = (kVocab + 31) / 32;
  SamplingParams broadcast;
  broadcast.temperature = 0.8f;
  broadcast.top_k = 5;
  broadcast.allowed_bitmask.assign(words, 0x55555555u);
  broadcast.logit_bias = {{7, 1.5f}, {3, -2.0f}, {7, 0.25f}};
  broadcast.banned_token_ids = {9};
  broadcast.repetition_penalty = 1.2f;
  broadcast.prompt_token_ids = {3, 11};
  broadcast.output_token_counts = {{11, 2}, {40, 1}};
  SamplingParams equal = broadcast;  // equal values, another object
  SamplingParams other;
  other.allowed_bitmask.assign(words, 0xf0f0f0f0u);
  other.logit_bias = {{1, 3.0f}};
  SamplingParams ride_along;
  ride_along.top_k = 1;
  const std::vector<const SamplingParams*> params = {
      &broadcast, &broadcast, &broadcast, &other, &broadcast,
      &equal,     &equal,     &other,     &other, &broadcast};
  const std::vector<char> valid = {1, 1, 1, 1, 1, 1, 0, 0, 1, 1};
  std::vector<RowSpec> specs(params.size());
  for (size_t r = 0; r < specs.size(); ++r) {
    specs[r].params = params[r];
    specs[r].seed = 1000 + r;
    specs[r].step = 7 * r;
  }
  ControlledPackScratch scratch;
  ControlledPlan shared;
  PackControlledRows(specs.data(), valid, 0, static_cast<int>(specs.size()),
                     ride_along, &scratch, &shared);
  ControlledRowLists lists;
  ControlledPlan fresh;
  for (size_t r = 0; r < specs.size(); ++r) {
    RowSpec spec = specs[r];
    if (!valid[r]) spec.params = &ride_along;
    fresh.AddRow(ControlledInputFrom(spec, &lists));
  }
  ASSERT_EQ(shared.rows(), fresh.rows());
  // Packed once each: broadcast's run of three, other, broadcast, equal,
  // the two ride-alongs (no bitmask), other, broadcast.
  EXPECT_EQ(shared.bitmask().size(), 6 * words);
  EXPECT_EQ(fresh.bitmask().size(), 8 * words);
  // Counted from the specs alone, as the engine routes a batch before it
  // packs: the plan's count, and a chunk's.
  EXPECT_EQ(shared.packed_bitmasks(), 6u);
  EXPECT_EQ(CountPackedBitmasks(specs.data(), valid, 0,
                                static_cast<int>(specs.size()), ride_along),
            6u);
  EXPECT_EQ(CountPackedBitmasks(specs.data(), valid, 1, 3, ride_along), 1u);
  EXPECT_EQ(CountPackedBitmasks(specs.data(), valid, 5, 9, ride_along), 2u);
  ControlledPlan chunk;
  PackControlledRows(specs.data(), valid, 5, 9, ride_along, &scratch, &chunk);
  EXPECT_EQ(chunk.packed_bitmasks(), 2u);
  // Ride-along params with a bitmask: the two refused rows pack it once.
  SamplingParams masked_ride_along = ride_along;
  masked_ride_along.allowed_bitmask.assign(words, 0x0f0f0f0fu);
  ControlledPlan masked;
  PackControlledRows(specs.data(), valid, 0, static_cast<int>(specs.size()),
                     masked_ride_along, &scratch, &masked);
  EXPECT_EQ(masked.packed_bitmasks(), 7u);
  EXPECT_EQ(
      CountPackedBitmasks(specs.data(), valid, 0,
                          static_cast<int>(specs.size()), masked_ride_along),
      7u);
  const std::vector<uint32_t> shared_words = shared.bitmask();
  const std::vector<uint32_t> fresh_words = fresh.bitmask();
  for (int r = 0; r < shared.rows(); ++r) {
    const ControlledRow& a = shared.row_controls()[r];
    const ControlledRow& b = fresh.row_controls()[r];
    EXPECT_TRUE(a.temperature == b.temperature && a.top_k == b.top_k &&
                a.top_p == b.top_p && a.min_p == b.min_p &&
                a.log_min_p == b.log_min_p &&
                a.repetition_penalty == b.repetition_penalty &&
                a.seed == b.seed && a.step == b.step && a.n == b.n &&
                a.top_n == b.top_n && a.logprob_flags == b.logprob_flags)
        << "row " << r;
    ASSERT_EQ(a.special_end - a.special_begin, b.special_end - b.special_begin)
        << "row " << r;
    for (int64_t k = 0; k < a.special_end - a.special_begin; ++k) {
      const size_t i = static_cast<size_t>(a.special_begin + k);
      const size_t j = static_cast<size_t>(b.special_begin + k);
      EXPECT_EQ(shared.special_ids()[i], fresh.special_ids()[j]) << r;
      EXPECT_EQ(shared.special_flags()[i], fresh.special_flags()[j]) << r;
      EXPECT_EQ(shared.special_bias()[i], fresh.special_bias()[j]) << r;
      EXPECT_EQ(shared.special_count()[i], fresh.special_count()[j]) << r;
    }
    ASSERT_EQ(a.bitmask_offset >= 0, b.bitmask_offset >= 0) << "row " << r;
    if (a.bitmask_offset < 0) continue;
    EXPECT_TRUE(std::equal(shared_words.begin() + a.bitmask_offset,
                           shared_words.begin() + a.bitmask_offset + words,
                           fresh_words.begin() + b.bitmask_offset))
        << "row " << r;
  }
  // The run's rows read the first row's packed entries.
  EXPECT_EQ(shared.row_controls()[2].special_begin,
            shared.row_controls()[0].special_begin);
  EXPECT_EQ(shared.row_controls()[2].bitmask_offset, 0);
  const std::vector<unsigned char> bytes = shared.bytes();
  std::vector<unsigned char> written(shared.byte_size(), 0xee);
  shared.WriteBytes(written.data());
  EXPECT_EQ(written, bytes);
}

// With a pool and enough entries the rows merge on several threads into
// regions closed up afterwards: the plan holds what packing row after row
// gives, repeats, refused rows and rows without entries included, and
// a plan reused for a second batch holds that batch alone.
TEST(ControlledRowsTest, RowsMergedOnAPoolPackTheSameBytes) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<int32_t> id(0, kVocab - 1);
  std::vector<SamplingParams> params(48);
  for (size_t p = 0; p < params.size(); ++p) {
    SamplingParams& row = params[p];
    row.temperature = 0.5f + 0.01f * p;
    if (p % 7 == 3) continue;  // no entries
    for (int e = 0; e < 120; ++e) {
      row.logit_bias.push_back({id(gen), 0.01f * e});
    }
    row.banned_token_ids = {id(gen), id(gen)};
    row.repetition_penalty = p % 2 ? 1.3f : 1.0f;
    for (int e = 0; e < 30; ++e) row.prompt_token_ids.push_back(id(gen));
    row.output_token_counts = {{id(gen), 2}, {id(gen), 0}, {id(gen), 1}};
    if (p % 5 == 0) row.allowed_bitmask.assign((kVocab + 31) / 32, ~0u);
  }
  SamplingParams ride_along;
  std::vector<RowSpec> specs;
  std::vector<char> valid;
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t repeat = 0; repeat < 1 + p % 3; ++repeat) {
      specs.push_back({&params[p], 100 + specs.size(), specs.size()});
      valid.push_back(specs.size() % 11 != 0);
    }
  }
  const int rows = static_cast<int>(specs.size());
  ThreadPool pool(3);
  ControlledPackScratch scratch;
  ControlledPlan serial;
  PackControlledRows(specs.data(), valid, 0, rows, ride_along, &scratch,
                     &serial);
  ControlledPlan pooled;
  // A smaller batch first: the second pack must not keep any of it.
  PackControlledRows(specs.data(), valid, 5, 9, ride_along, &scratch, &pooled,
                     &pool);
  pooled.Clear();
  PackControlledRows(specs.data(), valid, 0, rows, ride_along, &scratch,
                     &pooled, &pool);
  ControlledRowLists lists;
  ControlledPlan one_by_one;
  const SamplingParams* previous = nullptr;
  for (int r = 0; r < rows; ++r) {
    RowSpec spec = specs[r];
    if (!valid[r]) spec.params = &ride_along;
    if (spec.params == previous) {
      one_by_one.RepeatLastRow(spec.seed, spec.step);
    } else {
      one_by_one.AddRow(ControlledInputFrom(spec, &lists));
    }
    previous = spec.params;
  }
  // Enough list entries (each params packed at least once) for the pool.
  size_t entries = 0;
  for (const SamplingParams& p : params) {
    entries += p.logit_bias.size() + p.banned_token_ids.size() +
               p.output_token_counts.size() +
               (p.repetition_penalty != 1.0f ? p.prompt_token_ids.size() : 0);
  }
  ASSERT_GE(entries, kParallelPackEntries);
  // Field by field: ControlledRow's padding bytes are indeterminate.
  for (const ControlledPlan* plan : {&serial, &pooled}) {
    ASSERT_EQ(plan->rows(), rows);
    for (int r = 0; r < rows; ++r) {
      const ControlledRow& a = plan->row_controls()[r];
      const ControlledRow& b = one_by_one.row_controls()[r];
      EXPECT_TRUE(a.temperature == b.temperature && a.top_k == b.top_k &&
                  a.repetition_penalty == b.repetition_penalty &&
                  a.seed == b.seed && a.step == b.step &&
                  a.special_begin == b.special_begin &&
                  a.special_end == b.special_end &&
                  a.bitmask_offset == b.bitmask_offset)
          << "row " << r;
    }
    EXPECT_EQ(plan->special_ids(), one_by_one.special_ids());
    EXPECT_EQ(plan->special_flags(), one_by_one.special_flags());
    EXPECT_EQ(plan->special_bias(), one_by_one.special_bias());
    EXPECT_EQ(plan->special_count(), one_by_one.special_count());
    EXPECT_EQ(plan->bitmask(), one_by_one.bitmask());
    EXPECT_EQ(plan->byte_size(), one_by_one.byte_size());
  }
  // The bitmasks copied on the pool (CudaEngine::WriteControls): bytes()
  // again, whatever the buffer held.
  ASSERT_GE(pooled.packed_bitmasks(), 2u);
  std::vector<unsigned char> written(pooled.byte_size(), 0xee);
  pooled.WriteBytes(written.data(),
                    [&pool](int64_t n, absl::FunctionRef<void(int64_t)> copy) {
                      ParallelForOrInline(&pool, n, copy);
                    });
  EXPECT_EQ(written, pooled.bytes());

  // With device_merge the same batch leaves every row with entries to the
  // device's merge (a record per packed row, its repeats in it), and a
  // batch of fewer than kDeviceMergeEntries merges here.
  ControlledPlan deferred;
  PackControlledRows(specs.data(), valid, 0, rows, ride_along, &scratch,
                     &deferred, &pool, /*device_merge=*/true);
  int pending_rows = 0;
  for (const PendingMergeRow& m : deferred.pending_merges()) {
    pending_rows += m.rows;
  }
  int rows_with_entries = 0;
  for (const ControlledRow& r : one_by_one.row_controls()) {
    rows_with_entries += r.special_end > r.special_begin ? 1 : 0;
  }
  EXPECT_GT(rows_with_entries, rows / 2);
  EXPECT_EQ(pending_rows, rows_with_entries);
  ControlledPlan small;
  PackControlledRows(specs.data(), valid, 5, 9, ride_along, &scratch, &small,
                     &pool, /*device_merge=*/true);
  EXPECT_TRUE(small.pending_merges().empty());
}

// The token classes' inputs, unmerged, mark each row's tokens as the packed
// plan's entries do: the same set of ids per row (repeated and unsorted
// ids allowed), no id the plan leaves out (a prompt without a repetition
// penalty, an output count of 0), each row's bitmask where asked for, and
// a refused row or a repeat as the plan packs it.
TEST(ControlledRowsTest, TokenClassInputsMarkThePlansEntries) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int32_t> id(0, kVocab - 1);
  std::vector<SamplingParams> params(12);
  for (size_t p = 0; p < params.size(); ++p) {
    SamplingParams& row = params[p];
    if (p % 4 == 1) continue;  // no entries
    for (int e = 0; e < 10; ++e) row.logit_bias.push_back({id(gen), 0.5f});
    row.logit_bias.push_back(row.logit_bias.front());  // an id twice
    row.banned_token_ids = {id(gen)};
    row.repetition_penalty = p % 2 ? 1.2f : 1.0f;
    for (int e = 0; e < 8; ++e) row.prompt_token_ids.push_back(id(gen));
    row.output_token_counts = {{id(gen), 3}, {id(gen), 0}, {id(gen), 1}};
    if (p % 3 == 0) {
      row.allowed_bitmask.assign((kVocab + 31) / 32, 0u);
      for (int t = 0; t < kVocab; t += 1 + static_cast<int>(p)) {
        row.allowed_bitmask.mutable_words()[t / 32] |= 1u << (t % 32);
      }
    }
  }
  SamplingParams ride_along;
  ride_along.temperature = 0.0f;
  std::vector<RowSpec> specs;
  std::vector<char> valid;
  for (size_t p = 0; p < params.size(); ++p) {
    for (size_t repeat = 0; repeat < 1 + p % 2; ++repeat) {
      specs.push_back({&params[p], specs.size(), 0});
      valid.push_back(specs.size() % 7 != 0);
    }
  }
  const int rows = static_cast<int>(specs.size());
  ControlledPackScratch scratch;
  ControlledPlan plan;
  PackControlledRows(specs.data(), valid, 0, rows, ride_along, &scratch, &plan);
  const std::vector<uint32_t> plan_words = plan.bitmask();
  const size_t words = (kVocab + 31) / 32;
  for (bool with_bitmask : {false, true}) {
    TokenClassInputs inputs;
    inputs.Build(specs.data(), valid, rows, ride_along, with_bitmask,
                 /*shared=*/false);
    std::vector<unsigned char> bytes(inputs.byte_size(), 0xee);
    inputs.WriteBytes(bytes.data());
    ControlledSampleParams bound;
    inputs.BindInputs(bytes.data(), kVocab, &bound);
    ASSERT_EQ(bound.rows, rows);
    EXPECT_EQ(bound.vocab, kVocab);
    EXPECT_EQ(bound.bitmask == nullptr, !with_bitmask);
    for (int r = 0; r < rows; ++r) {
      const ControlledRow& got = bound.row_controls[r];
      const ControlledRow& want = plan.row_controls()[r];
      std::vector<int32_t> ids(bound.special_ids + got.special_begin,
                               bound.special_ids + got.special_end);
      std::sort(ids.begin(), ids.end());
      ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
      const std::vector<int32_t> merged(
          plan.special_ids().begin() + want.special_begin,
          plan.special_ids().begin() + want.special_end);
      EXPECT_EQ(ids, merged) << "row " << r;
      ASSERT_EQ(got.bitmask_offset >= 0,
                with_bitmask && want.bitmask_offset >= 0)
          << "row " << r;
      if (got.bitmask_offset < 0) continue;
      EXPECT_TRUE(std::equal(bound.bitmask + got.bitmask_offset,
                             bound.bitmask + got.bitmask_offset + words,
                             plan_words.begin() + want.bitmask_offset))
          << "row " << r;
    }
  }
  // One request's rows: the first row alone.
  std::vector<RowSpec> one(5, RowSpec{&params[0], 1, 0});
  TokenClassInputs shared;
  shared.Build(one.data(), std::vector<char>(5, 1), 5, ride_along,
               /*with_bitmask=*/true, /*shared=*/true);
  std::vector<unsigned char> bytes(shared.byte_size());
  shared.WriteBytes(bytes.data());
  ControlledSampleParams bound;
  shared.BindInputs(bytes.data(), kVocab, &bound);
  ASSERT_EQ(bound.rows, 1);
  EXPECT_EQ(
      bound.row_controls[0].special_end - bound.row_controls[0].special_begin,
      static_cast<int64_t>(params[0].logit_bias.size() +
                           params[0].banned_token_ids.size() + 2));
  EXPECT_EQ(bound.row_controls[0].bitmask_offset, 0);
}

TEST(ControlledRowsTest, BatchesOverTheBudgetSplitIntoChunksThatFit) {
  const size_t budget = kControlledPlanBudgetBytes;
  const size_t limit = budget - kControlledPlanLayoutSlack;
  const std::vector<size_t> small(256, 1000);
  EXPECT_EQ(SplitRowsByBudget(small, budget),
            (std::vector<std::pair<int, int>>{{0, 256}}));
  // 5 MB rows: three to a chunk.
  const std::vector<size_t> big(7, size_t{5} << 20);
  const std::vector<std::pair<int, int>> chunks =
      SplitRowsByBudget(big, budget);
  EXPECT_EQ(chunks, (std::vector<std::pair<int, int>>{{0, 3}, {3, 6}, {6, 7}}));
  // Mixed sizes: consecutive, covering, each within the budget.
  std::vector<size_t> mixed;
  for (int i = 0; i < 100; ++i) mixed.push_back((i * 7919 % 13) << 20 | 64);
  for (size_t& m : mixed) m = std::min(m, limit);
  const auto split = SplitRowsByBudget(mixed, budget);
  int next = 0;
  for (const auto& [first, end] : split) {
    EXPECT_EQ(first, next);
    EXPECT_LT(first, end);
    size_t sum = 0;
    for (int r = first; r < end; ++r) sum += mixed[r];
    EXPECT_LE(sum, limit);
    next = end;
  }
  EXPECT_EQ(next, 100);
  EXPECT_TRUE(SplitRowsByBudget({}, budget).empty());
}

TEST(ControlledRowsTest, ErrorTextsAreTheCpuSamplers) {
  EXPECT_EQ(ControlledRowError(kControlledAllMasked, -1, 0.0f, 0.0f),
            "every token is masked (banned ids, allowed bitmask or -inf bias)");
  EXPECT_EQ(ControlledRowError(kControlledNonFinite, 17,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::infinity()),
            "logit of token 17 is not finite (raw inf, processed inf)");
  EXPECT_EQ(ControlledRowError(kControlledNonFinite, 3, 2.5f,
                               std::numeric_limits<float>::quiet_NaN()),
            "logit of token 3 is not finite (raw 2.5, processed nan)");
}

// A row whose logits overflow fails on the CPU with exactly the text
// ControlledRowError builds from the kernel's error token and values.
TEST(ControlledRowsTest, NonFiniteMessageMatchesTheCpuOnOverflowingLogits) {
  testing_controls::Model model =
      testing_controls::MakeModel(kVocab, kHidden, 9);
  ASSERT_NE(model.sampler, nullptr);
  std::vector<float> hidden(kHidden, 0.0f);
  hidden[0] = std::ldexp(1.0f, 127);  // |W| >= 2 overflows to +-inf
  SamplingParams p;
  p.top_k = 4;
  RowSpec spec;
  spec.params = &p;
  std::vector<RowResult> cpu;
  (void)model.sampler->Sample(hidden.data(), 1, &spec, &cpu);
  ASSERT_EQ(cpu.size(), 1u);
  ASSERT_FALSE(cpu[0].error.empty());
  // The lowest id with |W[id, 0]| >= 2 (MakeModel's W, recomputed).
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<int> pick(-3, 3);
  std::vector<float> w(static_cast<size_t>(kVocab) * kHidden);
  for (float& v : w) v = static_cast<float>(pick(rng));
  int32_t token = -1;
  for (int64_t id = 0; id < kVocab && token < 0; ++id) {
    if (std::fabs(w[id * kHidden]) >= 2.0f) token = static_cast<int32_t>(id);
  }
  ASSERT_GE(token, 0);
  const float raw = w[token * kHidden] * hidden[0];
  EXPECT_EQ(cpu[0].error,
            ControlledRowError(kControlledNonFinite, token, raw, raw));
}

}  // namespace
}  // namespace flashsampler
