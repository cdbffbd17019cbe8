// A real Prometheus server (Debian's `prometheus`) scrapes the daemon's
// metrics endpoint every second while traffic flows; its HTTP API must then
// answer histogram_quantile(0.99, ...) of the request-duration histogram with
// a finite number. The exporter is only useful if Prometheus can read it.
// A second test checks the buckets' resolution: Prometheus' p50 and p99 of
// a load whose latencies the test measured itself agree within ~10%.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

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

// Prometheus on a free port scraping `target_port` every second; killed
// (and its directory removed) on destruction.
class ScrapingPrometheus {
 public:
  explicit ScrapingPrometheus(int target_port) : dir_(testing::MakeTempDir()) {
    std::ofstream config(dir_ + "/prometheus.yml");
    config << "global:\n"
              "  scrape_interval: 1s\n"
              "  evaluation_interval: 1s\n"
              "scrape_configs:\n"
              "  - job_name: flashsampler\n"
              "    static_configs:\n"
              "      - targets: ['127.0.0.1:"
           << target_port << "']\n";
    config.close();
    port_ = testing::FreeTcpPort();
    pid_ = testing::Spawn(
        {FS_PROMETHEUS_BIN, "--config.file=" + dir_ + "/prometheus.yml",
         "--storage.tsdb.path=" + dir_ + "/data",
         absl::StrCat("--web.listen-address=127.0.0.1:", port_),
         "--log.level=warn"},
        dir_ + "/prometheus.log");
  }
  ~ScrapingPrometheus() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int exit_status = 0;
      if (!testing::WaitForExit(pid_, absl::Seconds(15), &exit_status)) {
        kill(pid_, SIGKILL);
        testing::WaitForExit(pid_, absl::Seconds(5), &exit_status);
      }
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  bool started() const { return pid_ > 0 && !dir_.empty(); }
  int port() const { return port_; }
  std::string log() const {
    return testing::ReadFileOrEmpty(dir_ + "/prometheus.log");
  }

 private:
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// The sorted sample's q-quantile, the rank histogram_quantile estimates.
double Quantile(const std::vector<double>& sorted, double q) {
  const size_t rank = static_cast<size_t>(std::ceil(q * sorted.size()));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

// Defect: with buckets 1, 2.5, 5 ms, histogram_quantile put the p50 of a
// load answered in 2.0-2.4 ms at about 1.9 ms (17% off): the buckets could
// not resolve the GPU's 0.1-5 ms latencies.
TEST(PrometheusScrapeTest, CoarseBucketsMisplacedTheP50) {
#if defined(__SANITIZE_THREAD__)
  // The check compares latencies measured on both sides of the call;
  // ThreadSanitizer's 5-15x slowdown of the client side alone moves them
  // apart by more than a bucket.
  std::fprintf(stderr, "SKIPPED under ThreadSanitizer: a timing check\n");
  GTEST_SKIP() << "timing check, skipped under ThreadSanitizer";
#endif
  ASSERT_EQ(access(FS_PROMETHEUS_BIN, X_OK), 0)
      << FS_PROMETHEUS_BIN << " is missing: install Debian's prometheus";
  ServerOptions options = testing::TestServerOptions();
  options.metrics_port = testing::FreeTcpPort();
  absl::StatusOr<testing::FakeServer> started =
      testing::StartFakeServer(options);
  ASSERT_TRUE(started.ok()) << started.status();
  testing::FakeServer& f = *started;
  ScrapingPrometheus prometheus(f.server->metrics_port());
  ASSERT_TRUE(prometheus.started());

  // One request at a time, so each is one batch whose engine time the fake
  // sets: 95% take 2.0-2.4 ms, 5% take 7-8 ms (a tail the p99 falls in).
  constexpr int kCalls = 400;
  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<double> latencies;
  // Each call's queue and execution by the server's clock, which its
  // request duration contains: the bound from below. The client's latency
  // is the bound from above; on a busy host (a parallel test run) a stall
  // of the client alone stretches its tail, so the client's latency less
  // its median overhead is no bound from below (one run of the suite on
  // two busy cores: the client's p99 10.35 ms with 0.44 ms of median
  // overhead, the histogram's 8.36).
  std::vector<double> server_times;
  for (int i = 0; i < kCalls; ++i) {
    const double delay_ms = unit(random) < 0.95 ? 2.0 + 0.4 * unit(random)
                                                : 7.0 + 1.0 * unit(random);
    f.state->SetDelay(absl::Microseconds(1000 * delay_ms));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::SampleResponse response;
    const absl::Time start = absl::Now();
    ASSERT_TRUE(f.stub
                    ->Sample(&context, testing::MakeRequest(1, kHidden, i + 1),
                             &response)
                    .ok());
    latencies.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    server_times.push_back(response.timing().queue_seconds() +
                           response.timing().execute_seconds());
  }
  std::sort(latencies.begin(), latencies.end());
  std::sort(server_times.begin(), server_times.end());

  // Cumulative buckets (no rate()): every call above, once scraped.
  const std::string series =
      "flashsampler_request_duration_seconds_bucket{rpc=\"Sample\","
      "code=\"OK\"}";
  std::string raw;
  ASSERT_TRUE(testing::PollUntil(
      [&] {
        return QueryScalar(prometheus.port(),
                           "flashsampler_request_duration_seconds_count{rpc="
                           "\"Sample\",code=\"OK\"}",
                           &raw) == kCalls;
      },
      absl::Seconds(30)))
      << raw << "\nprometheus log:\n"
      << prometheus.log();
  for (const double q : {0.5, 0.99}) {
    SCOPED_TRACE(absl::StrCat("q = ", q));
    const double estimate = QueryScalar(
        prometheus.port(),
        absl::StrCat("histogram_quantile(", q, ", sum by (le) (", series, "))"),
        &raw);
    ASSERT_TRUE(std::isfinite(estimate)) << raw;
    // Between the server's queue and execution and the client's latency;
    // one bucket spans 10%.
    const double measured = Quantile(latencies, q);
    const double server = Quantile(server_times, q);
    EXPECT_LE(estimate, 1.1 * measured)
        << "client " << measured << ", server " << server;
    EXPECT_GE(estimate, 0.9 * server)
        << "client " << measured << ", server " << server;
  }
}

}  // namespace
}  // namespace flashsampler
