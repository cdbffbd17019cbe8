// The flashsamplerd binary itself: starts on synthetic weights, takes work,
// gets SIGTERM while that work is in flight, answers what it accepted,
// refuses what comes later, and exits with status 0; also a second SIGTERM
// during the drain, SIGTERM while loading, running out of descriptors, and
// too little memory for the model.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

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

// Waits for "serving on port N" in the daemon's log; N, or 0.
int WaitForServingPort(const std::string& log_path) {
  int port = 0;
  const std::regex serving("serving on port ([0-9]+)");
  testing::PollUntil(
      [&] {
        std::smatch match;
        const std::string log = testing::ReadFileOrEmpty(log_path);
        if (!std::regex_search(log, match, serving)) return false;
        port = std::stoi(match[1]);
        return true;
      },
      absl::Seconds(90));
  return port;
}

// Exit status of `pid` within `timeout` (SIGKILLed and -1 if it runs on).
int ExitStatus(pid_t pid, absl::Duration timeout) {
  int exit_status = 0;
  if (testing::WaitForExit(pid, timeout, &exit_status)) return exit_status;
  kill(pid, SIGKILL);
  testing::WaitForExit(pid, absl::Seconds(10), &exit_status);
  return -1;
}

// Defect: a thread created before main (OpenBLAS's pool) left SIGTERM
// unblocked; a second SIGTERM while main was draining (not in sigwait) went
// to that thread and killed the process (exit 143, in-flight calls reset).
TEST(DaemonTest, SecondSigtermDuringDrainKilledTheDaemon) {
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string log_path = dir + "/daemon.log";
  const pid_t pid = testing::Spawn(
      {FS_DAEMON_BIN, "--listen_address=127.0.0.1:0", "--metrics_port=0",
       "--weights=synthetic:vocab=32000,hidden=512,seed=1", "--backend=cpu",
       "--cpu_threads=2", "--warmup_rows=1", "--drain_timeout=60s"},
      log_path);
  ASSERT_GT(pid, 0);
  const int port = WaitForServingPort(log_path);
  ASSERT_GT(port, 0) << testing::ReadFileOrEmpty(log_path);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Sampler::NewStub(channel);
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
    });
  }
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  ASSERT_TRUE(testing::PollUntil(
      [&] {
        return absl::StrContains(testing::ReadFileOrEmpty(log_path),
                                 "draining");
      },
      absl::Seconds(10)));
  kill(pid, SIGTERM);
  kill(pid, SIGINT);
  for (std::thread& t : callers) t.join();
  const int exit_status = ExitStatus(pid, absl::Seconds(90));
  const std::string log = testing::ReadFileOrEmpty(log_path);
  EXPECT_TRUE(WIFEXITED(exit_status)) << exit_status << "\n" << log;
  EXPECT_EQ(WEXITSTATUS(exit_status), 0) << log;
  EXPECT_TRUE(absl::StrContains(log, "received SIGTERM again")) << log;
  EXPECT_TRUE(absl::StrContains(log, "stopped")) << log;
  int answered = 0;
  for (const Outcome& o : outcomes) {
    if (o.status.ok()) {
      ++answered;
    } else {
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::UNAVAILABLE)
          << o.status.error_message();
      EXPECT_TRUE(absl::StrContains(o.status.error_message(), "draining"))
          << "a call was reset, not refused: " << o.status.error_message();
    }
  }
  EXPECT_GE(answered, 1);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// Defect: SIGTERM while the weights loaded killed the process (exit 143).
TEST(DaemonTest, SigtermWhileLoadingKilledTheDaemon) {
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string log_path = dir + "/daemon.log";
  // 256000 x 1024 bf16 synthetic weights take seconds to generate.
  const pid_t pid = testing::Spawn(
      {FS_DAEMON_BIN, "--listen_address=127.0.0.1:0", "--metrics_port=0",
       "--weights=synthetic:vocab=256000,hidden=1024,seed=1", "--backend=cpu",
       "--cpu_threads=1", "--warmup_rows=1"},
      log_path);
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(testing::PollUntil(
      [&] {
        return absl::StrContains(testing::ReadFileOrEmpty(log_path),
                                 "loading weights");
      },
      absl::Seconds(30)));
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time sigterm = absl::Now();
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  const int exit_status = ExitStatus(pid, absl::Seconds(30));
  const std::string log = testing::ReadFileOrEmpty(log_path);
  EXPECT_TRUE(WIFEXITED(exit_status)) << exit_status << "\n" << log;
  EXPECT_EQ(WEXITSTATUS(exit_status), 0) << log;
  EXPECT_TRUE(absl::StrContains(log, "received SIGTERM while loading")) << log;
  EXPECT_FALSE(absl::StrContains(log, "serving on port")) << log;
  EXPECT_LT(absl::Now() - sigterm, absl::Seconds(5));
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// Defect: the metrics endpoint opened only after the weights loaded, so a
// minutes-long load looked like a dead target to Prometheus.
TEST(DaemonTest, MetricsWereDownWhileLoading) {
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string log_path = dir + "/daemon.log";
  const int metrics_port = testing::FreeTcpPort();
  // 256000 x 1024 bf16 synthetic weights take seconds to generate.
  const pid_t pid = testing::Spawn(
      {FS_DAEMON_BIN, "--listen_address=127.0.0.1:0",
       absl::StrCat("--metrics_port=", metrics_port),
       "--metrics_address=127.0.0.1",
       "--weights=synthetic:vocab=256000,hidden=1024,seed=1", "--backend=cpu",
       "--cpu_threads=1", "--warmup_rows=1", "--drain_timeout=5s"},
      log_path);
  ASSERT_GT(pid, 0);
  std::string during;
  ASSERT_TRUE(testing::PollUntil(
      [&] {
        int code = 0;
        during = testing::HttpGet(metrics_port, "/metrics", &code);
        return code == 200;
      },
      absl::Seconds(30)))
      << testing::ReadFileOrEmpty(log_path);
  const std::string log_then = testing::ReadFileOrEmpty(log_path);
  EXPECT_FALSE(absl::StrContains(log_then, "serving on port")) << log_then;
  EXPECT_EQ(testing::MetricValue(
                during, "flashsampler_serving_state{state=\"loading\"}"),
            1.0)
      << during;
  EXPECT_EQ(testing::MetricValue(
                during, "flashsampler_serving_state{state=\"serving\"}"),
            0.0);
  EXPECT_LT(testing::MetricValue(during, "flashsampler_load_progress_ratio"),
            1.0);

  const int port = WaitForServingPort(log_path);
  ASSERT_GT(port, 0) << testing::ReadFileOrEmpty(log_path);
  int code = 0;
  const std::string after = testing::HttpGet(metrics_port, "/metrics", &code);
  ASSERT_EQ(code, 200);
  EXPECT_EQ(testing::MetricValue(
                after, "flashsampler_serving_state{state=\"serving\"}"),
            1.0)
      << after;
  EXPECT_EQ(testing::MetricValue(
                after, "flashsampler_serving_state{state=\"loading\"}"),
            0.0);
  EXPECT_EQ(testing::MetricValue(after, "flashsampler_load_progress_ratio"),
            1.0);
  const std::string log = testing::ReadFileOrEmpty(log_path);
  EXPECT_TRUE(absl::StrContains(log, "sha256 ")) << log;
  EXPECT_TRUE(absl::StrContains(log, "backend cpu")) << log;
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  const int exit_status = ExitStatus(pid, absl::Seconds(30));
  EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) == 0)
      << exit_status;
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// Defect: with every descriptor in use once (nofile 128, 170 connections),
// gRPC's listener closed for good and every later call failed after its
// deadline while the daemon went on reporting SERVING. Now the daemon
// notices, drains and exits non-zero so that it is restarted.
TEST(DaemonTest, RunningOutOfDescriptorsStoppedGrpcForGood) {
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::string log_path = dir + "/daemon.log";
  const pid_t pid = testing::Spawn(
      {"/bin/sh", "-c", "ulimit -n 128 && exec \"$0\" \"$@\"", FS_DAEMON_BIN,
       "--listen_address=127.0.0.1:0", "--metrics_port=0",
       "--weights=synthetic:vocab=1000,hidden=16,seed=1", "--backend=cpu",
       "--cpu_threads=1", "--warmup_rows=1", "--drain_timeout=2s"},
      log_path);
  ASSERT_GT(pid, 0);
  const int port = WaitForServingPort(log_path);
  ASSERT_GT(port, 0) << testing::ReadFileOrEmpty(log_path);
  std::vector<int> sockets;
  for (int i = 0; i < 170; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    sockets.push_back(fd);
  }
  absl::SleepFor(absl::Milliseconds(500));
  for (const int fd : sockets) close(fd);

  // Either gRPC serves again, or the daemon has left with a non-zero status
  // and said why. Running on without accepting is the failure.
  auto stub = v1::Sampler::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  bool served = false;
  int exit_status = 0;
  bool exited = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!served && !exited && absl::Now() < deadline) {
    exited = testing::WaitForExit(pid, absl::ZeroDuration(), &exit_status);
    if (exited) break;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::ModelInfo info;
    served = stub->GetModelInfo(&context, {}, &info).ok();
  }
  const std::string log = testing::ReadFileOrEmpty(log_path);
  if (!exited) {
    kill(pid, SIGTERM);
    exit_status = ExitStatus(pid, absl::Seconds(30));
  }
  EXPECT_TRUE(served || exited) << log;
  if (exited) {
    EXPECT_TRUE(WIFEXITED(exit_status)) << exit_status << "\n" << log;
    EXPECT_NE(WEXITSTATUS(exit_status), 0) << log;
    EXPECT_TRUE(absl::StrContains(log, "NOT_SERVING: gRPC stopped accepting"))
        << log;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

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

// VmPeak of process `pid` in KiB, or 0.
uint64_t VmPeakKib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "VmPeak:") {
      uint64_t kib = 0;
      status >> kib;
      return kib;
    }
    std::getline(status, key);
  }
  return 0;
}

// Defect: out of memory aborts. A CPU backend whose fp32 copy of W could not
// be allocated died of an uncaught std::bad_alloc (SIGABRT, no message). Now
// start-up fails with the buffer named and its size, and the daemon exits 1.
TEST(DaemonTest, OutOfMemoryAborts) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory does not fit ulimit -v";
#endif
  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> flags = {"--listen_address=127.0.0.1:0",
                                          "--metrics_port=0", "--backend=cpu",
                                          "--cpu_threads=1", "--warmup_rows=1"};
  // One malloc arena and one OpenBLAS thread keep the address space the
  // daemon needs besides W small and independent of the host's cores
  // (glibc reserves 64 MiB per arena, up to 8 per core); it is measured on
  // tiny weights: VmPeak once serving, an upper bound of what start-up needs.
  const std::string env =
      "export MALLOC_ARENA_MAX=1 OPENBLAS_NUM_THREADS=1 && exec \"$0\" \"$@\"";
  const std::string small_log = dir + "/small.log";
  std::vector<std::string> argv = {
      "/bin/sh", "-c", env, FS_DAEMON_BIN,
      "--weights=synthetic:vocab=1000,hidden=16,seed=1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  const pid_t small = testing::Spawn(argv, small_log);
  ASSERT_GT(small, 0);
  ASSERT_GT(WaitForServingPort(small_log), 0)
      << testing::ReadFileOrEmpty(small_log);
  const uint64_t baseline_kib = VmPeakKib(small);
  kill(small, SIGTERM);
  ExitStatus(small, absl::Seconds(30));
  ASSERT_GT(baseline_kib, 0u);

  // 65536 x 2048 bf16 is 256 MiB; its fp32 copy 512 MiB. The limit leaves
  // room for the bf16 tensor and 128 MiB more: the copy cannot fit.
  const uint64_t limit_kib = baseline_kib + (uint64_t{384} << 10);
  const std::string log_path = dir + "/daemon.log";
  argv = {"/bin/sh", "-c", absl::StrCat("ulimit -v ", limit_kib, " && ", env),
          FS_DAEMON_BIN, "--weights=synthetic:vocab=65536,hidden=2048,seed=1"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  const pid_t pid = testing::Spawn(argv, log_path);
  ASSERT_GT(pid, 0);
  const int exit_status = ExitStatus(pid, absl::Seconds(120));
  const std::string log = testing::ReadFileOrEmpty(log_path);
  ASSERT_TRUE(WIFEXITED(exit_status))
      << "status " << exit_status << " (signal "
      << (WIFSIGNALED(exit_status) ? WTERMSIG(exit_status) : 0) << ")\n"
      << log;
  EXPECT_EQ(WEXITSTATUS(exit_status), 1) << log;
  EXPECT_TRUE(absl::StrContains(
      log,
      "startup failed: RESOURCE_EXHAUSTED: CpuEngine: cannot allocate the "
      "fp32 copy of W [65536, 2048]: 536870912 bytes"))
      << log;
  EXPECT_FALSE(absl::StrContains(log, "serving on port")) << log;
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace flashsampler
