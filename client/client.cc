// SamplerClient: channel setup (credentials, load balancing, message limits),
// the retry loop, request builders and a dependency-free grpc.health.v1 call
// (Debian ships no generated health stubs, and the messages are one field).
#include "client/client.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/completion_queue.h"
#include "common/dtype_convert.h"
#include "common/proto_dtype.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

// Tensor.data is little-endian on the wire; the request builders copy host
// memory as it is.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "flashsampler's client assumes a little-endian host");

namespace flashsampler {
namespace {

// ClientOptions::connections' bound: each is a socket and a reader thread's
// share on the server.
constexpr int kMaxConnections = 64;

absl::StatusOr<std::string> ReadFile(const std::string& path,
                                     const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open ", what, " ", path));
  }
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(
    const ClientOptions& options) {
  const bool tls = options.use_tls || !options.tls_root_certs_path.empty() ||
                   !options.tls_client_cert_path.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (options.tls_client_cert_path.empty() !=
      options.tls_client_key_path.empty()) {
    return absl::InvalidArgumentError(
        "tls_client_cert_path and tls_client_key_path go together (mutual "
        "TLS needs both)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_root_certs_path.empty()) {
    auto roots = ReadFile(options.tls_root_certs_path, "TLS root certificates");
    if (!roots.ok()) return roots.status();
    ssl.pem_root_certs = *std::move(roots);
  }
  if (!options.tls_client_cert_path.empty()) {
    auto cert = ReadFile(options.tls_client_cert_path, "TLS client cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(options.tls_client_key_path, "TLS client key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

absl::Status CheckRowFields(const RequestFields& fields, int64_t rows) {
  const auto row_count = static_cast<size_t>(rows);
  if (!fields.seeds.empty() && fields.seeds.size() != row_count) {
    return absl::InvalidArgumentError(absl::StrCat("seeds: expected 0 or ",
                                                   rows,
                                                   " entries (one per row), "
                                                   "got ",
                                                   fields.seeds.size()));
  }
  if (!fields.steps.empty() && fields.steps.size() != row_count) {
    return absl::InvalidArgumentError(absl::StrCat("steps: expected 0 or ",
                                                   rows,
                                                   " entries (one per row), "
                                                   "got ",
                                                   fields.steps.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(size_t elements, int64_t rows, int64_t dim) {
  if (rows < 1 || dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden states: rows and dim must be >= 1, got [", rows,
                     ", ", dim, "]"));
  }
  if (elements != static_cast<size_t>(rows) * static_cast<size_t>(dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden states: expected rows x dim = ", rows, " x ", dim,
                     " = ", rows * dim, " elements, got ", elements));
  }
  return absl::OkStatus();
}

v1::SampleRequest StartRequest(const RequestFields& fields, int64_t rows,
                               int64_t dim, DType wire_dtype) {
  v1::SampleRequest request;
  request.set_request_id(fields.request_id);
  *request.mutable_params() = fields.params;
  request.mutable_seeds()->Add(fields.seeds.begin(), fields.seeds.end());
  request.mutable_steps()->Add(fields.steps.begin(), fields.steps.end());
  v1::Tensor* tensor = request.mutable_hidden_states();
  tensor->set_dtype(ToProtoDType(wire_dtype));
  tensor->add_shape(rows);
  tensor->add_shape(dim);
  tensor->mutable_data()->resize(static_cast<size_t>(rows * dim) *
                                 DTypeSize(wire_dtype));
  return request;
}

// grpc.health.v1 messages in protobuf wire format. HealthCheckRequest is
// {string service = 1}; HealthCheckResponse is {ServingStatus status = 1}
// with UNKNOWN = 0, SERVING = 1, NOT_SERVING = 2, SERVICE_UNKNOWN = 3.
std::string EncodeHealthRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;  // proto3 omits the default value
  out.push_back(0x0a);              // field 1, length-delimited
  for (uint64_t n = service.size();; n >>= 7) {
    if (n < 0x80) {
      out.push_back(static_cast<char>(n));
      break;
    }
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  return out + service;
}

bool ReadVarint(const std::string& in, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    const auto byte = static_cast<uint8_t>(in[(*pos)++]);
    *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

absl::StatusOr<HealthStatus> DecodeHealthResponse(const std::string& in) {
  uint64_t status = 0;  // absent field = UNKNOWN
  size_t pos = 0;
  while (pos < in.size()) {
    uint64_t tag = 0;
    if (!ReadVarint(in, &pos, &tag)) break;
    uint64_t value = 0;
    size_t skip = 0;
    switch (tag & 7) {
      case 0:
        if (!ReadVarint(in, &pos, &value)) {
          return absl::DataLossError("malformed HealthCheckResponse");
        }
        if ((tag >> 3) == 1) status = value;
        continue;
      case 1:
        skip = 8;
        break;
      case 2:
        if (!ReadVarint(in, &pos, &value)) {
          return absl::DataLossError("malformed HealthCheckResponse");
        }
        skip = value;
        break;
      case 5:
        skip = 4;
        break;
      default:
        return absl::DataLossError("malformed HealthCheckResponse");
    }
    if (skip > in.size() - pos) {
      return absl::DataLossError("truncated HealthCheckResponse");
    }
    pos += skip;
  }
  switch (status) {
    case 1:
      return HealthStatus::kServing;
    case 2:
      return HealthStatus::kNotServing;
    case 3:
      return HealthStatus::kServiceUnknown;
    default:
      return HealthStatus::kUnknown;
  }
}

// One Sample attempt on a completion queue of its own, polled without
// sleeping until the call ends (ClientOptions::busy_poll); the context's
// deadline ends it at the latest.
grpc::Status PolledSample(v1::Sampler::Stub& stub, grpc::ClientContext* context,
                          const v1::SampleRequest& request,
                          v1::SampleResponse* response) {
  grpc::CompletionQueue queue;
  grpc::Status status;
  std::unique_ptr<grpc::ClientAsyncResponseReader<v1::SampleResponse>> call =
      stub.AsyncSample(context, request, &queue);
  call->Finish(response, &status, &queue);
  void* tag = nullptr;
  bool ok = false;
  const grpc::CompletionQueue::NextStatus next =
      NextWithoutSleeping(queue, &tag, &ok);
  queue.Shutdown();
  void* drained_tag = nullptr;
  bool drained_ok = false;
  while (queue.Next(&drained_tag, &drained_ok)) {
  }
  if (next != grpc::CompletionQueue::GOT_EVENT || tag != &queue || !ok) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        "the call's completion queue failed");
  }
  return status;
}

}  // namespace

const char* HealthStatusName(HealthStatus status) {
  switch (status) {
    case HealthStatus::kServing:
      return "SERVING";
    case HealthStatus::kNotServing:
      return "NOT_SERVING";
    case HealthStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case HealthStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  return FromGrpcStatus(status);
}

absl::Status ResponseStatus(const v1::SampleResponse& response) {
  if (!response.has_error() || response.error().code() == 0) {
    return absl::OkStatus();
  }
  return absl::Status(static_cast<absl::StatusCode>(response.error().code()),
                      response.error().message());
}

SampleStream::~SampleStream() {
  if (!finished_) {
    context_.TryCancel();
    Finish().IgnoreError();  // cancelled: the status says only that
  }
}

bool SampleStream::Write(const v1::SampleRequest& request) {
  return stream_->Write(request);
}

bool SampleStream::Read(v1::SampleResponse* response) {
  return stream_->Read(response);
}

bool SampleStream::WritesDone() { return stream_->WritesDone(); }

absl::Status SampleStream::Finish() {
  if (finished_) {
    return absl::FailedPreconditionError("SampleStream: Finish() twice");
  }
  finished_ = true;
  return ToAbslStatus(stream_->Finish());
}

absl::StatusOr<v1::SampleResponse> SampleStream::Sample(
    const v1::SampleRequest& request) {
  if (finished_) {
    return absl::FailedPreconditionError("SampleStream: already finished");
  }
  v1::SampleResponse response;
  if (Write(request) && Read(&response)) return response;
  // Broken: the server's status says why (Finish drains what is left).
  context_.TryCancel();
  absl::Status status = Finish();
  if (status.ok()) {
    return absl::DataLossError("SampleStream ended before the response");
  }
  return status;
}

absl::StatusOr<v1::SampleRequest> MakeSampleRequest(
    absl::Span<const float> hidden, int64_t rows, int64_t dim,
    const RequestFields& fields, DType wire_dtype) {
  if (auto s = CheckShape(hidden.size(), rows, dim); !s.ok()) return s;
  if (auto s = CheckRowFields(fields, rows); !s.ok()) return s;
  v1::SampleRequest request = StartRequest(fields, rows, dim, wire_dtype);
  ConvertDType(DType::kFp32, hidden.data(), hidden.size(), wire_dtype,
               request.mutable_hidden_states()->mutable_data()->data());
  return request;
}

absl::StatusOr<v1::SampleRequest> MakeSampleRequest16(
    absl::Span<const uint16_t> hidden_bits, int64_t rows, int64_t dim,
    const RequestFields& fields, DType wire_dtype) {
  if (wire_dtype == DType::kFp32) {
    return absl::InvalidArgumentError(
        "MakeSampleRequest16 takes bf16 or fp16 bit patterns, not fp32");
  }
  if (auto s = CheckShape(hidden_bits.size(), rows, dim); !s.ok()) return s;
  if (auto s = CheckRowFields(fields, rows); !s.ok()) return s;
  v1::SampleRequest request = StartRequest(fields, rows, dim, wire_dtype);
  std::memcpy(request.mutable_hidden_states()->mutable_data()->data(),
              hidden_bits.data(), hidden_bits.size() * sizeof(uint16_t));
  return request;
}

absl::StatusOr<std::unique_ptr<SamplerClient>> SamplerClient::Create(
    const ClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("target: empty");
  }
  if (options.retry.max_attempts < 1) {
    return absl::InvalidArgumentError("retry.max_attempts: must be >= 1");
  }
  if (options.retry.multiplier < 1.0 || options.retry.jitter < 0.0 ||
      options.retry.jitter >= 1.0) {
    return absl::InvalidArgumentError(
        "retry: multiplier must be >= 1 and jitter in [0, 1)");
  }
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeout: must be > 0");
  }
  if (options.connections < 1 || options.connections > kMaxConnections) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections: must be in [1, ", kMaxConnections, "], got ",
                     options.connections));
  }
  auto credentials = MakeCredentials(options);
  if (!credentials.ok()) return credentials.status();

  grpc::ChannelArguments args;
  if (!options.load_balancing_policy.empty()) {
    args.SetLoadBalancingPolicyName(options.load_balancing_policy);
  }
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Retries are ours (CallWithRetry), not a service-config retry policy, so
  // that the backoff is visible, testable and bounded by our deadline. gRPC
  // still retries transparently a call that never reached the server.
  if (!options.tls_server_name_override.empty()) {
    args.SetSslTargetNameOverride(options.tls_server_name_override);
  }
  // Each channel its own connections: gRPC otherwise shares one subchannel
  // (one HTTP/2 connection) among every channel of the process with the
  // same target, and every call would queue on it.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int c = 0; c < options.connections; ++c) {
    auto channel =
        grpc::CreateCustomChannel(options.target, *credentials, args);
    if (channel == nullptr) {
      return absl::InternalError(
          absl::StrCat("cannot create a channel to ", options.target));
    }
    channels.push_back(std::move(channel));
  }
  return std::unique_ptr<SamplerClient>(
      new SamplerClient(options, std::move(channels)));
}

SamplerClient::SamplerClient(
    const ClientOptions& options,
    std::vector<std::shared_ptr<grpc::Channel>> channels)
    : options_(options), channels_(std::move(channels)) {
  for (const std::shared_ptr<grpc::Channel>& channel : channels_) {
    stubs_.push_back(v1::Sampler::NewStub(channel));
  }
}

size_t SamplerClient::NextConnection() {
  return static_cast<size_t>(calls_.fetch_add(1, std::memory_order_relaxed) %
                             channels_.size());
}

absl::Duration SamplerClient::Jittered(absl::Duration backoff) {
  if (options_.retry.jitter == 0.0) return backoff;
  absl::MutexLock lock(&rng_mu_);
  return backoff * absl::Uniform(rng_, 1.0 - options_.retry.jitter,
                                 1.0 + options_.retry.jitter);
}

absl::Status SamplerClient::CallWithRetry(
    const std::function<grpc::Status(grpc::ClientContext*)>& attempt) {
  const RetryOptions& retry = options_.retry;
  const absl::Time deadline = absl::Now() + options_.timeout;
  absl::Duration backoff = retry.initial_backoff;
  for (int attempts = 1;; ++attempts) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    context.set_wait_for_ready(options_.wait_for_ready);
    const grpc::Status status = attempt(&context);
    if (status.ok()) return absl::OkStatus();
    absl::Status result = ToAbslStatus(status);
    const bool retryable =
        std::find(retry.retryable_codes.begin(), retry.retryable_codes.end(),
                  result.code()) != retry.retryable_codes.end();
    if (!retryable) return result;
    const absl::Duration sleep = Jittered(backoff);
    if (attempts >= retry.max_attempts || absl::Now() + sleep >= deadline) {
      // Say why we stopped: "UNAVAILABLE ... (gave up after 4 attempts)"
      // tells an operator the client did retry.
      absl::Status gave_up(
          result.code(),
          absl::StrCat(result.message(), " (gave up after ", attempts,
                       attempts == 1 ? " attempt" : " attempts",
                       attempts >= retry.max_attempts
                           ? ")"
                           : ": the next retry would pass the deadline)"));
      result.ForEachPayload(
          [&gave_up](absl::string_view url, const absl::Cord& payload) {
            gave_up.SetPayload(url, payload);
          });
      return gave_up;
    }
    retries_.fetch_add(1);
    absl::SleepFor(sleep);
    backoff = std::min(backoff * retry.multiplier, retry.max_backoff);
  }
}

absl::StatusOr<v1::SampleResponse> SamplerClient::Sample(
    const v1::SampleRequest& request) {
  v1::SampleResponse response;
  absl::Status status = CallWithRetry([&](grpc::ClientContext* context) {
    response.Clear();
    v1::Sampler::Stub& stub = *stubs_[NextConnection()];
    if (options_.busy_poll) {
      return PolledSample(stub, context, request, &response);
    }
    return stub.Sample(context, request, &response);
  });
  if (!status.ok()) return status;
  return response;
}

absl::StatusOr<v1::ModelInfo> SamplerClient::GetModelInfo() {
  v1::ModelInfo info;
  absl::Status status = CallWithRetry([&](grpc::ClientContext* context) {
    info.Clear();
    return stubs_[NextConnection()]->GetModelInfo(
        context, v1::GetModelInfoRequest(), &info);
  });
  if (!status.ok()) return status;
  return info;
}

absl::Status SamplerClient::RegisterSharedMemory(const std::string& name,
                                                 const std::string& key,
                                                 uint64_t byte_size) {
  v1::RegisterSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_byte_size(byte_size);
  return CallWithRetry([&](grpc::ClientContext* context) {
    v1::RegisterSharedMemoryResponse response;
    return stubs_[NextConnection()]->RegisterSharedMemory(context, request,
                                                          &response);
  });
}

absl::Status SamplerClient::UnregisterSharedMemory(const std::string& name) {
  v1::UnregisterSharedMemoryRequest request;
  request.set_name(name);
  return CallWithRetry([&](grpc::ClientContext* context) {
    v1::UnregisterSharedMemoryResponse response;
    return stubs_[NextConnection()]->UnregisterSharedMemory(context, request,
                                                            &response);
  });
}

absl::StatusOr<HealthStatus> SamplerClient::CheckHealth(
    const std::string& service) {
  grpc::GenericStub generic(channels_[NextConnection()]);
  const std::string encoded = EncodeHealthRequest(service);
  std::string reply;
  absl::Status status = CallWithRetry([&](grpc::ClientContext* context) {
    grpc::Slice slice(encoded);
    grpc::ByteBuffer request(&slice, 1);
    grpc::ByteBuffer response;
    grpc::Status result;
    absl::Notification done;
    generic.UnaryCall(context, "/grpc.health.v1.Health/Check",
                      grpc::StubOptions(), &request, &response,
                      [&](grpc::Status s) {
                        result = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    reply.clear();
    if (result.ok()) {
      std::vector<grpc::Slice> slices;
      if (!response.Dump(&slices).ok()) {
        return grpc::Status(grpc::StatusCode::DATA_LOSS,
                            "unreadable HealthCheckResponse");
      }
      for (const grpc::Slice& s : slices) {
        reply.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return result;
  });
  if (absl::IsNotFound(status)) return HealthStatus::kServiceUnknown;
  if (!status.ok()) return status;
  return DecodeHealthResponse(reply);
}

std::unique_ptr<SampleStream> SamplerClient::OpenStream(
    absl::Duration timeout) {
  std::unique_ptr<SampleStream> stream(new SampleStream);
  if (timeout != absl::InfiniteDuration()) {
    stream->context_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  stream->context_.set_wait_for_ready(options_.wait_for_ready);
  stream->stream_ = stubs_[NextConnection()]->SampleStream(&stream->context_);
  return stream;
}

absl::StatusOr<std::vector<v1::SampleResponse>> SamplerClient::SampleMany(
    absl::Span<const v1::SampleRequest> requests, absl::Duration timeout) {
  // No later than the stream's own deadline (set just after).
  const absl::Time deadline = absl::Now() + timeout;
  std::unique_ptr<SampleStream> stream = OpenStream(timeout);
  std::thread writer([&] {
    for (const v1::SampleRequest& request : requests) {
      if (!stream->Write(request)) return;
    }
    stream->WritesDone();
  });
  std::vector<v1::SampleResponse> responses;
  responses.reserve(requests.size());
  for (v1::SampleResponse response; stream->Read(&response);) {
    responses.push_back(std::move(response));
    response.Clear();
  }
  // Read ends only when the stream does; a writer still blocked then has
  // its Write fail, so the join cannot hang. Past the deadline the stream
  // is ending as DEADLINE_EXCEEDED, and a cancel racing with that could
  // make its status CANCELLED.
  if (responses.size() != requests.size() && absl::Now() < deadline) {
    stream->Cancel();
  }
  writer.join();
  absl::Status status = stream->Finish();
  if (!status.ok()) return status;
  if (responses.size() != requests.size()) {
    return absl::DataLossError(absl::StrCat("SampleStream: ", responses.size(),
                                            " responses to ", requests.size(),
                                            " requests"));
  }
  return responses;
}

void SamplerClient::SampleAsync(
    std::shared_ptr<const v1::SampleRequest> request,
    std::function<void(absl::StatusOr<v1::SampleResponse>)> done,
    absl::Duration timeout) {
  // Everything the call touches lives until its completion callback.
  struct Call {
    grpc::ClientContext context;
    std::shared_ptr<const v1::SampleRequest> request;
    v1::SampleResponse response;
    std::function<void(absl::StatusOr<v1::SampleResponse>)> done;
  };
  auto* call = new Call;
  call->request = std::move(request);
  call->done = std::move(done);
  if (timeout <= absl::ZeroDuration()) timeout = options_.timeout;
  call->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  call->context.set_wait_for_ready(options_.wait_for_ready);
  stubs_[NextConnection()]->async()->Sample(
      &call->context, call->request.get(), &call->response,
      [call](grpc::Status status) {
        auto done = std::move(call->done);
        absl::StatusOr<v1::SampleResponse> result =
            status.ok()
                ? absl::StatusOr<v1::SampleResponse>(std::move(call->response))
                : absl::StatusOr<v1::SampleResponse>(ToAbslStatus(status));
        // The call (its context's channel reference included) is gone
        // before the caller hears of the result, so a caller that then
        // destroys the client races with nothing still running here.
        delete call;
        done(std::move(result));
      });
}

}  // namespace flashsampler
