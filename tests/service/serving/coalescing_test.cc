// 64 concurrent callers against the real server on the real CPU engine: each
// must get exactly the tokens a separate reference CpuEngine computes for its
// own rows and seeds (so rows never leak between callers sharing a batch),
// and the batch-rows histogram must show that their rows did share batches.
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "service/backends/cpu/cpu_engine.h"
#include "service/serving/server.h"
#include "service/weights/weights.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

constexpr int kCallers = 64;
constexpr int kRequestsPerCaller = 3;
constexpr int64_t kHidden = 64;

// Delegates to the CPU engine after a pause, standing in for a slower device
// so that requests pile up while a batch runs (what coalescing needs).
class SlowEngine final : public Engine {
 public:
  SlowEngine(std::unique_ptr<Engine> inner, absl::Duration pause)
      : inner_(std::move(inner)), pause_(pause) {}
  const EngineInfo& info() const override { return inner_->info(); }
  int max_slots() const override { return inner_->max_slots(); }
  void* slot_input(int slot) override { return inner_->slot_input(slot); }
  absl::Status Sample(const BatchView& batch,
                      std::vector<RowResult>* results) override {
    absl::SleepFor(pause_);
    return inner_->Sample(batch, results);
  }

 private:
  std::unique_ptr<Engine> inner_;
  absl::Duration pause_;
};

struct CallerRequest {
  v1::SampleRequest request;
  SamplingParams params;  // the same controls, for the reference
  v1::SampleResponse response;
  grpc::Status status;
};

// Caller c's k-th request: 1..4 rows of N(0, 1) hidden states, caller-specific
// seeds, a decode step, and one of three control mixes.
CallerRequest MakeCallerRequest(int caller, int k) {
  CallerRequest out;
  const int rows = 1 + caller % 4;
  std::mt19937 gen(caller * 131 + k);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(rows * kHidden);
  for (float& v : hidden) v = normal(gen);
  v1::Tensor* t = out.request.mutable_hidden_states();
  t->set_dtype(v1::DTYPE_FP32);
  t->add_shape(rows);
  t->add_shape(kHidden);
  t->set_data(hidden.data(), hidden.size() * sizeof(float));
  for (int r = 0; r < rows; ++r) {
    out.request.add_seeds(1000003ull * caller + 101ull * k + r);
    out.request.add_steps(k);
  }
  switch (caller % 3) {
    case 0:
      out.request.mutable_params()->set_temperature(0.8f);
      out.request.mutable_params()->set_top_k(50);
      out.params.temperature = 0.8f;
      out.params.top_k = 50;
      break;
    case 1:
      out.request.mutable_params()->set_temperature(0.0f);
      out.params.temperature = 0.0f;
      break;
    default:
      out.request.mutable_params()->set_n(2);
      out.params.n = 2;
      break;
  }
  return out;
}

TEST(CoalescingTest, SixtyFourCallersGetTheirOwnTokensInSharedBatches) {
  WeightsOptions weights_options;
  weights_options.source = "synthetic:vocab=4099,hidden=64,seed=3,dtype=bf16";
  absl::StatusOr<std::unique_ptr<Weights>> loaded =
      Weights::Load(weights_options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::shared_ptr<const Weights> weights(std::move(*loaded));

  CpuEngineOptions engine_options;
  engine_options.sampler.threads = 2;
  engine_options.slots = 1;
  auto served = CpuEngine::Create(*weights, engine_options);
  ASSERT_TRUE(served.ok()) << served.status();
  auto reference = CpuEngine::Create(*weights, engine_options);
  ASSERT_TRUE(reference.ok()) << reference.status();

  ServerOptions options = testing::TestServerOptions();
  auto server = Server::CreateWithEngine(
      options,
      std::make_unique<SlowEngine>(*std::move(served), absl::Milliseconds(20)),
      weights, weights->source());
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials());
  auto stub = v1::Sampler::NewStub(channel);

  std::vector<std::vector<CallerRequest>> calls(kCallers);
  for (int c = 0; c < kCallers; ++c) {
    for (int k = 0; k < kRequestsPerCaller; ++k) {
      calls[c].push_back(MakeCallerRequest(c, k));
    }
  }
  absl::Notification go;
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      go.WaitForNotification();
      for (CallerRequest& call : calls[c]) {
        grpc::ClientContext context;
        context.set_deadline(
            absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
        call.status = stub->Sample(&context, call.request, &call.response);
      }
    });
  }
  go.Notify();
  for (std::thread& t : callers) t.join();

  // Every caller's tokens equal the reference engine's for its own rows.
  Engine& ref = **reference;
  for (int c = 0; c < kCallers; ++c) {
    for (const CallerRequest& call : calls[c]) {
      SCOPED_TRACE(absl::StrCat("caller ", c));
      ASSERT_TRUE(call.status.ok()) << call.status.error_message();
      const int rows = static_cast<int>(call.request.hidden_states().shape(0));
      std::memcpy(ref.slot_input(0), call.request.hidden_states().data().data(),
                  call.request.hidden_states().data().size());
      std::vector<RowSpec> specs(rows);
      for (int r = 0; r < rows; ++r) {
        specs[r].params = &call.params;
        specs[r].seed = call.request.seeds(r);
        specs[r].step = call.request.steps(r);
      }
      BatchView view;
      view.slot = 0;
      view.rows = rows;
      view.specs = specs.data();
      std::vector<RowResult> expected;
      ASSERT_TRUE(ref.Sample(view, &expected).ok());
      std::vector<int32_t> expected_tokens;
      for (const RowResult& row : expected) {
        expected_tokens.insert(expected_tokens.end(), row.token_ids.begin(),
                               row.token_ids.end());
      }
      EXPECT_THAT(call.response.token_ids(),
                  ::testing::ElementsAreArray(expected_tokens));
      EXPECT_THAT(call.response.seeds(),
                  ::testing::ElementsAreArray(call.request.seeds()));
      EXPECT_EQ(call.response.n(), call.params.n);
    }
  }

  // Coalescing, read back from the exported histogram.
  const std::string text = (*server)->metrics().TextExposition();
  const double sum = testing::MetricValue(text, "flashsampler_batch_rows_sum");
  const double count =
      testing::MetricValue(text, "flashsampler_batch_rows_count");
  ASSERT_GT(count, 0);
  double rows_total = 0;
  for (const auto& caller : calls) {
    for (const CallerRequest& call : caller) {
      rows_total += call.request.hidden_states().shape(0);
    }
  }
  EXPECT_EQ(sum, rows_total);
  RecordProperty("mean_rows_per_batch", std::to_string(sum / count));
  EXPECT_GT(sum / count, 4.0) << "batches: " << count;
  (*server)->Stop();
}

}  // namespace
}  // namespace flashsampler
