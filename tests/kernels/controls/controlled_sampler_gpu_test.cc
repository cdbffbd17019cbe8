// The controlled sampler kernel against the CPU reference sampler on exact
// small-integer logits: identical tokens and top-N ids, logprobs within
// 1e-5, for every control alone and combined, at V in {127, 129, 1000,
// 32768, 151936}. Skips loudly without a GPU.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_sampler.h"
#include "tests/kernels/controls/controlled_emulation.h"
#include "tests/kernels/controls/controlled_test_util.h"
#include "tests/testing/gpu_test_util.h"

namespace flashsampler {
namespace {

using testing_gpu::DeviceArray;

struct GpuRows {
  std::vector<int32_t> status, error_token, token_ids, top_ids, top_count,
      certified, ranks;
  std::vector<float> sampled, lse, top_logprobs;
  int max_samples = 1;
  int max_top_n = 0;
};

// Uploads logits and the plan, runs the kernel, downloads every output.
void RunGpu(const ControlledPlan& plan, const std::vector<float>& logits,
            int64_t vocab, GpuRows* out) {
  const int rows = plan.rows();
  const std::vector<unsigned char> bytes = plan.bytes();
  DeviceArray<unsigned char> d_bytes(bytes.size());
  DeviceArray<float> d_logits(logits.size());
  ASSERT_TRUE(d_bytes.ok() && d_logits.ok());
  FS_ASSERT_CUDA(d_bytes.Upload(bytes));
  FS_ASSERT_CUDA(d_logits.Upload(logits));
  PendingMerges merges;
  plan.BindPendingMerges(d_bytes.get(), &merges);
  FS_ASSERT_CUDA(LaunchMergePendingEntries(merges, nullptr));
  ControlledSampleParams params;
  plan.BindInputs(d_bytes.get(), vocab, &params);
  params.logits = d_logits.get();
  params.logits_row_stride = vocab;
  const int ms = params.max_samples;
  const int mt = std::max(1, params.max_top_n);
  DeviceArray<int32_t> d_tokens(rows * ms), d_status(rows), d_error(rows),
      d_top_ids(rows * mt), d_top_count(rows), d_certified(rows),
      d_ranks(rows * ms);
  DeviceArray<float> d_sampled(rows * ms), d_lse(rows), d_top_lp(rows * mt);
  params.token_ids = d_tokens.get();
  params.status = d_status.get();
  params.error_token = d_error.get();
  params.sampled_logprobs = d_sampled.get();
  params.sampled_ranks = d_ranks.get();
  params.logsumexp = d_lse.get();
  params.top_token_ids = d_top_ids.get();
  params.top_logprobs = d_top_lp.get();
  params.top_count = d_top_count.get();
  params.certified = d_certified.get();
  const size_t ws_bytes = ControlledSampleWorkspaceSize(rows, vocab);
  DeviceArray<unsigned char> workspace(ws_bytes);
  ASSERT_TRUE(workspace.ok());
  FS_ASSERT_CUDA(
      LaunchControlledSample(params, workspace.get(), ws_bytes, nullptr));
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  out->max_samples = ms;
  out->max_top_n = params.max_top_n;
  FS_ASSERT_CUDA(d_status.Download(&out->status, rows));
  FS_ASSERT_CUDA(d_error.Download(&out->error_token, rows));
  FS_ASSERT_CUDA(d_tokens.Download(&out->token_ids, rows * ms));
  FS_ASSERT_CUDA(d_sampled.Download(&out->sampled, rows * ms));
  FS_ASSERT_CUDA(d_ranks.Download(&out->ranks, rows * ms));
  FS_ASSERT_CUDA(d_lse.Download(&out->lse, rows));
  FS_ASSERT_CUDA(d_top_ids.Download(&out->top_ids, rows * mt));
  FS_ASSERT_CUDA(d_top_lp.Download(&out->top_logprobs, rows * mt));
  FS_ASSERT_CUDA(d_top_count.Download(&out->top_count, rows));
  FS_ASSERT_CUDA(d_certified.Download(&out->certified, rows));
}

// Runs `cases` on the GPU and compares every row with the CPU sampler, with
// the rows' entries merged on the host and again on the device (where a row
// has any); `certified` (if not null) receives each case's count of rows the
// candidate path sampled.
void CasesEqualCpu(int64_t vocab, int rows_per_case,
                   const std::vector<testing_controls::Case>& cases,
                   std::vector<int>* certified) {
  constexpr int kHidden = 32;
  testing_controls::Model model =
      testing_controls::MakeModel(vocab, kHidden, 11);
  ASSERT_NE(model.sampler, nullptr);
  for (const testing_controls::Case& c : cases) {
    testing_controls::CaseBatch batch;
    testing_controls::PrepareCase(model, c, rows_per_case, &batch);
    if (::testing::Test::HasFatalFailure()) return;
    const int rows = batch.rows;
    const std::vector<RowSpec>& specs = batch.specs;
    const std::vector<float>& logits = batch.logits;
    const std::vector<RowResult>& cpu = batch.cpu;
    const ControlledPlan pending = testing_controls::PendingPlanOf(specs);
    const ControlledPlan& merged_on_host = batch.plan;
    for (const ControlledPlan* plan : {&merged_on_host, &pending}) {
      const bool merged_on_device = plan == &pending;
      if (merged_on_device && plan->pending_merges().empty()) continue;
      GpuRows gpu;
      RunGpu(*plan, logits, vocab, &gpu);
      if (::testing::Test::HasFatalFailure()) return;
      int rows_certified = 0;
      for (int r = 0; r < rows; ++r) rows_certified += gpu.certified[r] == 1;
      std::printf("[%s V=%lld%s] %d of %d rows certified from candidates\n",
                  c.name.c_str(), static_cast<long long>(vocab),
                  merged_on_device ? ", merged on the device" : "",
                  rows_certified, rows);
      if (certified != nullptr && !merged_on_device) {
        certified->push_back(rows_certified);
      }
      for (int r = 0; r < rows; ++r) {
        const SamplingParams& p = *specs[r].params;
        const int ms = gpu.max_samples;
        const int mt = std::max(1, gpu.max_top_n);
        const int n = p.n;
        std::vector<int32_t> tokens(gpu.token_ids.begin() + r * ms,
                                    gpu.token_ids.begin() + r * ms + n);
        std::vector<float> sampled;
        if (p.logprobs.sampled) {
          sampled.assign(gpu.sampled.begin() + r * ms,
                         gpu.sampled.begin() + r * ms + n);
        }
        std::vector<int32_t> ranks;
        if (p.logprobs.rank) {
          ranks.assign(gpu.ranks.begin() + r * ms,
                       gpu.ranks.begin() + r * ms + n);
        }
        const int listed = gpu.top_count[r];
        std::vector<int32_t> top_ids(gpu.top_ids.begin() + r * mt,
                                     gpu.top_ids.begin() + r * mt + listed);
        std::vector<float> top_lp(gpu.top_logprobs.begin() + r * mt,
                                  gpu.top_logprobs.begin() + r * mt + listed);
        const std::string where =
            c.name + " V=" + std::to_string(vocab) + " row " +
            std::to_string(r) +
            (merged_on_device ? " (merged on the device)" : "");
        testing_controls::ExpectRowEqual(cpu[r], gpu.status[r], tokens, sampled,
                                         ranks, gpu.lse[r], top_ids, top_lp, p,
                                         where);
        if (gpu.status[r] != kControlledOk) {
          EXPECT_EQ(tokens, std::vector<int32_t>(n, -1)) << where;
          EXPECT_EQ(listed, 0) << where;
          EXPECT_EQ(gpu.certified[r], 0) << where;
        }
      }
    }
  }
}

void GpuEqualsCpu(int64_t vocab, int rows_per_case) {
  FS_SKIP_WITHOUT_GPU();
  CasesEqualCpu(vocab, rows_per_case, testing_controls::Cases(vocab), nullptr);
}

TEST(ControlledSamplerGpuTest, EqualsTheCpuSamplerV127) {
  GpuEqualsCpu(127, 6);
}
TEST(ControlledSamplerGpuTest, EqualsTheCpuSamplerV129) {
  GpuEqualsCpu(129, 6);
}
TEST(ControlledSamplerGpuTest, EqualsTheCpuSamplerV1000) {
  GpuEqualsCpu(1000, 8);
}
TEST(ControlledSamplerGpuTest, EqualsTheCpuSamplerV32768) {
  GpuEqualsCpu(32768, 4);
}
TEST(ControlledSamplerGpuTest, EqualsTheCpuSamplerV151936) {
  GpuEqualsCpu(151936, 2);
}

// Rows with fewer outputs than the controls ask for fail alone.
// The candidate path decides the common rows and hands the rest to the full
// passes on purpose: a flat row's nucleus at top_p 0.99 and a top_k far
// beyond the chunks' candidates cannot be certified; both paths equal the
// CPU sampler.
TEST(ControlledSamplerGpuTest, CandidatePathCertifiesPeakedRowsOnly) {
  FS_SKIP_WITHOUT_GPU();
  constexpr int64_t kVocab = 151936;
  auto with = [](auto edit) {
    SamplingParams p;
    edit(p);
    return p;
  };
  const SamplingParams common = with([](SamplingParams& p) {
    p.temperature = 0.8f;
    p.top_k = 50;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
  });
  const SamplingParams top_p_099 =
      with([](SamplingParams& p) { p.top_p = 0.99f; });
  const SamplingParams top_k_large =
      with([](SamplingParams& p) { p.top_k = 20000; });
  const SamplingParams greedy_logprobs = with([](SamplingParams& p) {
    p.temperature = 0.0f;
    p.logprobs = testing_controls::AllLogprobs(5, true);
  });
  const std::vector<testing_controls::Case> cases = {
      {"common", {common}, {}},
      {"greedy_raw_logprobs", {greedy_logprobs}, {}},
      {"flat_top_p_099", {top_p_099}, {0, 1, 2, 3, 4, 5, 6, 7}},
      {"top_k_20000", {top_k_large}, {}},
  };
  std::vector<int> certified;
  CasesEqualCpu(kVocab, 8, cases, &certified);
  if (::testing::Test::HasFatalFailure()) return;
  ASSERT_EQ(certified.size(), cases.size());
  EXPECT_EQ(certified[0], 8);
  EXPECT_EQ(certified[1], 8);
  EXPECT_EQ(certified[2], 0);
  EXPECT_EQ(certified[3], 0);
}

TEST(ControlledSamplerGpuTest, RowAskingBeyondTheOutputsFailsAlone) {
  FS_SKIP_WITHOUT_GPU();
  constexpr int64_t kVocab = 300;
  std::vector<float> logits(2 * kVocab);
  for (size_t i = 0; i < logits.size(); ++i)
    logits[i] = static_cast<float>(static_cast<int>(i % 17) - 8);
  ControlledPlan plan;
  ControlledRowInput in;
  in.n = 2;
  plan.AddRow(in);
  in.n = 3;
  plan.AddRow(in);
  const std::vector<unsigned char> bytes = plan.bytes();
  DeviceArray<unsigned char> d_bytes(bytes.size());
  DeviceArray<float> d_logits(logits.size());
  FS_ASSERT_CUDA(d_bytes.Upload(bytes));
  FS_ASSERT_CUDA(d_logits.Upload(logits));
  PendingMerges merges;
  plan.BindPendingMerges(d_bytes.get(), &merges);
  FS_ASSERT_CUDA(LaunchMergePendingEntries(merges, nullptr));
  ControlledSampleParams params;
  plan.BindInputs(d_bytes.get(), kVocab, &params);
  params.max_samples = 2;  // row 1 asks for 3
  params.logits = d_logits.get();
  params.logits_row_stride = kVocab;
  DeviceArray<int32_t> tokens(4), status(2), error(2);
  params.token_ids = tokens.get();
  params.status = status.get();
  params.error_token = error.get();
  const size_t ws = ControlledSampleWorkspaceSize(2, kVocab);
  DeviceArray<unsigned char> workspace(ws);
  FS_ASSERT_CUDA(LaunchControlledSample(params, workspace.get(), ws, nullptr));
  EXPECT_EQ(LaunchControlledSample(params, workspace.get(), ws - 1, nullptr),
            cudaErrorInvalidValue);
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> host_status, host_tokens;
  FS_ASSERT_CUDA(status.Download(&host_status, 2));
  FS_ASSERT_CUDA(tokens.Download(&host_tokens, 4));
  EXPECT_EQ(host_status[0], kControlledOk);
  EXPECT_EQ(host_status[1], kControlledBadControls);
  EXPECT_EQ(host_tokens[2], -1);
  EXPECT_EQ(host_tokens[3], -1);
}

// A non-finite raw logit fails its row with the lowest such id.
TEST(ControlledSamplerGpuTest, NonFiniteLogitFailsItsRowWithTheLowestId) {
  FS_SKIP_WITHOUT_GPU();
  constexpr int64_t kVocab = 1000;
  std::vector<float> logits(2 * kVocab, 1.0f);
  logits[kVocab + 700] = std::nanf("");
  logits[kVocab + 300] = controls::kPosInf;
  ControlledPlan plan;
  plan.AddRow(ControlledRowInput{});
  plan.AddRow(ControlledRowInput{});
  const std::vector<unsigned char> bytes = plan.bytes();
  DeviceArray<unsigned char> d_bytes(bytes.size());
  DeviceArray<float> d_logits(logits.size());
  FS_ASSERT_CUDA(d_bytes.Upload(bytes));
  FS_ASSERT_CUDA(d_logits.Upload(logits));
  PendingMerges merges;
  plan.BindPendingMerges(d_bytes.get(), &merges);
  FS_ASSERT_CUDA(LaunchMergePendingEntries(merges, nullptr));
  ControlledSampleParams params;
  plan.BindInputs(d_bytes.get(), kVocab, &params);
  params.logits = d_logits.get();
  params.logits_row_stride = kVocab;
  DeviceArray<int32_t> tokens(2), status(2), error(2);
  params.token_ids = tokens.get();
  params.status = status.get();
  params.error_token = error.get();
  const size_t ws = ControlledSampleWorkspaceSize(2, kVocab);
  DeviceArray<unsigned char> workspace(ws);
  FS_ASSERT_CUDA(LaunchControlledSample(params, workspace.get(), ws, nullptr));
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<int32_t> host_status, host_error;
  FS_ASSERT_CUDA(status.Download(&host_status, 2));
  FS_ASSERT_CUDA(error.Download(&host_error, 2));
  EXPECT_EQ(host_status[0], kControlledOk);
  EXPECT_EQ(host_status[1], kControlledNonFinite);
  EXPECT_EQ(host_error[1], 300);
}

// The device's merge of pending rows (LaunchMergePendingEntries) writes
// each row's entries as the host's merge does, bit for bit: rows with
// repeats within and across their lists, ids up to the largest it merges,
// a row of kPendingMaxKeys keys at the top ids, rows repeating the row
// before, rows without keys or without a repetition penalty, a row whose
// 2000 keys are one id, and rows of more keys than it takes (merged on the
// host) between them.
TEST(ControlledSamplerGpuTest, PendingRowsMergeOnTheDeviceAsOnTheHost) {
  FS_SKIP_WITHOUT_GPU();
  constexpr int kRows = 96;
  constexpr int64_t kVocab = kPendingMaxVocab;
  struct Lists {
    std::vector<int32_t> bias_ids, banned, prompt, output_ids, output_counts;
    std::vector<float> bias_values;
  };
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> value(-3.0f, 3.0f);
  std::vector<Lists> lists(kRows);
  std::vector<ControlledRowInput> inputs(kRows);
  std::vector<ControlledPlan::RowToAdd> rows(kRows);
  for (int r = 0; r < kRows; ++r) {
    ControlledPlan::RowToAdd& row = rows[r];
    row.seed = static_cast<uint64_t>(r);
    if (r % 7 == 3) continue;  // the row before's params again
    Lists& l = lists[r];
    int32_t low = 0;
    int32_t high = 151936;
    int size = static_cast<int>(rng() % 300);
    if (r % 11 == 5) size = 0;
    if (r % 5 == 2) high = 97;  // many repeats
    if (r % 13 == 4) {          // the top ids
      low = static_cast<int32_t>(kVocab) - 64;
      high = static_cast<int32_t>(kVocab);
    }
    if (r == 1) {  // kPendingMaxKeys keys at the top ids
      low = static_cast<int32_t>(kVocab) - 200;
      high = static_cast<int32_t>(kVocab);
      size = kPendingMaxKeys / 4;
    }
    if (r == 9) size = kPendingMaxKeys / 4 + 2;  // more: the host's
    if (r == 20) {  // 2000 keys of one id, 500 biases summed in list order
      low = 42;
      high = 43;
      size = 500;
    }
    std::uniform_int_distribution<int32_t> id(low, high - 1);
    for (int i = 0; i < size; ++i) {
      l.bias_ids.push_back(id(rng));
      l.bias_values.push_back(value(rng));
      l.banned.push_back(id(rng));
      l.prompt.push_back(id(rng));
      l.output_ids.push_back(id(rng));
      // Count 0 leaves no entry but where r == 1, which needs every key.
      l.output_counts.push_back(r == 1 ? 1 : static_cast<int32_t>(rng() % 4));
    }
    ControlledRowInput& in = inputs[r];
    in =
        testing_controls::InputOfLists(l.bias_ids, l.bias_values, l.banned,
                                       l.prompt, l.output_ids, l.output_counts);
    in.repetition_penalty = r % 3 == 0 ? 1.0f : 1.3f;
    if (r == 1 || r == 9) in.repetition_penalty = 1.3f;
    row.in = &in;
  }
  ControlledPlan host;
  host.AddRows(rows, testing_controls::InOrder{});
  ControlledPlan device;
  device.AddRows(rows, testing_controls::InOrder{}, kPendingMaxKeys);
  ASSERT_EQ(host.rows(), kRows);
  ASSERT_EQ(device.rows(), kRows);
  ASSERT_GT(device.pending_merges().size(), 40u);
  bool full_row_pending = false;
  for (const PendingMergeRow& m : device.pending_merges()) {
    full_row_pending |= m.first_row == 1 && m.key_count == kPendingMaxKeys;
    EXPECT_NE(m.first_row, 9);
  }
  EXPECT_TRUE(full_row_pending);

  const std::vector<unsigned char> bytes = device.bytes();
  DeviceArray<unsigned char> d_bytes(bytes.size());
  ASSERT_TRUE(d_bytes.ok());
  FS_ASSERT_CUDA(d_bytes.Upload(bytes));
  PendingMerges merges;
  device.BindPendingMerges(d_bytes.get(), &merges);
  FS_ASSERT_CUDA(LaunchMergePendingEntries(merges, nullptr));
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> merged;
  FS_ASSERT_CUDA(d_bytes.Download(&merged, bytes.size()));
  ControlledSampleParams got;
  device.BindInputs(merged.data(), kVocab, &got);

  for (int r = 0; r < kRows; ++r) {
    const ControlledRow& want = host.row_controls()[r];
    const ControlledRow& row = got.row_controls[r];
    ASSERT_EQ(row.special_end - row.special_begin,
              want.special_end - want.special_begin)
        << "row " << r;
    for (int64_t k = 0; k < want.special_end - want.special_begin; ++k) {
      const int64_t w = want.special_begin + k;
      const int64_t g = row.special_begin + k;
      EXPECT_EQ(got.special_ids[g], host.special_ids()[w]) << "row " << r;
      EXPECT_EQ(got.special_flags[g], host.special_flags()[w]) << "row " << r;
      EXPECT_EQ(got.special_bias[g], host.special_bias()[w]) << "row " << r;
      EXPECT_EQ(got.special_count[g], host.special_count()[w]) << "row " << r;
    }
  }
}

// Top-p masses use CUDA's double exp where the CPU uses glibc's: count the
// values whose fixed-point mass differs (each by at most one unit in the
// 53rd bit, which moves a cut only when the cumulative mass lies within that
// of ceil(p * total)).
TEST(ControlledSamplerGpuTest, FixedMassAgreesWithTheHostWithinOneUlp) {
  FS_SKIP_WITHOUT_GPU();
  constexpr int64_t kCount = int64_t{1} << 20;
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<float> d(-60.0f, 0.0f);
  const float x_max = 1.5f;
  std::vector<float> x(kCount);
  for (float& v : x) v = x_max + d(rng);
  DeviceArray<float> d_x(kCount);
  DeviceArray<uint64_t> d_out(kCount);
  FS_ASSERT_CUDA(d_x.Upload(x));
  FS_ASSERT_CUDA(LaunchControlledFixedMassProbe(d_x.get(), kCount, x_max,
                                                d_out.get(), nullptr));
  FS_ASSERT_CUDA(cudaDeviceSynchronize());
  std::vector<uint64_t> gpu;
  FS_ASSERT_CUDA(d_out.Download(&gpu, kCount));
  int64_t differ = 0;
  for (int64_t i = 0; i < kCount; ++i) {
    const uint64_t host = controls::FixedMass(x[i], x_max);
    if (gpu[i] == host) continue;
    ++differ;
    // One ulp of a double in [2^-k, 2^-k+1) is 2^(-k-52); times 2^62.
    const double e = std::ldexp(static_cast<double>(host), -62);
    const double ulp_units =
        std::ldexp(1.0, std::ilogb(e) - 52 + 62);  // >= 1 unit when e is big
    const double diff = gpu[i] > host ? static_cast<double>(gpu[i] - host)
                                      : static_cast<double>(host - gpu[i]);
    EXPECT_LE(diff, std::max(1.0, ulp_units)) << "x " << x[i];
  }
  std::fprintf(stderr,
               "FixedMass: %lld of %lld device masses differ from "
               "the host's (by <= 1 ulp)\n",
               static_cast<long long>(differ), static_cast<long long>(kCount));
  // A disagreement rate above 1% would mean a different exp, not rounding.
  EXPECT_LT(differ, kCount / 100);
}

}  // namespace
}  // namespace flashsampler
