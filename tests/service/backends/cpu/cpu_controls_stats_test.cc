// Distribution tests of the CPU sampler's controls
// (tests/testing/controls_stats.h, the CUDA engine's test at V = 127, 129
// and 1000): each control and their combinations, and one batch whose rows
// each have their own, against an fp64 reference of docs/api.md's order by
// chi-squared (each p-value printed); masked, banned and filtered tokens
// never drawn, greedy rows at the reference's argmax, logprobs within 1e-3
// of the reference's and ranks and top ids exact.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "service/backends/cpu/cpu_sampler.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "tests/testing/controls_stats.h"

namespace flashsampler {
namespace {

using controls_stats::Case;
using controls_stats::kHidden;

class CpuControlsStatsTest : public ::testing::TestWithParam<int64_t> {
 protected:
  // A CPU sampler over small-integer W (-3 .. 3; `values` receives it) and
  // its Sample() over kRows rows of `hidden`.
  void Start(int64_t vocab, uint64_t seed, const std::vector<float>& hidden,
             std::vector<float>* values) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> pick(-3, 3);
    values->resize(static_cast<size_t>(vocab) * kHidden);
    for (float& v : *values) v = static_cast<float>(pick(rng));
    auto sampler =
        CpuSampler::Create(std::make_shared<const std::vector<float>>(*values),
                           vocab, kHidden, CpuSamplerOptions());
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    sampler_ = std::move(*sampler);
    rows_hidden_ = controls_stats::RowsOf(hidden);
  }

  controls_stats::SampleRows Rows() {
    return [this](const std::vector<RowSpec>& specs,
                  std::vector<RowResult>* results) {
      return sampler_->Sample(rows_hidden_.data(),
                              static_cast<int>(specs.size()), specs.data(),
                              results);
    };
  }

  std::unique_ptr<CpuSampler> sampler_;
  std::vector<float> rows_hidden_;
};

TEST_P(CpuControlsStatsTest, EachControlAndCombinationFollowsTheReference) {
  const int64_t vocab = GetParam();
  const std::vector<float> hidden = controls_stats::SparseHidden(vocab);
  std::vector<float> w;
  ASSERT_NO_FATAL_FAILURE(Start(vocab, 71, hidden, &w));
  const std::vector<double> logits =
      controls_stats::ExactLogits(w, vocab, hidden);
  for (const Case& c : controls_stats::Cases(logits)) {
    controls_stats::ExpectSamplesFollowTheReference(
        Rows(), logits, {c}, "CPU, V = " + std::to_string(vocab));
  }
}

TEST_P(CpuControlsStatsTest, RowsWithDifferentControlsInOneBatch) {
  const int64_t vocab = GetParam();
  const std::vector<float> hidden = controls_stats::SparseHidden(vocab + 1);
  std::vector<float> w;
  ASSERT_NO_FATAL_FAILURE(Start(vocab, 72, hidden, &w));
  const std::vector<double> logits =
      controls_stats::ExactLogits(w, vocab, hidden);
  const std::vector<Case> mixed = controls_stats::MixedCases(logits);
  ASSERT_EQ(mixed.size(), 5u);
  controls_stats::ExpectSamplesFollowTheReference(
      Rows(), logits, mixed, "CPU, V = " + std::to_string(vocab) + ", mixed");
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, CpuControlsStatsTest,
                         ::testing::Values(127, 129, 1000),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "V" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace flashsampler
