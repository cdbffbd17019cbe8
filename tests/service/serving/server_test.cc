// The real Server over loopback gRPC with a gated fake engine: every call
// outcome of docs/api.md's error codes (validation, unimplemented, deadline,
// cancel, queue full, drain, fatal device error), SampleStream ordering and
// errors, health, reflection, ModelInfo and the metric families.
#include "service/serving/server.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

using testing::AsyncSample;
using testing::CheckHealth;
using ::testing::ElementsAreArray;
using testing::ExpectedFakeTokens;
using testing::FakeServer;
using testing::MakeRequest;
using testing::MetricValue;
using testing::PollUntil;
using testing::SampleAsync;
using testing::StartFakeServer;
using ::testing::StartsWith;
using testing::TestServerOptions;
using HealthStatus = grpc::health::v1::HealthCheckResponse;

constexpr int64_t kVocab = 1000;
constexpr int64_t kHidden = 16;
constexpr absl::Duration kWait = absl::Seconds(10);

FakeServer Start(const ServerOptions& options = TestServerOptions(),
                 const testing::FakeEngineOptions& engine = {}) {
  absl::StatusOr<FakeServer> fake = StartFakeServer(options, engine);
  EXPECT_TRUE(fake.ok()) << fake.status();
  return *std::move(fake);
}

grpc::Status Call(FakeServer& f, const v1::SampleRequest& request,
                  v1::SampleResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  return f.stub->Sample(&context, request, response);
}

// A server on a fresh FakeEngine, created but not started.
absl::StatusOr<std::unique_ptr<Server>> CreateOnFakeEngine(
    const ServerOptions& options) {
  return Server::CreateWithEngine(options,
                                  std::make_unique<testing::FakeEngine>(
                                      std::make_shared<testing::FakeState>(),
                                      testing::FakeEngineOptions()));
}

double Metric(FakeServer& f, const std::string& series) {
  return MetricValue(f.server->metrics().TextExposition(), series);
}

bool QueueRowsReach(FakeServer& f, double rows) {
  return PollUntil([&] { return Metric(f, "flashsampler_queue_rows") == rows; },
                   kWait);
}

TEST(ServerTest, SampleReturnsTheCallersRowsAndSeeds) {
  FakeServer f = Start();
  v1::SampleRequest request = MakeRequest(3, kHidden, 77, 1.0f);
  request.set_request_id("req-1");
  request.add_steps(4);
  request.add_steps(5);
  request.add_steps(6);
  v1::SampleResponse response;
  const grpc::Status status = Call(f, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_code() << " "
                           << status.error_message();
  EXPECT_EQ(response.request_id(), "req-1");
  EXPECT_EQ(response.n(), 1);
  EXPECT_THAT(response.token_ids(),
              ElementsAreArray(ExpectedFakeTokens(request, kVocab)));
  EXPECT_THAT(response.seeds(), ElementsAreArray({77u, 78u, 79u}));
  EXPECT_EQ(response.timing().batch_rows(), 3);
  EXPECT_GE(response.timing().queue_seconds(), 0.0);
}

TEST(ServerTest, ServerDrawnSeedsAreReturnedAndReplay) {
  FakeServer f = Start();
  v1::SampleRequest request = MakeRequest(4, kHidden, 0);
  request.mutable_params()->set_n(3);
  v1::SampleResponse first;
  ASSERT_TRUE(Call(f, request, &first).ok());
  ASSERT_EQ(first.seeds_size(), 4);
  ASSERT_EQ(first.token_ids_size(), 12);
  for (uint64_t seed : first.seeds()) request.add_seeds(seed);
  v1::SampleResponse replay;
  ASSERT_TRUE(Call(f, request, &replay).ok());
  EXPECT_THAT(replay.token_ids(), ElementsAreArray(first.token_ids()));
  EXPECT_THAT(replay.token_ids(),
              ElementsAreArray(ExpectedFakeTokens(request, kVocab)));
}

TEST(ServerTest, MalformedInputsAreInvalidArgumentAndTheServerKeepsServing) {
  ServerOptions options = TestServerOptions();
  options.batcher.max_batch_rows = 8;
  FakeServer f = Start(options);
  const std::vector<testing::MalformedCase> cases =
      testing::MalformedCases(kVocab, kHidden, 8);
  ASSERT_GE(cases.size(), 15u);
  const v1::SampleRequest valid = MakeRequest(2, kHidden, 5);
  for (const testing::MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::SampleResponse response;
    const grpc::Status status = Call(f, c.request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), StartsWith(c.field + ": "));
    // grpc-status-details-bin: google.rpc.BadRequest with the field path as
    // the request spells it, and an ErrorInfo reason.
    const std::vector<FieldViolation> violations = FieldViolations(status);
    ASSERT_EQ(violations.size(), 1u) << status.error_message();
    EXPECT_EQ(violations[0].field, c.field);
    EXPECT_EQ(c.field + ": " + violations[0].description,
              status.error_message());
    EXPECT_EQ(ErrorReason(status),
              absl::StartsWith(c.field, "hidden_states")
                  ? "INVALID_HIDDEN_STATES"
              : absl::StartsWith(c.field, "params") ||
                      absl::StartsWith(c.field, "row_params")
                  ? "INVALID_SAMPLING_PARAMS"
                  : "INVALID_REQUEST");
    // The next well-formed request is served as usual.
    v1::SampleResponse ok;
    ASSERT_TRUE(Call(f, valid, &ok).ok());
    EXPECT_THAT(ok.token_ids(),
                ElementsAreArray(ExpectedFakeTokens(valid, kVocab)));
  }
  EXPECT_EQ(f.state->launches(), static_cast<int>(cases.size()));
  EXPECT_EQ(Metric(f,
                   "flashsampler_requests_total{code=\"INVALID_ARGUMENT\","
                   "rpc=\"Sample\"}"),
            static_cast<double>(cases.size()));
}

TEST(ServerTest, ControlTheEngineLacksIsUnimplemented) {
  testing::FakeEngineOptions engine;
  engine.all_controls = false;
  engine.supported_controls = {"temperature", "top_k"};
  FakeServer f = Start(TestServerOptions(), engine);
  v1::SampleRequest request = MakeRequest(2, kHidden, 5);
  request.mutable_params()->set_top_k(3);
  v1::SampleResponse response;
  ASSERT_TRUE(Call(f, request, &response).ok());
  request.mutable_params()->set_min_p(0.1f);
  const grpc::Status status = Call(f, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_THAT(status.error_message(), StartsWith("params.min_p: "));
}

TEST(ServerTest, GetModelInfoDescribesTheEngine) {
  ServerOptions options = TestServerOptions();
  options.batcher.max_batch_rows = 64;
  FakeServer f = Start(options);
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(f.stub->GetModelInfo(&context, {}, &info).ok());
  EXPECT_EQ(info.vocab_size(), kVocab);
  EXPECT_EQ(info.hidden_size(), kHidden);
  EXPECT_EQ(info.backend(), "fake");
  EXPECT_EQ(info.tp_degree(), 1);
  ASSERT_EQ(info.shards_size(), 1);
  EXPECT_EQ(info.shards(0).vocab_end(), kVocab);
  EXPECT_EQ(info.max_batch_rows(), 64);
  EXPECT_EQ(info.weights_source(), "fake");
  EXPECT_FALSE(info.version().empty());
  EXPECT_EQ(info.supported_features_size(),
            static_cast<int>(AllSamplingControls().size()));
}

TEST(ServerTest, HealthIsServingAfterStartAndReflectionListsTheService) {
  FakeServer f = Start();
  EXPECT_EQ(CheckHealth(f.health.get()), HealthStatus::SERVING);
  EXPECT_EQ(CheckHealth(f.health.get(), "flashsampler.v1.Sampler"),
            HealthStatus::SERVING);
  const std::string services =
      testing::ReflectionListServicesRaw(f.channel.get());
  EXPECT_TRUE(absl::StrContains(services, "flashsampler.v1.Sampler"));
  EXPECT_TRUE(absl::StrContains(services, "grpc.health.v1.Health"));
}

// The tail of the "dropped before launch" tests: with the gate still
// closed, give the server time to see the drop, open the gate, and check
// that `running` (seed 1) completed, the dropped call was counted under
// `code`, and only seed 1's rows were computed.
void ExpectOnlyTheRunningCallComputed(FakeServer& f,
                                      testing::AsyncSample& running,
                                      const std::string& code) {
  absl::SleepFor(absl::Milliseconds(300));
  f.state->OpenGate();
  running.Join();
  EXPECT_TRUE(running.status.ok());
  const std::string series = absl::StrCat("flashsampler_requests_total{code=\"",
                                          code, "\",rpc=\"Sample\"}");
  ASSERT_TRUE(PollUntil([&] { return Metric(f, series) == 1.0; }, kWait));
  EXPECT_THAT(f.state->seeds_computed(), ElementsAreArray({1u}));
}

TEST(ServerTest, DeadlineThatPassesInTheQueueIsNotComputed) {
  FakeServer f = Start();
  f.state->CloseGate();
  auto running = SampleAsync(f.stub.get(), MakeRequest(1, kHidden, 1));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  auto expiring = SampleAsync(f.stub.get(), MakeRequest(2, kHidden, 500),
                              absl::Milliseconds(200));
  expiring->Join();
  EXPECT_EQ(expiring->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server's copy of the deadline starts when the call reaches it, a
  // little after the client's; it passes too before the launch, and the
  // server answers the expired request without computing its rows.
  ExpectOnlyTheRunningCallComputed(f, *running, "DEADLINE_EXCEEDED");
}

TEST(ServerTest, ClientCancelBeforeLaunchIsNotComputed) {
  FakeServer f = Start();
  f.state->CloseGate();
  auto running = SampleAsync(f.stub.get(), MakeRequest(1, kHidden, 1));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  auto cancelled = SampleAsync(f.stub.get(), MakeRequest(3, kHidden, 900));
  ASSERT_TRUE(QueueRowsReach(f, 3));
  cancelled->context.TryCancel();
  cancelled->Join();
  EXPECT_EQ(cancelled->status.error_code(), grpc::StatusCode::CANCELLED);
  // The cancellation reaches the server before the launch.
  ExpectOnlyTheRunningCallComputed(f, *running, "CANCELLED");
}

TEST(ServerTest, FullQueueIsResourceExhausted) {
  ServerOptions options = TestServerOptions();
  options.batcher.max_queue_rows = 4;
  FakeServer f = Start(options);
  f.state->CloseGate();
  auto running = SampleAsync(f.stub.get(), MakeRequest(2, kHidden, 1));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  auto q1 = SampleAsync(f.stub.get(), MakeRequest(2, kHidden, 10));
  auto q2 = SampleAsync(f.stub.get(), MakeRequest(2, kHidden, 20));
  ASSERT_TRUE(QueueRowsReach(f, 4));
  v1::SampleResponse response;
  const grpc::Status status = Call(f, MakeRequest(1, kHidden, 30), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "queue full"));
  f.state->OpenGate();
  for (auto* call : {running.get(), q1.get(), q2.get()}) {
    call->Join();
    EXPECT_TRUE(call->status.ok());
  }
}

TEST(ServerTest, ACallIsNotHeldBehindABatchItsSampleThreadRuns) {
  // The first call finds the engine idle, so the sample thread that took it
  // runs its batch (Batcher::SubmitOrRun), held at the gate. Later calls on
  // the same connection must reach the other thread: gRPC hands a
  // connection's calls to one completion queue first.
  ServerOptions options = TestServerOptions();
  options.sample_threads = 2;
  FakeServer f = Start(options);
  // A quick batch first: the batcher runs a call on its own thread only
  // after one that took under Batcher::kInlineMaxExecute.
  v1::SampleResponse quick;
  ASSERT_TRUE(Call(f, MakeRequest(1, kHidden, 1), &quick).ok());
  f.state->CloseGate();
  auto running = SampleAsync(f.stub.get(), MakeRequest(1, kHidden, 1));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  v1::SampleRequest refused = MakeRequest(1, kHidden, 2);
  refused.mutable_params()->set_top_p(2.0f);
  for (int i = 0; i < 8; ++i) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    v1::SampleResponse response;
    EXPECT_EQ(f.stub->Sample(&context, refused, &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << "call " << i;
  }
  f.state->OpenGate();
  running->Join();
  EXPECT_TRUE(running->status.ok()) << running->status.error_message();
}

TEST(ServerTest, ShutdownAnswersEveryAcceptedRequestAndRefusesLaterOnes) {
  FakeServer f = Start();
  f.state->CloseGate();
  std::vector<std::unique_ptr<AsyncSample>> accepted;
  std::vector<v1::SampleRequest> requests;
  requests.push_back(MakeRequest(1, kHidden, 1, 0.0f));
  accepted.push_back(SampleAsync(f.stub.get(), requests.back()));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  for (int i = 1; i < 4; ++i) {
    requests.push_back(MakeRequest(2, kHidden, 100 * i, 3.0f * i));
    accepted.push_back(SampleAsync(f.stub.get(), requests.back()));
  }
  ASSERT_TRUE(QueueRowsReach(f, 6));

  std::thread stopper([&f] { f.server->Stop(); });
  // Draining: health says NOT_SERVING while accepted work finishes, and new
  // calls are refused with UNAVAILABLE.
  ASSERT_TRUE(PollUntil(
      [&] { return CheckHealth(f.health.get()) == HealthStatus::NOT_SERVING; },
      kWait));
  v1::SampleResponse refused;
  const grpc::Status late = Call(f, MakeRequest(1, kHidden, 9), &refused);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(late.error_message(), "draining"));

  f.state->OpenGate();
  stopper.join();
  for (size_t i = 0; i < accepted.size(); ++i) {
    accepted[i]->Join();
    ASSERT_TRUE(accepted[i]->status.ok())
        << accepted[i]->status.error_message();
    EXPECT_THAT(accepted[i]->response.token_ids(),
                ElementsAreArray(ExpectedFakeTokens(requests[i], kVocab)));
  }
  v1::SampleResponse after;
  EXPECT_EQ(Call(f, MakeRequest(1, kHidden, 9), &after).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST(ServerTest, FatalDeviceErrorFlipsHealthAndFailsLaterCalls) {
  FakeServer f = Start();
  f.state->FailNext(absl::UnavailableError("device lost"));
  v1::SampleResponse response;
  EXPECT_EQ(Call(f, MakeRequest(1, kHidden, 1), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CheckHealth(f.health.get()), HealthStatus::NOT_SERVING);
  EXPECT_FALSE(f.server->serving());
  const grpc::Status later = Call(f, MakeRequest(1, kHidden, 2), &response);
  EXPECT_EQ(later.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(f.state->launches(), 0);
  const absl::Time start = absl::Now();
  f.server->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// --- SampleStream -----------------------------------------------------------

using Stream = grpc::ClientReaderWriter<v1::SampleRequest, v1::SampleResponse>;

TEST(ServerTest, StreamAnswersInOrderAndSurvivesABadMessage) {
  FakeServer f = Start();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = f.stub->SampleStream(&context);
  std::vector<v1::SampleRequest> requests;
  for (int i = 0; i < 6; ++i) {
    v1::SampleRequest r = MakeRequest(1 + i % 3, kHidden, 1000 * (i + 1), i);
    r.set_request_id(absl::StrCat("r", i));
    if (i == 2) r.mutable_hidden_states()->set_shape(1, kHidden + 1);
    if (i == 4) r.mutable_params()->set_top_p(0.0f);
    requests.push_back(r);
    ASSERT_TRUE(stream->Write(r));
  }
  stream->WritesDone();
  for (int i = 0; i < 6; ++i) {
    SCOPED_TRACE(i);
    v1::SampleResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(response.request_id(), absl::StrCat("r", i));
    if (i == 2 || i == 4) {
      EXPECT_EQ(response.error().code(),
                static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
      EXPECT_THAT(
          response.error().message(),
          StartsWith(i == 2 ? "hidden_states.shape[1]: " : "params.top_p: "));
      EXPECT_EQ(response.token_ids_size(), 0);
    } else {
      EXPECT_FALSE(response.has_error());
      EXPECT_THAT(response.token_ids(),
                  ElementsAreArray(ExpectedFakeTokens(requests[i], kVocab)));
    }
  }
  v1::SampleResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
}

// A stream's message is read and decoded as a Sample() request is: rows
// whose row_params fill 64 KB and more (decoded on the parse pool) give the
// same tokens, and the same error naming the row and entry, on both.
TEST(ServerTest, StreamDecodesLargeRowParamsAsSampleDoes) {
  FakeServer f = Start();
  v1::SampleRequest good = MakeRequest(6, kHidden, 77);
  for (int r = 0; r < 6; ++r) {
    v1::SamplingParams* row = good.add_row_params();
    row->set_repetition_penalty(1.2f);
    for (int i = 0; i < 8000; ++i)
      row->add_prompt_token_ids((i * 37 + r) % kVocab);
  }
  ASSERT_GE(good.ByteSizeLong(), size_t{64} << 10);
  v1::SampleRequest bad = good;
  bad.mutable_row_params(4)->set_prompt_token_ids(3001, -1);
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = f.stub->SampleStream(&context);
  ASSERT_TRUE(stream->Write(good));
  ASSERT_TRUE(stream->Write(bad));
  stream->WritesDone();
  v1::SampleResponse streamed_good, streamed_bad;
  ASSERT_TRUE(stream->Read(&streamed_good));
  ASSERT_TRUE(stream->Read(&streamed_bad));
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_FALSE(streamed_good.has_error());
  EXPECT_THAT(streamed_good.token_ids(),
              ElementsAreArray(ExpectedFakeTokens(good, kVocab)));
  v1::SampleResponse unary;
  ASSERT_TRUE(Call(f, good, &unary).ok());
  EXPECT_THAT(unary.token_ids(), ElementsAreArray(streamed_good.token_ids()));
  const grpc::Status refused = Call(f, bad, &unary);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(),
              StartsWith("row_params[4].prompt_token_ids[3001]: "));
  EXPECT_EQ(streamed_bad.error().code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_EQ(streamed_bad.error().message(), refused.error_message());
}

TEST(ServerTest, StreamErrorWaitsForEarlierAnswers) {
  FakeServer f = Start();
  f.state->CloseGate();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = f.stub->SampleStream(&context);
  v1::SampleRequest slow = MakeRequest(1, kHidden, 1);
  slow.set_request_id("slow");
  v1::SampleRequest bad = MakeRequest(1, kHidden, 2);
  bad.set_request_id("bad");
  bad.clear_hidden_states();
  ASSERT_TRUE(stream->Write(slow));
  ASSERT_TRUE(stream->Write(bad));
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  // "bad" is answered at once on the server but must not overtake "slow".
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(Metric(f,
                   "flashsampler_requests_total{code=\"INVALID_ARGUMENT\","
                   "rpc=\"SampleStream\"}"),
            1.0);
  f.state->OpenGate();
  v1::SampleResponse first, second;
  ASSERT_TRUE(stream->Read(&first));
  ASSERT_TRUE(stream->Read(&second));
  EXPECT_EQ(first.request_id(), "slow");
  EXPECT_FALSE(first.has_error());
  EXPECT_EQ(second.request_id(), "bad");
  EXPECT_EQ(second.error().code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(ServerTest, StreamInFlightRequestsAreBounded) {
  ServerOptions options = TestServerOptions();
  options.max_stream_in_flight = 2;
  FakeServer f = Start(options);
  f.state->CloseGate();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = f.stub->SampleStream(&context);
  std::vector<v1::SampleRequest> requests;
  for (int i = 0; i < 5; ++i) {
    requests.push_back(MakeRequest(1, kHidden, 10 * (i + 1)));
    ASSERT_TRUE(stream->Write(requests.back()));
  }
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  // Two accepted (in the engine, or one there and one queued); the other
  // three wait in flow control rather than in server memory.
  auto accepted_rows = [&] {
    return f.state->rows_at_gate() + Metric(f, "flashsampler_queue_rows");
  };
  ASSERT_TRUE(PollUntil([&] { return accepted_rows() == 2; }, kWait));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(accepted_rows(), 2);
  f.state->OpenGate();
  stream->WritesDone();
  for (int i = 0; i < 5; ++i) {
    v1::SampleResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_THAT(response.token_ids(),
                ElementsAreArray(ExpectedFakeTokens(requests[i], kVocab)));
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST(ServerTest, DrainEndsOpenStreamsWithUnavailable) {
  FakeServer f = Start();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = f.stub->SampleStream(&context);
  ASSERT_TRUE(stream->Write(MakeRequest(1, kHidden, 1)));
  v1::SampleResponse response;
  ASSERT_TRUE(stream->Read(&response));
  // The stream is idle and open; Stop() must not wait drain_timeout on it.
  const absl::Time start = absl::Now();
  f.server->Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "draining"));
}

TEST(ServerTest, MetricFamiliesAreExported) {
  FakeServer f = Start();
  v1::SampleResponse response;
  ASSERT_TRUE(Call(f, MakeRequest(2, kHidden, 1), &response).ok());
  const std::string text = f.server->metrics().TextExposition();
  for (const char* name : {
           "flashsampler_request_duration_seconds_bucket",
           "flashsampler_requests_total",
           "flashsampler_request_decode_seconds_bucket",
           "flashsampler_queue_wait_seconds_bucket",
           "flashsampler_response_encode_seconds_bucket",
           "flashsampler_batch_execute_seconds_bucket",
           "flashsampler_batch_rows_bucket",
           "flashsampler_rows_sampled_total",
           "flashsampler_queue_rows",
           "flashsampler_batches_in_flight",
           "flashsampler_weights_info",
           "flashsampler_build_info",
       }) {
    EXPECT_TRUE(absl::StrContains(text, name)) << name;
  }
  // Labelled families appear once they have a series: device memory only
  // on GPU backends (none on the fake/CPU engine), fallbacks when counted.
  EXPECT_FALSE(absl::StrContains(text, "flashsampler_device_memory_bytes{"));
  f.server->metrics().SetDeviceMemoryBytes(3, 1024);
  f.server->metrics().CountExactFallback("top_p_nucleus_over_buffer", 2);
  const std::string later = f.server->metrics().TextExposition();
  EXPECT_EQ(
      MetricValue(later, "flashsampler_device_memory_bytes{device=\"3\"}"),
      1024.0);
  EXPECT_EQ(MetricValue(later,
                        "flashsampler_exact_fallback_rows_total{reason="
                        "\"top_p_nucleus_over_buffer\"}"),
            2.0);
  EXPECT_EQ(Metric(f, "flashsampler_rows_sampled_total"), 2.0);
  EXPECT_EQ(Metric(f,
                   "flashsampler_weights_info{backend=\"fake\","
                   "dtype=\"fp32\",hidden=\"16\",tp=\"1\",vocab=\"1000\"}"),
            1.0);
  EXPECT_EQ(Metric(f, "flashsampler_batch_rows_bucket{le=\"2\"}"), 1.0);
  // The one request's decoding and encoding, each observed once.
  EXPECT_EQ(Metric(f, "flashsampler_request_decode_seconds_count"), 1.0);
  EXPECT_EQ(Metric(f, "flashsampler_response_encode_seconds_count"), 1.0);
}

TEST(ServerTest, MetricsEndpointServesTheExposition) {
  ServerOptions options = TestServerOptions();
  options.metrics_port = testing::FreeTcpPort();
  FakeServer f = Start(options);
  EXPECT_EQ(f.server->metrics_port(), options.metrics_port);
  v1::SampleResponse response;
  ASSERT_TRUE(Call(f, MakeRequest(1, kHidden, 1), &response).ok());
  int code = 0;
  const std::string body =
      testing::HttpGet(f.server->metrics_port(), "/metrics", &code);
  EXPECT_EQ(code, 200);
  EXPECT_TRUE(absl::StrContains(
      body, "flashsampler_requests_total{code=\"OK\",rpc=\"Sample\"} 1"));
}

TEST(ServerTest, MaxReceiveSizeFollowsTheModel) {
  ServerOptions options = TestServerOptions();
  options.batcher.max_batch_rows = 4;
  FakeServer f = Start(options);
  // 4 rows x (16 x 4 + ceil(1000 / 32) x 10 + 256) + 4 MiB.
  EXPECT_EQ(f.server->max_receive_message_bytes(),
            4 * (16 * 4 + 32 * 10 + 256) + (4 << 20));
  // A message over the limit is refused by gRPC itself.
  v1::SampleRequest huge = MakeRequest(1, kHidden, 1);
  huge.set_request_id(std::string(5 << 20, 'x'));
  v1::SampleResponse response;
  EXPECT_EQ(Call(f, huge, &response).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  ASSERT_TRUE(Call(f, MakeRequest(1, kHidden, 1), &response).ok());
}

TEST(ServerTest, BatcherOptionsOutOfRangeAreRefusedNamingTheField) {
  struct Case {
    const char* field;
    void (*apply)(BatcherOptions*);
  };
  const Case cases[] = {
      {"max_batch_rows", [](BatcherOptions* b) { b->max_batch_rows = 0; }},
      {"max_queue_rows", [](BatcherOptions* b) { b->max_queue_rows = 0; }},
      {"overlap_min_rows", [](BatcherOptions* b) { b->overlap_min_rows = -1; }},
  };
  for (const Case& c : cases) {
    ServerOptions options = TestServerOptions();
    c.apply(&options.batcher);
    auto server = CreateOnFakeEngine(options);
    ASSERT_FALSE(server.ok()) << c.field;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(server.status().message(), c.field))
        << server.status();
  }
}

TEST(ServerTest, SampleThreadOptionsOutOfRangeAreRefusedNamingTheField) {
  struct Case {
    const char* field;
    void (*apply)(ServerOptions*);
  };
  const Case cases[] = {
      {"sample_threads", [](ServerOptions* o) { o->sample_threads = 0; }},
      {"sample_threads", [](ServerOptions* o) { o->sample_threads = -1; }},
      {"sample_threads", [](ServerOptions* o) { o->sample_threads = 257; }},
      {"sample_poll_spin",
       [](ServerOptions* o) { o->sample_poll_spin = absl::Microseconds(-1); }},
      {"sample_poll_spin",
       [](ServerOptions* o) { o->sample_poll_spin = absl::Milliseconds(11); }},
  };
  for (const Case& c : cases) {
    ServerOptions options = TestServerOptions();
    c.apply(&options);
    auto server = CreateOnFakeEngine(options);
    ASSERT_FALSE(server.ok()) << c.field;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(server.status().message()),
                StartsWith(absl::StrCat(c.field, ": ")));
  }
}

// A thread that polls without sleeping after its inline batch still takes
// every call of its queue, the next caller's and another connection's alike,
// and the server stops while it spins.
TEST(ServerTest, ASpinningSampleThreadAnswersEveryCall) {
  ServerOptions options = TestServerOptions();
  options.sample_threads = 1;
  options.sample_poll_spin = absl::Milliseconds(10);
  FakeServer f = Start(options);
  auto other_channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", f.server->port()),
                          grpc::InsecureChannelCredentials());
  auto other = v1::Sampler::NewStub(other_channel);
  for (int i = 0; i < 40; ++i) {
    const v1::SampleRequest request =
        MakeRequest(1 + i % 3, kHidden, 7 * i + 1);
    v1::SampleResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
    v1::Sampler::Stub* stub = i % 2 == 0 ? f.stub.get() : other.get();
    const grpc::Status status = stub->Sample(&context, request, &response);
    ASSERT_TRUE(status.ok()) << i << ": " << status.error_message();
    EXPECT_THAT(response.token_ids(),
                ElementsAreArray(ExpectedFakeTokens(request, kVocab)))
        << i;
  }
  const absl::Time stop = absl::Now();
  f.server->Stop();
  EXPECT_LT(absl::Now() - stop, kWait);
}

TEST(ServerTest, BadListenAddressFailsStart) {
  ServerOptions options = TestServerOptions();
  FakeServer first = Start(options);
  options.listen_address = absl::StrCat("127.0.0.1:", first.server->port());
  auto second = CreateOnFakeEngine(options);
  ASSERT_TRUE(second.ok());
  const absl::Status status = (*second)->Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(status.message(), "listen_address"));
}

// One Sample call over the Unix socket at `path`.
grpc::Status SampleOverUnix(const std::string& path,
                            const v1::SampleRequest& request,
                            v1::SampleResponse* response) {
  std::unique_ptr<v1::Sampler::Stub> stub =
      v1::Sampler::NewStub(grpc::CreateChannel(
          absl::StrCat("unix:", path), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  return stub->Sample(&context, request, response);
}

TEST(ServerTest, ServesOnAUnixSocketBesideTheTcpPortAndRemovesIt) {
  ServerOptions options = TestServerOptions();
  options.unix_socket = testing::MakeTempDir() + "/sampler.sock";
  FakeServer f = Start(options);
  ASSERT_TRUE(std::filesystem::is_socket(options.unix_socket));
  const v1::SampleRequest request = MakeRequest(2, kHidden, 5, 1.0f);
  v1::SampleResponse over_unix, over_tcp;
  const grpc::Status status =
      SampleOverUnix(options.unix_socket, request, &over_unix);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_TRUE(Call(f, request, &over_tcp).ok());
  EXPECT_THAT(over_unix.token_ids(),
              ElementsAreArray(ExpectedFakeTokens(request, kVocab)));
  EXPECT_THAT(over_unix.token_ids(), ElementsAreArray(over_tcp.token_ids()));
  f.server->Stop();
  EXPECT_FALSE(std::filesystem::exists(options.unix_socket));
}

TEST(ServerTest, AUnixSocketStillServingIsRefusedAndAStaleOneReplaced) {
  ServerOptions options = TestServerOptions();
  options.unix_socket = testing::MakeTempDir() + "/sampler.sock";
  FakeServer first = Start(options);
  auto second = CreateOnFakeEngine(options);
  ASSERT_TRUE(second.ok());
  const absl::Status status = (*second)->Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(status.message(), "unix_socket"));
  EXPECT_TRUE(absl::StrContains(status.message(), "in use"));
  // The first still answers on it.
  v1::SampleResponse response;
  EXPECT_TRUE(
      SampleOverUnix(options.unix_socket, MakeRequest(1, kHidden, 1), &response)
          .ok());
  first.server->Stop();

  // A socket file nobody accepts on (a daemon killed with SIGKILL leaves
  // one) does not stop the next daemon.
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  options.unix_socket.copy(address.sun_path, sizeof(address.sun_path) - 1);
  ASSERT_EQ(
      bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)),
      0);
  close(fd);
  ASSERT_TRUE(std::filesystem::is_socket(options.unix_socket));
  FakeServer next = Start(options);
  EXPECT_TRUE(
      SampleOverUnix(options.unix_socket, MakeRequest(1, kHidden, 1), &response)
          .ok());
}

TEST(ServerTest, UnixSocketErrorsNameTheField) {
  ServerOptions options = TestServerOptions();
  options.unix_socket = "/" + std::string(200, 'a');
  auto too_long = CreateOnFakeEngine(options);
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(too_long.status().message(), "unix_socket"));

  options.unix_socket = testing::MakeTempDir() + "/no/such/dir/sampler.sock";
  auto server = CreateOnFakeEngine(options);
  ASSERT_TRUE(server.ok());
  const absl::Status status = (*server)->Start();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(status.message(), "unix_socket")) << status;

  // A file that is not a socket is neither removed nor listened on.
  options.unix_socket = testing::MakeTempDir() + "/not_a_socket";
  { std::ofstream(options.unix_socket) << "keep"; }
  auto over_file = CreateOnFakeEngine(options);
  ASSERT_TRUE(over_file.ok());
  const absl::Status file_status = (*over_file)->Start();
  EXPECT_EQ(file_status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(file_status.message(), "unix_socket"))
      << file_status;
  EXPECT_TRUE(std::filesystem::is_regular_file(options.unix_socket));
}

}  // namespace
}  // namespace flashsampler
