// flashsamplerd: parses flags into ServerOptions, serves until SIGTERM or
// SIGINT, then drains (server.h) and returns 0. A signal during start-up
// exits 0 without serving; a second signal during the drain is logged and
// the drain goes on.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/program_flags.h"
#include "service/serving/process_setup.h"
#include "service/serving/server.h"
#include "service/serving/server_options.h"

namespace {

const flashsampler::ServerOptions kDefaults;

}  // namespace

ABSL_FLAG(std::string, listen_address, kDefaults.listen_address,
          "gRPC listen address host:port (port 0 = any free port)");
ABSL_FLAG(std::string, unix_socket, kDefaults.unix_socket,
          "Also serve gRPC on a Unix socket at this path (callers on the same "
          "host: target unix:<path>); empty = none");
ABSL_FLAG(int, metrics_port, kDefaults.metrics_port,
          "Prometheus /metrics port; 0 = no metrics endpoint");
ABSL_FLAG(std::string, metrics_address, kDefaults.metrics_address,
          "Address the metrics endpoint binds (0.0.0.0: every interface, as "
          "a pod's Prometheus scrape needs; 127.0.0.1: this host only)");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate chain (TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require and verify client certificates (mTLS)");
ABSL_FLAG(absl::Duration, keepalive_time, kDefaults.keepalive.time,
          "Ping a connection after this much silence");
ABSL_FLAG(absl::Duration, keepalive_timeout, kDefaults.keepalive.timeout,
          "Close a connection whose ping is not acknowledged by then");
ABSL_FLAG(absl::Duration, keepalive_min_client_ping_interval,
          kDefaults.keepalive.min_client_ping_interval,
          "Shortest client ping interval tolerated");
ABSL_FLAG(int, max_batch_rows, kDefaults.batcher.max_batch_rows,
          "Most rows per engine batch and per request");
ABSL_FLAG(int64_t, max_queue_rows, kDefaults.batcher.max_queue_rows,
          "Rows that may wait for a batch; beyond: RESOURCE_EXHAUSTED");
ABSL_FLAG(int, overlap_min_rows, kDefaults.batcher.overlap_min_rows,
          "Queued rows that may launch beside an executing batch (0: any)");
ABSL_FLAG(int, max_stream_in_flight, kDefaults.max_stream_in_flight,
          "Requests of one SampleStream accepted but not yet answered");
ABSL_FLAG(int, parse_threads, kDefaults.parse_threads,
          "Threads that help parse a request's row_params of 64 KB or more "
          "(0: the handler's thread alone)");
ABSL_FLAG(int, sample_threads, kDefaults.sample_threads,
          "Threads that serve unary Sample() calls, each polling its own gRPC "
          "completion queue (1 to 256)");
ABSL_FLAG(absl::Duration, sample_poll_spin, kDefaults.sample_poll_spin,
          "How long a Sample thread that just ran an idle engine's batch "
          "polls for the next call without sleeping (0: never; at most 10ms)");
ABSL_FLAG(int, max_shared_memory_regions, kDefaults.max_shared_memory_regions,
          "Shared-memory regions same-host callers may register for their "
          "hidden states (0: none; any object under /dev/shm the daemon can "
          "read may be named)");
ABSL_FLAG(int, max_samples_per_row, kDefaults.limits.max_samples_per_row,
          "Largest SamplingParams.n");
ABSL_FLAG(int, max_top_logprobs, kDefaults.limits.max_top_logprobs,
          "Largest LogprobOptions.top_logprobs");
ABSL_FLAG(absl::Duration, drain_timeout, kDefaults.drain_timeout,
          "On SIGTERM: time accepted requests get to finish");
ABSL_FLAG(std::string, weights, kDefaults.weights.source,
          "Required. LM-head weights: a .safetensors file, a "
          "model.safetensors.index.json, a directory, or synthetic weights "
          "asked for by name: "
          "synthetic:vocab=V,hidden=D,seed=S[,dtype=bf16|fp16|fp32] (e.g. "
          "synthetic:vocab=32000,hidden=512,seed=1)");
ABSL_FLAG(std::string, weights_tensor, kDefaults.weights.tensor_name,
          "Tensor name (default lm_head.weight, else "
          "model.embed_tokens.weight)");
ABSL_FLAG(std::string, weights_dtype, kDefaults.weights.expected_dtype,
          "Refuse weights of another dtype (bf16, fp16, fp32; empty = any)");
ABSL_FLAG(std::string, backend, kDefaults.backend,
          "auto (cuda when a GPU is visible), cpu or cuda");
ABSL_FLAG(int, cpu_threads, kDefaults.cpu_threads,
          "CPU backend threads; 0 = hardware concurrency");
ABSL_FLAG(int64_t, cpu_chunk_rows, kDefaults.cpu_chunk_rows,
          "CPU backend vocabulary rows per chunk");
ABSL_FLAG(int, cpu_slots, kDefaults.cpu_slots, "CPU backend batches in flight");
ABSL_FLAG(int, tp, kDefaults.tp,
          "CUDA backend: GPUs to split the vocabulary over; 0 = all");
ABSL_FLAG(int, cuda_slots, kDefaults.cuda_slots,
          "CUDA backend batches in flight");
ABSL_FLAG(bool, cuda_graphs, kDefaults.cuda_graphs,
          "CUDA backend, one GPU: replay a batch's copies and kernel as one "
          "recorded CUDA graph (false: queue them call by call)");
ABSL_FLAG(std::string, tp_transport, kDefaults.tp_transport,
          "tensor parallel (--tp > 1): auto (NCCL device API, else CUDA peer "
          "access), nccl, or peer");
ABSL_FLAG(int, warmup_rows, kDefaults.warmup_rows,
          "Rows of the warm-up batch run before SERVING");

namespace {

flashsampler::ServerOptions OptionsFromFlags() {
  flashsampler::ServerOptions o;
  o.listen_address = absl::GetFlag(FLAGS_listen_address);
  o.unix_socket = absl::GetFlag(FLAGS_unix_socket);
  o.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  o.tls.cert_path = absl::GetFlag(FLAGS_tls_cert);
  o.tls.key_path = absl::GetFlag(FLAGS_tls_key);
  o.tls.client_ca_path = absl::GetFlag(FLAGS_tls_client_ca);
  o.keepalive.time = absl::GetFlag(FLAGS_keepalive_time);
  o.keepalive.timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o.keepalive.min_client_ping_interval =
      absl::GetFlag(FLAGS_keepalive_min_client_ping_interval);
  o.batcher.max_batch_rows = absl::GetFlag(FLAGS_max_batch_rows);
  o.batcher.max_queue_rows = absl::GetFlag(FLAGS_max_queue_rows);
  o.batcher.overlap_min_rows = absl::GetFlag(FLAGS_overlap_min_rows);
  o.max_stream_in_flight = absl::GetFlag(FLAGS_max_stream_in_flight);
  o.parse_threads = absl::GetFlag(FLAGS_parse_threads);
  o.sample_threads = absl::GetFlag(FLAGS_sample_threads);
  o.sample_poll_spin = absl::GetFlag(FLAGS_sample_poll_spin);
  o.max_shared_memory_regions = absl::GetFlag(FLAGS_max_shared_memory_regions);
  o.limits.max_samples_per_row = absl::GetFlag(FLAGS_max_samples_per_row);
  o.limits.max_top_logprobs = absl::GetFlag(FLAGS_max_top_logprobs);
  o.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  o.weights.source = absl::GetFlag(FLAGS_weights);
  o.weights.tensor_name = absl::GetFlag(FLAGS_weights_tensor);
  o.weights.expected_dtype = absl::GetFlag(FLAGS_weights_dtype);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  o.cpu_chunk_rows = absl::GetFlag(FLAGS_cpu_chunk_rows);
  o.cpu_slots = absl::GetFlag(FLAGS_cpu_slots);
  o.tp = absl::GetFlag(FLAGS_tp);
  o.cuda_slots = absl::GetFlag(FLAGS_cuda_slots);
  o.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  o.tp_transport = absl::GetFlag(FLAGS_tp_transport);
  o.warmup_rows = absl::GetFlag(FLAGS_warmup_rows);
  return o;
}

// The only logger: one line per lifecycle event on stderr.
void Log(const std::string& line) {
  std::fprintf(stderr, "flashsamplerd: %s\n", line.c_str());
  std::fflush(stderr);
}

// Stop signals reach main through a self-pipe: the handler writes the signal
// number, main reads it. Blocking the signals and calling sigwait() is not
// enough: a thread created before main (OpenBLAS starts its pool from a
// shared-library constructor, which runs before anything in this file) keeps
// SIGTERM unblocked, and while main is not inside sigwait() (loading, or
// draining) the kernel delivers the signal to that thread, whose default
// action kills the process (exit 143). A handler runs in whichever thread
// receives the signal, so every SIGTERM/SIGINT ends up in the pipe.
// Bytes on the pipe: a signal number, or kWakeByte from main's own threads.
int g_signal_pipe[2] = {-1, -1};
constexpr char kWakeByte = 0;

void OnStopSignal(int signal_number) {
  const int saved_errno = errno;
  const char byte = static_cast<char>(signal_number);
  // A full pipe (64 KiB of unread signals) drops the byte: main has enough.
  [[maybe_unused]] const ssize_t ignored = write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

bool InstallStopHandlers() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  return sigaction(SIGTERM, &action, nullptr) == 0 &&
         sigaction(SIGINT, &action, nullptr) == 0;
}

void Wake() {
  [[maybe_unused]] const ssize_t ignored =
      write(g_signal_pipe[1], &kWakeByte, 1);
}

// The next byte on the pipe, or -1 after `timeout_ms` (-1: no timeout).
int NextByte(int timeout_ms) {
  for (;;) {
    char byte = 0;
    if (read(g_signal_pipe[0], &byte, 1) == 1) return byte;
    pollfd p{g_signal_pipe[0], POLLIN, 0};
    const int ready = poll(&p, 1, timeout_ms);
    if (ready == 0) return -1;
  }
}

const char* SignalName(int signal_number) {
  return signal_number == SIGINT ? "SIGINT" : "SIGTERM";
}

// Descriptors are the first resource a busy gRPC server runs out of, and
// gRPC's listener never recovers from running out (Server::ListenerHealth),
// so the soft limit goes up to the hard one (often 1024 -> 1048576 in a
// container).
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  if (limit.rlim_cur < limit.rlim_max) {
    const rlim_t before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &limit) == 0) {
      Log(absl::StrCat("file descriptor limit raised from ", before, " to ",
                       limit.rlim_max));
      return;
    }
  }
  Log(absl::StrCat("file descriptor limit ", limit.rlim_cur));
}

// Loading the weights can take minutes; it runs on its own thread so that a
// stop signal meanwhile ends the process at once (the loader is left
// behind: it only reads files and allocates).
struct LoadResult {
  absl::StatusOr<std::unique_ptr<flashsampler::Server>> server =
      absl::UnknownError("not loaded");
};

}  // namespace

int main(int argc, char** argv) {
  flashsampler::SetUpServingProcess();
  if (!InstallStopHandlers()) {
    Log("startup failed: cannot install the SIGTERM/SIGINT handlers");
    return 1;
  }
  const flashsampler::ParsedCommandLine parsed =
      flashsampler::ParseProgramFlags(
          argc, argv, "flashsamplerd", "service/serving/main.cc",
          "flashsamplerd --weights=<checkpoint or synthetic:...> [flags]\n"
          "LM-head sampling daemon (hidden states in, token ids out) over "
          "gRPC.\n"
          "See docs/operations.md (running it) and docs/api.md (the API).");
  if (parsed.exit_code.has_value()) return *parsed.exit_code;
  if (parsed.args.size() > 1) {
    Log(absl::StrCat("startup failed: unexpected argument \"", parsed.args[1],
                     "\" (flags are --name=value)"));
    return 1;
  }
  const flashsampler::ServerOptions options = OptionsFromFlags();
  if (options.weights.source.empty()) {
    Log("startup failed: no --weights given. Serve a checkpoint "
        "(--weights=/models/lm_head.safetensors, a "
        "model.safetensors.index.json or a directory) or ask for synthetic "
        "weights by name, e.g. "
        "--weights=synthetic:vocab=32000,hidden=512,seed=1");
    return 1;
  }
  Log(flashsampler::VersionLine("flashsamplerd"));
  RaiseDescriptorLimit();

  Log(absl::StrCat("loading weights from ", options.weights.source));
  if (options.metrics_port != 0) {
    Log(absl::StrCat("metrics on http://", options.metrics_address, ":",
                     options.metrics_port,
                     "/metrics (flashsampler_serving_state, "
                     "flashsampler_load_progress_ratio during the load)"));
  }
  auto load = std::make_shared<LoadResult>();
  std::thread loader([load, options] {
    load->server = flashsampler::Server::Create(options);
    Wake();
  });
  const int first = NextByte(-1);
  if (first != kWakeByte) {
    Log(absl::StrCat("received ", SignalName(first),
                     " while loading the weights; exiting without serving"));
    loader.detach();
    return 0;
  }
  loader.join();
  absl::StatusOr<std::unique_ptr<flashsampler::Server>>& server = load->server;
  if (!server.ok()) {
    Log(absl::StrCat("startup failed: ", server.status().ToString()));
    return 1;
  }
  const flashsampler::EngineInfo& info = (*server)->engine_info();
  const flashsampler::v1::ModelInfo& model = (*server)->model_info();
  std::vector<int> devices;
  for (const flashsampler::ShardInfo& shard : info.shards) {
    if (shard.device >= 0) devices.push_back(shard.device);
  }
  Log(absl::StrCat(
      "weights ", model.weights_source(),
      model.weights_tensor().empty()
          ? ""
          : absl::StrCat(" [", model.weights_tensor(), "]"),
      ": V=", info.vocab_size, ", D=", info.hidden_size, ", ",
      flashsampler::DTypeName(info.weight_dtype), ", sha256 ",
      model.weights_sha256(), "; backend ", info.backend,
      devices.empty()
          ? ""
          : absl::StrCat(" on devices ", absl::StrJoin(devices, ",")),
      ", tp ", info.shards.size(),
      info.tp_transport.empty() ? ""
                                : absl::StrCat(" over ", info.tp_transport),
      info.controls_path.empty()
          ? ""
          : absl::StrCat("; controls from ", info.controls_path)));
  if (absl::Status s = (*server)->Start(); !s.ok()) {
    Log(absl::StrCat("startup failed: ", s.ToString()));
    return 1;
  }
  Log(absl::StrCat("serving on port ", (*server)->port(), " (",
                   options.listen_address, ")",
                   options.unix_socket.empty()
                       ? ""
                       : absl::StrCat(" and unix:", options.unix_socket)));

  // Wait for a stop signal, checking once a second that gRPC still accepts.
  int signal_number = -1;
  absl::Status listener = absl::OkStatus();
  while (signal_number <= 0) {
    signal_number = NextByte(1000);
    listener = flashsampler::Server::ListenerHealth();
    if (!listener.ok()) break;
  }
  if (!listener.ok()) {
    Log(absl::StrCat("NOT_SERVING: ", listener.message(), "; draining (up to ",
                     absl::FormatDuration(options.drain_timeout),
                     ") and exiting with status 1 so the replica restarts"));
  } else {
    Log(absl::StrCat("received ", SignalName(signal_number),
                     "; draining (up to ",
                     absl::FormatDuration(options.drain_timeout), ")"));
  }
  // Later signals are logged; the drain goes on to its end (Kubernetes
  // follows a SIGTERM with SIGKILL after its grace period, which is the
  // deliberate fast exit).
  std::thread repeat_logger([] {
    for (int byte = NextByte(-1); byte != kWakeByte; byte = NextByte(-1)) {
      Log(absl::StrCat("received ", SignalName(byte),
                       " again; the drain goes on"));
    }
  });
  (*server)->Stop();
  Wake();
  repeat_logger.join();
  Log("stopped");
  return listener.ok() ? 0 : 1;
}
