// The flashsamplerd binary itself: starts on synthetic weights, takes work,
// gets SIGTERM while that work is in flight, answers what it accepted,
// refuses what comes later, and exits with status 0.
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <regex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

constexpr int64_t kHidden = 512;
constexpr int kRequests = 6;
constexpr int kRows = 256;

struct Outcome {
  grpc::Status status;
  v1::SampleResponse response;
  absl::Time finished;
};

TEST(DaemonTest, SigtermDrainsInFlightRequestsAndExitsZero) {
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string log_path = dir + "/daemon.log";
  const pid_t pid = testing::Spawn(
      {FS_DAEMON_BIN, "--listen_address=127.0.0.1:0", "--metrics_port=0",
       "--weights=synthetic:vocab=32000,hidden=512,seed=1", "--backend=cpu",
       "--cpu_threads=2", "--warmup_rows=1", "--drain_timeout=60s"},
      log_path);
  ASSERT_GT(pid, 0);

  // The daemon logs the port it bound once it serves.
  int port = 0;
  const std::regex serving("serving on port ([0-9]+)");
  ASSERT_TRUE(testing::PollUntil(
      [&] {
        std::smatch match;
        const std::string log = testing::ReadFileOrEmpty(log_path);
        if (!std::regex_search(log, match, serving)) return false;
        port = std::stoi(match[1]);
        return true;
      },
      absl::Seconds(90)))
      << testing::ReadFileOrEmpty(log_path);

  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Sampler::NewStub(channel);
  {
    grpc::ClientContext context;
    v1::ModelInfo info;
    ASSERT_TRUE(stub->GetModelInfo(&context, {}, &info).ok());
    EXPECT_EQ(info.backend(), "cpu");
    EXPECT_EQ(info.hidden_size(), kHidden);
  }

  // Enough work (6 batches of 256 rows x V = 32000 x D = 512) that some is
  // still queued or running when SIGTERM arrives.
  std::vector<Outcome> outcomes(kRequests);
  std::vector<std::thread> callers;
  for (int i = 0; i < kRequests; ++i) {
    callers.emplace_back([&, i] {
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
      outcomes[i].status = stub->Sample(
          &context,
          testing::MakeRequest(kRows, kHidden, 1 + 1000 * i, 0.001f * i),
          &outcomes[i].response);
      outcomes[i].finished = absl::Now();
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time sigterm = absl::Now();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  for (std::thread& t : callers) t.join();

  int exit_status = 0;
  const bool exited =
      testing::WaitForExit(pid, absl::Seconds(90), &exit_status);
  if (!exited) kill(pid, SIGKILL);
  const std::string log = testing::ReadFileOrEmpty(log_path);
  ASSERT_TRUE(exited) << log;
  EXPECT_TRUE(WIFEXITED(exit_status)) << log;
  EXPECT_EQ(WEXITSTATUS(exit_status), 0) << log;
  EXPECT_TRUE(absl::StrContains(log, "received SIGTERM")) << log;
  EXPECT_TRUE(absl::StrContains(log, "stopped")) << log;

  int answered_after_sigterm = 0;
  for (const Outcome& o : outcomes) {
    // Accepted before SIGTERM: answered in full. Arrived later: UNAVAILABLE.
    if (o.status.ok()) {
      EXPECT_EQ(o.response.token_ids_size(), kRows);
      if (o.finished > sigterm) ++answered_after_sigterm;
    } else {
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::UNAVAILABLE)
          << o.status.error_message();
    }
  }
  EXPECT_GE(answered_after_sigterm, 1)
      << "no request was in flight at SIGTERM; the drain went untested";

  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::SampleResponse response;
  EXPECT_EQ(
      stub->Sample(&context, testing::MakeRequest(1, kHidden, 1), &response)
          .error_code(),
      grpc::StatusCode::UNAVAILABLE);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace flashsampler
