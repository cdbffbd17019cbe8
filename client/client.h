// C++ client library for flashsamplerd: one channel (plaintext, TLS or mutual
// TLS; round_robin over every address a target resolves to), per-call
// deadlines and retry with exponential backoff and jitter on UNAVAILABLE, and
// SampleStream (many requests, answers in order, on one call).
#ifndef FLASHSAMPLER_CLIENT_CLIENT_H_
#define FLASHSAMPLER_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/field_violation.h"
#include "common/status_util.h"
#include "flashsampler/v1/sampler.grpc.pb.h"

namespace flashsampler {

// Retry of failed attempts. The sleep before retry k (k = 1, 2, ...) is
// min(initial_backoff * multiplier^(k-1), max_backoff), scaled by a uniform
// factor in [1 - jitter, 1 + jitter] so that many clients thrown off by the
// same server restart do not come back in lockstep. Retries never outlive the
// call's deadline (ClientOptions::timeout covers every attempt).
struct RetryOptions {
  // Attempts in total, the first included; 1 = never retry.
  int max_attempts = 4;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  double multiplier = 2.0;
  double jitter = 0.2;  // in [0, 1)
  // Codes worth another attempt. UNAVAILABLE means the request was not
  // accepted (server loading, draining, restarting or unreachable), so a
  // retry cannot sample a row twice. RESOURCE_EXHAUSTED (queue full) is not
  // here by default: retrying into an overloaded server makes it worse.
  // CANCELLED is: this client never cancels its own unary calls, so a
  // CANCELLED answer is gRPC dropping a call the server had not accepted yet
  // while it shut down (the server answers every accepted call).
  std::vector<absl::StatusCode> retryable_codes = {
      absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled};
};

struct ClientOptions {
  // Any gRPC target: "host:port", "dns:///name:port" (every A/AAAA record
  // becomes a backend: a headless Kubernetes Service), "ipv4:a:p,b:q",
  // "unix:/path".
  std::string target = "localhost:50051";
  // "round_robin" spreads calls over every resolved address that is READY;
  // "pick_first" sticks to one connection.
  std::string load_balancing_policy = "round_robin";
  // Transport security. With all of these empty and use_tls false the
  // channel is plaintext. use_tls alone uses the system's root certificates.
  bool use_tls = false;
  std::string tls_root_certs_path;   // PEM CA bundle that signed the server
  std::string tls_client_cert_path;  // PEM client chain (mutual TLS)
  std::string tls_client_key_path;   // PEM key of tls_client_cert_path
  // Name checked against the server certificate instead of the target's host
  // (tests, or addressing a pod by IP). Empty = the target's host.
  std::string tls_server_name_override;
  // Deadline of one client call, every retry and backoff included.
  absl::Duration timeout = absl::Seconds(10);
  RetryOptions retry;
  // Largest message sent or received. A request is B x D x dtype bytes plus
  // a little: 256 rows x 8192 x fp32 = 8 MiB.
  int max_message_bytes = 256 << 20;
  // Queue calls while the channel connects instead of failing fast with
  // UNAVAILABLE (useful right after the server starts).
  bool wait_for_ready = false;
  // HTTP/2 connections to each server address, 1 to 64; every call (every
  // attempt, every stream) takes the next in turn. A connection carries one
  // request's bytes at a time and the server reads it on one thread: four
  // callers of 256 rows (2 MB of bf16 each) sharing a client were served
  // 210-302k rows/s on one connection and 361-424k on four, and one
  // connection carries about 17k small calls/s (flashsamplerd on an H100
  // host; docs/performance.md#service).
  int connections = 1;
  // Sample() waits for each attempt's answer by polling the call's own
  // completion queue without sleeping, instead of blocking in gRPC: the
  // calling thread keeps its core busy for the whole call (about the
  // kernel's time), and the answer is taken without a wake-up, which on a
  // VM whose idle cores halt goes through the hypervisor: 0.04-0.11 ms off
  // one caller's p50 at one row against the CUDA daemon on an H100 host
  // (fs_load --retries=2 --poll_spin; docs/performance.md#service). For a
  // caller with a core to spare for each call it has in flight; the other
  // methods wait as before.
  bool busy_poll = false;
};

// grpc.health.v1 serving status.
enum class HealthStatus { kUnknown, kServing, kNotServing, kServiceUnknown };
const char* HealthStatusName(HealthStatus status);

// Per-request fields of a SampleRequest other than the hidden states.
struct RequestFields {
  std::string request_id;
  // Empty (the server draws a seed per row and returns it) or one per row.
  std::vector<uint64_t> seeds;
  // Empty (step 0 for every row) or one per row.
  std::vector<uint64_t> steps;
  // Broadcast to every row.
  v1::SamplingParams params;
};

// Builds a request from row-major fp32 hidden states [rows, dim], sent as
// `wire_dtype` (bf16 and fp16 round to nearest even). InvalidArgument when the
// sizes disagree or seeds/steps are neither empty nor one per row.
absl::StatusOr<v1::SampleRequest> MakeSampleRequest(
    absl::Span<const float> hidden, int64_t rows, int64_t dim,
    const RequestFields& fields, DType wire_dtype = DType::kFp32);

// Same from bf16 (or fp16) bit patterns, sent as they are.
absl::StatusOr<v1::SampleRequest> MakeSampleRequest16(
    absl::Span<const uint16_t> hidden_bits, int64_t rows, int64_t dim,
    const RequestFields& fields, DType wire_dtype = DType::kBf16);

// gRPC status -> absl::Status (the code numbers are the same google.rpc.Code).
// Every error this client returns went through it, so an INVALID_ARGUMENT
// from the server keeps the request field at fault (the google.rpc.BadRequest
// the server sends in grpc-status-details-bin):
//   GetFieldViolation(status)->field        e.g. "row_params[3].top_p"
//   GetFieldViolation(status)->description  e.g. "must be in (0, 1] ..."
//   ErrorReason(status)                     e.g. "INVALID_SAMPLING_PARAMS"
// (common/field_violation.h, common/status_util.h; FieldViolations(const
// grpc::Status&) reads every violation of a raw gRPC status).
absl::Status ToAbslStatus(const grpc::Status& status);

// OK, or the failure a SampleStream response carries in its `error` field
// (the server refused that one request; the stream goes on).
absl::Status ResponseStatus(const v1::SampleResponse& response);

// One open SampleStream call: requests go out in order and their responses
// come back in the same order. One thread may Write while another Reads
// (several requests in flight); never two Writes or two Reads at once.
// Streams are not retried: after a broken stream the caller cannot tell
// which requests were sampled.
class SampleStream {
 public:
  ~SampleStream();
  SampleStream(const SampleStream&) = delete;
  SampleStream& operator=(const SampleStream&) = delete;

  // False when the stream is broken (Finish() says why).
  bool Write(const v1::SampleRequest& request);
  // The next response; false when the stream has ended.
  bool Read(v1::SampleResponse* response);
  // No more requests; responses to those written still arrive.
  bool WritesDone();
  // The stream's status once every response has been read (or after
  // Cancel()). Call once.
  absl::Status Finish();
  // Write then Read: one round trip with nothing else in flight. A request
  // the server refused is a response with `error` set (ResponseStatus).
  // When the stream broke, the stream's status (Finish() is then done).
  absl::StatusOr<v1::SampleResponse> Sample(const v1::SampleRequest& request);
  void Cancel() { context_.TryCancel(); }
  bool finished() const { return finished_; }

 private:
  friend class SamplerClient;
  SampleStream() = default;

  grpc::ClientContext context_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::SampleRequest, v1::SampleResponse>>
      stream_;
  bool finished_ = false;
};

// Thread-safe; one per process is enough: its connections (one unless
// ClientOptions::connections) multiplex the calls.
class SamplerClient {
 public:
  static absl::StatusOr<std::unique_ptr<SamplerClient>> Create(
      const ClientOptions& options);

  // One Sample call with deadline and retries.
  absl::StatusOr<v1::SampleResponse> Sample(const v1::SampleRequest& request);
  absl::StatusOr<v1::ModelInfo> GetModelInfo();
  // RegisterSharedMemory / UnregisterSharedMemory (client/shared_memory.h
  // makes the region): the daemon maps `byte_size` bytes of the object
  // shm_open(`key`) names, read-only, and requests may then name it.
  absl::Status RegisterSharedMemory(const std::string& name,
                                    const std::string& key, uint64_t byte_size);
  absl::Status UnregisterSharedMemory(const std::string& name);
  // grpc.health.v1.Health/Check; "" asks about the whole server. A service
  // the server does not know is kServiceUnknown (the protocol's NOT_FOUND).
  absl::StatusOr<HealthStatus> CheckHealth(const std::string& service = "");

  // Opens a SampleStream. `timeout` bounds the whole stream; infinite = no
  // deadline (a stream kept open by an engine for its whole life).
  std::unique_ptr<SampleStream> OpenStream(
      absl::Duration timeout = absl::InfiniteDuration());
  // Sends every request on one stream (a writer thread, so that neither side
  // waits on flow control) and returns one response per request, in order;
  // refused requests have `error` set. The stream's status when it fails,
  // DATA_LOSS when it ends with responses missing.
  absl::StatusOr<std::vector<v1::SampleResponse>> SampleMany(
      absl::Span<const v1::SampleRequest> requests,
      absl::Duration timeout = absl::InfiniteDuration());

  // One attempt, no retry, non-blocking: `done` runs on a gRPC thread when
  // the call ends. For load generators that must not wait for a response
  // before sending the next request. `timeout` <= 0 uses options().timeout.
  // The request is shared, not copied: a load generator sends one request
  // many times.
  void SampleAsync(std::shared_ptr<const v1::SampleRequest> request,
                   std::function<void(absl::StatusOr<v1::SampleResponse>)> done,
                   absl::Duration timeout = absl::ZeroDuration());

  // Attempts that failed with a retryable code and were retried, over the
  // client's lifetime.
  int64_t retries() const { return retries_.load(); }
  const ClientOptions& options() const { return options_; }
  // The first connection's channel.
  const std::shared_ptr<grpc::Channel>& channel() const {
    return channels_.front();
  }

 private:
  SamplerClient(const ClientOptions& options,
                std::vector<std::shared_ptr<grpc::Channel>> channels);
  // The connection the next call takes (ClientOptions::connections).
  size_t NextConnection();

  // Runs `attempt` (one RPC on the given context) until it succeeds, fails
  // with a code not worth retrying, runs out of attempts or of deadline.
  absl::Status CallWithRetry(
      const std::function<grpc::Status(grpc::ClientContext*)>& attempt);
  absl::Duration Jittered(absl::Duration backoff);

  const ClientOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::Sampler::Stub>> stubs_;  // one per channel
  std::atomic<uint64_t> calls_{0};
  std::atomic<int64_t> retries_{0};
  absl::Mutex rng_mu_;
  absl::BitGen rng_ ABSL_GUARDED_BY(rng_mu_);
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_CLIENT_CLIENT_H_
