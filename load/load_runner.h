// The two load shapes. Closed loop: N callers, each sends its next request
// when the previous one is answered (measures capacity; latency includes no
// client-side queueing). Open loop: requests arrive as a Poisson process at a
// target rate whatever the server does (measures latency under a given
// offered load, the way production traffic behaves).
#ifndef FLASHSAMPLER_LOAD_LOAD_RUNNER_H_
#define FLASHSAMPLER_LOAD_LOAD_RUNNER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "load/load_stats.h"

namespace flashsampler {

struct LoadOptions {
  enum class Mode { kClosed, kOpen };
  Mode mode = Mode::kClosed;
  int concurrency = 8;  // closed loop: callers
  // Closed loop: each caller keeps one SampleStream open and sends its
  // requests on it (the way an engine holding a stream calls) instead of
  // one Sample call per request. A broken stream counts its status for the
  // request in flight and the caller opens a new one. A stalled server holds
  // a caller until the stream's deadline: the rest of the run plus the
  // client's timeout.
  bool stream = false;
  // Closed-loop unary callers on the request's wire bytes wait for each
  // answer by polling their completion queue without sleeping, as a caller
  // that busy-polls does, instead of sleeping in it: the caller's own
  // wake-up is then not part of the latency. (Callers that go through
  // SamplerClient::Sample, with retries, poll by the client's own
  // ClientOptions::busy_poll, which load_main sets from the same flag.)
  bool poll_spin = false;
  double rate = 100.0;  // open loop: mean arrivals per second
  // Measured window; calls that start in the warm-up before it are sent but
  // not recorded (connections, server caches and thread pools warm up).
  absl::Duration duration = absl::Seconds(10);
  absl::Duration warmup = absl::ZeroDuration();
  // Open loop: most calls in flight; an arrival beyond it is counted as
  // dropped instead of sent, so a stalled server cannot make the generator
  // hold unbounded memory.
  int max_outstanding = 10000;
  uint64_t seed = 1;  // arrival process
  // Each call's deadline is the client's options().timeout.
};

struct LoadResult {
  std::vector<CallRecord> records;  // measured window only, by start time
  double duration_s = 0.0;
  int64_t dropped = 0;
};

// Draws the open loop's arrival offsets (seconds from 0, ascending) in
// [0, horizon_s): exponential gaps with mean 1 / rate.
std::vector<double> PoissonArrivals(double rate, double horizon_s,
                                    uint64_t seed);

// Sends `request` again and again as `options` says. Closed-loop unary
// callers of clients without retries (retry.max_attempts 1) send the
// request's bytes serialized once, so that the generator's cost per call is
// gRPC's, not a fresh encoding of the hidden states. A response whose
// token count is not rows x n counts as DATA_LOSS, one whose `error` is set
// (SampleStream) as that error's code. InvalidArgument for options out of
// range (`stream` is for the closed loop only).
absl::StatusOr<LoadResult> RunLoad(
    SamplerClient& client, std::shared_ptr<const v1::SampleRequest> request,
    const LoadOptions& options);

// The same over several clients (each its own connection): closed-loop
// caller i uses clients[i % n], open-loop arrival k uses clients[k % n]. One
// HTTP/2 connection carries about 17k small calls per second on 2 cores,
// below what the daemon serves, so a load generator that measures the
// daemon spreads its callers.
absl::StatusOr<LoadResult> RunLoad(
    const std::vector<SamplerClient*>& clients,
    std::shared_ptr<const v1::SampleRequest> request,
    const LoadOptions& options);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_LOAD_LOAD_RUNNER_H_
