// Distribution tests of the CUDA engine's sampling controls
// (tests/testing/controls_stats.h): each control and their combinations,
// and one batch whose rows each have their own, against an fp64 reference
// of docs/api.md's order by chi-squared (each p-value printed), at
// V = 127, 129, 1000, 32768 and 151936; masked, banned and filtered tokens
// never drawn, greedy rows at the reference's argmax, logprobs within 1e-3
// of the reference's and ranks and top ids exact. Skips loudly without a
// GPU.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "service/backends/cuda/cuda_engine.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "tests/service/backends/cuda/cuda_engine_test_util.h"
#include "tests/testing/controls_stats.h"
#include "tests/testing/gpu_test_util.h"

namespace flashsampler {
namespace {

using controls_stats::Case;
using controls_stats::kHidden;
using controls_stats::kRows;

class ControlsStatsGpuTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override { FS_SKIP_WITHOUT_GPU(); }
};

// The engine's Sample() on slot 0, every row `hidden`.
controls_stats::SampleRows EngineRows(Engine& engine,
                                      const std::vector<float>& hidden) {
  return [&engine, rows_hidden = controls_stats::RowsOf(hidden)](
             const std::vector<RowSpec>& specs,
             std::vector<RowResult>* results) {
    testing_cuda::StageHidden(engine, 0, rows_hidden);
    return engine.Sample(
        BatchView{0, static_cast<int>(specs.size()), specs.data()}, results);
  };
}

TEST_P(ControlsStatsGpuTest, EachControlAndCombinationFollowsTheReference) {
  const int64_t vocab = GetParam();
  std::vector<float> w;
  auto engine = testing_cuda::OneGpuEngine(vocab, kHidden, 71, kRows, &w);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<float> hidden = controls_stats::SparseHidden(vocab);
  const std::vector<double> logits =
      controls_stats::ExactLogits(w, vocab, hidden);
  for (const Case& c : controls_stats::Cases(logits)) {
    controls_stats::ExpectSamplesFollowTheReference(
        EngineRows(**engine, hidden), logits, {c},
        "V = " + std::to_string(vocab));
  }
}

// One batch whose rows cycle through five parameter sets: each set's rows
// follow their own reference.
TEST_P(ControlsStatsGpuTest, RowsWithDifferentControlsInOneBatch) {
  const int64_t vocab = GetParam();
  std::vector<float> w;
  auto engine = testing_cuda::OneGpuEngine(vocab, kHidden, 72, kRows, &w);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<float> hidden = controls_stats::SparseHidden(vocab + 1);
  const std::vector<double> logits =
      controls_stats::ExactLogits(w, vocab, hidden);
  const std::vector<Case> mixed = controls_stats::MixedCases(logits);
  ASSERT_EQ(mixed.size(), 5u);
  controls_stats::ExpectSamplesFollowTheReference(
      EngineRows(**engine, hidden), logits, mixed,
      "V = " + std::to_string(vocab) + ", mixed");
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, ControlsStatsGpuTest,
                         ::testing::Values(127, 129, 1000, 32768, 151936),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "V" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace flashsampler
