// Every Prometheus metric flashsamplerd exports, built in one place (the
// constructor) so the names, units, help texts and buckets can be read
// together. Names follow flashsampler_<what>_<unit>; labels stay
// low-cardinality (rpc, code, device, reason and one-per-process info labels).
#ifndef FLASHSAMPLER_SERVICE_SERVING_METRICS_H_
#define FLASHSAMPLER_SERVICE_SERVING_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace flashsampler {

// The service's RPC names, the `rpc` label of the request metrics
// (ObserveRequest keeps their children after the first request).
inline constexpr char kRpcSample[] = "Sample";
inline constexpr char kRpcSampleStream[] = "SampleStream";
inline constexpr char kRpcGetModelInfo[] = "GetModelInfo";
inline constexpr char kRpcRegisterSharedMemory[] = "RegisterSharedMemory";
inline constexpr char kRpcUnregisterSharedMemory[] = "UnregisterSharedMemory";

// What health would answer, as flashsampler_serving_state shows it.
enum class ServingState { kLoading, kServing, kDraining, kNotServing };
const char* ServingStateName(ServingState state);

class Metrics {
 public:
  Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The registry the metrics endpoint (or a test) collects from.
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One finished RPC (for SampleStream: one answered message). `rpc` is the
  // method name (kRpcSample ...).
  void ObserveRequest(absl::string_view rpc, absl::StatusCode code,
                      double seconds);
  // Received -> handed to the batcher (parsing, decoding and checking it),
  // once per request that decoded.
  void ObserveDecode(double seconds);
  // Accepted -> launched, once per request that reached a batch.
  void ObserveQueueWait(double seconds);
  // Its batch answered -> its response handed to gRPC (encoding and
  // serializing it), once per request that reached a batch.
  void ObserveEncode(double seconds);
  // One engine launch of `rows` rows that took `seconds`.
  void ObserveBatch(int rows, double seconds);
  void SetQueueRows(int64_t rows);
  void AddBatchesInFlight(int delta);
  void SetDeviceMemoryBytes(int device, double bytes);
  void SetWeightsInfo(int64_t vocab, int64_t hidden, absl::string_view dtype,
                      int tp, absl::string_view backend);

  // Upper bounds of the latency histograms (request, queue wait, batch).
  static const std::vector<double>& LatencyBucketBounds();
  // flashsampler_serving_state{state=...}: 1 for `state`, 0 for the others.
  void SetServingState(ServingState state);
  // flashsampler_load_progress_ratio, 0..1 (server.h says what each step is).
  void SetLoadProgress(double ratio);
  // A fast path that could not certify exactness fell back to the exact
  // path (docs/design.md#exactness-and-refusals).
  void CountExactFallback(absl::string_view reason, double rows);

  // Text exposition of everything in the registry (what /metrics serves).
  std::string TextExposition() const;
  // Sum and count of flashsampler_batch_rows (tests read coalescing here).
  void BatchRowsSumAndCount(double* sum, uint64_t* count) const;

 private:
  // The kRpc* names and status codes whose request children are kept below.
  static constexpr int kKnownRpcs = 5;
  static constexpr int kStatusCodes = 17;  // absl::StatusCode 0..16

  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Counter>* requests_;
  // request_duration_'s and requests_' child of each (known rpc, code),
  // null until its first request. Family::Add builds a whole Histogram
  // (bucket bounds copied, counters allocated) before it finds the labels'
  // existing child, and takes the family's lock: 1% of the daemon's CPU
  // samples under 64 callers on the null engine.
  std::array<std::atomic<prometheus::Histogram*>, kKnownRpcs * kStatusCodes>
      duration_children_{};
  std::array<std::atomic<prometheus::Counter*>, kKnownRpcs * kStatusCodes>
      count_children_{};
  prometheus::Histogram* request_decode_;
  prometheus::Histogram* queue_wait_;
  prometheus::Histogram* response_encode_;
  prometheus::Histogram* batch_execute_;
  prometheus::Histogram* batch_rows_;
  prometheus::Counter* rows_sampled_;
  prometheus::Gauge* queue_rows_;
  prometheus::Gauge* batches_in_flight_;
  prometheus::Family<prometheus::Gauge>* device_memory_;
  prometheus::Family<prometheus::Gauge>* weights_info_;
  prometheus::Family<prometheus::Counter>* exact_fallback_;
  prometheus::Gauge* state_gauges_[4];
  prometheus::Gauge* load_progress_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_METRICS_H_
