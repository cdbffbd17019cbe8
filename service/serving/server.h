// flashsamplerd's top-level object: owns the weights, the engine, the
// batcher, the gRPC server (Sampler + grpc.health.v1 + reflection) and the
// Prometheus metrics endpoint, and orders their start and stop.
//
// Lifecycle:
//   Create()  starts the metrics endpoint (so that Prometheus sees
//             flashsampler_serving_state{state="loading"} and
//             flashsampler_load_progress_ratio during a minutes-long load),
//             loads and checksums the weights and builds the engine (the
//             gRPC port does not listen yet). Progress: 0 while reading the
//             weights, 0.5 once read and checksummed, 0.75 once the backend
//             holds them, 1 after the warm-up (the loader reports no finer
//             steps; reading and device upload dominate).
//   Start()   runs a warm-up batch on every engine slot, starts the batcher,
//             the metrics endpoint (if Create did not) and the gRPC server,
//             then reports SERVING.
//             gRPC starts last, so health never answers SERVING before the
//             warm-up (the default health service starts out SERVING).
//   Stop()    in this order, each step for a reason:
//     1. health NOT_SERVING: load balancers and Kubernetes readiness stop
//        sending new work while the server still answers.
//     2. stop accepting: new Sample calls get UNAVAILABLE "draining"; open
//        SampleStreams stop reading, answer what they accepted, then end
//        with UNAVAILABLE.
//     3. wait until the batcher is idle (every accepted request answered),
//        bounded by drain_timeout.
//     4. grpc::Server::Shutdown(deadline = start of Stop + drain_timeout):
//        waits for the calls still open, cancels what is left at the
//        deadline. The batcher's workers still run here, so every reactor
//        gets finished and Shutdown cannot hang on our own calls.
//     5. stop the batcher (join its workers; anything queued after a timeout
//        is answered CANCELLED by then), then unary Sample's threads (a
//        batcher thread's answer goes out through their completion queues).
//     6. stop the metrics endpoint, then tear the engine down (device
//        buffers, streams, NCCL) and release the weights, in that order
//        because the engine reads the weights.
#ifndef FLASHSAMPLER_SERVICE_SERVING_SERVER_H_
#define FLASHSAMPLER_SERVICE_SERVING_SERVER_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "flashsampler/v1/sampler.pb.h"
#include "grpcpp/server.h"
#include "service/backends/engine.h"
#include "service/serving/batcher.h"
#include "service/serving/metrics.h"
#include "service/serving/metrics_http_server.h"
#include "service/serving/sampler_service.h"
#include "service/serving/server_options.h"
#include "service/serving/shared_memory.h"
#include "service/weights/weights.h"

namespace flashsampler {

class Server {
 public:
  // Loads options.weights and builds the backend options.backend names.
  // An empty options.weights.source is refused (InvalidArgument saying how
  // to ask for synthetic weights).
  static absl::StatusOr<std::unique_ptr<Server>> Create(
      const ServerOptions& options);
  // Serves an engine built by the caller (tests, embedders); `weights`, if
  // given, is kept alive until the engine is gone. `weights_source` is
  // reported in ModelInfo.
  static absl::StatusOr<std::unique_ptr<Server>> CreateWithEngine(
      const ServerOptions& options, std::unique_ptr<Engine> engine,
      std::shared_ptr<const Weights> weights = nullptr,
      std::string weights_source = "");

  ~Server();  // Stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Warm-up, then serving. Fails (and serves nothing) if the warm-up batch
  // fails or a port cannot be bound. Call at most once.
  absl::Status Start();
  // Drains and stops (order above). Idempotent; safe from any thread except
  // a gRPC or batcher thread.
  void Stop();

  // The bound gRPC port (resolves listen_address port 0), after Start().
  int port() const { return port_; }
  // The bound metrics port after Start(); 0 when metrics are off.
  int metrics_port() const { return metrics_port_; }
  Metrics& metrics() { return *metrics_; }
  const EngineInfo& engine_info() const { return info_; }
  // What GetModelInfo answers (weights, backend, build).
  const v1::ModelInfo& model_info() const { return model_; }
  // What a health check answers right now.
  bool serving() const;
  // Largest request message the server accepts, derived from the model.
  int max_receive_message_bytes() const { return max_receive_bytes_; }

  // Non-OK once gRPC's listener in this process has stopped accepting
  // connections for good. gRPC 1.51's POSIX listener closes itself when
  // accept4() fails with anything but EAGAIN/EINTR, EMFILE included (all
  // descriptors in use), and logs "Failed accept4: <error>"; that line is the
  // only trace it leaves, so Start() watches gRPC's log for it. The replica
  // can then never take a new connection again: flashsamplerd drains and
  // exits non-zero so that Kubernetes restarts it.
  static absl::Status ListenerHealth();

 private:
  // What Create() made before the engine existed: the metrics (and their
  // endpoint, already serving) and the weights' identity.
  struct Prepared {
    std::unique_ptr<Metrics> metrics;
    std::unique_ptr<MetricsHttpServer> metrics_http;
    std::string weights_tensor;
    std::string weights_sha256;
  };
  static absl::StatusOr<std::unique_ptr<Server>> CreateImpl(
      const ServerOptions& options, std::unique_ptr<Engine> engine,
      std::shared_ptr<const Weights> weights, std::string weights_source,
      Prepared prepared);
  Server(const ServerOptions& options, std::shared_ptr<const Weights> weights,
         std::unique_ptr<Engine> engine, std::string weights_source,
         Prepared prepared);

  absl::Status WarmUp();
  absl::Status StartMetrics();
  absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpc();
  void SetServing(bool serving) ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu_);
  // Binds the metrics endpoint on options.metrics_port, serving `metrics`.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> ServeMetrics(
      const ServerOptions& options, Metrics* metrics);
  void OnFatal(const absl::Status& status);

  const ServerOptions options_;
  const std::string weights_source_;
  EngineInfo info_;  // a copy: still readable after Stop() frees the engine
  v1::ModelInfo model_;
  std::unique_ptr<Metrics> metrics_;
  // Declared after metrics_, so destroyed before it (it reads metrics_).
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  // Declared in teardown order reversed: the engine reads the weights, the
  // batcher drives the engine, the service feeds the batcher.
  std::shared_ptr<const Weights> weights_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Batcher> batcher_;
  // Before the service, which decodes from it.
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  std::unique_ptr<SamplerService> service_;
  std::unique_ptr<grpc::Server> grpc_server_ ABSL_GUARDED_BY(health_mu_);
  int port_ = 0;
  int metrics_port_ = 0;
  int max_receive_bytes_ = 0;

  mutable absl::Mutex health_mu_;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;
  bool fatal_ ABSL_GUARDED_BY(health_mu_) = false;
  bool started_ ABSL_GUARDED_BY(health_mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(health_mu_) = false;
  absl::Mutex stop_mu_;  // serializes Stop()
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_SERVER_H_
