// The programs' command lines, run as child processes: --help lists each
// program's own flags and exits 0, --version names the version and the git
// revision, flashsamplerd refuses to start without --weights or with a CUDA
// backend it cannot have, and `flashsampler-cli health` exits with
// grpc_health_probe's codes. Also the C++ client against a real Server:
// field violations come back with the error.
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "flashsampler/version.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "tests/client/fake_sampler_server.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

struct ProgramRun {
  int exit_code = -1;  // -1: did not exit normally (or timed out)
  std::string output;  // stdout and stderr
};

// Runs argv to its end (at most `timeout`) and returns its exit code and
// output.
ProgramRun RunProgram(const std::vector<std::string>& argv,
                      absl::Duration timeout = absl::Seconds(30)) {
  static int counter = 0;
  static const std::string dir = testing::MakeTempDir();
  const std::string log = absl::StrCat(dir, "/run", ++counter, ".log");
  ProgramRun run;
  const pid_t pid = testing::Spawn(argv, log);
  if (pid <= 0) return run;
  int status = 0;
  if (!testing::WaitForExit(pid, timeout, &status)) {
    kill(pid, SIGKILL);
    testing::WaitForExit(pid, absl::Seconds(10), &status);
    run.output = testing::ReadFileOrEmpty(log);
    return run;
  }
  if (WIFEXITED(status)) run.exit_code = WEXITSTATUS(status);
  run.output = testing::ReadFileOrEmpty(log);
  return run;
}

struct Program {
  const char* path;
  const char* own_flag;  // a flag defined in the program's main file
};
const Program kPrograms[] = {{FS_DAEMON_BIN, "--weights"},
                             {FS_CLI_BIN, "--target"},
                             {FS_LOAD_BIN, "--concurrency"}};

// Defect: absl's --help listed no flag ("No flags matched.", exit 1): its
// default filters match no file of this repository.
TEST(CliTest, HelpListedNoFlagsAndExitedOne) {
  for (const Program& program : kPrograms) {
    SCOPED_TRACE(program.path);
    const ProgramRun run = RunProgram({program.path, "--help"});
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(absl::StrContains(run.output, program.own_flag)) << run.output;
    EXPECT_FALSE(absl::StrContains(run.output, "No flags matched"))
        << run.output;
    const ProgramRun full = RunProgram({program.path, "--helpfull"});
    EXPECT_EQ(full.exit_code, 0) << full.output;
    EXPECT_TRUE(absl::StrContains(full.output, program.own_flag));
  }
}

// Defect: --version printed "Debug build (NDEBUG not #defined)".
TEST(CliTest, VersionPrintedNoVersion) {
  ASSERT_STRNE(kGitRevision, "");
  for (const Program& program : kPrograms) {
    SCOPED_TRACE(program.path);
    const ProgramRun run = RunProgram({program.path, "--version"});
    EXPECT_EQ(run.exit_code, 0) << run.output;
    EXPECT_TRUE(absl::StrContains(
        run.output, absl::StrCat(kVersion, " (git ", kGitRevision, ")")))
        << run.output;
    EXPECT_FALSE(absl::StrContains(run.output, "NDEBUG")) << run.output;
  }
}

TEST(CliTest, DaemonWithoutWeightsRefusesAndSaysHowToAskForSynthetic) {
  const ProgramRun run =
      RunProgram({FS_DAEMON_BIN, "--listen_address=127.0.0.1:0",
                  "--metrics_port=0", "--backend=cpu"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "no --weights given"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(
      run.output, "--weights=synthetic:vocab=32000,hidden=512,seed=1"))
      << run.output;
  EXPECT_FALSE(absl::StrContains(run.output, "serving on port")) << run.output;
}

TEST(CliTest, DaemonAskedForCudaWithoutGpuRefuses) {
#ifdef FS_HAVE_CUDA_BACKEND
  if (std::filesystem::exists("/dev/nvidia0")) {
    GTEST_SKIP() << "a GPU is visible: --backend=cuda may serve here";
  }
  const char* kExpected = "no CUDA device is visible";
#else
  const char* kExpected = "this build has no CUDA backend";
#endif
  const ProgramRun run = RunProgram(
      {FS_DAEMON_BIN, "--listen_address=127.0.0.1:0", "--metrics_port=0",
       "--backend=cuda", "--weights=synthetic:vocab=1000,hidden=16,seed=1"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "backend: \"cuda\" asked for"))
      << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, kExpected)) << run.output;
}

TEST(CliTest, HealthExitCodesFollowGrpcHealthProbe) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  const std::string target = "--target=" + server->address();
  auto health = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {FS_CLI_BIN, "health", target,
                                     "--retries=1", "--timeout=5s"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProgram(argv);
  };
  ProgramRun run = health({});
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "SERVING")) << run.output;

  run = health({"--service=no.such.Service"});
  EXPECT_EQ(run.exit_code, 4) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "SERVICE_UNKNOWN")) << run.output;

  server->server().GetHealthCheckService()->SetServingStatus(false);
  run = health({});
  EXPECT_EQ(run.exit_code, 4) << run.output;
  EXPECT_TRUE(absl::StrContains(run.output, "NOT_SERVING")) << run.output;

  // A server that never answers: the RPC runs out of time. (A 1 us
  // deadline against the live server races gRPC's deadline timer, and on
  // a loaded host the answer can come first.)
  testing::SilentTcpListener silent;
  ASSERT_NE(silent.port(), 0);
  run = RunProgram({FS_CLI_BIN, "health",
                    absl::StrCat("--target=127.0.0.1:", silent.port()),
                    "--retries=1", "--timeout=300ms"});
  EXPECT_EQ(run.exit_code, 3) << run.output;

  run = RunProgram({FS_CLI_BIN, "health",
                    absl::StrCat("--target=127.0.0.1:", testing::FreeTcpPort()),
                    "--retries=1", "--timeout=5s"});
  EXPECT_EQ(run.exit_code, 2) << run.output;

  run = RunProgram({FS_CLI_BIN, "health", "extra-argument", target});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  run = RunProgram({FS_CLI_BIN, "healthz", target});
  EXPECT_EQ(run.exit_code, 1) << run.output;
  run = RunProgram({FS_CLI_BIN, "health", target, "--tls_ca=/no/such/ca.pem"});
  EXPECT_EQ(run.exit_code, 1) << run.output;
}

TEST(CliTest, ClientErrorsNameTheFieldAtFault) {
  auto server = testing::StartFakeServer();
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions options;
  options.target = absl::StrCat("127.0.0.1:", server->server->port());
  auto client = SamplerClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  v1::SampleRequest request = testing::MakeRequest(4, 16, 1);
  for (int r = 0; r < 4; ++r) request.add_row_params();
  request.mutable_row_params(3)->set_top_p(1.5f);
  const absl::StatusOr<v1::SampleResponse> response =
      (*client)->Sample(request);
  ASSERT_EQ(response.status().code(), absl::StatusCode::kInvalidArgument);
  const std::optional<FieldViolation> violation =
      GetFieldViolation(response.status());
  ASSERT_TRUE(violation.has_value()) << response.status();
  EXPECT_EQ(violation->field, "row_params[3].top_p");
  EXPECT_TRUE(absl::StrContains(violation->description, "got 1.5"))
      << violation->description;
  EXPECT_EQ(ErrorReason(response.status()), "INVALID_SAMPLING_PARAMS");

  // ModelInfo names the build it came from.
  const absl::StatusOr<v1::ModelInfo> info = (*client)->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version(), kVersion);
  EXPECT_EQ(info->git_revision(), kGitRevision);
}

}  // namespace
}  // namespace flashsampler
