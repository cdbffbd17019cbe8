// Configuration of flashsamplerd as plain structs, one commented default per
// field. Only main.cc parses flags; everything else (tests, embedders) fills
// these structs directly.
#ifndef FLASHSAMPLER_SERVICE_SERVING_SERVER_OPTIONS_H_
#define FLASHSAMPLER_SERVICE_SERVING_SERVER_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "service/weights/weights.h"

namespace flashsampler {

// Transport security. All paths empty = plaintext. cert + key = TLS;
// additionally client_ca = mutual TLS (clients must present a certificate
// signed by that CA, or the handshake fails).
struct TlsOptions {
  std::string cert_path;       // PEM server certificate chain; "" = no TLS
  std::string key_path;        // PEM private key of cert_path
  std::string client_ca_path;  // PEM CA bundle for client certs; "" = no mTLS
};

// HTTP/2 keepalive. The server pings idle connections so that dead peers
// (a node gone behind a load balancer) are noticed, and it tolerates client
// pings down to min_client_ping_interval (clients pinging faster get a GOAWAY).
struct KeepaliveOptions {
  absl::Duration time = absl::Seconds(60);     // ping after this much silence
  absl::Duration timeout = absl::Seconds(20);  // close if no ack by then
  bool permit_without_calls = true;  // also ping connections with no RPC
  absl::Duration min_client_ping_interval = absl::Seconds(10);
};

// Limits the request codec enforces beyond the model's shape.
struct RequestLimits {
  int max_samples_per_row = 16;  // largest SamplingParams.n
  int max_top_logprobs = 20;     // largest LogprobOptions.top_logprobs
};

// The batcher's knobs.
struct BatcherOptions {
  // Most rows in one engine launch; a request never gets split, so this is
  // also the largest B a request may carry. Clamped to the engine's own
  // EngineInfo::max_batch_rows.
  int max_batch_rows = 256;
  // Rows accepted but not yet launched. A request that would push the queue
  // past this bound is refused with RESOURCE_EXHAUSTED (memory stays bounded:
  // the queue holds at most max_queue_rows x D hidden-state elements).
  int64_t max_queue_rows = 4096;
  // A batch launches beside one the engine is still executing only when at
  // least this many rows are queued for it (clamped to max_batch_rows and
  // max_queue_rows); fewer wait
  // for it and go out together, so W is read once for all of them. 0:
  // whenever a slot is free. 32 against 0 on an H100 (two CUDA slots,
  // single-row callers): 14.7k against 11.0k requests/s at 16 callers,
  // 46.4k against 37.9k at 64, 80.6k against 71.8k at 256; multi-row loads
  // and open-loop tails within the runs' noise (docs/performance.md).
  int overlap_min_rows = 32;
};

struct ServerOptions {
  // gRPC listen address. Port 0 picks a free port (see Server::port()).
  std::string listen_address = "0.0.0.0:50051";
  // Also serve on a Unix socket at this path (empty = none): callers on the
  // same host (a sidecar, a pod sharing the volume) reach the daemon without
  // a TCP port, and the socket file's permissions decide who may. Same
  // services and credentials as listen_address. Not a speed-up on the
  // measured H100 host (docs/performance.md#service). A socket at the path
  // that still accepts is refused; a stale one is replaced.
  std::string unix_socket;
  // Prometheus text exposition on http://<metrics_address>:<metrics_port>/
  // metrics. 0 = no metrics endpoint (the registry still exists in-process).
  int metrics_port = 9400;
  std::string metrics_address = "0.0.0.0";
  TlsOptions tls;
  KeepaliveOptions keepalive;
  BatcherOptions batcher;
  RequestLimits limits;
  // Most requests of one SampleStream accepted but not yet answered; the
  // server stops reading that stream until a response has been written.
  int max_stream_in_flight = 32;
  // Threads that help a handler parse a Sample request's or a SampleStream
  // message's row_params once they hold 64 KB or more
  // (kParallelRowParamsBytes), beside the handler's own; 0: the handler alone.
  // Each row's controls are a message protobuf parses on one thread, about 10
  // us a row with a bitmask, 64 bias entries and 128 penalized ids (a
  // development host).
  int parse_threads = 4;
  // Threads that serve unary Sample() calls, each polling its own gRPC
  // completion queue (1 to 256): they decode requests, hand them to the
  // batcher and run an idle engine's batch themselves; a thread takes its
  // next call once the last is in the batcher or answered. Four against
  // eight and sixteen on a 16-core H100 host (docs/performance.md#service):
  // the most requests at 64 and 256 single-row callers, within 3% of eight
  // at one caller; sixteen lost what four gained over gRPC's callback API.
  int sample_threads = 4;
  // How long a Sample thread that has just run an idle engine's batch itself
  // keeps polling its completion queue without sleeping, so that the
  // caller's next call finds it awake (one thread at a time; 0: never; at
  // most 10 ms). A thread that sleeps in gRPC's poller is woken
  // by the kernel's scheduler when the call arrives, and on a VM an idle
  // vCPU halts until the hypervisor wakes it. Calls run inline only when
  // nothing else is queued or running, so a loaded daemon rarely spins. On
  // three H100 hosts, daemons alternating: one caller of 64 rows had a
  // lower p50 in 11 of 11 rounds (by 0.05 ms at the median), one of one
  // row in 8 of 11 (by 0.025 ms), for 25-40% more daemon CPU per request
  // at one caller; 2 ms gained no more than 500 us.
  absl::Duration sample_poll_spin = absl::Microseconds(500);
  // Most shared-memory regions callers may register at once
  // (RegisterSharedMemory; service/serving/shared_memory.h). 0: none, every
  // request carries its hidden states. Off by default because a region is
  // any object the daemon's user can read under /dev/shm: turn it on where
  // every caller that reaches the daemon is trusted with that.
  int max_shared_memory_regions = 0;
  // How long Stop() (SIGTERM) lets accepted requests and open streams finish
  // before the gRPC server cancels what is left.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Where W comes from. No default: Server::Create refuses an empty source,
  // so synthetic weights are served only when named
  // ("synthetic:vocab=32000,hidden=512,seed=1"), never by accident.
  WeightsOptions weights = [] {
    WeightsOptions none;
    none.source.clear();
    return none;
  }();
  // "auto" (cuda when built with the CUDA backend and a GPU is visible, else
  // cpu), "cpu" or "cuda".
  std::string backend = "auto";
  // CPU backend: worker threads (0 = hardware concurrency) and vocabulary
  // rows per chunk.
  int cpu_threads = 0;
  int64_t cpu_chunk_rows = 4096;
  // CPU backend: batches that may run at once (each has its own slot).
  int cpu_slots = 1;
  // CUDA backend: tensor-parallel degree = number of GPUs the vocabulary is
  // split over, devices 0 .. tp-1. 0 = every visible GPU.
  int tp = 0;
  // CUDA backend: batches in flight (two lets copies overlap compute).
  int cuda_slots = 2;
  // CUDA backend, one GPU: replay each batch size's input copy, kernel and
  // token copy (or, for a controlled batch served from unit candidates, its
  // input copy and kernel) as one recorded CUDA graph
  // (CudaEngineOptions::replay_graphs).
  bool cuda_graphs = true;
  // CUDA backend, tp > 1: how ranks hand their candidates to rank 0. "auto":
  // NCCL's device API, or CUDA peer access when that cannot be set up;
  // "nccl": the device API or fail; "peer": CUDA peer access.
  std::string tp_transport = "auto";
  // Rows of the warm-up batch run on every slot before health says SERVING.
  int warmup_rows = 8;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_SERVER_OPTIONS_H_
