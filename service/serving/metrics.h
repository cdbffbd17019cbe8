// Every Prometheus metric flashsamplerd exports, built in one place (the
// constructor) so the names, units, help texts and buckets can be read
// together. Names follow flashsampler_<what>_<unit>; labels stay
// low-cardinality (rpc, code, device, reason and one-per-process info labels).
#ifndef FLASHSAMPLER_SERVICE_SERVING_METRICS_H_
#define FLASHSAMPLER_SERVICE_SERVING_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace flashsampler {

class Metrics {
 public:
  Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The registry the metrics endpoint (or a test) collects from.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One finished RPC (for SampleStream: one answered message). `rpc` is the
  // method name ("Sample", "SampleStream", "GetModelInfo").
  void ObserveRequest(absl::string_view rpc, absl::StatusCode code,
                      double seconds);
  // Accepted -> launched, once per request that reached a batch.
  void ObserveQueueWait(double seconds);
  // One engine launch of `rows` rows that took `seconds`.
  void ObserveBatch(int rows, double seconds);
  void SetQueueRows(int64_t rows);
  void AddBatchesInFlight(int delta);
  void SetDeviceMemoryBytes(int device, double bytes);
  void SetWeightsInfo(int64_t vocab, int64_t hidden, absl::string_view dtype,
                      int tp, absl::string_view backend);
  // Rule 4 of DESIGN.md: a fast path that could not certify exactness fell
  // back to the exact path.
  void CountExactFallback(absl::string_view reason, double rows);

  // Text exposition of everything in the registry (what /metrics serves).
  std::string TextExposition() const;
  // Sum and count of flashsampler_batch_rows (tests read coalescing here).
  void BatchRowsSumAndCount(double* sum, uint64_t* count) const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Histogram* queue_wait_;
  prometheus::Histogram* batch_execute_;
  prometheus::Histogram* batch_rows_;
  prometheus::Counter* rows_sampled_;
  prometheus::Gauge* queue_rows_;
  prometheus::Gauge* batches_in_flight_;
  prometheus::Family<prometheus::Gauge>* device_memory_;
  prometheus::Family<prometheus::Gauge>* weights_info_;
  prometheus::Family<prometheus::Counter>* exact_fallback_;
};

// Serves GET /metrics (Prometheus text format 0.0.4) from a registry on its
// own thread, one connection at a time.
//
// Why not prometheus::Exposer: its civetweb workers run on fixed 100 KB
// stacks (Debian builds civetweb with USE_STACK_SIZE=102400), and glibc
// places every thread's static TLS inside its stack. OpenBLAS (60 KB of TLS),
// NCCL (12 KB) and cudart (4 KB) leave the workers about 25 KB, and the first
// scrape overflows it and crashes the daemon (reproduced with a plain Exposer
// linked against those libraries). This server runs on a default-size thread.
class MetricsHttpServer {
 public:
  // Binds address:port (port 0 = any free port) and starts serving.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& address, int port,
      std::shared_ptr<prometheus::Registry> registry);
  ~MetricsHttpServer();  // stops the thread, closes the socket
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  MetricsHttpServer(int listen_fd, int wake_read_fd, int wake_write_fd,
                    int port, std::shared_ptr<prometheus::Registry> registry);
  void Loop();
  void Serve(int fd);

  const int listen_fd_;
  const int wake_read_fd_;  // readable once the destructor asks to stop
  const int wake_write_fd_;
  const int port_;
  const std::shared_ptr<prometheus::Registry> registry_;
  std::thread thread_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_METRICS_H_
