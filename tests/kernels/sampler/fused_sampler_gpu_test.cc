// GPU tests of the fused sampler kernels against slow, obviously correct
// references: bit-exact logits and identical tokens on small-integer inputs
// (CpuSampler), agreement with fp32 cuBLAS logits on random bf16 inputs,
// chi-squared against the exact softmax, batch invariance
// (docs/design.md#invariance) for every tensor-core path and tile width, and
// the stage-2 tie-break. Every test skips loudly without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "common/dtype_convert.h"
#include "gtest/gtest.h"
#include "kernels/baselines/baselines.h"
#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"
#include "service/backends/cpu/cpu_sampler.h"
#include "tests/testing/chi_squared.h"
#include "tests/testing/gpu_test_util.h"

namespace flashsampler {
namespace {

using testing_gpu::AvailablePaths;
using testing_gpu::ConfigsOf;
using testing_gpu::DeviceArray;
using testing_gpu::KernelConfig;
using testing_gpu::PathName;
using testing_gpu::ReferenceSample;

// Device-side inputs of one problem: W, hidden rows and per-row controls.
struct Problem {
  int64_t vocab = 0;
  int hidden = 0;
  int rows = 0;
  DType dtype = DType::kBf16;
  std::shared_ptr<DeviceArray<uint16_t>> weights;
  std::unique_ptr<DeviceArray<uint16_t>> hidden_states;
  std::unique_ptr<DeviceArray<float>> inv_temperature;
  std::unique_ptr<DeviceArray<uint64_t>> seeds;
  std::unique_ptr<DeviceArray<uint64_t>> steps;
};

// The stage-1 parameters of one launch over rows [first_row, first_row +
// batch) of `problem`, outputs unset (vocab_offset 0, one sample).
FusedSampleParams LaunchParams(const Problem& problem, int first_row,
                               int batch) {
  FusedSampleParams params;
  params.weights = problem.weights->get();
  params.hidden = problem.hidden_states->get() +
                  static_cast<size_t>(first_row) * problem.hidden;
  params.dtype = problem.dtype;
  params.vocab_rows = problem.vocab;
  params.hidden_size = problem.hidden;
  params.batch = batch;
  params.inv_temperature = problem.inv_temperature->get() + first_row;
  params.seeds = problem.seeds->get() + first_row;
  params.steps = problem.steps->get() + first_row;
  return params;
}

struct LaunchSpec {
  int first_row = 0;  // rows [first_row, first_row + batch) of the problem
  int batch = 1;
  int num_samples = 1;
  int64_t vocab_offset = 0;
  FusedTuning tuning;            // path, block_n, stage depth, schedule
  int hidden_capacity_rows = 0;  // FusedSampleParams::hidden_capacity_rows
  bool want_logits = false;
};

// A spec on `path` at one kernel configuration (0s: the defaults).
LaunchSpec SpecFor(FusedKernel path, int block_n = 0, int stage_k = 0) {
  LaunchSpec spec;
  spec.tuning.kernel = path;
  spec.tuning.block_n = block_n;
  spec.tuning.w_stage_k = stage_k;
  return spec;
}

struct LaunchOutput {
  std::vector<int32_t> tokens;  // [batch][num_samples]
  std::vector<float> logits;    // [batch][vocab] when asked for
};

// The first `batch` rows of a Run output (with want_logits) against
// small-integer products: logits bit for bit against `reference` ([rows]
// [vocab]), and every token against ReferenceSample, the same noise on
// those logits.
::testing::AssertionResult MatchesExactReference(
    const LaunchOutput& out, const std::vector<float>& reference, int64_t vocab,
    int64_t vocab_offset, int batch, int num_samples,
    const std::vector<float>& inv_t, const std::vector<uint64_t>& seeds,
    const std::vector<uint64_t>& steps) {
  if (std::memcmp(out.logits.data(), reference.data(),
                  sizeof(float) * batch * vocab) != 0) {
    return ::testing::AssertionFailure()
           << "logits differ from the exact small-integer products";
  }
  for (int r = 0; r < batch; ++r) {
    for (int s = 0; s < num_samples; ++s) {
      const int32_t expected =
          ReferenceSample(&reference[r * vocab], vocab, vocab_offset, inv_t[r],
                          seeds[r], steps[r], s)
              .token_id;
      if (out.tokens[r * num_samples + s] != expected) {
        return ::testing::AssertionFailure()
               << "row " << r << " sample " << s << ": token "
               << out.tokens[r * num_samples + s] << ", expected " << expected;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<uint16_t> ToHalfBits(const std::vector<float>& values,
                                 DType dtype) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bits[i] =
        dtype == DType::kBf16 ? FloatToBf16(values[i]) : FloatToHalf(values[i]);
  }
  return bits;
}

std::vector<float> SmallIntegers(size_t count, int magnitude,
                                 std::mt19937_64& rng) {
  std::uniform_int_distribution<int> pick(-magnitude, magnitude);
  std::vector<float> values(count);
  for (float& v : values) v = static_cast<float>(pick(rng));
  return values;
}

// Per-row controls: every fifth row greedy, the others at a few
// temperatures (1 / T rounded to fp32 once, as the engine does).
void MakeControls(int rows, uint64_t salt, std::vector<float>* inv_t,
                  std::vector<uint64_t>* seeds, std::vector<uint64_t>* steps) {
  const float temperatures[] = {0.7f, 1.0f, 1.3f, 0.45f};
  inv_t->resize(rows);
  seeds->resize(rows);
  steps->resize(rows);
  for (int r = 0; r < rows; ++r) {
    (*inv_t)[r] = r % 5 == 0 ? 0.0f : 1.0f / temperatures[r % 4];
    (*seeds)[r] = 0x9e3779b97f4a7c15ull * (r + 1) ^ salt;
    (*steps)[r] = 17 + 3 * static_cast<uint64_t>(r) + (salt << 40);
  }
}

// The fixture of every fused-kernel test: skips loudly without a GPU, and
// holds the steps the tests share: Upload a problem, Run it every way, and
// the ExactLogits of small-integer inputs.
class FusedSamplerGpuTest : public ::testing::Test {
 protected:
  void SetUp() override { FS_SKIP_WITHOUT_GPU(); }

  // Uploads host W (unless `shared_weights` already holds it), hidden rows
  // and controls into a Problem.
  static ::testing::AssertionResult Upload(
      const std::vector<float>& weights, const std::vector<float>& hidden,
      int64_t vocab, int hidden_size, DType dtype,
      const std::vector<float>& inv_temperature,
      const std::vector<uint64_t>& seeds, const std::vector<uint64_t>& steps,
      Problem* problem,
      std::shared_ptr<DeviceArray<uint16_t>> shared_weights = nullptr) {
    problem->vocab = vocab;
    problem->hidden = hidden_size;
    problem->rows = static_cast<int>(inv_temperature.size());
    problem->dtype = dtype;
    problem->weights = shared_weights;
    problem->hidden_states =
        std::make_unique<DeviceArray<uint16_t>>(hidden.size());
    problem->inv_temperature =
        std::make_unique<DeviceArray<float>>(inv_temperature.size());
    problem->seeds = std::make_unique<DeviceArray<uint64_t>>(seeds.size());
    problem->steps = std::make_unique<DeviceArray<uint64_t>>(steps.size());
    if (problem->weights == nullptr) {
      problem->weights =
          std::make_shared<DeviceArray<uint16_t>>(weights.size());
      if (problem->weights->Upload(ToHalfBits(weights, dtype)) != cudaSuccess) {
        return ::testing::AssertionFailure() << "upload of W failed";
      }
    }
    if (problem->hidden_states->Upload(ToHalfBits(hidden, dtype)) !=
            cudaSuccess ||
        problem->inv_temperature->Upload(inv_temperature) != cudaSuccess ||
        problem->seeds->Upload(seeds) != cudaSuccess ||
        problem->steps->Upload(steps) != cudaSuccess) {
      return ::testing::AssertionFailure() << "upload failed";
    }
    return ::testing::AssertionSuccess();
  }

  // Uploads a problem of small-integer W (|w| <= 3) and hidden rows
  // (|h| <= 2) drawn from `seed`, with MakeControls(rows, salt)'s controls.
  static ::testing::AssertionResult UploadSmallIntegers(int64_t vocab,
                                                        int hidden_size,
                                                        int rows, uint64_t seed,
                                                        uint64_t salt,
                                                        Problem* problem) {
    std::mt19937_64 rng(seed);
    const std::vector<float> weights =
        SmallIntegers(vocab * hidden_size, 3, rng);
    const std::vector<float> hidden = SmallIntegers(rows * hidden_size, 2, rng);
    std::vector<float> inv_t;
    std::vector<uint64_t> seeds;
    std::vector<uint64_t> steps;
    MakeControls(rows, salt, &inv_t, &seeds, &steps);
    return Upload(weights, hidden, vocab, hidden_size, DType::kBf16, inv_t,
                  seeds, steps, problem);
  }

  // Stage 1 + stage 2 over rows of `problem`, three ways: with candidates and
  // LaunchReduceCandidates (the tensor-parallel tile layout), with the
  // in-kernel stage 2 (token_ids), and with the shard's winners
  // (shard_winners, the tensor-parallel winner layout) reduced as one tile;
  // all must give the same tokens. Scratch is allocated per call (tests only:
  // the engine allocates once).
  static ::testing::AssertionResult Run(const Problem& problem,
                                        const LaunchSpec& spec,
                                        LaunchOutput* out) {
    const int64_t tiles = FusedSampleNumTiles(problem.vocab);
    const size_t workspace_bytes =
        FusedSampleWorkspaceSize(spec.batch, problem.vocab, problem.hidden);
    DeviceArray<Candidate> candidates(tiles * spec.num_samples * spec.batch);
    DeviceArray<int32_t> tokens(static_cast<size_t>(spec.num_samples) *
                                spec.batch);
    DeviceArray<int32_t> in_kernel_tokens(tokens.count());
    DeviceArray<Candidate> winners(static_cast<size_t>(spec.num_samples) *
                                   spec.batch);
    DeviceArray<int32_t> winner_tokens(tokens.count());
    DeviceArray<char> workspace(workspace_bytes);
    DeviceArray<float> logits(spec.want_logits ? problem.vocab * spec.batch
                                               : 1);
    if (!candidates.ok() || !tokens.ok() || !logits.ok() ||
        !in_kernel_tokens.ok() || !winners.ok() || !winner_tokens.ok() ||
        !workspace.ok() ||
        cudaMemset(workspace.get(), 0, workspace_bytes) != cudaSuccess) {
      return ::testing::AssertionFailure() << "cudaMalloc failed";
    }
    FusedSampleParams params =
        LaunchParams(problem, spec.first_row, spec.batch);
    params.vocab_offset = spec.vocab_offset;
    params.num_samples = spec.num_samples;
    params.candidates = candidates.get();
    params.logits_out = spec.want_logits ? logits.get() : nullptr;
    params.tuning = spec.tuning;
    params.hidden_capacity_rows = spec.hidden_capacity_rows;
    cudaError_t error = LaunchFusedSample(params, nullptr, 0, nullptr);
    if (error != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "LaunchFusedSample: " << cudaGetErrorString(error);
    }
    error = LaunchReduceCandidates(candidates.get(), tiles, spec.num_samples,
                                   spec.batch, tokens.get(), nullptr, nullptr);
    if (error != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "LaunchReduceCandidates: " << cudaGetErrorString(error);
    }
    FusedSampleParams in_kernel = params;
    in_kernel.candidates = nullptr;
    in_kernel.logits_out = nullptr;
    in_kernel.token_ids = in_kernel_tokens.get();
    // Twice: the first launch must leave the workspace zeroed for the second.
    for (int repeat = 0; repeat < 2; ++repeat) {
      error = LaunchFusedSample(in_kernel, workspace.get(), workspace_bytes,
                                nullptr);
      if (error != cudaSuccess) {
        return ::testing::AssertionFailure()
               << "LaunchFusedSample (in-kernel stage 2): "
               << cudaGetErrorString(error);
      }
    }
    FusedSampleParams shard = in_kernel;
    shard.token_ids = nullptr;
    shard.shard_winners = winners.get();
    error = LaunchFusedSample(shard, workspace.get(), workspace_bytes, nullptr);
    if (error != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "LaunchFusedSample (shard winners): "
             << cudaGetErrorString(error);
    }
    error =
        LaunchReduceCandidates(winners.get(), 1, spec.num_samples, spec.batch,
                               winner_tokens.get(), nullptr, nullptr);
    if (error != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "LaunchReduceCandidates (shard winners): "
             << cudaGetErrorString(error);
    }
    error = cudaDeviceSynchronize();
    if (error != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "kernel failed: " << cudaGetErrorString(error);
    }
    std::vector<int32_t> in_kernel_result;
    std::vector<int32_t> winner_result;
    if (tokens.Download(&out->tokens, tokens.count()) != cudaSuccess ||
        in_kernel_tokens.Download(&in_kernel_result, tokens.count()) !=
            cudaSuccess ||
        winner_tokens.Download(&winner_result, tokens.count()) != cudaSuccess ||
        (spec.want_logits &&
         logits.Download(&out->logits, problem.vocab * spec.batch) !=
             cudaSuccess)) {
      return ::testing::AssertionFailure() << "download failed";
    }
    if (in_kernel_result != out->tokens) {
      return ::testing::AssertionFailure()
             << "the in-kernel stage 2 gave other tokens than "
                "LaunchReduceCandidates";
    }
    if (winner_result != out->tokens) {
      return ::testing::AssertionFailure()
             << "the shard's winners gave other tokens than its tiles' "
                "candidates";
    }
    return ::testing::AssertionSuccess();
  }

  // Exact logits [rows][vocab] of small-integer W and hidden rows (every
  // partial sum exact in fp32), from the CPU sampler.
  static ::testing::AssertionResult ExactLogits(
      const std::vector<float>& weights, const std::vector<float>& hidden,
      int64_t vocab, int hidden_size, int rows, std::vector<float>* logits) {
    auto sampler =
        CpuSampler::Create(std::make_shared<const std::vector<float>>(weights),
                           vocab, hidden_size, CpuSamplerOptions());
    if (!sampler.ok()) {
      return ::testing::AssertionFailure() << sampler.status();
    }
    logits->resize(static_cast<size_t>(rows) * vocab);
    const absl::Status status =
        (*sampler)->ComputeLogits(hidden.data(), rows, logits->data());
    if (!status.ok()) return ::testing::AssertionFailure() << status;
    return ::testing::AssertionSuccess();
  }
};

// The wgmma path's own schedules: skipped (loudly) where it does not run.
class FusedSamplerWgmmaGpuTest : public FusedSamplerGpuTest {
 protected:
  void SetUp() override {
    FusedSamplerGpuTest::SetUp();
    if (IsSkipped()) return;
    if (FusedSampleResolveKernel(FusedKernel::kAuto) != FusedKernel::kWgmma) {
      GTEST_SKIP() << "a wgmma-path schedule; no sm_90a here";
    }
  }
};

// The epilogue's branch-free noise must be philox.h's bit for bit over its
// whole domain (all 2^23 uniforms, as a token's and as a block's), or GPU
// and CPU samples differ.
TEST_F(FusedSamplerGpuTest, BranchFreeNoiseEqualsTheReferenceForAllUniforms) {
  DeviceArray<unsigned int> mismatches(1);
  ASSERT_TRUE(mismatches.ok());
  FS_ASSERT_CUDA(LaunchNoiseSelfCheck(mismatches.get(), nullptr));
  std::vector<unsigned int> host;
  FS_ASSERT_CUDA(mismatches.Download(&host, 1));
  EXPECT_EQ(host[0], 0u);
}

// Pruning is exact only if every bracket the epilogue compares against
// contains the exact score, for every uniform: the word bounds, PruneBounds
// and the block bounds (the uppers are what the launch's floor is compared
// with).
TEST_F(FusedSamplerGpuTest, PruningBracketsContainTheExactScoreForAllUniforms) {
  DeviceArray<unsigned int> violations(kNoiseBracketCount);
  ASSERT_TRUE(violations.ok());
  FS_ASSERT_CUDA(LaunchNoiseBracketCheck(violations.get(), nullptr));
  std::vector<unsigned int> host;
  FS_ASSERT_CUDA(violations.Download(&host, kNoiseBracketCount));
  ASSERT_EQ(host.size(), static_cast<size_t>(kNoiseBracketCount));
  EXPECT_EQ(host[kNoiseBracketWordUpper], 0u) << "WordUpperBound";
  EXPECT_EQ(host[kNoiseBracketWordLower], 0u) << "WordLowerBound";
  EXPECT_EQ(host[kNoiseBracketLogLower], 0u) << "PruneBounds lower";
  EXPECT_EQ(host[kNoiseBracketLogUpper], 0u) << "PruneBounds upper";
  EXPECT_EQ(host[kNoiseBracketBlockFirstLower], 0u) << "BlockFirstLowerBound";
  EXPECT_EQ(host[kNoiseBracketBlockFirstUpper], 0u)
      << "BlockUpperBound, first slot";
  EXPECT_EQ(host[kNoiseBracketBlockOtherUpper], 0u)
      << "BlockUpperBound, other slot";
}

// Small-integer logits, exact in fp32, per operand dtype and batch size:
// every path, tile width and stage depth.
class FusedSamplerExactTest
    : public FusedSamplerGpuTest,
      public ::testing::WithParamInterface<std::tuple<DType, int>> {};

TEST_P(FusedSamplerExactTest, SmallIntegerLogitsMatchCpuReferenceBitForBit) {
  const DType dtype = std::get<0>(GetParam());
  const int batch = std::get<1>(GetParam());
  // |logit| <= 3 * 2 * 512 < 2^24: every partial sum is exact in fp32, so
  // any accumulation order gives the same bits.
  constexpr int64_t kVocab = 1001;  // a ragged last tile
  constexpr int kHidden = 512;
  constexpr int kRows = 200;
  constexpr int kSamples = 2;
  std::mt19937_64 rng(11);
  const std::vector<float> weights = SmallIntegers(kVocab * kHidden, 3, rng);
  const std::vector<float> hidden = SmallIntegers(kRows * kHidden, 2, rng);
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 1, &inv_t, &seeds, &steps);

  std::vector<float> reference;
  ASSERT_TRUE(ExactLogits(weights, hidden, kVocab, kHidden, kRows, &reference));

  // Expected tokens for each vocab_offset (the shard's first global id; 6
  // exercises the unaligned noise path, 48 the wgmma epilogue's own block
  // calls where a tile is not two whole block groups), row and sample.
  const int64_t offsets[] = {0, 6, 48};
  constexpr int kOffsets = 3;
  std::vector<std::vector<int32_t>> expected(kOffsets);
  for (int o = 0; o < kOffsets; ++o) {
    for (int r = 0; r < kRows; ++r) {
      for (int s = 0; s < kSamples; ++s) {
        expected[o].push_back(ReferenceSample(&reference[r * kVocab], kVocab,
                                              offsets[o], inv_t[r], seeds[r],
                                              steps[r], s)
                                  .token_id);
      }
    }
  }

  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, kVocab, kHidden, dtype, inv_t, seeds,
                     steps, &problem));
  for (FusedKernel path : AvailablePaths()) {
    for (const KernelConfig& config : ConfigsOf(path)) {
      for (int o = 0; o < kOffsets; ++o) {
        SCOPED_TRACE(::testing::Message()
                     << PathName(path) << " block_n=" << config.block_n
                     << " stage_k=" << config.stage_k << " batch=" << batch
                     << " offset=" << offsets[o] << " " << DTypeName(dtype));
        LaunchSpec spec = SpecFor(path, config.block_n, config.stage_k);
        spec.batch = batch;
        spec.num_samples = kSamples;
        spec.vocab_offset = offsets[o];
        spec.want_logits = true;
        LaunchOutput out;
        ASSERT_TRUE(Run(problem, spec, &out));
        int logit_mismatches = 0;
        for (int64_t i = 0; i < batch * kVocab; ++i) {
          uint32_t got;
          uint32_t want;
          std::memcpy(&got, &out.logits[i], 4);
          std::memcpy(&want, &reference[i], 4);
          if (got != want && logit_mismatches++ == 0) {
            ADD_FAILURE() << "first logit mismatch at row " << i / kVocab
                          << " token " << i % kVocab << ": " << out.logits[i]
                          << " vs " << reference[i];
          }
        }
        EXPECT_EQ(logit_mismatches, 0);
        for (int i = 0; i < batch * kSamples; ++i) {
          ASSERT_EQ(out.tokens[i], expected[o][i])
              << "row " << i / kSamples << " sample " << i % kSamples;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    DTypeAndBatch, FusedSamplerExactTest,
    ::testing::Combine(::testing::Values(DType::kBf16, DType::kFp16),
                       ::testing::Values(1, 3, 64, 200)),
    [](const ::testing::TestParamInfo<std::tuple<DType, int>>& info) {
      return std::string(DTypeName(std::get<0>(info.param))) + "_B" +
             std::to_string(std::get<1>(info.param));
    });

// The small case tools/device/run.sh runs under compute-sanitizer
// (memcheck, racecheck): every path and tile width once, a ragged last vocab
// tile, a partial batch tile, two samples, the unaligned-noise offset.
TEST_F(FusedSamplerGpuTest, SanitizerSmallCase) {
  constexpr int64_t kVocab = 1001;
  constexpr int kHidden = 128;
  constexpr int kRows = 70;
  constexpr int kSamples = 2;
  constexpr int64_t kOffset = 6;
  std::mt19937_64 rng(3);
  const std::vector<float> weights = SmallIntegers(kVocab * kHidden, 3, rng);
  const std::vector<float> hidden = SmallIntegers(kRows * kHidden, 2, rng);
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 4, &inv_t, &seeds, &steps);
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab, 0.0f);
  for (int r = 0; r < kRows; ++r) {
    for (int64_t v = 0; v < kVocab; ++v) {
      float sum = 0.0f;  // small integers: exact in any order
      for (int d = 0; d < kHidden; ++d) {
        sum += hidden[r * kHidden + d] * weights[v * kHidden + d];
      }
      logits[r * kVocab + v] = sum;
    }
  }
  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, kVocab, kHidden, DType::kBf16, inv_t,
                     seeds, steps, &problem));
  for (FusedKernel path : AvailablePaths()) {
    for (const KernelConfig& config : ConfigsOf(path)) {
      const int block_n = config.block_n;
      LaunchSpec spec = SpecFor(path, block_n, config.stage_k);
      spec.batch = kRows;
      spec.num_samples = kSamples;
      spec.vocab_offset = kOffset;
      spec.want_logits = true;
      LaunchOutput out;
      ASSERT_TRUE(Run(problem, spec, &out));
      ASSERT_EQ(out.logits, logits) << PathName(path) << " " << block_n;
      for (int r = 0; r < kRows; ++r) {
        for (int s = 0; s < kSamples; ++s) {
          ASSERT_EQ(out.tokens[r * kSamples + s],
                    ReferenceSample(&logits[r * kVocab], kVocab, kOffset,
                                    inv_t[r], seeds[r], steps[r], s)
                        .token_id)
              << PathName(path) << " " << block_n << " row " << r;
        }
      }
    }
  }
}

// The wgmma kernel cuts the items of a last round that fills at most half
// the SMs into two 64-column halves (WorkSchedule in
// fused_sampler_wgmma.cuh). Here the vocabulary is SMs + 3 tiles, the last
// one ragged, so that every batch of 65..256 rows (block_n 128) ends in such
// a round: 3 or 6 items on a grid of SMs. Logits and tokens must be exact,
// with the split and without it, and with the CTA's last piece scored by
// both consumers (the default, in every other test too) and by its owner
// alone. The same schedules cover H multicast over CTA pairs (one batch
// tile, B <= 128): pieces shared by a pair, the split round's halves that
// are not, a last piece whose peer has none (no split: 3 items), and at
// B = 17 a second half of H wholly past the batch; and W multicast (two
// batch tiles, B = 200 and 256): every piece shared, the split round's
// halves included, and a last vocab tile whose second half of W is wholly
// past the vocabulary; with multicast off as the control. Small enough
// for compute-sanitizer.
TEST_F(FusedSamplerWgmmaGpuTest, SplitLastRoundIsExact) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0),
            cudaSuccess);
  const int64_t vocab = (sms + 3) * int64_t{FusedSampleTileRows()} - 80;
  constexpr int kHidden = 128;
  constexpr int kRows = 256;
  constexpr int kSamples = 2;
  constexpr int64_t kOffset = 6;
  std::mt19937_64 rng(21);
  const std::vector<float> weights = SmallIntegers(vocab * kHidden, 3, rng);
  const std::vector<float> hidden = SmallIntegers(kRows * kHidden, 2, rng);
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 6, &inv_t, &seeds, &steps);
  std::vector<float> reference;
  ASSERT_TRUE(ExactLogits(weights, hidden, vocab, kHidden, kRows, &reference));
  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, vocab, kHidden, DType::kBf16, inv_t,
                     seeds, steps, &problem));
  struct Schedule {
    bool split;
    bool share;
    bool multicast;
  };
  for (int batch : {17, 65, 128, 200, 256}) {
    for (Schedule schedule :
         {Schedule{true, true, true}, Schedule{false, true, true},
          Schedule{true, false, true}, Schedule{true, true, false},
          Schedule{false, true, false}}) {
      SCOPED_TRACE(::testing::Message()
                   << "batch " << batch << " split " << schedule.split
                   << " share " << schedule.share << " multicast "
                   << schedule.multicast << " SMs " << sms);
      LaunchSpec spec = SpecFor(FusedKernel::kWgmma, 128);
      spec.batch = batch;
      spec.num_samples = kSamples;
      spec.vocab_offset = kOffset;
      spec.tuning.split_last_round = schedule.split;
      spec.tuning.share_last_epilogue = schedule.share;
      spec.tuning.multicast_h = schedule.multicast;
      spec.tuning.multicast_w = schedule.multicast;
      spec.want_logits = true;
      LaunchOutput out;
      ASSERT_TRUE(Run(problem, spec, &out));
      ASSERT_TRUE(MatchesExactReference(out, reference, vocab, kOffset, batch,
                                        kSamples, inv_t, seeds, steps));
    }
  }
}

// FusedSampleParams::hidden_capacity_rows: H declared to TMA up to the batch
// rounded up to the tile width, rows past the batch multiplied but never
// scored. Rows 200..255 of H are NaN, so that a padded tile that reads them
// (B = 200 at every width, B = 136 at 128) would show any leak into a batch
// column's logits; batches at every tile width, with one batch tile and
// with several, logits bit for bit and tokens exact.
TEST_F(FusedSamplerWgmmaGpuTest, HiddenRowsPastTheBatchChangeNoBit) {
  constexpr int64_t kVocab = 3 * 128 + 56;
  constexpr int kHidden = 128;
  constexpr int kRows = 256;
  constexpr int kFiniteRows = 200;
  constexpr int kSamples = 2;
  std::mt19937_64 rng(51);
  const std::vector<float> weights = SmallIntegers(kVocab * kHidden, 3, rng);
  std::vector<float> hidden = SmallIntegers(kRows * kHidden, 2, rng);
  std::fill(hidden.begin() + kFiniteRows * kHidden, hidden.end(),
            std::numeric_limits<float>::quiet_NaN());
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 4, &inv_t, &seeds, &steps);
  std::vector<float> reference;
  ASSERT_TRUE(
      ExactLogits(weights, hidden, kVocab, kHidden, kFiniteRows, &reference));
  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, kVocab, kHidden, DType::kBf16, inv_t,
                     seeds, steps, &problem));
  for (int block_n : {0, 16, 64, 80, 96, 112, 128}) {
    for (int batch : {1, 17, 100, 136, 200}) {
      SCOPED_TRACE(::testing::Message()
                   << "block_n " << block_n << " batch " << batch);
      LaunchSpec spec = SpecFor(FusedKernel::kWgmma, block_n);
      spec.batch = batch;
      spec.num_samples = kSamples;
      spec.hidden_capacity_rows = kRows;
      spec.want_logits = true;
      LaunchOutput out;
      ASSERT_TRUE(Run(problem, spec, &out));
      ASSERT_TRUE(MatchesExactReference(out, reference, kVocab, 0, batch,
                                        kSamples, inv_t, seeds, steps));
    }
  }
}

// FusedTuning::timeline (fs_bench --timeline): every piece of the
// persistent schedule is recorded once, by the consumer that owns it, with
// ordered stamps, and recording changes no token.
TEST_F(FusedSamplerWgmmaGpuTest, TimelineRecordsEveryPieceAndChangesNoToken) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0),
            cudaSuccess);
  // 64-wide items (no split rounds), 3 to 4 per CTA.
  const int64_t items = 3 * int64_t{sms} + 5;
  const int64_t vocab = items * FusedSampleTileRows() - 7;
  constexpr int kHidden = 128;
  constexpr int kRows = 64;
  constexpr int kPieces = 8;
  Problem problem;
  ASSERT_TRUE(UploadSmallIntegers(vocab, kHidden, kRows, 33, 8, &problem));
  const size_t workspace_bytes =
      FusedSampleWorkspaceSize(kRows, vocab, kHidden);
  DeviceArray<char> workspace(workspace_bytes);
  DeviceArray<int32_t> tokens(kRows);
  const size_t stamps = static_cast<size_t>(sms) * 2 * kPieces * 3;
  DeviceArray<uint64_t> timeline(stamps);
  ASSERT_TRUE(workspace.ok() && tokens.ok() && timeline.ok());
  ASSERT_EQ(cudaMemset(workspace.get(), 0, workspace_bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(timeline.get(), 0, stamps * sizeof(uint64_t)),
            cudaSuccess);
  FusedSampleParams params = LaunchParams(problem, 0, kRows);
  params.token_ids = tokens.get();
  params.tuning.kernel = FusedKernel::kWgmma;
  params.tuning.block_n = 64;
  std::vector<int32_t> plain;
  std::vector<int32_t> recorded;
  ASSERT_EQ(
      LaunchFusedSample(params, workspace.get(), workspace_bytes, nullptr),
      cudaSuccess);
  ASSERT_EQ(tokens.Download(&plain, kRows), cudaSuccess);
  params.tuning.timeline = timeline.get();
  params.tuning.timeline_pieces = kPieces;
  ASSERT_EQ(
      LaunchFusedSample(params, workspace.get(), workspace_bytes, nullptr),
      cudaSuccess);
  ASSERT_EQ(tokens.Download(&recorded, kRows), cudaSuccess);
  EXPECT_EQ(recorded, plain);
  std::vector<uint64_t> host;
  ASSERT_EQ(timeline.Download(&host, stamps), cudaSuccess);
  int64_t pieces = 0;
  for (size_t slot = 0; slot < stamps / 3; ++slot) {
    const uint64_t* stamp = &host[slot * 3];
    if (stamp[0] == 0) continue;
    ++pieces;
    const size_t consumer = (slot / kPieces) % 2;
    const size_t piece = slot % kPieces;
    EXPECT_EQ(piece % 2, consumer) << "slot " << slot;
    EXPECT_LE(stamp[0], stamp[1]) << "slot " << slot;
    EXPECT_LE(stamp[1], stamp[2]) << "slot " << slot;
  }
  EXPECT_EQ(pieces, items);
}

// FusedSampleSetAsideL2ForUnits: the set-aside is 2/5 of the L2 (at most
// what the GPU allows), and launches that keep their unit records in it
// (an access policy window on the launch, the one-CTA and the CTA-pair
// launch alike) write the same records and row maxima, byte for byte, as
// launches without it.
TEST_F(FusedSamplerWgmmaGpuTest, UnitRecordsKeptInL2AreTheSameBytes) {
  constexpr int64_t kVocab = 41 * 128 + 56;
  constexpr int kHidden = 128;
  constexpr int kRows = 200;
  Problem problem;
  ASSERT_TRUE(UploadSmallIntegers(kVocab, kHidden, kRows, 77, 8, &problem));
  const size_t units = static_cast<size_t>(UnitsPerRow(kVocab));
  DeviceArray<UnitRecord> records(units * kRows);
  DeviceArray<uint32_t> maxima(2 * kRows);
  DeviceArray<int32_t> tokens(kRows);
  const size_t workspace_bytes =
      FusedSampleWorkspaceSize(kRows, kVocab, kHidden);
  DeviceArray<char> workspace(workspace_bytes);
  ASSERT_TRUE(records.ok() && maxima.ok() && tokens.ok() && workspace.ok());
  ASSERT_EQ(cudaMemset(workspace.get(), 0, workspace_bytes), cudaSuccess);
  // Records and maxima of one launch over `batch` rows, every tail summed.
  auto launch = [&](int batch, bool multicast, std::vector<UnitRecord>* out,
                    std::vector<uint32_t>* out_maxima) {
    if (cudaMemset(records.get(), 0xa5, sizeof(UnitRecord) * records.count()) !=
            cudaSuccess ||
        cudaMemset(maxima.get(), 0, sizeof(uint32_t) * maxima.count()) !=
            cudaSuccess) {
      return ::testing::AssertionFailure() << "cudaMemset failed";
    }
    FusedSampleParams params = LaunchParams(problem, 0, batch);
    params.token_ids = tokens.get();
    params.tuning.kernel = FusedKernel::kWgmma;
    params.tuning.multicast_h = multicast;
    params.unit_candidates.records = records.get();
    params.unit_candidates.row_bound = maxima.get();
    params.unit_candidates.row_top = maxima.get() + kRows;
    params.unit_candidates.tail_inv_temperature =
        problem.inv_temperature->get();
    const cudaError_t error =
        LaunchFusedSample(params, workspace.get(), workspace_bytes, nullptr);
    if (error != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
      return ::testing::AssertionFailure()
             << "LaunchFusedSample: " << cudaGetErrorString(error);
    }
    if (records.Download(out, units * batch) != cudaSuccess ||
        maxima.Download(out_maxima, maxima.count()) != cudaSuccess) {
      return ::testing::AssertionFailure() << "download failed";
    }
    return ::testing::AssertionSuccess();
  };
  for (int batch : {17, 128, 200}) {
    for (bool multicast : {true, false}) {
      SCOPED_TRACE(::testing::Message()
                   << "batch " << batch << " multicast " << multicast);
      size_t set_aside = 1;
      ASSERT_EQ(FusedSampleSetAsideL2ForUnits(0, &set_aside), cudaSuccess);
      EXPECT_EQ(set_aside, 0u);
      std::vector<UnitRecord> plain;
      std::vector<uint32_t> plain_maxima;
      ASSERT_TRUE(launch(batch, multicast, &plain, &plain_maxima));
      ASSERT_EQ(FusedSampleSetAsideL2ForUnits(-1, &set_aside), cudaSuccess);
      EXPECT_EQ(set_aside, testing_gpu::DefaultUnitL2SetAside());
      std::vector<UnitRecord> kept;
      std::vector<uint32_t> kept_maxima;
      ASSERT_TRUE(launch(batch, multicast, &kept, &kept_maxima));
      EXPECT_EQ(std::memcmp(plain.data(), kept.data(),
                            sizeof(UnitRecord) * plain.size()),
                0);
      EXPECT_EQ(plain_maxima, kept_maxima);
      // Every record written: a bound is 0 or has its low 5 bits set, and
      // the fill's 0xa5a5a5a5 has not.
      for (size_t q = 0; q < kept.size(); ++q) {
        ASSERT_NE(kept[q].bound, 0xa5a5a5a5u) << "record " << q;
      }
    }
  }
  size_t set_aside = 1;
  EXPECT_EQ(FusedSampleSetAsideL2ForUnits(0, &set_aside), cudaSuccess);
}

TEST_F(FusedSamplerGpuTest, GreedyTiesGoToTheLowestGlobalId) {
  constexpr int64_t kVocab = 300;
  constexpr int kHidden = 64;
  const std::vector<float> weights(kVocab * kHidden, 1.0f);  // equal logits
  const std::vector<float> hidden(4 * kHidden, 1.0f);
  const std::vector<float> inv_t(4, 0.0f);
  const std::vector<uint64_t> seeds = {1, 2, 3, 4};
  const std::vector<uint64_t> steps = {0, 0, 0, 0};
  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, kVocab, kHidden, DType::kBf16, inv_t,
                     seeds, steps, &problem));
  for (FusedKernel path : AvailablePaths()) {
    for (const KernelConfig& config : ConfigsOf(path)) {
      const int block_n = config.block_n;
      for (int64_t offset : {0, 5, 1000}) {
        LaunchSpec spec = SpecFor(path, block_n, config.stage_k);
        spec.batch = 4;
        spec.vocab_offset = offset;
        LaunchOutput out;
        ASSERT_TRUE(Run(problem, spec, &out));
        for (int32_t token : out.tokens) {
          EXPECT_EQ(token, offset) << PathName(path) << " " << block_n;
        }
      }
    }
  }
}

TEST_F(FusedSamplerGpuTest, RandomBf16TokensAgreeWithFp32CublasReference) {
  constexpr int64_t kVocab = 151936;
  constexpr int kHidden = 4096;
  constexpr int kRows = 4096;
  constexpr int kChunk = 256;
  const int64_t tiles = FusedSampleNumTiles(kVocab);
  const int64_t chunks = GumbelLogitsNumChunks(kVocab);
  DeviceArray<uint16_t> weights(kVocab * kHidden);
  DeviceArray<uint16_t> hidden(static_cast<size_t>(kRows) * kHidden);
  DeviceArray<float> logits(kVocab * kChunk);
  DeviceArray<float> fused_logits(kVocab * kChunk);
  DeviceArray<Candidate> candidates(tiles * kChunk);
  DeviceArray<Candidate> reference_candidates(chunks * kChunk);
  DeviceArray<int32_t> tokens(kChunk);
  DeviceArray<int32_t> reference_tokens(kChunk);
  DeviceArray<float> inv_t_device(kRows);
  DeviceArray<uint64_t> seeds_device(kRows);
  DeviceArray<uint64_t> steps_device(kRows);
  ASSERT_TRUE(weights.ok() && hidden.ok() && logits.ok() && fused_logits.ok() &&
              candidates.ok() && reference_candidates.ok());
  FS_ASSERT_CUDA(LaunchFillUniform(weights.get(), kVocab * kHidden,
                                   DType::kBf16, 21, 0.35f, nullptr));
  FS_ASSERT_CUDA(LaunchFillUniform(hidden.get(),
                                   static_cast<int64_t>(kRows) * kHidden,
                                   DType::kBf16, 22, 0.35f, nullptr));
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 2, &inv_t, &seeds, &steps);
  FS_ASSERT_CUDA(inv_t_device.Upload(inv_t));
  FS_ASSERT_CUDA(seeds_device.Upload(seeds));
  FS_ASSERT_CUDA(steps_device.Upload(steps));
  cublasHandle_t cublas;
  ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);

  int agree = 0;
  int near_ties = 0;
  std::vector<float> row(kVocab);
  for (int first = 0; first < kRows; first += kChunk) {
    const uint16_t* chunk_hidden =
        hidden.get() + static_cast<size_t>(first) * kHidden;
    FusedSampleParams params;
    params.weights = weights.get();
    params.hidden = chunk_hidden;
    params.vocab_rows = kVocab;
    params.hidden_size = kHidden;
    params.batch = kChunk;
    params.inv_temperature = inv_t_device.get() + first;
    params.seeds = seeds_device.get() + first;
    params.steps = steps_device.get() + first;
    params.candidates = candidates.get();
    params.logits_out = first == 0 ? fused_logits.get() : nullptr;
    FS_ASSERT_CUDA(LaunchFusedSample(params, nullptr, 0, nullptr));
    FS_ASSERT_CUDA(LaunchReduceCandidates(candidates.get(), tiles, 1, kChunk,
                                          tokens.get(), nullptr, nullptr));
    // Reference: fp32 logits from cuBLAS, the same noise, Gumbel-max.
    FS_ASSERT_CUDA(CublasLogits(cublas, weights.get(), chunk_hidden,
                                DType::kBf16, kVocab, kHidden, kChunk,
                                logits.get(), DType::kFp32, nullptr));
    FS_ASSERT_CUDA(LaunchGumbelOverLogits(
        logits.get(), DType::kFp32, kVocab, 0, kChunk, 1,
        inv_t_device.get() + first, seeds_device.get() + first,
        steps_device.get() + first, reference_candidates.get(), nullptr));
    FS_ASSERT_CUDA(LaunchReduceCandidates(reference_candidates.get(), chunks, 1,
                                          kChunk, reference_tokens.get(),
                                          nullptr, nullptr));
    FS_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<int32_t> got;
    std::vector<int32_t> want;
    FS_ASSERT_CUDA(tokens.Download(&got, kChunk));
    FS_ASSERT_CUDA(reference_tokens.Download(&want, kChunk));
    if (first == 0) {
      // The fused kernel's logits are the same dot products in another
      // accumulation order: equal to a few fp32 ulps of the row's scale.
      std::vector<float> fused;
      std::vector<float> cublas_logits;
      FS_ASSERT_CUDA(fused_logits.Download(&fused, kVocab * kChunk));
      FS_ASSERT_CUDA(logits.Download(&cublas_logits, kVocab * kChunk));
      double max_error = 0;
      for (size_t i = 0; i < fused.size(); ++i) {
        max_error = std::max(max_error,
                             std::fabs(static_cast<double>(fused[i]) -
                                       static_cast<double>(cublas_logits[i])));
      }
      EXPECT_LT(max_error, 1e-3) << "fused logits vs cuBLAS fp32 logits";
    }
    for (int i = 0; i < kChunk; ++i) {
      const int r = first + i;
      // Check the reference itself on a few rows against the host.
      const bool check_reference = i % 64 == 0;
      if (got[i] == want[i] && !check_reference) {
        ++agree;
        continue;
      }
      FS_ASSERT_CUDA(cudaMemcpy(row.data(), logits.get() + i * kVocab,
                                sizeof(float) * kVocab,
                                cudaMemcpyDeviceToHost));
      if (check_reference) {
        ASSERT_EQ(ReferenceSample(row.data(), kVocab, 0, inv_t[r], seeds[r],
                                  steps[r], 0)
                      .token_id,
                  want[i])
            << "reference kernel disagrees with the host on row " << r;
      }
      if (got[i] == want[i]) {
        ++agree;
        continue;
      }
      auto score = [&](int32_t token) {
        return inv_t[r] == 0.0f
                   ? row[token]
                   : GumbelScore(row[token], inv_t[r],
                                 GumbelNoise(seeds[r], steps[r], 0, token));
      };
      ASSERT_GE(got[i], 0);
      ASSERT_LT(got[i], kVocab);
      const float s_got = score(got[i]);
      const float s_want = score(want[i]);
      const float scale = std::max({std::fabs(s_got), std::fabs(s_want), 1.0f});
      EXPECT_LE(std::fabs(s_got - s_want), 1e-4f * scale)
          << "row " << r << ": fused token " << got[i] << " (" << s_got
          << ") vs reference " << want[i] << " (" << s_want
          << ") is not a near-tie";
      ++near_ties;
    }
  }
  cublasDestroy(cublas);
  EXPECT_GE(agree, kRows - kRows / 1000)
      << near_ties << " near-tie disagreements out of " << kRows;
}

// The CUDA backend samples every controlled row from the logits the fused
// kernel writes (FusedSampleParams::logits_out), so they must be the model's
// logits at its real shapes and batch tiles, not only at the tests' small
// ones: each equals cuBLAS's fp32 dot product to the accumulation order.
struct LogitsCase {
  int64_t vocab;
  int hidden;
  int batch;
};

class FusedLogitsOutTest : public FusedSamplerGpuTest,
                           public ::testing::WithParamInterface<LogitsCase> {};

TEST_P(FusedLogitsOutTest, LogitsOutEqualsCublasAtModelShapes) {
  const LogitsCase c = GetParam();
  const int capacity = 256;
  const int64_t tiles = FusedSampleNumTiles(c.vocab);
  DeviceArray<uint16_t> weights(static_cast<size_t>(c.vocab) * c.hidden);
  DeviceArray<uint16_t> hidden(static_cast<size_t>(capacity) * c.hidden);
  DeviceArray<float> fused_logits(static_cast<size_t>(c.vocab) * c.batch);
  DeviceArray<float> cublas_logits(static_cast<size_t>(c.vocab) * c.batch);
  DeviceArray<Candidate> candidates(tiles * c.batch);
  DeviceArray<float> inv_t_device(c.batch);
  DeviceArray<uint64_t> seeds_device(c.batch);
  DeviceArray<uint64_t> steps_device(c.batch);
  ASSERT_TRUE(weights.ok() && hidden.ok() && fused_logits.ok() &&
              cublas_logits.ok() && candidates.ok());
  FS_ASSERT_CUDA(LaunchFillUniform(weights.get(), c.vocab * c.hidden,
                                   DType::kBf16, 31, 0.3f, nullptr));
  FS_ASSERT_CUDA(LaunchFillUniform(hidden.get(),
                                   static_cast<int64_t>(capacity) * c.hidden,
                                   DType::kBf16, 32, 0.3f, nullptr));
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(c.batch, 2, &inv_t, &seeds, &steps);
  FS_ASSERT_CUDA(inv_t_device.Upload(inv_t));
  FS_ASSERT_CUDA(seeds_device.Upload(seeds));
  FS_ASSERT_CUDA(steps_device.Upload(steps));
  cublasHandle_t cublas;
  ASSERT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
  FS_ASSERT_CUDA(CublasLogits(cublas, weights.get(), hidden.get(), DType::kBf16,
                              c.vocab, c.hidden, c.batch, cublas_logits.get(),
                              DType::kFp32, nullptr));
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  cublasDestroy(cublas);
  std::vector<float> want;
  FS_ASSERT_CUDA(cublas_logits.Download(&want, c.vocab * c.batch));
  // Both stage-2 layouts: candidates per tile (tensor parallel), and the
  // in-kernel stage 2 whose pruning floor lets tiles skip tokens that cannot
  // win (the one-GPU path): the logits are written either way.
  const size_t workspace_bytes =
      FusedSampleWorkspaceSize(c.batch, c.vocab, c.hidden);
  DeviceArray<unsigned char> workspace(workspace_bytes);
  DeviceArray<int32_t> tokens(c.batch);
  ASSERT_TRUE(workspace.ok() && tokens.ok());
  FS_ASSERT_CUDA(cudaMemset(workspace.get(), 0, workspace_bytes));
  for (const bool in_kernel : {false, true}) {
    SCOPED_TRACE(in_kernel ? "in-kernel stage 2" : "candidates");
    // NaN everywhere first: every logit must be written.
    FS_ASSERT_CUDA(cudaMemset(fused_logits.get(), 0xff,
                              sizeof(float) * c.vocab * c.batch));
    FusedSampleParams params;
    params.weights = weights.get();
    params.hidden = hidden.get();
    params.hidden_capacity_rows = capacity;
    params.vocab_rows = c.vocab;
    params.hidden_size = c.hidden;
    params.batch = c.batch;
    params.inv_temperature = inv_t_device.get();
    params.seeds = seeds_device.get();
    params.steps = steps_device.get();
    params.candidates = in_kernel ? nullptr : candidates.get();
    params.token_ids = in_kernel ? tokens.get() : nullptr;
    params.logits_out = fused_logits.get();
    FS_ASSERT_CUDA(
        LaunchFusedSample(params, workspace.get(), workspace_bytes, nullptr));
    FS_ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> got;
    FS_ASSERT_CUDA(fused_logits.Download(&got, c.vocab * c.batch));
    double max_error = 0;
    double sum_squares = 0;
    size_t first_bad = got.size();
    for (size_t i = 0; i < got.size(); ++i) {
      const double error = std::fabs(static_cast<double>(got[i]) - want[i]);
      if (!(error <= 1e-3) && first_bad == got.size()) first_bad = i;
      max_error = std::max(max_error, error);
      sum_squares += static_cast<double>(want[i]) * want[i];
    }
    ASSERT_EQ(first_bad, got.size())
        << "row " << first_bad / c.vocab << " token " << first_bad % c.vocab
        << ": fused " << got[first_bad] << " vs cuBLAS " << want[first_bad];
    // Not a constant row: the logits' spread is that of the inputs.
    EXPECT_GT(std::sqrt(sum_squares / got.size()), 0.5) << "logits near zero";
    EXPECT_LT(max_error, 1e-3);
  }
}

INSTANTIATE_TEST_SUITE_P(ModelShapes, FusedLogitsOutTest,
                         ::testing::Values(LogitsCase{151936, 4096, 1},
                                           LogitsCase{151936, 4096, 8},
                                           LogitsCase{151936, 4096, 136},
                                           LogitsCase{151936, 4096, 256},
                                           LogitsCase{128256, 8192, 1},
                                           LogitsCase{128256, 8192, 8},
                                           LogitsCase{128256, 8192, 64},
                                           LogitsCase{128256, 8192, 136}),
                         [](const ::testing::TestParamInfo<LogitsCase>& info) {
                           return "V" + std::to_string(info.param.vocab) +
                                  "_D" + std::to_string(info.param.hidden) +
                                  "_B" + std::to_string(info.param.batch);
                         });

using stats::ChiSquaredPValue;

struct ChiCase {
  int64_t vocab;
  int batch;
};

class FusedSamplerChiSquaredTest
    : public FusedSamplerGpuTest,
      public ::testing::WithParamInterface<ChiCase> {};

TEST_P(FusedSamplerChiSquaredTest, SamplesFollowTheExactSoftmax) {
  const int64_t vocab = GetParam().vocab;
  const int batch = GetParam().batch;
  constexpr int kHidden = 64;
  constexpr int kSamples = 32;
  constexpr float kInvTemperature = 0.25f;  // exact: x = l / 4 exactly
  std::mt19937_64 rng(static_cast<uint64_t>(vocab) * 131 + batch);
  const std::vector<float> weights = SmallIntegers(vocab * kHidden, 3, rng);
  const std::vector<float> one_row = SmallIntegers(kHidden, 1, rng);
  // Every row of the batch holds the same hidden state (one distribution)
  // with its own seed; the step changes per launch.
  const int64_t total = std::max<int64_t>(50000, 30 * vocab);
  const int64_t per_launch = static_cast<int64_t>(batch) * kSamples;
  const int launches = static_cast<int>((total + per_launch - 1) / per_launch);
  std::vector<float> hidden;
  for (int b = 0; b < batch; ++b) {
    hidden.insert(hidden.end(), one_row.begin(), one_row.end());
  }
  std::vector<float> inv_t(batch, kInvTemperature);
  std::vector<uint64_t> seeds(batch);
  for (int b = 0; b < batch; ++b) seeds[b] = 1000003ull * (b + 1);
  Problem problem;
  ASSERT_TRUE(Upload(weights, hidden, vocab, kHidden, DType::kBf16, inv_t,
                     seeds, std::vector<uint64_t>(batch, 0), &problem));
  const int64_t tiles = FusedSampleNumTiles(vocab);
  DeviceArray<Candidate> candidates(tiles * per_launch);
  DeviceArray<int32_t> tokens(static_cast<size_t>(launches) * per_launch);
  std::vector<uint64_t> all_steps(static_cast<size_t>(launches) * batch);
  for (size_t i = 0; i < all_steps.size(); ++i) all_steps[i] = i / batch;
  DeviceArray<uint64_t> steps(all_steps.size());
  ASSERT_TRUE(candidates.ok() && tokens.ok() && steps.ok());
  FS_ASSERT_CUDA(steps.Upload(all_steps));
  for (int launch = 0; launch < launches; ++launch) {
    FusedSampleParams params = LaunchParams(problem, 0, batch);
    params.num_samples = kSamples;
    params.steps = steps.get() + static_cast<size_t>(launch) * batch;
    params.candidates = candidates.get();
    FS_ASSERT_CUDA(LaunchFusedSample(params, nullptr, 0, nullptr));
    FS_ASSERT_CUDA(LaunchReduceCandidates(
        candidates.get(), tiles, kSamples, batch,
        tokens.get() + static_cast<size_t>(launch) * per_launch, nullptr,
        nullptr));
  }
  std::vector<int32_t> samples;
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  FS_ASSERT_CUDA(tokens.Download(&samples, tokens.count()));

  // Exact distribution: logits are small integers (exact), x = l / 4.
  std::vector<double> x(vocab);
  double x_max = -1e300;
  for (int64_t i = 0; i < vocab; ++i) {
    double logit = 0;
    for (int d = 0; d < kHidden; ++d) {
      logit += static_cast<double>(weights[i * kHidden + d]) * one_row[d];
    }
    x[i] = logit * kInvTemperature;
    x_max = std::max(x_max, x[i]);
  }
  double mass = 0;
  for (double& v : x) mass += (v = std::exp(v - x_max));
  std::vector<int64_t> counts(vocab, 0);
  for (int32_t token : samples) {
    ASSERT_GE(token, 0);
    ASSERT_LT(token, vocab);
    ++counts[token];
  }
  const double n = static_cast<double>(samples.size());
  // Bins of expected count >= 5: tokens sorted by probability, merged
  // greedily; a short last bin joins the one before it.
  std::vector<int64_t> order(vocab);
  for (int64_t i = 0; i < vocab; ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return x[a] > x[b]; });
  std::vector<double> bin_expected;
  std::vector<double> bin_observed;
  double e = 0;
  double o = 0;
  for (int64_t i : order) {
    e += n * x[i] / mass;
    o += static_cast<double>(counts[i]);
    if (e >= 5.0) {
      bin_expected.push_back(e);
      bin_observed.push_back(o);
      e = o = 0;
    }
  }
  if (e > 0 || o > 0) {
    ASSERT_FALSE(bin_expected.empty());
    bin_expected.back() += e;
    bin_observed.back() += o;
  }
  ASSERT_GE(bin_expected.size(), 2u);
  double statistic = 0;
  for (size_t b = 0; b < bin_expected.size(); ++b) {
    const double d = bin_observed[b] - bin_expected[b];
    statistic += d * d / bin_expected[b];
  }
  const int dof = static_cast<int>(bin_expected.size()) - 1;
  const double p = ChiSquaredPValue(statistic, dof);
  EXPECT_GT(p, 1e-4) << "chi2 = " << statistic << " with " << dof
                     << " degrees of freedom over " << n << " samples";
}

INSTANTIATE_TEST_SUITE_P(
    VocabAndBatch, FusedSamplerChiSquaredTest,
    ::testing::Values(ChiCase{127, 1}, ChiCase{127, 3}, ChiCase{127, 64},
                      ChiCase{128, 1}, ChiCase{128, 3}, ChiCase{128, 64},
                      ChiCase{129, 1}, ChiCase{129, 3}, ChiCase{129, 64},
                      ChiCase{1000, 1}, ChiCase{1000, 3}, ChiCase{1000, 64},
                      ChiCase{32768, 1}, ChiCase{32768, 3}, ChiCase{32768, 64}),
    [](const ::testing::TestParamInfo<ChiCase>& info) {
      return "V" + std::to_string(info.param.vocab) + "_B" +
             std::to_string(info.param.batch);
    });

// docs/design.md#invariance: a row's logits (bit for bit) and tokens are the
// same alone, in any batch of 2..256 at any position, and for every tile width
// of the path.
TEST_F(FusedSamplerGpuTest, BatchInvariance) {
  constexpr int64_t kVocab = 4096 + 77;
  constexpr int kHidden = 4096;  // the full K depth of real models
  constexpr int kRows = 256;
  constexpr int kSamples = 2;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> uniform(-0.35f, 0.35f);
  std::vector<float> weights(kVocab * kHidden);
  for (float& v : weights) v = uniform(rng);
  std::vector<float> hidden(static_cast<size_t>(kRows) * kHidden);
  for (float& v : hidden) v = uniform(rng);
  std::vector<float> inv_t;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
  MakeControls(kRows, 3, &inv_t, &seeds, &steps);

  for (FusedKernel path : AvailablePaths()) {
    SCOPED_TRACE(PathName(path));
    Problem problem;
    ASSERT_TRUE(Upload(weights, hidden, kVocab, kHidden, DType::kBf16, inv_t,
                       seeds, steps, &problem));
    // Each row alone.
    std::vector<int32_t> alone_tokens(kRows * kSamples);
    std::vector<float> alone_logits(static_cast<size_t>(kRows) * kVocab);
    for (int r = 0; r < kRows; ++r) {
      LaunchSpec spec = SpecFor(path);
      spec.first_row = r;
      spec.batch = 1;
      spec.num_samples = kSamples;
      spec.want_logits = true;
      LaunchOutput out;
      ASSERT_TRUE(Run(problem, spec, &out));
      std::copy(out.tokens.begin(), out.tokens.end(),
                alone_tokens.begin() + r * kSamples);
      std::copy(out.logits.begin(), out.logits.end(),
                alone_logits.begin() + static_cast<size_t>(r) * kVocab);
    }
    // Every batch size, rows rotated so that each lands at many positions;
    // then every tile width at a few sizes.
    struct Case {
      int batch;
      int block_n;
      int stage_k;
    };
    std::vector<Case> cases;
    for (int b = 2; b <= kRows; ++b) cases.push_back({b, 0, 0});
    for (const KernelConfig& config : ConfigsOf(path)) {
      for (int b : {1, 17, 100, 256}) {
        cases.push_back({b, config.block_n, config.stage_k});
      }
    }
    for (const Case& c : cases) {
      const int rotation = (c.batch * 37 + c.block_n + c.stage_k) % kRows;
      std::vector<float> rotated_hidden(hidden.size());
      std::vector<float> rotated_inv_t(kRows);
      std::vector<uint64_t> rotated_seeds(kRows);
      std::vector<uint64_t> rotated_steps(kRows);
      std::vector<int> source(kRows);
      for (int i = 0; i < kRows; ++i) {
        const int r = (i + rotation) % kRows;
        source[i] = r;
        std::copy(hidden.begin() + static_cast<size_t>(r) * kHidden,
                  hidden.begin() + static_cast<size_t>(r + 1) * kHidden,
                  rotated_hidden.begin() + static_cast<size_t>(i) * kHidden);
        rotated_inv_t[i] = inv_t[r];
        rotated_seeds[i] = seeds[r];
        rotated_steps[i] = steps[r];
      }
      Problem rotated;
      ASSERT_TRUE(Upload(weights, rotated_hidden, kVocab, kHidden, DType::kBf16,
                         rotated_inv_t, rotated_seeds, rotated_steps, &rotated,
                         problem.weights));
      for (int first = 0; first < kRows; first += c.batch) {
        LaunchSpec spec = SpecFor(path, c.block_n, c.stage_k);
        spec.first_row = first;
        spec.batch = std::min(c.batch, kRows - first);
        spec.num_samples = kSamples;
        spec.want_logits = true;
        LaunchOutput out;
        ASSERT_TRUE(Run(rotated, spec, &out));
        for (int j = 0; j < spec.batch; ++j) {
          const int r = source[first + j];
          ASSERT_EQ(std::memcmp(&out.logits[static_cast<size_t>(j) * kVocab],
                                &alone_logits[static_cast<size_t>(r) * kVocab],
                                sizeof(float) * kVocab),
                    0)
              << "logits of row " << r << " at position " << j
              << " of a batch of " << spec.batch << " (block_n " << c.block_n
              << ", stage_k " << c.stage_k << ") differ from the row alone";
          for (int s = 0; s < kSamples; ++s) {
            ASSERT_EQ(out.tokens[j * kSamples + s],
                      alone_tokens[r * kSamples + s])
                << "row " << r << " sample " << s << " batch " << spec.batch;
          }
        }
      }
    }
  }
}

TEST_F(FusedSamplerGpuTest, ReduceCandidatesPicksBestScoreThenLowestId) {
  std::mt19937_64 rng(9);
  for (int64_t tiles : {1, 5, 2000}) {
    for (int samples : {1, 3}) {
      for (int batch : {1, 2, 7, 256}) {
        const int64_t pairs = static_cast<int64_t>(samples) * batch;
        std::vector<Candidate> host(tiles * pairs);
        // Scores from a tiny set: many exact ties across tiles.
        std::uniform_int_distribution<int> score(0, 3);
        std::uniform_int_distribution<int> id(0, 1 << 20);
        for (Candidate& c : host) {
          c = score(rng) == 0
                  ? Candidate{-__builtin_inff(), kNoToken}
                  : Candidate{static_cast<float>(score(rng)), id(rng)};
        }
        DeviceArray<Candidate> candidates(host.size());
        DeviceArray<int32_t> tokens(pairs);
        DeviceArray<float> scores(pairs);
        FS_ASSERT_CUDA(candidates.Upload(host));
        FS_ASSERT_CUDA(LaunchReduceCandidates(candidates.get(), tiles, samples,
                                              batch, tokens.get(), scores.get(),
                                              nullptr));
        std::vector<int32_t> got;
        std::vector<float> got_scores;
        FS_ASSERT_CUDA(tokens.Download(&got, pairs));
        FS_ASSERT_CUDA(scores.Download(&got_scores, pairs));
        for (int s = 0; s < samples; ++s) {
          for (int b = 0; b < batch; ++b) {
            Candidate best{-__builtin_inff(), kNoToken};
            for (int64_t t = 0; t < tiles; ++t) {
              const Candidate& c = host[(t * samples + s) * batch + b];
              if (CandidateBetter(c.score, c.token_id, best.score,
                                  best.token_id)) {
                best = c;
              }
            }
            ASSERT_EQ(got[b * samples + s], best.token_id)
                << "tiles " << tiles << " sample " << s << " row " << b;
            ASSERT_EQ(got_scores[b * samples + s], best.score);
          }
        }
      }
    }
  }
}

TEST_F(FusedSamplerGpuTest, RefusesUnsupportedShapes) {
  DeviceArray<uint16_t> weights(1024 * 128);
  DeviceArray<uint16_t> hidden(300 * 128);
  DeviceArray<float> inv_t(300);
  DeviceArray<uint64_t> seeds(300);
  DeviceArray<Candidate> candidates(8 * 300);
  FusedSampleParams params;
  params.weights = weights.get();
  params.hidden = hidden.get();
  params.vocab_rows = 1024;
  params.hidden_size = 128;
  params.batch = 4;
  params.inv_temperature = inv_t.get();
  params.seeds = seeds.get();
  params.steps = seeds.get();
  params.candidates = candidates.get();
  FusedSampleParams bad = params;
  bad.hidden_size = 100;
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.batch = kMaxFusedBatch + 1;
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.batch = 0;
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.hidden_capacity_rows = params.batch - 1;  // fewer rows than the batch
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.dtype = DType::kFp32;  // the tensor cores take bf16 and fp16 only
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.hidden = hidden.get() + 1;  // misaligned
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
  bad = params;
  bad.tuning.kernel = FusedKernel::kMmaSync;
  bad.tuning.block_n = 256;  // no such mma.sync configuration
  EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr), cudaErrorNotSupported);
  if (FusedSampleResolveKernel(FusedKernel::kAuto) != FusedKernel::kWgmma) {
    bad = params;
    bad.tuning.kernel = FusedKernel::kWgmma;
    EXPECT_EQ(LaunchFusedSample(bad, nullptr, 0, nullptr),
              cudaErrorNotSupported);
  }
  EXPECT_EQ(LaunchFusedSample(params, nullptr, 0, nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace flashsampler
