// SamplerClient against scripted in-process servers: retry and backoff on
// UNAVAILABLE, deadlines, busy polling, several connections, round_robin
// spreading, dns:/// targets, health, TLS and mutual TLS, the request
// builders, and SampleStream (in order, refused requests answered in place,
// broken and stalled streams).
#include "client/client.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/dtype_convert.h"
#include "gmock/gmock.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "tests/client/fake_sampler_server.h"

namespace flashsampler {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kDim = FakeSamplerService::kHidden;

v1::SampleRequest TwoRowRequest() {
  std::vector<float> hidden(2 * kDim, 0.5f);
  RequestFields fields;
  fields.seeds = {11, 12};
  auto request = MakeSampleRequest(hidden, 2, kDim, fields);
  EXPECT_TRUE(request.ok()) << request.status();
  return *request;
}

ClientOptions FastRetryOptions(const std::string& target) {
  ClientOptions options;
  options.target = target;
  options.timeout = absl::Seconds(5);
  options.retry.max_attempts = 4;
  options.retry.initial_backoff = absl::Milliseconds(40);
  options.retry.multiplier = 2.0;
  options.retry.max_backoff = absl::Milliseconds(200);
  options.retry.jitter = 0.25;
  return options;
}

std::unique_ptr<SamplerClient> MustCreate(const ClientOptions& options) {
  auto client = SamplerClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

TEST(SamplerClientTest, SampleReturnsTokensRowsInOrderAndSeeds) {
  auto server = FakeSamplerServer::Start(/*server_id=*/3);
  ASSERT_NE(server, nullptr);
  auto client = MustCreate(FastRetryOptions(server->address()));
  auto response = client->Sample(TwoRowRequest());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_THAT(response->token_ids(),
              ElementsAre(FakeToken(3, 0, 0), FakeToken(3, 1, 0)));
  EXPECT_THAT(response->seeds(), ElementsAre(11u, 12u));
}

TEST(SamplerClientTest, RetriesUnavailableWithExponentialBackoff) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(3, grpc::StatusCode::UNAVAILABLE);
  auto client = MustCreate(FastRetryOptions(server->address()));

  auto response = client->Sample(TwoRowRequest());
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(server->service().calls(), 4);
  EXPECT_EQ(client->retries(), 3);

  // Backoffs 40, 80, 160 ms, each scaled by a jitter factor in [0.75, 1.25]:
  // every gap is at least 0.75 x its backoff, and the gaps grow.
  const std::vector<absl::Time> at = server->service().arrivals();
  ASSERT_EQ(at.size(), 4u);
  const absl::Duration base[] = {absl::Milliseconds(40), absl::Milliseconds(80),
                                 absl::Milliseconds(160)};
  for (int k = 0; k < 3; ++k) {
    const absl::Duration gap = at[k + 1] - at[k];
    EXPECT_GE(gap, base[k] * 0.75) << "retry " << k + 1;
    // Generous upper bound: a loaded 2-core machine can be slow, never this
    // slow.
    EXPECT_LE(gap, base[k] * 1.25 + absl::Seconds(1)) << "retry " << k + 1;
  }
  // 0.75 * 160 > 1.25 * 40: the third gap is longer than the first whatever
  // the jitter.
  EXPECT_GT(at[3] - at[2], at[1] - at[0]);
}

TEST(SamplerClientTest, BackoffIsCappedAtMaxBackoff) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(3, grpc::StatusCode::UNAVAILABLE);
  ClientOptions options = FastRetryOptions(server->address());
  options.retry.initial_backoff = absl::Milliseconds(60);
  options.retry.multiplier = 10.0;
  options.retry.max_backoff = absl::Milliseconds(100);
  options.retry.jitter = 0.0;
  auto client = MustCreate(options);
  ASSERT_TRUE(client->Sample(TwoRowRequest()).ok());
  const std::vector<absl::Time> at = server->service().arrivals();
  ASSERT_EQ(at.size(), 4u);
  // 60 ms, then min(600, 100) = 100 ms, then 100 ms again.
  EXPECT_GE(at[2] - at[1], absl::Milliseconds(100));
  EXPECT_GE(at[3] - at[2], absl::Milliseconds(100));
  EXPECT_LT(at[3] - at[2], absl::Milliseconds(100) + absl::Seconds(1));
}

TEST(SamplerClientTest, GivesUpAfterMaxAttempts) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(100, grpc::StatusCode::UNAVAILABLE);
  ClientOptions options = FastRetryOptions(server->address());
  options.retry.max_attempts = 3;
  auto client = MustCreate(options);
  auto response = client->Sample(TwoRowRequest());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(response.status().message(), HasSubstr("scripted failure 3"));
  EXPECT_THAT(response.status().message(), HasSubstr("after 3 attempts"));
  EXPECT_EQ(server->service().calls(), 3);
}

TEST(SamplerClientTest, DoesNotRetryOtherCodes) {
  for (grpc::StatusCode code :
       {grpc::StatusCode::INVALID_ARGUMENT,
        grpc::StatusCode::RESOURCE_EXHAUSTED, grpc::StatusCode::UNIMPLEMENTED,
        grpc::StatusCode::INTERNAL}) {
    auto server = FakeSamplerServer::Start();
    ASSERT_NE(server, nullptr);
    server->service().FailFirst(1, code);
    auto client = MustCreate(FastRetryOptions(server->address()));
    auto response = client->Sample(TwoRowRequest());
    EXPECT_EQ(static_cast<int>(response.status().code()),
              static_cast<int>(code));
    EXPECT_EQ(server->service().calls(), 1) << "code " << code;
    EXPECT_EQ(client->retries(), 0);
  }
}

// A server shutting down drops calls it had not accepted yet with CANCELLED
// (gRPC's doing, not the caller's): the client retries them like
// UNAVAILABLE instead of failing the caller's decode step.
TEST(SamplerClientTest, CancelledByAServerShuttingDownWasNotRetried) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(1, grpc::StatusCode::CANCELLED);
  auto client = MustCreate(FastRetryOptions(server->address()));
  EXPECT_TRUE(client->Sample(TwoRowRequest()).ok());
  EXPECT_EQ(server->service().calls(), 2);
  EXPECT_EQ(client->retries(), 1);
}

TEST(SamplerClientTest, RetryableCodesAreConfigurable) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(1, grpc::StatusCode::RESOURCE_EXHAUSTED);
  ClientOptions options = FastRetryOptions(server->address());
  options.retry.retryable_codes.push_back(absl::StatusCode::kResourceExhausted);
  auto client = MustCreate(options);
  EXPECT_TRUE(client->Sample(TwoRowRequest()).ok());
  EXPECT_EQ(server->service().calls(), 2);
}

// Blocking in gRPC and polling (ClientOptions::busy_poll) alike.
TEST(SamplerClientTest, DeadlineExceededWhenServerStalls) {
  for (const bool busy_poll : {false, true}) {
    SCOPED_TRACE(busy_poll ? "busy_poll" : "blocking");
    auto server = FakeSamplerServer::Start();
    ASSERT_NE(server, nullptr);
    server->service().set_delay(absl::Seconds(3));
    ClientOptions options = FastRetryOptions(server->address());
    options.timeout = absl::Milliseconds(200);
    options.busy_poll = busy_poll;
    auto client = MustCreate(options);
    const absl::Time start = absl::Now();
    auto response = client->Sample(TwoRowRequest());
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(response.status().code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_GE(took, absl::Milliseconds(150));
    EXPECT_LT(took, absl::Seconds(2));
    EXPECT_EQ(server->service().calls(), 1);  // not retried
  }
}

// ClientOptions::busy_poll: the same answers and retries as the blocking
// wait (its deadline: DeadlineExceededWhenServerStalls).
TEST(SamplerClientTest, BusyPollGetsTheAnswerAfterRetries) {
  auto server = FakeSamplerServer::Start(/*server_id=*/5);
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(2, grpc::StatusCode::UNAVAILABLE);
  ClientOptions options = FastRetryOptions(server->address());
  options.busy_poll = true;
  auto client = MustCreate(options);
  for (int i = 0; i < 3; ++i) {
    auto response = client->Sample(TwoRowRequest());
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_THAT(response->token_ids(),
                ElementsAre(FakeToken(5, 0, 0), FakeToken(5, 1, 0)));
    EXPECT_THAT(response->seeds(), ElementsAre(11u, 12u));
  }
  EXPECT_EQ(server->service().calls(), 5);
  EXPECT_EQ(client->retries(), 2);
}

// ClientOptions::connections: calls take the connections in turn, and one
// client keeps to one connection by default.
TEST(SamplerClientTest, CallsTakeTheConnectionsInTurn) {
  for (const int connections : {1, 3}) {
    SCOPED_TRACE(connections);
    auto server = FakeSamplerServer::Start(/*server_id=*/4);
    ASSERT_NE(server, nullptr);
    ClientOptions options = FastRetryOptions(server->address());
    options.connections = connections;
    auto client = MustCreate(options);
    for (int i = 0; i < 6; ++i) {
      auto response = client->Sample(TwoRowRequest());
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_EQ(response->token_ids(1), FakeToken(4, 1, 0));
    }
    EXPECT_EQ(server->service().peers().size(),
              static_cast<size_t>(connections));
  }
}

TEST(SamplerClientTest, RetriesStopAtTheDeadline) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(100, grpc::StatusCode::UNAVAILABLE);
  ClientOptions options = FastRetryOptions(server->address());
  options.timeout = absl::Milliseconds(300);
  options.retry.max_attempts = 100;
  options.retry.initial_backoff = absl::Milliseconds(100);
  options.retry.max_backoff = absl::Milliseconds(100);
  options.retry.jitter = 0.0;
  auto client = MustCreate(options);
  const absl::Time start = absl::Now();
  auto response = client->Sample(TwoRowRequest());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(response.status().message(), HasSubstr("deadline"));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(300) + absl::Seconds(1));
  // 300 ms with 100 ms sleeps leaves room for about 3 attempts, far from 100.
  EXPECT_GE(server->service().calls(), 2);
  EXPECT_LE(server->service().calls(), 4);
}

TEST(SamplerClientTest, UnreachableServerIsUnavailableAfterRetries) {
  // Reserve a port, then close the server: nothing listens there any more.
  std::string address;
  {
    auto server = FakeSamplerServer::Start();
    ASSERT_NE(server, nullptr);
    address = server->address();
  }
  ClientOptions options = FastRetryOptions(address);
  options.retry.max_attempts = 2;
  auto client = MustCreate(options);
  auto info = client->GetModelInfo();
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client->retries(), 1);
}

TEST(SamplerClientTest, RoundRobinSpreadsCallsOverAddresses) {
  auto a = FakeSamplerServer::Start(1);
  auto b = FakeSamplerServer::Start(2);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ClientOptions options = FastRetryOptions(
      absl::StrCat("ipv4:127.0.0.1:", a->port(), ",127.0.0.1:", b->port()));
  options.wait_for_ready = true;  // both subchannels connect before picks
  auto client = MustCreate(options);
  // Warm up until both backends answered once, so that the count below is
  // not skewed by one subchannel connecting later than the other.
  for (int i = 0;
       i < 50 && (a->service().calls() == 0 || b->service().calls() == 0);
       ++i) {
    ASSERT_TRUE(client->Sample(TwoRowRequest()).ok());
  }
  ASSERT_GT(a->service().calls(), 0);
  ASSERT_GT(b->service().calls(), 0);
  const int a0 = a->service().calls();
  const int b0 = b->service().calls();
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(client->Sample(TwoRowRequest()).ok());
  }
  // round_robin alternates over READY subchannels: 10 each.
  EXPECT_EQ(a->service().calls() - a0, 10);
  EXPECT_EQ(b->service().calls() - b0, 10);
}

TEST(SamplerClientTest, PickFirstSticksToOneAddress) {
  auto a = FakeSamplerServer::Start(1);
  auto b = FakeSamplerServer::Start(2);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ClientOptions options = FastRetryOptions(
      absl::StrCat("ipv4:127.0.0.1:", a->port(), ",127.0.0.1:", b->port()));
  options.load_balancing_policy = "pick_first";
  auto client = MustCreate(options);
  for (int i = 0; i < 10; ++i) {
    ASSERT_TRUE(client->Sample(TwoRowRequest()).ok());
  }
  EXPECT_EQ(a->service().calls() + b->service().calls(), 10);
  EXPECT_TRUE(a->service().calls() == 0 || b->service().calls() == 0);
}

TEST(SamplerClientTest, DnsTargetSmoke) {
  auto server = FakeSamplerServer::Start(4);
  ASSERT_NE(server, nullptr);
  // localhost may resolve to ::1 as well, where nothing listens; round_robin
  // only picks READY addresses, so calls still succeed.
  ClientOptions options =
      FastRetryOptions(absl::StrCat("dns:///localhost:", server->port()));
  options.wait_for_ready = true;
  auto client = MustCreate(options);
  for (int i = 0; i < 4; ++i) {
    auto response = client->Sample(TwoRowRequest());
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->token_ids(0), FakeToken(4, 0, 0));
  }
  EXPECT_EQ(server->service().calls(), 4);
}

TEST(SamplerClientTest, GetModelInfo) {
  auto server = FakeSamplerServer::Start(5);
  ASSERT_NE(server, nullptr);
  auto client = MustCreate(FastRetryOptions(server->address()));
  auto info = client->GetModelInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->vocab_size(), FakeSamplerService::kVocab);
  EXPECT_EQ(info->hidden_size(), FakeSamplerService::kHidden);
  EXPECT_EQ(info->version(), "fake-5");
}

TEST(SamplerClientTest, CheckHealthFollowsServingStatus) {
  auto server = FakeSamplerServer::Start();
  ASSERT_NE(server, nullptr);
  auto client = MustCreate(FastRetryOptions(server->address()));
  auto health = client->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServing);

  grpc::HealthCheckServiceInterface* service =
      server->server().GetHealthCheckService();
  service->SetServingStatus("flashsampler.v1.Sampler", false);
  health = client->CheckHealth("flashsampler.v1.Sampler");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kNotServing);

  service->SetServingStatus(false);
  health = client->CheckHealth();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kNotServing);

  health = client->CheckHealth("no.such.Service");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, HealthStatus::kServiceUnknown);
  EXPECT_STREQ(HealthStatusName(HealthStatus::kServing), "SERVING");
}

TEST(SamplerClientTest, SampleAsyncDeliversResponseAndErrors) {
  auto server = FakeSamplerServer::Start(6);
  ASSERT_NE(server, nullptr);
  server->service().FailFirst(1, grpc::StatusCode::UNAVAILABLE);
  auto client = MustCreate(FastRetryOptions(server->address()));
  auto request = std::make_shared<const v1::SampleRequest>(TwoRowRequest());
  for (int i = 0; i < 2; ++i) {
    absl::Notification done;
    absl::StatusOr<v1::SampleResponse> result;
    client->SampleAsync(request, [&](absl::StatusOr<v1::SampleResponse> r) {
      result = std::move(r);
      done.Notify();
    });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    if (i == 0) {  // one attempt only: the scripted failure comes through
      EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
    } else {
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->token_ids(1), FakeToken(6, 1, 0));
    }
  }
}

std::vector<v1::SampleRequest> NumberedRequests(int count) {
  std::vector<v1::SampleRequest> requests;
  for (int i = 0; i < count; ++i) {
    std::vector<float> hidden(static_cast<size_t>((i % 3 + 1) * kDim), 1.0f);
    RequestFields fields;
    fields.request_id = absl::StrCat("r", i);
    fields.seeds.assign(static_cast<size_t>(i % 3 + 1), 100u + i);
    auto request = MakeSampleRequest(hidden, i % 3 + 1, kDim, fields);
    EXPECT_TRUE(request.ok()) << request.status();
    requests.push_back(*std::move(request));
  }
  return requests;
}

TEST(SampleStreamTest, SampleManyAnswersEveryRequestInOrder) {
  auto server = FakeSamplerServer::Start(4);
  ASSERT_NE(server, nullptr);
  // Every 5th request fails inside the stream: answered in place, with the
  // error, and the stream goes on.
  server->service().FailEvery(5, grpc::StatusCode::INVALID_ARGUMENT);
  auto client = MustCreate(FastRetryOptions(server->address()));
  const std::vector<v1::SampleRequest> requests = NumberedRequests(300);
  auto responses = client->SampleMany(requests, absl::Seconds(30));
  ASSERT_TRUE(responses.ok()) << responses.status();
  ASSERT_EQ(responses->size(), requests.size());
  EXPECT_EQ(server->service().streams(), 1);
  for (size_t i = 0; i < requests.size(); ++i) {
    const v1::SampleResponse& response = (*responses)[i];
    EXPECT_EQ(response.request_id(), absl::StrCat("r", i));
    if ((i + 1) % 5 == 0) {
      EXPECT_EQ(ResponseStatus(response).code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(ResponseStatus(response).message(),
                  HasSubstr("scripted failure"));
      continue;
    }
    ASSERT_TRUE(ResponseStatus(response).ok()) << ResponseStatus(response);
    const int rows = static_cast<int>(i % 3) + 1;
    ASSERT_EQ(response.token_ids_size(), rows);
    EXPECT_EQ(response.token_ids(rows - 1), FakeToken(4, rows - 1, 0));
    EXPECT_EQ(response.seeds(0), 100u + i);
  }
}

TEST(SampleStreamTest, OpenStreamRoundTripsOnOneStream) {
  auto server = FakeSamplerServer::Start(2);
  ASSERT_NE(server, nullptr);
  auto client = MustCreate(FastRetryOptions(server->address()));
  auto stream = client->OpenStream();
  for (const v1::SampleRequest& request : NumberedRequests(10)) {
    auto response = stream->Sample(request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->request_id(), request.request_id());
    EXPECT_EQ(response->seeds_size(), request.hidden_states().shape(0));
  }
  EXPECT_TRUE(stream->WritesDone());
  v1::SampleResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(server->service().streams(), 1);
  EXPECT_EQ(server->service().calls(), 10);
}

TEST(SampleStreamTest, BrokenStreamReportsTheStreamsStatus) {
  auto client = MustCreate(FastRetryOptions("127.0.0.1:1"));  // nothing there
  auto stream = client->OpenStream(absl::Seconds(5));
  auto response = stream->Sample(TwoRowRequest());
  EXPECT_EQ(response.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(stream->finished());
  EXPECT_EQ(stream->Sample(TwoRowRequest()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto many = client->SampleMany(NumberedRequests(3), absl::Seconds(5));
  EXPECT_EQ(many.status().code(), absl::StatusCode::kUnavailable);
}

TEST(SampleStreamTest, StreamDeadlineEndsAStalledStream) {
  auto server = FakeSamplerServer::Start(1);
  ASSERT_NE(server, nullptr);
  server->service().set_delay(absl::Seconds(20));
  auto client = MustCreate(FastRetryOptions(server->address()));
  const absl::Time start = absl::Now();
  auto many = client->SampleMany(NumberedRequests(2), absl::Milliseconds(300));
  EXPECT_EQ(many.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

class TlsTest : public ::testing::Test {
 protected:
  static std::string Data(const std::string& name) {
    return std::string(FS_CLIENT_TESTDATA_DIR) + "/" + name;
  }
  ClientOptions TlsOptions(int port) {
    ClientOptions options = FastRetryOptions(absl::StrCat("127.0.0.1:", port));
    options.retry.max_attempts = 1;
    options.timeout = absl::Seconds(5);
    options.tls_root_certs_path = Data("ca.pem");
    options.tls_server_name_override = "localhost";
    return options;
  }
};

TEST_F(TlsTest, ServerAuthenticatedTls) {
  auto server = FakeSamplerServer::StartTls(FS_CLIENT_TESTDATA_DIR, false);
  ASSERT_NE(server, nullptr);
  auto client = MustCreate(TlsOptions(server->port()));
  auto info = client->GetModelInfo();
  EXPECT_TRUE(info.ok()) << info.status();

  // A plaintext client cannot talk to a TLS server.
  ClientOptions plain = FastRetryOptions(server->address());
  plain.retry.max_attempts = 1;
  plain.timeout = absl::Seconds(5);
  EXPECT_FALSE(MustCreate(plain)->GetModelInfo().ok());

  // A client trusting another CA refuses the server.
  ClientOptions wrong_ca = TlsOptions(server->port());
  wrong_ca.tls_root_certs_path = Data("other_ca.pem");
  EXPECT_EQ(MustCreate(wrong_ca)->GetModelInfo().status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTls) {
  auto server = FakeSamplerServer::StartTls(FS_CLIENT_TESTDATA_DIR, true);
  ASSERT_NE(server, nullptr);
  ClientOptions options = TlsOptions(server->port());
  options.tls_client_cert_path = Data("client.pem");
  options.tls_client_key_path = Data("client.key");
  auto response = MustCreate(options)->Sample(TwoRowRequest());
  EXPECT_TRUE(response.ok()) << response.status();

  // No client certificate: the handshake fails.
  EXPECT_EQ(
      MustCreate(TlsOptions(server->port()))->GetModelInfo().status().code(),
      absl::StatusCode::kUnavailable);

  // A certificate from an unknown CA: refused as well.
  ClientOptions rogue = TlsOptions(server->port());
  rogue.tls_client_cert_path = Data("other_client.pem");
  rogue.tls_client_key_path = Data("other_client.key");
  EXPECT_EQ(MustCreate(rogue)->GetModelInfo().status().code(),
            absl::StatusCode::kUnavailable);
}

TEST(SamplerClientCreateTest, RejectsBadOptions) {
  ClientOptions options;
  options.target = "";
  EXPECT_EQ(SamplerClient::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = ClientOptions();
  options.retry.max_attempts = 0;
  EXPECT_EQ(SamplerClient::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = ClientOptions();
  options.tls_client_cert_path = "/no/such/cert.pem";
  EXPECT_EQ(SamplerClient::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);  // key missing
  options.tls_client_key_path = "/no/such/key.pem";
  EXPECT_EQ(SamplerClient::Create(options).status().code(),
            absl::StatusCode::kNotFound);
  for (const int connections : {0, 65}) {
    options = ClientOptions();
    options.connections = connections;
    const absl::Status status = SamplerClient::Create(options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("connections"));
  }
}

TEST(MakeSampleRequestTest, Fp32PayloadShapeAndFields) {
  const std::vector<float> hidden = {1.0f, -2.0f, 0.5f, 3.0f, 0.0f, 8.0f};
  RequestFields fields;
  fields.request_id = "r1";
  fields.seeds = {5, 6};
  fields.steps = {0, 9};
  fields.params.set_temperature(0.7f);
  auto request = MakeSampleRequest(hidden, 2, 3, fields);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->request_id(), "r1");
  EXPECT_EQ(request->hidden_states().dtype(), v1::DTYPE_FP32);
  EXPECT_THAT(request->hidden_states().shape(), ElementsAre(2, 3));
  ASSERT_EQ(request->hidden_states().data().size(), 6 * sizeof(float));
  EXPECT_EQ(std::memcmp(request->hidden_states().data().data(), hidden.data(),
                        6 * sizeof(float)),
            0);
  EXPECT_THAT(request->seeds(), ElementsAre(5u, 6u));
  EXPECT_THAT(request->steps(), ElementsAre(0u, 9u));
  EXPECT_FLOAT_EQ(request->params().temperature(), 0.7f);
}

TEST(MakeSampleRequestTest, ConvertsToBf16AndFp16) {
  const std::vector<float> hidden = {1.0f, -2.0f};
  auto bf16 = MakeSampleRequest(hidden, 1, 2, {}, DType::kBf16);
  ASSERT_TRUE(bf16.ok());
  EXPECT_EQ(bf16->hidden_states().dtype(), v1::DTYPE_BF16);
  uint16_t bits[2];
  ASSERT_EQ(bf16->hidden_states().data().size(), sizeof(bits));
  std::memcpy(bits, bf16->hidden_states().data().data(), sizeof(bits));
  EXPECT_EQ(bits[0], 0x3f80);
  EXPECT_EQ(bits[1], 0xc000);

  auto fp16 = MakeSampleRequest(hidden, 1, 2, {}, DType::kFp16);
  ASSERT_TRUE(fp16.ok());
  EXPECT_EQ(fp16->hidden_states().dtype(), v1::DTYPE_FP16);
  std::memcpy(bits, fp16->hidden_states().data().data(), sizeof(bits));
  EXPECT_EQ(bits[0], 0x3c00);
  EXPECT_EQ(bits[1], 0xc000);

  const std::vector<uint16_t> raw = {0x3f80, 0x4000, 0x4040, 0x4080};
  auto from_bits = MakeSampleRequest16(raw, 2, 2, {});
  ASSERT_TRUE(from_bits.ok());
  EXPECT_EQ(from_bits->hidden_states().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(std::memcmp(from_bits->hidden_states().data().data(), raw.data(),
                        sizeof(uint16_t) * 4),
            0);
}

TEST(MakeSampleRequestTest, RejectsInconsistentSizes) {
  const std::vector<float> hidden(6, 1.0f);
  EXPECT_EQ(MakeSampleRequest(hidden, 2, 4, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeSampleRequest(hidden, 0, 6, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  RequestFields fields;
  fields.seeds = {1, 2, 3};
  auto bad_seeds = MakeSampleRequest(hidden, 2, 3, fields);
  EXPECT_EQ(bad_seeds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_seeds.status().message(), HasSubstr("seeds"));
  fields.seeds.clear();
  fields.steps = {1};
  auto bad_steps = MakeSampleRequest(hidden, 2, 3, fields);
  EXPECT_THAT(bad_steps.status().message(), HasSubstr("steps"));
  const std::vector<uint16_t> bits(6);
  EXPECT_EQ(MakeSampleRequest16(bits, 2, 3, {}, DType::kFp32).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ToAbslStatusTest, KeepsCodeAndMessage) {
  EXPECT_TRUE(ToAbslStatus(grpc::Status::OK).ok());
  absl::Status s = ToAbslStatus(
      grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "hidden_states.shape");
}

}  // namespace
}  // namespace flashsampler
