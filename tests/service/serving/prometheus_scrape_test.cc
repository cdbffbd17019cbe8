// A real Prometheus server (Debian's `prometheus`) scrapes the daemon's
// metrics endpoint every second while traffic flows; its HTTP API must then
// answer histogram_quantile(0.99, ...) of the request-duration histogram with
// a finite number. The exporter is only useful if Prometheus can read it.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

constexpr int64_t kHidden = 16;

// Evaluates `query` on the Prometheus at `port`; NaN until it has a finite
// single-sample answer.
double QueryScalar(int port, const std::string& query, std::string* raw) {
  int code = 0;
  *raw = testing::HttpGet(
      port, absl::StrCat("/api/v1/query?query=", testing::UrlEncode(query)),
      &code);
  if (code != 200) return NAN;
  const nlohmann::json reply = nlohmann::json::parse(*raw, nullptr, false);
  if (reply.is_discarded() || reply.value("status", "") != "success") {
    return NAN;
  }
  const nlohmann::json& result = reply["data"]["result"];
  if (!result.is_array() || result.size() != 1) return NAN;
  const nlohmann::json& value = result[0]["value"];
  if (!value.is_array() || value.size() != 2 || !value[1].is_string()) {
    return NAN;
  }
  return std::strtod(value[1].get<std::string>().c_str(), nullptr);
}

TEST(PrometheusScrapeTest, RealPrometheusComputesTheP99RequestDuration) {
  // Part of acceptance: a missing Prometheus is a failure, not a skip.
  ASSERT_EQ(access(FS_PROMETHEUS_BIN, X_OK), 0)
      << FS_PROMETHEUS_BIN << " is missing: install Debian's prometheus";

  ServerOptions options = testing::TestServerOptions();
  options.metrics_port = testing::FreeTcpPort();
  absl::StatusOr<testing::FakeServer> started =
      testing::StartFakeServer(options);
  ASSERT_TRUE(started.ok()) << started.status();
  testing::FakeServer& f = *started;
  f.state->SetDelay(absl::Milliseconds(2));

  const std::string dir = testing::MakeTempDir();
  ASSERT_FALSE(dir.empty());
  {
    std::ofstream config(dir + "/prometheus.yml");
    config << "global:\n"
              "  scrape_interval: 1s\n"
              "  evaluation_interval: 1s\n"
              "scrape_configs:\n"
              "  - job_name: flashsampler\n"
              "    static_configs:\n"
              "      - targets: ['127.0.0.1:"
           << f.server->metrics_port() << "']\n";
  }
  const int prometheus_port = testing::FreeTcpPort();
  const pid_t prometheus = testing::Spawn(
      {FS_PROMETHEUS_BIN, "--config.file=" + dir + "/prometheus.yml",
       "--storage.tsdb.path=" + dir + "/data",
       absl::StrCat("--web.listen-address=127.0.0.1:", prometheus_port),
       "--log.level=warn"},
      dir + "/prometheus.log");
  ASSERT_GT(prometheus, 0);

  std::atomic<bool> stop{false};
  std::atomic<int> ok_calls{0};
  std::thread traffic([&] {
    uint64_t seed = 1;
    while (!stop) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      v1::SampleResponse response;
      if (f.stub
              ->Sample(&context, testing::MakeRequest(2, kHidden, seed++),
                       &response)
              .ok()) {
        ++ok_calls;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  });

  const std::string query =
      "histogram_quantile(0.99, sum by (le) "
      "(rate(flashsampler_request_duration_seconds_bucket[30s])))";
  double p99 = NAN;
  std::string raw;
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  while (absl::Now() < deadline) {
    p99 = QueryScalar(prometheus_port, query, &raw);
    if (std::isfinite(p99)) break;
    absl::SleepFor(absl::Milliseconds(500));
  }
  std::string up_raw;
  const double up =
      QueryScalar(prometheus_port, "up{job=\"flashsampler\"}", &up_raw);

  stop = true;
  traffic.join();
  kill(prometheus, SIGTERM);
  int exit_status = 0;
  if (!testing::WaitForExit(prometheus, absl::Seconds(15), &exit_status)) {
    kill(prometheus, SIGKILL);
    testing::WaitForExit(prometheus, absl::Seconds(5), &exit_status);
  }
  const std::string log = testing::ReadFileOrEmpty(dir + "/prometheus.log");
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);

  EXPECT_GT(ok_calls.load(), 0);
  EXPECT_EQ(up, 1.0) << up_raw << "\nprometheus log:\n" << log;
  ASSERT_TRUE(std::isfinite(p99))
      << "last answer: " << raw << "\nprometheus log:\n"
      << log;
  // Requests take 2 ms or more in the engine and the top bucket is 10 s.
  EXPECT_GT(p99, 0.0);
  EXPECT_LE(p99, 10.0);
}

}  // namespace
}  // namespace flashsampler
