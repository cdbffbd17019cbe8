// Closed-loop callers on threads (unary calls, or one SampleStream each); the
// open loop on one dispatcher thread that sends at the scheduled Poisson
// arrival times through the async client API, so that slow answers never
// delay the next send.
#include "load/load_runner.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/completion_queue.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace flashsampler {
namespace {

int RequestRows(const v1::SampleRequest& request) {
  const auto& shape = request.hidden_states().shape();
  return shape.empty() ? 0 : static_cast<int>(shape[0]);
}

// OK only when the answer has rows x n tokens: a load test must not count a
// wrong answer as a fast one.
absl::StatusCode Check(const absl::StatusOr<v1::SampleResponse>& response,
                       int rows) {
  if (!response.ok()) return response.status().code();
  if (absl::Status s = ResponseStatus(*response); !s.ok()) return s.code();
  const int n = std::max(response->n(), 1);
  return response->token_ids_size() == rows * n ? absl::StatusCode::kOk
                                                : absl::StatusCode::kDataLoss;
}

// One closed-loop caller's unary calls without retries, on the request's
// wire bytes: the request is serialized once and every call sends the same
// bytes (gRPC refers to them, no copy), and the caller waits on its own
// completion queue. The typed stub would serialize the request again on each
// call (2 MB at 256 rows of D = 4096, on the request's critical path) and
// make a queue per call: the generator's own cost, not the server's.
class WireCaller {
 public:
  WireCaller(SamplerClient& client, const grpc::ByteBuffer& request,
             bool poll_spin)
      : stub_(client.channel()),
        request_(request),
        timeout_(client.options().timeout),
        wait_for_ready_(client.options().wait_for_ready),
        poll_spin_(poll_spin) {}
  ~WireCaller() {
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  WireCaller(const WireCaller&) = delete;
  WireCaller& operator=(const WireCaller&) = delete;

  absl::StatusOr<v1::SampleResponse> Sample() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    context.set_wait_for_ready(wait_for_ready_);
    grpc::ByteBuffer reply;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub_.PrepareUnaryCall(&context, "/flashsampler.v1.Sampler/Sample",
                               request_, &cq_);
    call->StartCall();
    call->Finish(&reply, &status, this);
    void* tag = nullptr;
    bool ok = false;
    bool got = false;
    if (poll_spin_) {
      got = NextWithoutSleeping(cq_, &tag, &ok) ==
            grpc::CompletionQueue::GOT_EVENT;
    } else {
      got = cq_.Next(&tag, &ok);
    }
    if (!got || tag != this || !ok) {
      return absl::InternalError("the call's completion queue failed");
    }
    if (!status.ok()) return ToAbslStatus(status);
    v1::SampleResponse response;
    grpc::ProtoBufferReader reader(&reply);
    if (!response.ParseFromZeroCopyStream(&reader)) {
      return absl::DataLossError("unparsable SampleResponse");
    }
    return response;
  }

 private:
  grpc::GenericStub stub_;
  const grpc::ByteBuffer request_;
  const absl::Duration timeout_;
  const bool wait_for_ready_;
  const bool poll_spin_;  // LoadOptions::poll_spin
  grpc::CompletionQueue cq_;
};

bool ByStart(const CallRecord& a, const CallRecord& b) {
  return a.start_s < b.start_s;
}

LoadResult RunClosed(const std::vector<SamplerClient*>& clients,
                     const v1::SampleRequest& request,
                     const LoadOptions& options) {
  const int rows = RequestRows(request);
  const absl::Time measure_start = absl::Now() + options.warmup;
  const absl::Time end = measure_start + options.duration;
  std::vector<std::vector<CallRecord>> per_caller(
      static_cast<size_t>(options.concurrency));
  grpc::ByteBuffer wire;
  bool own_buffer = false;
  if (!grpc::SerializationTraits<v1::SampleRequest>::Serialize(request, &wire,
                                                               &own_buffer)
           .ok()) {
    // The typed path below reports the same failure on every call.
    wire.Clear();
  }
  std::vector<std::thread> callers;
  for (int i = 0; i < options.concurrency; ++i) {
    callers.emplace_back([&, i] {
      SamplerClient& client = *clients[static_cast<size_t>(i) % clients.size()];
      std::vector<CallRecord>& records = per_caller[static_cast<size_t>(i)];
      std::unique_ptr<SampleStream> stream;
      std::unique_ptr<WireCaller> wire_caller;
      if (!options.stream && client.options().retry.max_attempts <= 1 &&
          wire.Valid()) {
        wire_caller =
            std::make_unique<WireCaller>(client, wire, options.poll_spin);
      }
      for (absl::Time start = absl::Now(); start < end; start = absl::Now()) {
        absl::StatusCode code;
        if (options.stream) {
          if (stream == nullptr || stream->finished()) {
            stream = client.OpenStream(end - start + client.options().timeout);
          }
          code = Check(stream->Sample(request), rows);
        } else if (wire_caller != nullptr) {
          code = Check(wire_caller->Sample(), rows);
        } else {
          code = Check(client.Sample(request), rows);
        }
        const absl::Time done = absl::Now();
        if (start < measure_start) continue;
        records.push_back({absl::ToDoubleSeconds(start - measure_start),
                           absl::ToDoubleSeconds(done - start), code, rows});
      }
      if (stream != nullptr && !stream->finished()) {
        stream->WritesDone();
        // The run's records hold every answer; how the stream ended adds
        // nothing to them.
        stream->Finish().IgnoreError();
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  LoadResult result;
  result.duration_s = absl::ToDoubleSeconds(options.duration);
  for (auto& records : per_caller) {
    result.records.insert(result.records.end(), records.begin(), records.end());
  }
  std::sort(result.records.begin(), result.records.end(), ByStart);
  return result;
}

// What the open loop's completion callbacks share with the dispatcher. Held
// by shared_ptr: the last callback may still be unlocking `mu` when the
// dispatcher wakes up and returns.
struct OpenLoopState {
  absl::Mutex mu;
  std::vector<CallRecord> records ABSL_GUARDED_BY(mu);
  int outstanding ABSL_GUARDED_BY(mu) = 0;
};

LoadResult RunOpen(const std::vector<SamplerClient*>& clients,
                   std::shared_ptr<const v1::SampleRequest> request,
                   const LoadOptions& options) {
  const int rows = RequestRows(*request);
  const double warmup_s = absl::ToDoubleSeconds(options.warmup);
  const std::vector<double> arrivals = PoissonArrivals(
      options.rate, warmup_s + absl::ToDoubleSeconds(options.duration),
      options.seed);
  auto state = std::make_shared<OpenLoopState>();
  LoadResult result;
  const absl::Time t0 = absl::Now();
  size_t next_client = 0;
  for (double arrival : arrivals) {
    const absl::Time scheduled = t0 + absl::Seconds(arrival);
    const absl::Duration wait = scheduled - absl::Now();
    if (wait > absl::ZeroDuration()) absl::SleepFor(wait);
    const bool measured = arrival >= warmup_s;
    {
      absl::MutexLock lock(&state->mu);
      if (state->outstanding >= options.max_outstanding) {
        if (measured) ++result.dropped;
        continue;
      }
      ++state->outstanding;
    }
    SamplerClient& client = *clients[next_client++ % clients.size()];
    client.SampleAsync(
        request, [state, scheduled, measured, rows, arrival,
                  warmup_s](absl::StatusOr<v1::SampleResponse> response) {
          const absl::StatusCode code = Check(response, rows);
          const absl::Time done = absl::Now();
          absl::MutexLock lock(&state->mu);
          if (measured) {
            state->records.push_back({arrival - warmup_s,
                                      absl::ToDoubleSeconds(done - scheduled),
                                      code, rows});
          }
          --state->outstanding;
        });
  }
  {
    // Every call ends by its deadline, so this wait is bounded.
    absl::MutexLock lock(&state->mu);
    state->mu.Await(absl::Condition(
        +[](int* outstanding) { return *outstanding == 0; },
        &state->outstanding));
    result.records = std::move(state->records);
  }
  result.duration_s = absl::ToDoubleSeconds(options.duration);
  std::sort(result.records.begin(), result.records.end(), ByStart);
  return result;
}

}  // namespace

std::vector<double> PoissonArrivals(double rate, double horizon_s,
                                    uint64_t seed) {
  std::vector<double> arrivals;
  if (rate <= 0.0 || horizon_s <= 0.0) return arrivals;
  std::mt19937_64 gen(seed);
  // Inverse CDF of the exponential with u in (0, 1], written out so that the
  // schedule does not depend on the standard library's distributions.
  for (double t = 0.0;;) {
    const double u = (static_cast<double>(gen() >> 11) + 1.0) * 0x1.0p-53;
    t += -std::log(u) / rate;
    if (t >= horizon_s) break;
    arrivals.push_back(t);
  }
  return arrivals;
}

absl::StatusOr<LoadResult> RunLoad(
    SamplerClient& client, std::shared_ptr<const v1::SampleRequest> request,
    const LoadOptions& options) {
  return RunLoad(std::vector<SamplerClient*>{&client}, std::move(request),
                 options);
}

absl::StatusOr<LoadResult> RunLoad(
    const std::vector<SamplerClient*>& clients,
    std::shared_ptr<const v1::SampleRequest> request,
    const LoadOptions& options) {
  if (clients.empty() ||
      std::find(clients.begin(), clients.end(), nullptr) != clients.end()) {
    return absl::InvalidArgumentError("clients: at least one, none null");
  }
  if (request == nullptr || RequestRows(*request) < 1) {
    return absl::InvalidArgumentError("request: needs hidden states [B, D]");
  }
  if (options.duration <= absl::ZeroDuration() ||
      options.warmup < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("duration must be > 0 and warmup >= 0");
  }
  if (options.mode == LoadOptions::Mode::kClosed) {
    if (options.concurrency < 1) {
      return absl::InvalidArgumentError("concurrency: must be >= 1");
    }
    return RunClosed(clients, *request, options);
  }
  if (options.stream) {
    return absl::InvalidArgumentError(
        "stream: closed loop only (each caller keeps one stream)");
  }
  if (!(options.rate > 0.0) || options.max_outstanding < 1) {
    return absl::InvalidArgumentError(
        "rate must be > 0 and max_outstanding >= 1");
  }
  return RunOpen(clients, std::move(request), options);
}

}  // namespace flashsampler
