// Multi-GPU tests of tensor-parallel sampling (kernels/tp/tp_exchange.h,
// kernels/baselines/allgather_baseline.h): TP invariance (tokens at TP = 2, 4,
// 8 equal TP = 1 exactly, even and uneven shards, NCCL device API and CUDA
// peer), chi-squared at TP = 2 against the exact softmax, the all-gather
// baseline on exactly representable logits, and the fatal-error path (a barrier
// that times out or is aborted instead of hanging). Each test skips loudly when
// fewer than 2 GPUs are visible.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/baselines/allgather_baseline.h"
#include "kernels/sampler/fused_sampler.h"
#include "kernels/tp/tp_exchange.h"
#include "kernels/tp/tp_layout.h"
#include "tests/kernels/tp/tp_test_util.h"

namespace flashsampler {
namespace {

using tp_test::FloatToBf16;

int VisibleGpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// Empty when two GPUs with mutual peer access exist; else why not.
std::string WhyNoTwoGpus() {
  const int gpus = VisibleGpus();
  if (gpus < 2) return std::to_string(gpus) + " GPU(s) visible";
  int can01 = 0, can10 = 0;
  cudaDeviceCanAccessPeer(&can01, 0, 1);
  cudaDeviceCanAccessPeer(&can10, 1, 0);
  if (!can01 || !can10) return "GPUs 0 and 1 lack peer access";
  return "";
}

#define SKIP_WITHOUT_TWO_GPUS()                                                \
  do {                                                                         \
    const std::string why = WhyNoTwoGpus();                                    \
    if (!why.empty()) {                                                        \
      const std::string name =                                                 \
          ::testing::UnitTest::GetInstance()->current_test_info()->name();     \
      std::fprintf(stderr, "NEEDS 2 GPUs: skipping %s (%s)\n", name.c_str(),   \
                   why.c_str());                                               \
      GTEST_SKIP() << "NEEDS 2 GPUs: skipping " << name << " (" << why << ")"; \
    }                                                                          \
  } while (0)

#define ASSERT_CUDA(expr)                                    \
  do {                                                       \
    const cudaError_t assert_err_ = (expr);                  \
    ASSERT_EQ(assert_err_, cudaSuccess)                      \
        << #expr << ": " << cudaGetErrorString(assert_err_); \
  } while (0)

#define ASSERT_TP_OK(expr)                          \
  do {                                              \
    const TpStatus assert_status_ = (expr);         \
    ASSERT_TRUE(assert_status_.ok())                \
        << #expr << ": " << assert_status_.message; \
  } while (0)

// cudaMalloc'd memory on one device, freed with that device current.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) {
      int saved = 0;
      cudaGetDevice(&saved);
      cudaSetDevice(device_);
      cudaFree(ptr_);
      cudaSetDevice(saved);
    }
  }
  cudaError_t Allocate(int device, size_t bytes) {
    device_ = device;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return err;
    return cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes);
  }
  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  int device_ = 0;
  void* ptr_ = nullptr;
};

// W [V][D] as bf16 bits, on the host.
struct Problem {
  int64_t vocab = 0;
  int hidden = 0;
  std::vector<uint16_t> weights;
};

// One step's inputs.
struct Batch {
  int rows = 0;
  int num_samples = 1;
  std::vector<uint16_t> hidden;  // [rows][D] bf16 bits
  std::vector<float> inv_temperature;
  std::vector<uint64_t> seeds;
  std::vector<uint64_t> steps;
};

// Inputs and outputs of one rank (or of TP1) on one device.
struct RankBuffers {
  int device = 0;
  DeviceBuffer weights, hidden, inv_t, seeds, steps, tokens, workspace;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;

  ~RankBuffers() {
    if (stream != nullptr) {
      cudaSetDevice(device);
      cudaStreamDestroy(stream);
    }
  }
};

void AllocRank(const Problem& problem, int64_t offset, int64_t rows,
               int max_batch, int max_samples, int device, RankBuffers* rb) {
  const int D = problem.hidden;
  rb->device = device;
  ASSERT_CUDA(rb->weights.Allocate(device, sizeof(uint16_t) * rows * D));
  ASSERT_CUDA(cudaMemcpy(rb->weights.get<void>(),
                         problem.weights.data() + offset * D,
                         sizeof(uint16_t) * rows * D, cudaMemcpyHostToDevice));
  ASSERT_CUDA(rb->hidden.Allocate(device, sizeof(uint16_t) * max_batch * D));
  ASSERT_CUDA(rb->inv_t.Allocate(device, sizeof(float) * max_batch));
  ASSERT_CUDA(rb->seeds.Allocate(device, sizeof(uint64_t) * max_batch));
  ASSERT_CUDA(rb->steps.Allocate(device, sizeof(uint64_t) * max_batch));
  ASSERT_CUDA(
      rb->tokens.Allocate(device, sizeof(int32_t) * max_batch * max_samples));
  rb->workspace_bytes = FusedSampleWorkspaceSize(max_batch, rows, D);
  ASSERT_CUDA(rb->workspace.Allocate(device, rb->workspace_bytes));
  // Zeroed once; every launch leaves it zeroed (fused_sampler.h).
  ASSERT_CUDA(cudaMemset(rb->workspace.get<void>(), 0, rb->workspace_bytes));
  ASSERT_CUDA(cudaStreamCreateWithFlags(&rb->stream, cudaStreamNonBlocking));
}

void Upload(const Batch& batch, int hidden, RankBuffers* rb) {
  ASSERT_CUDA(cudaSetDevice(rb->device));
  ASSERT_CUDA(cudaMemcpy(rb->hidden.get<void>(), batch.hidden.data(),
                         sizeof(uint16_t) * batch.rows * hidden,
                         cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(rb->inv_t.get<void>(), batch.inv_temperature.data(),
                         sizeof(float) * batch.rows, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(rb->seeds.get<void>(), batch.seeds.data(),
                         sizeof(uint64_t) * batch.rows,
                         cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(rb->steps.get<void>(), batch.steps.data(),
                         sizeof(uint64_t) * batch.rows,
                         cudaMemcpyHostToDevice));
}

FusedSampleParams ParamsFor(const RankBuffers& rb, int64_t rows, int64_t offset,
                            int hidden, const Batch& batch) {
  FusedSampleParams p;
  p.weights = rb.weights.get<void>();
  p.hidden = rb.hidden.get<void>();
  p.dtype = DType::kBf16;
  p.vocab_rows = rows;
  p.vocab_offset = offset;
  p.hidden_size = hidden;
  p.batch = batch.rows;
  p.num_samples = batch.num_samples;
  p.inv_temperature = rb.inv_t.get<float>();
  p.seeds = rb.seeds.get<uint64_t>();
  p.steps = rb.steps.get<uint64_t>();
  return p;
}

void DownloadTokens(const RankBuffers& rb, const Batch& batch,
                    std::vector<int32_t>* tokens) {
  tokens->resize(static_cast<size_t>(batch.rows) * batch.num_samples);
  ASSERT_CUDA(cudaSetDevice(rb.device));
  ASSERT_CUDA(cudaMemcpy(tokens->data(), rb.tokens.get<void>(),
                         sizeof(int32_t) * tokens->size(),
                         cudaMemcpyDeviceToHost));
}

// TP = 1: the whole vocabulary on GPU 0, stage 1 + stage 2, no exchange.
class Tp1Runner {
 public:
  void Init(const Problem& problem, int max_samples) {
    problem_ = &problem;
    AllocRank(problem, 0, problem.vocab, kMaxFusedBatch, max_samples, 0, &rb_);
    ASSERT_CUDA(candidates_.Allocate(0, sizeof(Candidate) *
                                            FusedSampleNumTiles(problem.vocab) *
                                            kMaxFusedBatch * max_samples));
  }

  void Run(const Batch& batch, std::vector<int32_t>* tokens) {
    Upload(batch, problem_->hidden, &rb_);
    FusedSampleParams p =
        ParamsFor(rb_, problem_->vocab, 0, problem_->hidden, batch);
    p.candidates = candidates_.get<Candidate>();
    ASSERT_CUDA(cudaSetDevice(0));
    ASSERT_CUDA(LaunchFusedSample(p, rb_.workspace.get<void>(),
                                  rb_.workspace_bytes, rb_.stream));
    ASSERT_CUDA(LaunchReduceCandidates(
        candidates_.get<Candidate>(), FusedSampleNumTiles(problem_->vocab),
        batch.num_samples, batch.rows, rb_.tokens.get<int32_t>(), nullptr,
        rb_.stream));
    ASSERT_CUDA(cudaStreamSynchronize(rb_.stream));
    DownloadTokens(rb_, batch, tokens);
  }

 private:
  const Problem* problem_ = nullptr;
  RankBuffers rb_;
  DeviceBuffer candidates_;
};

// TP = ranks over `devices` (a device may repeat with the peer transport).
class TpRunner {
 public:
  void Init(const Problem& problem, const std::vector<int64_t>& parts,
            const std::vector<int>& devices, TpTransport transport,
            int max_samples, uint64_t barrier_timeout_ns = 5000000000ull) {
    problem_ = &problem;
    devices_ = devices;
    std::string error;
    ASSERT_TRUE(MakeTpLayout(problem.vocab, parts, FusedSampleTileRows(),
                             &layout_, &error))
        << error;
    ranks_.clear();
    for (int r = 0; r < layout_.num_ranks(); ++r) {
      ranks_.emplace_back(new RankBuffers());
      AllocRank(problem, layout_.shards[r].vocab_offset,
                layout_.shards[r].vocab_rows, kMaxFusedBatch, max_samples,
                devices[r], ranks_.back().get());
    }
    if (transport == TpTransport::kNcclDevice) {
      ASSERT_TP_OK(TpComms::Create(devices, &comms_));
    }
    TpExchangeOptions options;
    options.transport = transport;
    options.max_samples = max_samples;
    options.barrier_timeout_ns = barrier_timeout_ns;
    ASSERT_TP_OK(TpExchange::Create(devices, comms_.get(), layout_, options,
                                    &exchange_));
  }

  ~TpRunner() {
    for (auto& rb : ranks_) {
      cudaSetDevice(rb->device);
      cudaStreamSynchronize(rb->stream);
    }
    exchange_.reset();
    comms_.reset();
  }

  // The three ways TpExchange::Step can run a step.
  enum class Exchange {
    kShardWinners,    // workspaces: ranks prune and send only their winners
    kTilesWithFloor,  // workspaces, but every tile's (pruned) candidate
    kTilesNoFloor,    // no workspaces: every tile's exact candidate
  };

  void Run(const Batch& batch, std::vector<int32_t>* tokens,
           Exchange exchange = Exchange::kShardWinners) {
    const bool with_workspaces = exchange != Exchange::kTilesNoFloor;
    exchange_->set_send_shard_winners(exchange == Exchange::kShardWinners);
    const int n = layout_.num_ranks();
    std::vector<FusedSampleParams> params(n);
    std::vector<void*> workspaces(n);
    std::vector<size_t> workspace_bytes(n);
    std::vector<cudaStream_t> streams(n);
    for (int r = 0; r < n; ++r) {
      Upload(batch, problem_->hidden, ranks_[r].get());
      params[r] =
          ParamsFor(*ranks_[r], layout_.shards[r].vocab_rows,
                    layout_.shards[r].vocab_offset, problem_->hidden, batch);
      workspaces[r] =
          with_workspaces ? ranks_[r]->workspace.get<void>() : nullptr;
      workspace_bytes[r] = with_workspaces ? ranks_[r]->workspace_bytes : 0;
      streams[r] = ranks_[r]->stream;
    }
    ASSERT_CUDA(exchange_->Step(params, workspaces, workspace_bytes, streams,
                                ranks_[0]->tokens.get<int32_t>(), nullptr));
    // Winners go out whenever they can: with workspaces and few enough
    // samples for the in-kernel reduce.
    ASSERT_EQ(exchange_->last_step_sent_winners(),
              exchange == Exchange::kShardWinners &&
                  batch.num_samples <= kMaxFusedInKernelSamples);
    for (int r = 0; r < n; ++r) {
      ASSERT_CUDA(cudaSetDevice(ranks_[r]->device));
      ASSERT_CUDA(cudaStreamSynchronize(ranks_[r]->stream));
    }
    ASSERT_EQ(exchange_->status(), TpBarrierResult::kOk)
        << TpBarrierResultName(exchange_->status());
    DownloadTokens(*ranks_[0], batch, tokens);
  }

  const TpLayout& layout() const { return layout_; }
  TpExchange* exchange() { return exchange_.get(); }
  TpComms* comms() { return comms_.get(); }
  RankBuffers& rank(int r) { return *ranks_[r]; }

 private:
  const Problem* problem_ = nullptr;
  std::vector<int> devices_;
  TpLayout layout_;
  std::vector<std::unique_ptr<RankBuffers>> ranks_;
  std::unique_ptr<TpComms> comms_;
  std::unique_ptr<TpExchange> exchange_;
};

Problem RandomProblem(int64_t vocab, int hidden, uint64_t seed) {
  Problem p;
  p.vocab = vocab;
  p.hidden = hidden;
  p.weights.resize(static_cast<size_t>(vocab) * hidden);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-0.1f, 0.1f);
  for (uint16_t& w : p.weights) w = FloatToBf16(dist(rng));
  return p;
}

// A batch of random hidden states with mixed temperatures: every 8th row is
// greedy, the others cycle through 1.0, 0.7 and 1.3 (inverse computed in
// fp32, as the service does).
Batch RandomBatch(int rows, int num_samples, int hidden, std::mt19937_64* rng) {
  Batch b;
  b.rows = rows;
  b.num_samples = num_samples;
  b.hidden.resize(static_cast<size_t>(rows) * hidden);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (uint16_t& h : b.hidden) h = FloatToBf16(dist(*rng));
  const float temperatures[3] = {1.0f, 0.7f, 1.3f};
  for (int i = 0; i < rows; ++i) {
    b.inv_temperature.push_back(i % 8 == 7 ? 0.0f : 1.0f / temperatures[i % 3]);
    b.seeds.push_back((*rng)());
    b.steps.push_back((*rng)() % 100000);
  }
  return b;
}

// ------------------------------------------------------- TP invariance --

struct InvarianceCase {
  const char* name;
  int64_t vocab;
  int hidden;
  std::vector<int64_t> parts;  // ranks = parts.size(), rank r on GPU r % gpus
  TpTransport transport;
  int num_samples;
  int gpus = 2;  // GPUs the ranks spread over; the case needs that many
};

// gtest prints a parameter with PrintTo; the case name reads better than
// the struct's bytes.
void PrintTo(const InvarianceCase& c, std::ostream* os) { *os << c.name; }

class TpInvarianceTest : public ::testing::TestWithParam<InvarianceCase> {};

// Batch sizes cycle so that rows ride in batches of every size (rule 2:
// batch invariance comes along with TP invariance): 10,240+ rows in all.
constexpr int kBatchCycle[] = {256, 255, 64, 1, 200, 17, 256, 128};
constexpr int kInvarianceRows = 10240;

TEST_P(TpInvarianceTest, TokensEqualTp1Exactly) {
  const InvarianceCase& c = GetParam();
  if (c.gpus >= 2) {
    SKIP_WITHOUT_TWO_GPUS();
  } else if (VisibleGpus() < 1) {
    std::fprintf(stderr, "NO GPU: skipping %s\n", c.name);
    GTEST_SKIP() << "NO GPU: skipping " << c.name;
  }
  if (VisibleGpus() < c.gpus) {
    std::fprintf(stderr, "NEEDS %d GPUs: skipping %s (%d visible)\n", c.gpus,
                 c.name, VisibleGpus());
    GTEST_SKIP() << "NEEDS " << c.gpus << " GPUs: skipping " << c.name;
  }
  const Problem problem = RandomProblem(c.vocab, c.hidden, 0x7e57 + c.vocab);
  std::vector<int> devices;
  for (size_t r = 0; r < c.parts.size(); ++r) {
    devices.push_back(static_cast<int>(r % c.gpus));
  }
  Tp1Runner tp1;
  ASSERT_NO_FATAL_FAILURE(tp1.Init(problem, c.num_samples));
  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(
      tp.Init(problem, c.parts, devices, c.transport, c.num_samples));
  std::mt19937_64 rng(0xba7c4 + c.parts.size());
  int rows = 0;
  int64_t greedy_rows = 0;
  for (int step = 0; rows < kInvarianceRows; ++step) {
    const int batch_rows = kBatchCycle[step % 8];
    const Batch batch =
        RandomBatch(batch_rows, c.num_samples, problem.hidden, &rng);
    std::vector<int32_t> expected, got;
    ASSERT_NO_FATAL_FAILURE(tp1.Run(batch, &expected));
    // The steps cycle through the three exchanges, through the same two
    // slots: the ranks' winners, every tile's candidate pruned against the
    // rank's floor, every tile's exact candidate. Three against the eight
    // batch sizes: every size meets every exchange.
    constexpr TpRunner::Exchange kExchanges[] = {
        TpRunner::Exchange::kShardWinners, TpRunner::Exchange::kTilesWithFloor,
        TpRunner::Exchange::kTilesNoFloor};
    ASSERT_NO_FATAL_FAILURE(tp.Run(batch, &got, kExchanges[step % 3]));
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_GE(expected[i], 0);
      ASSERT_LT(expected[i], c.vocab);
      const int row = static_cast<int>(i) / c.num_samples;
      ASSERT_EQ(got[i], expected[i])
          << "step " << step << " row " << row << " sample "
          << i % c.num_samples << " (inv_t " << batch.inv_temperature[row]
          << ", token's rank at TP: " << tp.layout().RankOfToken(expected[i])
          << ")";
    }
    for (float inv_t : batch.inv_temperature) greedy_rows += inv_t == 0.0f;
    rows += batch_rows;
  }
  EXPECT_GE(rows, 10000);
  EXPECT_GT(greedy_rows, 1000);
}

INSTANTIATE_TEST_SUITE_P(
    Tp, TpInvarianceTest,
    ::testing::Values(
        InvarianceCase{"Llama3Halves_Nccl",
                       128256,
                       256,
                       {1, 1},
                       TpTransport::kNcclDevice,
                       1},
        InvarianceCase{"Llama3Split60_40_Nccl",
                       128256,
                       256,
                       {60, 40},
                       TpTransport::kNcclDevice,
                       1},
        InvarianceCase{"V1001Halves_TwoSamples_Nccl",
                       1001,
                       128,
                       {1, 1},
                       TpTransport::kNcclDevice,
                       2},
        InvarianceCase{"Llama3Halves_Peer",
                       128256,
                       256,
                       {1, 1},
                       TpTransport::kCudaPeer,
                       1},
        InvarianceCase{"V1001Split60_40_Peer",
                       1001,
                       128,
                       {60, 40},
                       TpTransport::kCudaPeer,
                       1},
        // 4 and 8 ranks on 2 GPUs (rank r on GPU r % 2) through the peer
        // transport: the 4- and 8-rank layouts and offsets on real kernels.
        // 2 and 4 ranks' shards on one GPU through the peer transport: the
        // same kernels, exchange and merge, where one GPU is all there is.
        InvarianceCase{"Tp2Split60_40_PeerOn1Gpu",
                       128256,
                       256,
                       {60, 40},
                       TpTransport::kCudaPeer,
                       1,
                       1},
        InvarianceCase{"Tp4Uneven_TwoSamples_PeerOn1Gpu",
                       151936,
                       128,
                       {2, 1, 1, 1},
                       TpTransport::kCudaPeer,
                       2,
                       1},
        InvarianceCase{"Tp4Uneven_PeerOn2Gpus",
                       128256,
                       256,
                       {2, 1, 1, 1},
                       TpTransport::kCudaPeer,
                       1},
        InvarianceCase{"Tp8Even_PeerOn2Gpus",
                       151936,
                       128,
                       {1, 1, 1, 1, 1, 1, 1, 1},
                       TpTransport::kCudaPeer,
                       1},
        // One rank per GPU through NCCL's device API on 4- and 8-GPU
        // machines; they skip, loudly, on fewer GPUs.
        InvarianceCase{"Tp4Even_NcclOn4Gpus",
                       128256,
                       256,
                       {1, 1, 1, 1},
                       TpTransport::kNcclDevice,
                       1,
                       4},
        InvarianceCase{"Tp4Uneven_NcclOn4Gpus",
                       151936,
                       128,
                       {2, 1, 1, 1},
                       TpTransport::kNcclDevice,
                       2,
                       4},
        InvarianceCase{"Tp8Even_NcclOn8Gpus",
                       151936,
                       128,
                       {1, 1, 1, 1, 1, 1, 1, 1},
                       TpTransport::kNcclDevice,
                       1,
                       8}),
    [](const ::testing::TestParamInfo<InvarianceCase>& info) {
      return std::string(info.param.name);
    });

// ------------------------------------------------------- chi-squared --

class TpChiSquaredTest : public ::testing::TestWithParam<int64_t> {};

// Logits are small integers (exact in fp32 and bf16): h = (1, 1, 1, 1, 0...)
// and W[i][0..3] in {-1, 0, 1}, so logit_i = sum of W[i][0..3] in [-4, 4].
// 256 rows x 8 samples x 50 steps = 102,400 independent draws of token ids
// from softmax(logit) at TP = 2, against the exact probabilities.
TEST_P(TpChiSquaredTest, Tp2MatchesExactSoftmax) {
  SKIP_WITHOUT_TWO_GPUS();
  const int64_t vocab = GetParam();
  constexpr int kHidden = 64;
  constexpr int kRows = 256;
  constexpr int kSamples = 8;
  constexpr int kSteps = 50;
  Problem problem;
  problem.vocab = vocab;
  problem.hidden = kHidden;
  problem.weights.resize(static_cast<size_t>(vocab) * kHidden);
  std::mt19937_64 rng(0xc41 + vocab);
  std::vector<double> logits(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    int sum = 0;
    for (int k = 0; k < kHidden; ++k) {
      const int w = static_cast<int>(rng() % 5) - 2;  // -2..2
      const int v = k < 4 ? std::max(-1, std::min(1, w)) : w;
      problem.weights[i * kHidden + k] = FloatToBf16(static_cast<float>(v));
      if (k < 4) sum += v;
    }
    logits[i] = sum;
  }
  double max_logit = -1e30;
  for (double l : logits) max_logit = std::max(max_logit, l);
  std::vector<double> probs(vocab);
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    probs[i] = std::exp(logits[i] - max_logit);
    z += probs[i];
  }
  for (double& p : probs) p /= z;

  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(
      tp.Init(problem, {1, 1}, {0, 1}, TpTransport::kNcclDevice, kSamples));
  std::vector<int64_t> counts(vocab, 0);
  for (int step = 0; step < kSteps; ++step) {
    Batch batch;
    batch.rows = kRows;
    batch.num_samples = kSamples;
    batch.hidden.assign(static_cast<size_t>(kRows) * kHidden,
                        FloatToBf16(0.0f));
    for (int b = 0; b < kRows; ++b) {
      for (int k = 0; k < 4; ++k) {
        batch.hidden[b * kHidden + k] = FloatToBf16(1.0f);
      }
      batch.inv_temperature.push_back(1.0f);
      batch.seeds.push_back(rng());
      batch.steps.push_back(step);
    }
    std::vector<int32_t> tokens;
    ASSERT_NO_FATAL_FAILURE(tp.Run(batch, &tokens));
    for (int32_t t : tokens) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, vocab);
      ++counts[t];
    }
  }
  const tp_test::ChiSquaredResult r = tp_test::ChiSquaredTest(probs, counts);
  EXPECT_GT(r.p_value, 1e-3)
      << "chi2 " << r.statistic << " dof " << r.dof << " bins " << r.bins;
  EXPECT_GE(r.bins, std::min<int64_t>(vocab, 100));
}

INSTANTIATE_TEST_SUITE_P(Tp2, TpChiSquaredTest,
                         ::testing::Values(int64_t{129}, int64_t{1001},
                                           int64_t{32768}),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return "V" + std::to_string(info.param);
                         });

// ---------------------------------------------------- all-gather baseline --

// With W and h in {-1, 0, 1} and D = 64 every logit is an integer in
// [-64, 64], exact in the baseline's bf16 logits and in the fused kernel's
// fp32 ones, so the baseline must give TP1's tokens exactly, greedy ties
// (frequent with integer logits) included.
TEST(AllGatherBaselineTest, MatchesTp1OnExactLogitsWithUnevenShards) {
  SKIP_WITHOUT_TWO_GPUS();
  constexpr int kHidden = 64;
  constexpr int kSamples = 2;
  Problem problem;
  problem.vocab = 1001;
  problem.hidden = kHidden;
  std::mt19937_64 rng(0xba5e);
  problem.weights.resize(problem.vocab * kHidden);
  for (uint16_t& w : problem.weights) {
    w = FloatToBf16(static_cast<float>(static_cast<int>(rng() % 3) - 1));
  }
  Tp1Runner tp1;
  ASSERT_NO_FATAL_FAILURE(tp1.Init(problem, kSamples));
  // The TP runner provides per-rank inputs and the communicators.
  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(
      tp.Init(problem, {60, 40}, {0, 1}, TpTransport::kNcclDevice, kSamples));
  AllGatherBaselineOptions options;
  options.hidden_size = kHidden;
  options.max_samples = kSamples;
  std::unique_ptr<AllGatherBaseline> baseline;
  ASSERT_TP_OK(
      AllGatherBaseline::Create(tp.comms(), tp.layout(), options, &baseline));
  for (int step = 0; step < 8; ++step) {
    const int rows = kBatchCycle[step];
    Batch batch;
    batch.rows = rows;
    batch.num_samples = kSamples;
    for (int i = 0; i < rows * kHidden; ++i) {
      batch.hidden.push_back(
          FloatToBf16(static_cast<float>(static_cast<int>(rng() % 3) - 1)));
    }
    for (int b = 0; b < rows; ++b) {
      batch.inv_temperature.push_back(b % 4 == 3 ? 0.0f : 1.0f);
      batch.seeds.push_back(rng());
      batch.steps.push_back(step);
    }
    std::vector<int32_t> expected;
    ASSERT_NO_FATAL_FAILURE(tp1.Run(batch, &expected));
    std::vector<FusedSampleParams> params;
    std::vector<int32_t*> tokens;
    std::vector<cudaStream_t> streams;
    for (int r = 0; r < 2; ++r) {
      RankBuffers& rb = tp.rank(r);
      Upload(batch, kHidden, &rb);
      params.push_back(ParamsFor(rb, tp.layout().shards[r].vocab_rows,
                                 tp.layout().shards[r].vocab_offset, kHidden,
                                 batch));
      tokens.push_back(rb.tokens.get<int32_t>());
      streams.push_back(rb.stream);
    }
    ASSERT_TP_OK(baseline->Step(params, tokens, streams));
    for (int r = 0; r < 2; ++r) {
      ASSERT_CUDA(cudaSetDevice(r));
      ASSERT_CUDA(cudaStreamSynchronize(streams[r]));
    }
    // Rank 1's gathered logits hold both shards, padded: check them against
    // the exact integer logits.
    const int64_t stride = baseline->padded_rows();
    std::vector<uint16_t> gathered(2 * rows * stride);
    ASSERT_CUDA(cudaSetDevice(1));
    ASSERT_CUDA(cudaMemcpy(gathered.data(), baseline->gathered_logits(1),
                           sizeof(uint16_t) * gathered.size(),
                           cudaMemcpyDeviceToHost));
    for (int b = 0; b < rows; b += 37) {
      for (int64_t i = 0; i < problem.vocab; i += 13) {
        const int rank = tp.layout().RankOfToken(i);
        const TpShard& s = tp.layout().shards[rank];
        float exact = 0;
        for (int k = 0; k < kHidden; ++k) {
          exact += tp_test::Bf16ToFloat(batch.hidden[b * kHidden + k]) *
                   tp_test::Bf16ToFloat(problem.weights[i * kHidden + k]);
        }
        const float got = tp_test::Bf16ToFloat(
            gathered[(rank * rows + b) * stride + (i - s.vocab_offset)]);
        ASSERT_EQ(got, exact) << "row " << b << " token " << i;
      }
    }
    for (int r = 0; r < 2; ++r) {
      std::vector<int32_t> got;
      ASSERT_NO_FATAL_FAILURE(DownloadTokens(tp.rank(r), batch, &got));
      ASSERT_EQ(got, expected) << "rank " << r << " step " << step;
    }
  }
}

// ------------------------------------------------------- fatal errors --

// Polls the stream until it is idle or `limit` passes; true when idle.
bool WaitIdle(int device, cudaStream_t stream,
              std::chrono::milliseconds limit) {
  cudaSetDevice(device);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) return true;  // an error also ends the wait
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

Problem TinyProblem() { return RandomProblem(1001, 64, 0xfa7a1); }

// A peer that never arrives (its process died, its GPU fell off the bus):
// rank 0's barrier must give up after the timeout and say so, not hang.
TEST(TpFatalErrorTest, BarrierTimesOutWhenAPeerNeverArrives) {
  SKIP_WITHOUT_TWO_GPUS();
  const Problem problem = TinyProblem();
  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(tp.Init(problem, {1, 1}, {0, 1},
                                  TpTransport::kNcclDevice, 1,
                                  /*barrier_timeout_ns=*/200000000ull));
  cudaStream_t s0 = tp.rank(0).stream;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_CUDA(tp.exchange()->AfterStageOne(0, s0, s0));  // rank 1 never does
  const bool idle = WaitIdle(0, s0, std::chrono::seconds(20));
  if (!idle) tp.exchange()->Abort();  // do not leave a spinning kernel behind
  ASSERT_TRUE(idle) << "barrier kernel still waiting after 20 s";
  const double waited_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_GE(waited_s, 0.15);  // it did wait for the peer first
  ASSERT_CUDA(cudaStreamSynchronize(s0));
  EXPECT_EQ(tp.exchange()->status(), TpBarrierResult::kTimedOut);
  // Teardown after the failure aborts the communicators instead of running
  // collectives a dead peer would never join; reaching the end is the test.
}

// Abort() from another thread releases a barrier that would otherwise wait
// for a minute, and later barriers return at once.
TEST(TpFatalErrorTest, AbortReleasesAWaitingBarrier) {
  SKIP_WITHOUT_TWO_GPUS();
  const Problem problem = TinyProblem();
  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(tp.Init(problem, {1, 1}, {0, 1},
                                  TpTransport::kNcclDevice, 1,
                                  /*barrier_timeout_ns=*/60000000000ull));
  cudaStream_t s0 = tp.rank(0).stream;
  ASSERT_CUDA(tp.exchange()->AfterStageOne(0, s0, s0));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_CUDA(cudaSetDevice(0));
  EXPECT_EQ(cudaStreamQuery(s0), cudaErrorNotReady) << "barrier did not wait";
  std::thread aborter([&] { tp.exchange()->Abort(); });
  aborter.join();
  ASSERT_TRUE(WaitIdle(0, s0, std::chrono::seconds(10)))
      << "barrier kernel ignored the abort flag";
  ASSERT_CUDA(cudaStreamSynchronize(s0));
  EXPECT_EQ(tp.exchange()->status(), TpBarrierResult::kAborted);
  // A later barrier on rank 1 returns at once too.
  cudaStream_t s1 = tp.rank(1).stream;
  ASSERT_CUDA(tp.exchange()->AfterStageOne(1, s1, s0));
  ASSERT_TRUE(WaitIdle(1, s1, std::chrono::seconds(10)));
  ASSERT_CUDA(cudaStreamSynchronize(s1));
}

// A healthy exchange reports kOk after many steps (the epochs stay in step
// across slots and sessions).
TEST(TpFatalErrorTest, HealthyStepsReportOk) {
  SKIP_WITHOUT_TWO_GPUS();
  const Problem problem = TinyProblem();
  TpRunner tp;
  ASSERT_NO_FATAL_FAILURE(
      tp.Init(problem, {1, 1}, {0, 1}, TpTransport::kNcclDevice, 1));
  std::mt19937_64 rng(5);
  for (int step = 0; step < 20; ++step) {
    std::vector<int32_t> tokens;
    ASSERT_NO_FATAL_FAILURE(
        tp.Run(RandomBatch(3, 1, problem.hidden, &rng), &tokens));
  }
  EXPECT_EQ(tp.exchange()->status(), TpBarrierResult::kOk);
}

TEST(TpExchangeTest, RejectsLayoutsTheKernelCannotFill) {
  SKIP_WITHOUT_TWO_GPUS();
  TpLayout layout;
  std::string error;
  ASSERT_TRUE(
      MakeTpLayout(1001, {1, 1}, FusedSampleTileRows() + 1, &layout, &error));
  std::unique_ptr<TpExchange> exchange;
  TpExchangeOptions options;
  options.transport = TpTransport::kCudaPeer;
  TpStatus s = TpExchange::Create({0, 1}, nullptr, layout, options, &exchange);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message.find("tile_rows"), std::string::npos) << s.message;
  ASSERT_TRUE(
      MakeTpLayout(1001, {1, 1}, FusedSampleTileRows(), &layout, &error));
  s = TpExchange::Create({0}, nullptr, layout, options, &exchange);
  EXPECT_FALSE(s.ok());
  options.transport = TpTransport::kNcclDevice;
  s = TpExchange::Create({0, 1}, nullptr, layout, options, &exchange);
  EXPECT_FALSE(s.ok());  // the NCCL transport needs communicators
}

}  // namespace
}  // namespace flashsampler
