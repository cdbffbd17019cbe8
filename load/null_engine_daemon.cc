// flashsamplerd_null_engine: the daemon's serving path (gRPC, codec,
// batcher, metrics) on an engine that answers token 0 at once, or after a
// fixed --engine_delay per batch. Benchmark-only: it measures what the
// service costs around the kernel, and the ceiling of the load generator.
//   flashsamplerd_null_engine --listen_address=127.0.0.1:50051 --hidden=4096
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "service/serving/process_setup.h"
#include "service/serving/server.h"

ABSL_FLAG(std::string, listen_address, "127.0.0.1:50051", "gRPC address");
ABSL_FLAG(std::string, unix_socket, "", "also serve on this Unix socket");
ABSL_FLAG(std::string, metrics_address, "127.0.0.1", "metrics address");
ABSL_FLAG(int, metrics_port, 0, "Prometheus port; 0 = none");
ABSL_FLAG(int64_t, vocab, 151936, "V the engine claims");
ABSL_FLAG(int64_t, hidden, 4096, "D the engine claims");
ABSL_FLAG(std::string, input_dtype, "bf16",
          "dtype the engine takes hidden states in: bf16 or fp32");
ABSL_FLAG(int, max_batch_rows, 256, "largest batch");
ABSL_FLAG(int, max_shared_memory_regions, 0,
          "shared-memory regions callers may register (0: none)");
ABSL_FLAG(int, slots, 2, "batches in flight at once");
ABSL_FLAG(int, sample_threads, flashsampler::ServerOptions().sample_threads,
          "threads that serve unary Sample() calls, a completion queue each");
ABSL_FLAG(absl::Duration, sample_poll_spin,
          flashsampler::ServerOptions().sample_poll_spin,
          "how long a Sample thread that just ran the batch itself polls "
          "without sleeping (0: never)");
ABSL_FLAG(int, parse_threads, flashsampler::ServerOptions().parse_threads,
          "threads that help parse large row_params (0: the handler alone)");
ABSL_FLAG(absl::Duration, engine_delay, absl::ZeroDuration(),
          "time each batch takes (a kernel stand-in); 0 = returns at once");
ABSL_FLAG(bool, controls, false,
          "claim every sampling control, so that requests with controls are "
          "decoded and batched as for the CUDA engine (answers: token 0)");

namespace flashsampler {
namespace {

class NullEngine final : public Engine {
 public:
  NullEngine(int64_t vocab, int64_t hidden, DType input_dtype, int max_rows,
             int slots, absl::Duration delay, bool controls)
      : delay_(delay) {
    info_.backend = "null";
    info_.vocab_size = vocab;
    info_.hidden_size = hidden;
    info_.weight_dtype = input_dtype;
    info_.input_dtype = input_dtype;
    info_.max_batch_rows = max_rows;
    info_.shards.push_back({0, -1, 0, vocab});
    if (controls) info_.supported_controls = AllSamplingControls();
    inputs_.resize(static_cast<size_t>(slots));
    for (auto& input : inputs_) {
      input.resize(static_cast<size_t>(max_rows) * hidden * 4);
    }
  }
  const EngineInfo& info() const override { return info_; }
  int max_slots() const override { return static_cast<int>(inputs_.size()); }
  void* slot_input(int slot) override { return inputs_[slot].data(); }
  absl::Status Sample(const BatchView& batch,
                      std::vector<RowResult>* results) override {
    // Spins, as the CUDA engine's thread does while the GPU runs (a sleep
    // overshoots by tens of microseconds).
    const absl::Time until = absl::Now() + delay_;
    while (absl::Now() < until) {
    }
    results->resize(static_cast<size_t>(batch.rows));
    for (int r = 0; r < batch.rows; ++r) {
      RowResult& row = (*results)[r];
      row.token_ids.assign(static_cast<size_t>(batch.specs[r].params->n), 0);
      row.sampled_logprobs.assign(row.token_ids.size(), 0.0f);
      row.sampled_ranks.assign(row.token_ids.size(), 1);
      row.logsumexp = 0.0f;
    }
    return absl::OkStatus();
  }

 private:
  EngineInfo info_;
  std::vector<std::vector<char>> inputs_;
  const absl::Duration delay_;
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  SetUpServingProcess();  // as flashsamplerd
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before any thread starts

  ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen_address);
  options.unix_socket = absl::GetFlag(FLAGS_unix_socket);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  options.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.batcher.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  options.parse_threads = absl::GetFlag(FLAGS_parse_threads);
  options.sample_threads = absl::GetFlag(FLAGS_sample_threads);
  options.sample_poll_spin = absl::GetFlag(FLAGS_sample_poll_spin);
  options.max_shared_memory_regions =
      absl::GetFlag(FLAGS_max_shared_memory_regions);
  options.drain_timeout = absl::Seconds(5);
  const DType dtype =
      absl::GetFlag(FLAGS_input_dtype) == "fp32" ? DType::kFp32 : DType::kBf16;
  auto engine = std::make_unique<NullEngine>(
      absl::GetFlag(FLAGS_vocab), absl::GetFlag(FLAGS_hidden), dtype,
      absl::GetFlag(FLAGS_max_batch_rows), absl::GetFlag(FLAGS_slots),
      absl::GetFlag(FLAGS_engine_delay), absl::GetFlag(FLAGS_controls));
  auto server =
      Server::CreateWithEngine(options, std::move(engine), nullptr, "null");
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = (*server)->Start(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "flashsamplerd_null_engine: serving on port %d\n",
               (*server)->port());
  int signal_number = 0;
  sigwait(&stop, &signal_number);
  (*server)->Stop();
  return 0;
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) { return flashsampler::Main(argc, argv); }
