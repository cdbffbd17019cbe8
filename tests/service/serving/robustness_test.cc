// The Sampler service against bytes that are not SampleRequests (sent raw,
// past the typed stubs) and against shutdown under load: what each caller
// hears back, and that every answer is counted.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

using ::testing::ElementsAreArray;
using testing::ExpectedFakeTokens;
using testing::FakeServer;
using testing::MakeRequest;
using testing::MetricValue;
using testing::StartFakeServer;
using testing::TestServerOptions;

constexpr int64_t kVocab = 1000;
constexpr int64_t kHidden = 16;
constexpr absl::Duration kWait = absl::Seconds(10);
// Parses as no protobuf message: a tag varint with field number 2^28-ish
// followed by a varint that never ends.
const std::string kUndecodable("\xff\xff\xff\xff\x0f", 5);

FakeServer Start() {
  absl::StatusOr<FakeServer> fake = StartFakeServer(TestServerOptions());
  EXPECT_TRUE(fake.ok()) << fake.status();
  return *std::move(fake);
}

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

bool ParseResponse(grpc::ByteBuffer* bytes, v1::SampleResponse* response) {
  grpc::ProtoBufferReader reader(bytes);
  return response->ParseFromZeroCopyStream(&reader);
}

double Metric(FakeServer& f, const std::string& series) {
  return MetricValue(f.server->metrics().TextExposition(), series);
}

// Regression: an undecodable SampleStream message was dropped silently and
// the stream ended OK, so the caller lost the requests after it.
TEST(RobustnessTest, StreamUndecodableFrameEndsTheStreamWithInvalidArgument) {
  FakeServer f = Start();
  static const grpc::internal::RpcMethod kMethod(
      "/flashsampler.v1.Sampler/SampleStream",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream(grpc::internal::ClientReaderWriterFactory<
             grpc::ByteBuffer, grpc::ByteBuffer>::Create(f.channel.get(),
                                                         kMethod, &context));
  v1::SampleRequest first = MakeRequest(2, kHidden, 11, 1.0f);
  first.set_request_id("first");
  v1::SampleRequest last = MakeRequest(1, kHidden, 22, 2.0f);
  last.set_request_id("last");
  ASSERT_TRUE(stream->Write(Bytes(first.SerializeAsString())));
  // The server may end the stream before reading the rest: a failed write
  // is then expected, not an error of the test.
  stream->Write(Bytes(kUndecodable));
  stream->Write(Bytes(last.SerializeAsString()));
  stream->WritesDone();

  std::vector<v1::SampleResponse> answers;
  grpc::ByteBuffer in;
  while (stream->Read(&in)) {
    v1::SampleResponse response;
    ASSERT_TRUE(ParseResponse(&in, &response));
    answers.push_back(response);
  }
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("frame 1"));
  EXPECT_THAT(status.error_message(),
              ::testing::HasSubstr("flashsampler.v1.SampleRequest"));
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].request_id(), "first");
  EXPECT_FALSE(answers[0].has_error());
  EXPECT_THAT(answers[0].token_ids(),
              ElementsAreArray(ExpectedFakeTokens(first, kVocab)));
  EXPECT_EQ(Metric(f,
                   "flashsampler_requests_total{code=\"INVALID_ARGUMENT\","
                   "rpc=\"SampleStream\"}"),
            1.0);
}

// Regression: an undecodable unary request was answered UNIMPLEMENTED with
// an empty message and not counted in flashsampler_requests_total.
TEST(RobustnessTest, UndecodableUnaryRequestIsInvalidArgumentAndCounted) {
  FakeServer f = Start();
  grpc::GenericStub generic(f.channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
  grpc::ByteBuffer request = Bytes(kUndecodable);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  generic.UnaryCall(&context, "/flashsampler.v1.Sampler/Sample",
                    grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      status = std::move(s);
                      done.Notify();
                    });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "request is not a valid flashsampler.v1.SampleRequest");
  EXPECT_EQ(Metric(f,
                   "flashsampler_requests_total{code=\"INVALID_ARGUMENT\","
                   "rpc=\"Sample\"}"),
            1.0);
  EXPECT_EQ(f.state->launches(), 0);
}

// Regression: calls in flight when the drain began got CANCELLED instead of
// their answer. Every call started before Stop() must end OK or UNAVAILABLE.
// (Calls sent in the instant gRPC itself shuts down, after the drain, can
// still be cancelled by gRPC's core before any handler sees them: the
// server marks itself shut down before its GOAWAY reaches the client.)
TEST(RobustnessTest, DrainUnderLoadAnswersEveryCallStartedBeforeIt) {
  for (int round = 0; round < 5; ++round) {
    SCOPED_TRACE(round);
    ServerOptions options = TestServerOptions();
    options.drain_timeout = absl::Seconds(10);
    absl::StatusOr<FakeServer> started = StartFakeServer(options);
    ASSERT_TRUE(started.ok()) << started.status();
    FakeServer f = *std::move(started);
    f.state->SetDelay(absl::Microseconds(200));
    std::atomic<bool> stop{false};
    absl::Mutex mu;
    absl::Time drain_start = absl::InfiniteFuture();
    std::vector<std::string> bad;
    int ok = 0;
    std::vector<std::thread> callers;
    for (int c = 0; c < 32; ++c) {
      callers.emplace_back([&, c] {
        while (!stop.load()) {
          const v1::SampleRequest request =
              MakeRequest(1, kHidden, 1 + c, 0.5f * c);
          v1::SampleResponse response;
          grpc::ClientContext context;
          context.set_deadline(absl::ToChronoTime(absl::Now() + kWait));
          const absl::Time start = absl::Now();
          const grpc::Status s = f.stub->Sample(&context, request, &response);
          absl::MutexLock lock(&mu);
          if (start >= drain_start) break;  // only calls before the drain
          if (s.ok()) {
            ++ok;
          } else if (s.error_code() != grpc::StatusCode::UNAVAILABLE) {
            bad.push_back(absl::StrCat(
                s.error_code(), ": ", s.error_message(), " started ",
                absl::FormatDuration(drain_start - start),
                " before the drain, took ",
                absl::FormatDuration(absl::Now() - start)));
          }
        }
      });
    }
    absl::SleepFor(absl::Milliseconds(100));
    {
      absl::MutexLock lock(&mu);
      drain_start = absl::Now();
    }
    f.server->Stop();
    stop.store(true);
    for (std::thread& caller : callers) caller.join();
    absl::MutexLock lock(&mu);
    EXPECT_GT(ok, 0);
    EXPECT_THAT(bad, ::testing::IsEmpty());
  }
}

}  // namespace
}  // namespace flashsampler
