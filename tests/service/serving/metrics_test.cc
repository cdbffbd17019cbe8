// Metrics::ObserveRequest: every request lands in its (rpc, code) series,
// from many threads at once, for the RPCs whose children are kept and for
// any other name.
#include "service/serving/metrics.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;

TEST(MetricsTest, RequestsFromManyThreadsAreEachCountedOnce) {
  Metrics metrics;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 1000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.ObserveRequest("Sample",
                               (i + t) % 4 == 0
                                   ? absl::StatusCode::kInvalidArgument
                                   : absl::StatusCode::kOk,
                               0.002);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::string text = metrics.TextExposition();
  constexpr int kInvalid = kThreads * kPerThread / 4;
  constexpr int kOk = kThreads * kPerThread - kInvalid;
  EXPECT_THAT(
      text, HasSubstr(absl::StrCat(
                "flashsampler_requests_total{code=\"OK\",rpc=\"Sample\"} ", kOk,
                "\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat(
                        "flashsampler_requests_total{code=\"INVALID_ARGUMENT\","
                        "rpc=\"Sample\"} ",
                        kInvalid, "\n")));
  EXPECT_THAT(text,
              HasSubstr(absl::StrCat("flashsampler_request_duration_seconds_"
                                     "count{code=\"OK\",rpc=\"Sample\"} ",
                                     kOk, "\n")));
}

TEST(MetricsTest, AnRpcWithoutKeptChildrenIsStillCounted) {
  Metrics metrics;
  for (int i = 0; i < 3; ++i) {
    metrics.ObserveRequest("Custom", absl::StatusCode::kNotFound, 0.5);
  }
  metrics.ObserveRequest("SampleStream", absl::StatusCode::kCancelled, 0.5);
  const std::string text = metrics.TextExposition();
  EXPECT_THAT(text, HasSubstr("flashsampler_requests_total{code=\"NOT_FOUND\","
                              "rpc=\"Custom\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("flashsampler_request_duration_seconds_count{"
                              "code=\"NOT_FOUND\",rpc=\"Custom\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("flashsampler_requests_total{code=\"CANCELLED\","
                              "rpc=\"SampleStream\"} 1\n"));
}

}  // namespace
}  // namespace flashsampler
