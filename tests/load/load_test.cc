// The load generator: nearest-rank percentiles, summaries and CSVs, the
// Poisson schedule, and both load shapes against a scripted server
// (counts, error codes by name, no coordinated omission), unary or on one
// SampleStream per caller.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/hidden_states.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "load/load_runner.h"
#include "load/load_stats.h"
#include "tests/client/fake_sampler_server.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::UnorderedElementsAre;

TEST(PercentileTest, NearestRank) {
  std::vector<double> v;
  for (int i = 1; i <= 1000; ++i) v.push_back(i);
  EXPECT_EQ(Percentile(v, 0.5), 500);
  EXPECT_EQ(Percentile(v, 0.9), 900);
  EXPECT_EQ(Percentile(v, 0.99), 990);
  EXPECT_EQ(Percentile(v, 0.999), 999);
  EXPECT_EQ(Percentile(v, 1.0), 1000);
  EXPECT_EQ(Percentile(v, 0.0), 1);
  EXPECT_EQ(Percentile({7.0}, 0.999), 7.0);
  EXPECT_EQ(Percentile({}, 0.5), 0.0);
  // 10 values: p99 is the largest (rank ceil(9.9) = 10), p50 the 5th.
  std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_EQ(Percentile(ten, 0.99), 10);
  EXPECT_EQ(Percentile(ten, 0.5), 5);
}

TEST(SummarizeTest, CountsCodesAndUsesOkLatenciesOnly) {
  std::vector<CallRecord> records;
  for (int i = 0; i < 98; ++i) {
    records.push_back({0.01 * i, 0.001 * (i + 1), absl::StatusCode::kOk, 4});
  }
  records.push_back({1.0, 9.0, absl::StatusCode::kUnavailable, 4});
  records.push_back({1.0, 9.0, absl::StatusCode::kResourceExhausted, 4});
  const LoadSummary s = Summarize(records, 2.0, 3);
  EXPECT_EQ(s.requests, 100);
  EXPECT_EQ(s.ok, 98);
  EXPECT_EQ(s.errors, 2);
  EXPECT_EQ(s.dropped, 3);
  EXPECT_DOUBLE_EQ(s.throughput_rps, 49.0);
  EXPECT_DOUBLE_EQ(s.rows_per_s, 196.0);
  EXPECT_DOUBLE_EQ(s.p50_s, 0.049);
  EXPECT_DOUBLE_EQ(s.max_s, 0.098);  // the 9 s errors are not latencies
  EXPECT_THAT(s.codes,
              UnorderedElementsAre(Pair("OK", 98), Pair("UNAVAILABLE", 1),
                                   Pair("RESOURCE_EXHAUSTED", 1)));
  const std::string text = FormatSummary(s);
  EXPECT_THAT(text, HasSubstr("UNAVAILABLE=1"));
  EXPECT_THAT(text, HasSubstr("p99"));
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(CsvTest, RecordsAndAppendedSummaries) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp != nullptr ? tmp : "/tmp";
  const std::string records_path = dir + "/fs_load_records.csv";
  ASSERT_TRUE(
      WriteRecordsCsv(records_path,
                      {{0.5, 0.002, absl::StatusCode::kOk, 2},
                       {0.7, 0.1, absl::StatusCode::kDeadlineExceeded, 2}})
          .ok());
  EXPECT_EQ(ReadAll(records_path),
            "start_s,latency_s,code,rows\n"
            "0.500000,0.002000000,OK,2\n"
            "0.700000,0.100000000,DEADLINE_EXCEEDED,2\n");

  const std::string summary_path = dir + "/fs_load_summary.csv";
  std::remove(summary_path.c_str());
  LoadSummary s;
  s.requests = s.ok = 10;
  RunLabel run{"a", "closed", 4, 0.0, 1};
  ASSERT_TRUE(AppendSummaryCsv(summary_path, run, s).ok());
  run.label = "b";
  ASSERT_TRUE(AppendSummaryCsv(summary_path, run, s).ok());
  const std::string text = ReadAll(summary_path);
  EXPECT_EQ(text.find("label,mode"), 0u);
  EXPECT_EQ(text.find("label,mode", 1), std::string::npos);  // one header
  EXPECT_THAT(text, HasSubstr("\na,closed,4,"));
  EXPECT_THAT(text, HasSubstr("\nb,closed,4,"));
}

TEST(PoissonArrivalsTest, RateAndExponentialGaps) {
  const double rate = 1000.0;
  const std::vector<double> t = PoissonArrivals(rate, 20.0, 3);
  // 20000 expected, sd sqrt(20000) = 141: 5 sd is 707.
  EXPECT_NEAR(static_cast<double>(t.size()), 20000.0, 710.0);
  ASSERT_TRUE(std::is_sorted(t.begin(), t.end()));
  EXPECT_GE(t.front(), 0.0);
  EXPECT_LT(t.back(), 20.0);
  // Exponential gaps: mean 1/rate, and P(gap > mean) = e^-1.
  int longer = 0;
  for (size_t i = 1; i < t.size(); ++i) longer += (t[i] - t[i - 1]) > 1e-3;
  EXPECT_NEAR(static_cast<double>(longer) / (t.size() - 1), std::exp(-1.0),
              0.02);
  EXPECT_EQ(PoissonArrivals(rate, 20.0, 3), t);  // seeded
  EXPECT_TRUE(PoissonArrivals(0.0, 1.0, 3).empty());
}

class LoadRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = FakeSamplerServer::Start(1);
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.target = server_->address();
    options.timeout = absl::Seconds(5);
    options.retry.max_attempts = 1;
    auto client = SamplerClient::Create(options);
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);
    auto request = MakeSampleRequest(
        RandomHiddenStates(3, FakeSamplerService::kHidden, 1, DType::kBf16),
        {});
    ASSERT_TRUE(request.ok());
    request_ = std::make_shared<const v1::SampleRequest>(*request);
  }
  std::unique_ptr<FakeSamplerServer> server_;
  std::unique_ptr<SamplerClient> client_;
  std::shared_ptr<const v1::SampleRequest> request_;
};

TEST_F(LoadRunTest, ClosedLoopKeepsConcurrencyCallersBusy) {
  server_->service().set_delay(absl::Milliseconds(20));
  LoadOptions options;
  options.mode = LoadOptions::Mode::kClosed;
  options.concurrency = 4;
  options.duration = absl::Milliseconds(500);
  options.warmup = absl::Milliseconds(100);
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const LoadSummary s = Summarize(result->records, result->duration_s, 0);
  // 4 callers x 500 ms / ~20 ms = ~100 calls; at least half of that even on
  // a loaded machine, and never more than the 4 x 25 the delay allows.
  EXPECT_GE(s.ok, 50);
  EXPECT_LE(s.ok, 104);
  EXPECT_EQ(s.errors, 0);
  EXPECT_GE(s.p50_s, 0.020);
  for (const CallRecord& r : result->records) {
    EXPECT_GE(r.start_s, 0.0);
    EXPECT_LT(r.start_s, 0.5);
    EXPECT_EQ(r.rows, 3);
  }
  // The warm-up calls were made but not recorded.
  EXPECT_GT(server_->service().calls(), static_cast<int>(s.requests));
}

// A caller that polls for its answers without sleeping gets every answer,
// checked as the sleeping caller's are.
TEST_F(LoadRunTest, ClosedLoopPollSpinGetsEveryAnswer) {
  server_->service().set_delay(absl::Milliseconds(5));
  LoadOptions options;
  options.mode = LoadOptions::Mode::kClosed;
  options.concurrency = 1;
  options.poll_spin = true;
  options.duration = absl::Milliseconds(200);
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const LoadSummary s = Summarize(result->records, result->duration_s, 0);
  EXPECT_GE(s.ok, 10);
  EXPECT_LE(s.ok, 41);  // 200 ms / 5 ms, and the answers are checked
  EXPECT_EQ(s.errors, 0);
  EXPECT_GE(s.p50_s, 0.005);
  EXPECT_EQ(server_->service().calls(), static_cast<int>(s.requests));
}

TEST_F(LoadRunTest, ClosedLoopStreamKeepsOneStreamPerCaller) {
  server_->service().set_delay(absl::Milliseconds(20));
  LoadOptions options;
  options.mode = LoadOptions::Mode::kClosed;
  options.stream = true;
  options.concurrency = 4;
  options.duration = absl::Milliseconds(500);
  options.warmup = absl::Milliseconds(100);
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const LoadSummary s = Summarize(result->records, result->duration_s, 0);
  // The same bounds as unary calls: one request in flight per caller.
  EXPECT_GE(s.ok, 50);
  EXPECT_LE(s.ok, 104);
  EXPECT_EQ(s.errors, 0);
  EXPECT_GE(s.p50_s, 0.020);
  for (const CallRecord& r : result->records) EXPECT_EQ(r.rows, 3);
  // Every request went on the callers' streams: 4 streams, no unary call
  // besides the stream's own (the fake counts each streamed request).
  EXPECT_EQ(server_->service().streams(), 4);
  EXPECT_GT(server_->service().calls(), static_cast<int>(s.requests));
}

TEST_F(LoadRunTest, ClosedLoopStreamCountsPerRequestErrorsByCode) {
  // Refused requests are answered in the stream; the streams stay open.
  server_->service().FailEvery(5, grpc::StatusCode::RESOURCE_EXHAUSTED);
  LoadOptions options;
  options.stream = true;
  options.concurrency = 2;
  options.duration = absl::Milliseconds(200);
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const LoadSummary s = Summarize(result->records, result->duration_s, 0);
  EXPECT_GT(s.ok, 0);
  EXPECT_EQ(s.codes.at("RESOURCE_EXHAUSTED"), server_->service().calls() / 5);
  EXPECT_EQ(s.ok + s.codes.at("RESOURCE_EXHAUSTED"), s.requests);
  EXPECT_EQ(server_->service().streams(), 2);
}

TEST_F(LoadRunTest, ClosedLoopStreamSurvivesABrokenStream) {
  LoadOptions options;
  options.stream = true;
  options.concurrency = 1;
  options.duration = absl::Milliseconds(300);
  server_->service().set_delay(absl::Milliseconds(5));
  std::thread restarter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    // Cancels every call in flight, the open stream included.
    server_->server().Shutdown(absl::ToChronoTime(absl::Now()));
  });
  auto result = RunLoad(*client_, request_, options);
  restarter.join();
  ASSERT_TRUE(result.ok()) << result.status();
  const LoadSummary s = Summarize(result->records, result->duration_s, 0);
  EXPECT_GT(s.ok, 0);
  EXPECT_GT(s.errors, 0);  // the stream broke; each new one fails to open
  EXPECT_EQ(s.ok + s.errors, s.requests);
}

TEST_F(LoadRunTest, OpenLoopSendsAtTheOfferedRateAndCountsErrorsByCode) {
  server_->service().FailEvery(5, grpc::StatusCode::RESOURCE_EXHAUSTED);
  LoadOptions options;
  options.mode = LoadOptions::Mode::kOpen;
  options.rate = 400.0;
  options.duration = absl::Milliseconds(500);
  options.seed = 9;
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  const size_t expected = PoissonArrivals(400.0, 0.5, 9).size();
  const LoadSummary s =
      Summarize(result->records, result->duration_s, result->dropped);
  EXPECT_EQ(static_cast<size_t>(s.requests), expected);  // every arrival sent
  EXPECT_EQ(s.dropped, 0);
  EXPECT_EQ(s.codes.at("RESOURCE_EXHAUSTED"), server_->service().calls() / 5);
  EXPECT_EQ(s.ok + s.codes.at("RESOURCE_EXHAUSTED"), s.requests);
}

TEST_F(LoadRunTest, OpenLoopMeasuresFromTheScheduledArrival) {
  // A server slower than the arrival rate: latency must include the time
  // calls waited behind earlier ones (no coordinated omission), and the cap
  // on outstanding calls turns the excess into drops.
  server_->service().set_delay(absl::Milliseconds(50));
  LoadOptions options;
  options.mode = LoadOptions::Mode::kOpen;
  options.rate = 200.0;
  options.duration = absl::Milliseconds(400);
  options.max_outstanding = 4;
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(result->dropped, 0);
  for (const CallRecord& r : result->records) {
    EXPECT_GE(r.latency_s, 0.050);
  }
}

TEST_F(LoadRunTest, WrongTokenCountIsDataLoss) {
  // A fast wrong answer must not count as a fast answer.
  server_->service().set_truncate_tokens(true);
  LoadOptions options;
  options.concurrency = 1;
  options.duration = absl::Milliseconds(50);
  auto result = RunLoad(*client_, request_, options);
  ASSERT_TRUE(result.ok());
  ASSERT_FALSE(result->records.empty());
  for (const CallRecord& r : result->records) {
    EXPECT_EQ(r.code, absl::StatusCode::kDataLoss);
  }
}

TEST_F(LoadRunTest, RejectsBadOptions) {
  LoadOptions options;
  options.concurrency = 0;
  EXPECT_EQ(RunLoad(*client_, request_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = LoadOptions();
  options.mode = LoadOptions::Mode::kOpen;
  options.rate = 0.0;
  EXPECT_EQ(RunLoad(*client_, request_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.rate = 10.0;
  options.stream = true;  // streams are for the closed loop's callers
  EXPECT_EQ(RunLoad(*client_, request_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunLoad(*client_, nullptr, LoadOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace flashsampler
