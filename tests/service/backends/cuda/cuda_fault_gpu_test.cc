// A device fault under the server: the CUDA engine's test switch makes a
// batch launch a kernel that traps (the sticky error an Xid leaves). The
// calls of that batch and every later one fail UNAVAILABLE, health turns
// NOT_SERVING, and Stop() returns within seconds. Each scenario runs in its
// own process (a death-test child): the fault poisons the CUDA context of
// the process for good, and the other GPU tests must keep working. Skips
// loudly without a GPU.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/backends/cuda/cuda_engine.h"
#include "service/serving/server.h"
#include "service/weights/weights.h"
#include "tests/service/serving/service_test_util.h"
#include "tests/testing/gpu_test_util.h"

namespace flashsampler {
namespace {

using HealthStatus = grpc::health::v1::HealthCheckResponse;
constexpr int64_t kHidden = 256;
constexpr int kCalls = 6;

// The scenario, in the child. "" when every expectation holds, else the
// first that did not.
std::string TrapUnderTheServer() {
  WeightsOptions source;
  source.source = "synthetic:vocab=1001,hidden=256,seed=7,dtype=bf16";
  auto loaded = Weights::Load(source);
  if (!loaded.ok()) return loaded.status().ToString();
  const std::shared_ptr<const Weights> weights(std::move(*loaded));
  CudaEngineOptions options;
  options.devices = {0};
  options.max_batch_rows = 16;
  options.slots = 2;
  auto trap = std::make_shared<std::atomic<bool>>(false);
  options.trap_next_batch_for_tests = trap;
  auto engine = CreateCudaEngine(weights, options);
  if (!engine.ok()) return engine.status().ToString();
  auto server = Server::CreateWithEngine(
      testing::TestServerOptions(), std::move(*engine), weights, "synthetic");
  if (!server.ok()) return server.status().ToString();
  if (absl::Status s = (*server)->Start(); !s.ok()) return s.ToString();

  // The gauge holds every buffer of the engine, not only the weights.
  const std::string metrics = (*server)->metrics().TextExposition();
  const double gauge = testing::MetricValue(
      metrics, "flashsampler_device_memory_bytes{device=\"0\"}");
  const int64_t device_bytes =
      (*server)->engine_info().shards.at(0).device_bytes;
  if (gauge != static_cast<double>(device_bytes) ||
      device_bytes <= 1001 * kHidden * 2) {
    return absl::StrCat("device memory gauge ", gauge, ", engine holds ",
                        device_bytes);
  }

  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->port()),
                          grpc::InsecureChannelCredentials());
  auto stub = v1::Sampler::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);
  if (testing::CheckHealth(health.get()) != HealthStatus::SERVING) {
    return "not SERVING before the fault";
  }
  {
    auto before = testing::SampleAsync(
        stub.get(), testing::MakeRequest(4, kHidden, 11), absl::Seconds(30));
    before->Join();
    if (!before->status.ok()) {
      return "before the fault: " + before->status.error_message();
    }
  }

  trap->store(true);
  std::vector<std::unique_ptr<testing::AsyncSample>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(testing::SampleAsync(
        stub.get(), testing::MakeRequest(4, kHidden, 100 + 10 * i),
        absl::Seconds(30)));
  }
  for (auto& call : calls) call->Join();
  // The batch that trapped and every batch after it fail; a call that made
  // it into a batch before the switch was read may have been served.
  int unavailable = 0;
  for (int i = 0; i < kCalls; ++i) {
    const grpc::Status& status = calls[i]->status;
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
      ++unavailable;
    } else if (!status.ok()) {
      return absl::StrCat("call ", i, ": code ", status.error_code(), " ",
                          status.error_message());
    }
  }
  if (unavailable == 0) return "no call failed UNAVAILABLE";
  if (testing::CheckHealth(health.get()) != HealthStatus::NOT_SERVING) {
    return "health is not NOT_SERVING after the fault";
  }
  auto after = testing::SampleAsync(
      stub.get(), testing::MakeRequest(2, kHidden, 999), absl::Seconds(30));
  after->Join();
  if (after->status.error_code() != grpc::StatusCode::UNAVAILABLE) {
    return absl::StrCat("call after the fault: code ",
                        after->status.error_code(), " ",
                        after->status.error_message());
  }
  const absl::Time stop = absl::Now();
  (*server)->Stop();
  const absl::Duration took = absl::Now() - stop;
  if (took > absl::Seconds(5)) {
    return absl::StrCat("Stop() took ", absl::FormatDuration(took));
  }
  return "";
}

// A device fault (a kernel that traps) fails the calls UNAVAILABLE, turns
// health NOT_SERVING and leaves a server that stops within seconds.
TEST(CudaFaultGpuTest, ATrapFailsCallsUnavailableAndHealthNotServing) {
  FS_SKIP_WITHOUT_GPU();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const std::string failure = TrapUnderTheServer();
        std::fprintf(stderr, "fault scenario: %s\n",
                     failure.empty() ? "held" : failure.c_str());
        _exit(failure.empty() ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "fault scenario: held");
}

}  // namespace
}  // namespace flashsampler
