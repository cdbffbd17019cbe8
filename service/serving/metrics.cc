// Metric families of flashsamplerd (metrics_http_server.h serves them).
// Latency buckets resolve the numbers that matter: a Sample() takes 0.1-2 ms
// on a GPU, so from 50 us to 10 ms the bounds grow by a factor of 1.1 (a
// quantile read with histogram_quantile lands within 10% of the truth);
// the CPU backend's 10 ms-1 s and the tail up to 10 s get a 1-2.5-5 ladder.
// Batch sizes are powers of two up to the default max_batch_rows (256).
#include "service/serving/metrics.h"

#include <cmath>
#include <sstream>
#include <string>

#include "flashsampler/version.h"
#include "prometheus/text_serializer.h"

namespace flashsampler {

namespace {

std::vector<double> MakeLatencyBuckets() {
  std::vector<double> bounds;
  // 50 us * 1.1^k below 10 ms: 56 bounds. Rounded to 4 significant digits
  // so the `le` labels stay readable.
  for (double bound = 50e-6; bound < 10e-3 * 1.0001; bound *= 1.1) {
    const double scale = std::pow(10.0, std::floor(std::log10(bound)) - 3.0);
    bounds.push_back(std::round(bound / scale) * scale);
  }
  for (double bound :
       {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0}) {
    bounds.push_back(bound);
  }
  return bounds;
}

prometheus::Histogram::BucketBoundaries RowBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double rows = 1; rows <= 256; rows *= 2) buckets.push_back(rows);
  return buckets;
}

constexpr ServingState kAllStates[] = {
    ServingState::kLoading, ServingState::kServing, ServingState::kDraining,
    ServingState::kNotServing};

}  // namespace

const char* ServingStateName(ServingState state) {
  switch (state) {
    case ServingState::kLoading:
      return "loading";
    case ServingState::kServing:
      return "serving";
    case ServingState::kDraining:
      return "draining";
    case ServingState::kNotServing:
      return "not_serving";
  }
  return "not_serving";
}

const std::vector<double>& Metrics::LatencyBucketBounds() {
  static const auto* const kBounds =
      new std::vector<double>(MakeLatencyBuckets());
  return *kBounds;
}

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  request_duration_ =
      &prometheus::BuildHistogram()
           .Name("flashsampler_request_duration_seconds")
           .Help(
               "Time from receiving a request to its answer, by RPC and "
               "gRPC status code (SampleStream: per message)")
           .Register(*registry_);
  requests_ = &prometheus::BuildCounter()
                   .Name("flashsampler_requests_total")
                   .Help("Requests answered, by RPC and gRPC status code")
                   .Register(*registry_);
  request_decode_ = &prometheus::BuildHistogram()
                         .Name("flashsampler_request_decode_seconds")
                         .Help(
                             "Time from receiving a request to handing it to "
                             "the batcher: parsing, decoding, checking")
                         .Register(*registry_)
                         .Add({}, LatencyBucketBounds());
  response_encode_ = &prometheus::BuildHistogram()
                          .Name("flashsampler_response_encode_seconds")
                          .Help(
                              "Time from a request's batch answering to its "
                              "response handed to gRPC: encoding, serializing")
                          .Register(*registry_)
                          .Add({}, LatencyBucketBounds());
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("flashsampler_queue_wait_seconds")
                     .Help(
                         "Time a request waited in the batcher queue "
                         "before its batch launched")
                     .Register(*registry_)
                     .Add({}, LatencyBucketBounds());
  batch_execute_ = &prometheus::BuildHistogram()
                        .Name("flashsampler_batch_execute_seconds")
                        .Help(
                            "Engine time of one batch (copy in, sample, "
                            "copy out), all ranks")
                        .Register(*registry_)
                        .Add({}, LatencyBucketBounds());
  batch_rows_ = &prometheus::BuildHistogram()
                     .Name("flashsampler_batch_rows")
                     .Help(
                         "Rows per engine launch (rows of many requests "
                         "coalesce into one batch)")
                     .Register(*registry_)
                     .Add({}, RowBuckets());
  rows_sampled_ = &prometheus::BuildCounter()
                       .Name("flashsampler_rows_sampled_total")
                       .Help("Hidden-state rows sampled")
                       .Register(*registry_)
                       .Add({});
  queue_rows_ = &prometheus::BuildGauge()
                     .Name("flashsampler_queue_rows")
                     .Help("Rows accepted and waiting for a batch")
                     .Register(*registry_)
                     .Add({});
  batches_in_flight_ = &prometheus::BuildGauge()
                            .Name("flashsampler_batches_in_flight")
                            .Help("Batches running on the engine")
                            .Register(*registry_)
                            .Add({});
  device_memory_ = &prometheus::BuildGauge()
                        .Name("flashsampler_device_memory_bytes")
                        .Help(
                            "Device memory the engine holds (weight shard, "
                            "slot buffers, workspaces, NCCL buffers), by "
                            "CUDA device (no series on CPU)")
                        .Register(*registry_);
  weights_info_ = &prometheus::BuildGauge()
                       .Name("flashsampler_weights_info")
                       .Help("Loaded weights and backend (value is always 1)")
                       .Register(*registry_);
  prometheus::BuildGauge()
      .Name("flashsampler_build_info")
      .Help("Build of flashsamplerd (value is always 1)")
      .Register(*registry_)
      .Add({{"version", kVersion}, {"revision", kGitRevision}})
      .Set(1);
  exact_fallback_ = &prometheus::BuildCounter()
                         .Name("flashsampler_exact_fallback_rows_total")
                         .Help(
                             "Rows whose fast path could not certify "
                             "exactness and ran the exact path, by reason")
                         .Register(*registry_);
  auto& state = prometheus::BuildGauge()
                    .Name("flashsampler_serving_state")
                    .Help(
                        "1 for the daemon's current state (loading, serving, "
                        "draining, not_serving), 0 for the others")
                    .Register(*registry_);
  for (ServingState s : kAllStates) {
    state_gauges_[static_cast<int>(s)] =
        &state.Add({{"state", ServingStateName(s)}});
  }
  load_progress_ = &prometheus::BuildGauge()
                        .Name("flashsampler_load_progress_ratio")
                        .Help(
                            "Start-up progress 0..1: 0 loading the weights, "
                            "0.5 read and checksummed, 0.75 backend built, 1 "
                            "warmed up")
                        .Register(*registry_)
                        .Add({});
  SetServingState(ServingState::kLoading);
}

void Metrics::ObserveRequest(absl::string_view rpc, absl::StatusCode code,
                             double seconds) {
  // const, not constexpr: under UBSan GCC 12 checks the arrays' addresses
  // for null, which makes the views no constant expression.
  static const absl::string_view kRpcs[kKnownRpcs] = {
      kRpcSample, kRpcSampleStream, kRpcGetModelInfo, kRpcRegisterSharedMemory,
      kRpcUnregisterSharedMemory};
  int slot = -1;
  const int code_value = static_cast<int>(code);
  if (code_value >= 0 && code_value < kStatusCodes) {
    for (int i = 0; i < kKnownRpcs; ++i) {
      if (rpc == kRpcs[i]) slot = i * kStatusCodes + code_value;
    }
  }
  prometheus::Histogram* duration =
      slot >= 0 ? duration_children_[slot].load(std::memory_order_acquire)
                : nullptr;
  prometheus::Counter* count =
      slot >= 0 ? count_children_[slot].load(std::memory_order_acquire)
                : nullptr;
  if (duration == nullptr || count == nullptr) {
    const prometheus::Labels labels = {
        {"rpc", std::string(rpc)}, {"code", absl::StatusCodeToString(code)}};
    // Family::Add returns the existing child when the labels exist already,
    // so threads that race here store the same pointers.
    duration = &request_duration_->Add(labels, LatencyBucketBounds());
    count = &requests_->Add(labels);
    if (slot >= 0) {
      duration_children_[slot].store(duration, std::memory_order_release);
      count_children_[slot].store(count, std::memory_order_release);
    }
  }
  duration->Observe(seconds);
  count->Increment();
}

void Metrics::ObserveDecode(double seconds) {
  request_decode_->Observe(seconds);
}

void Metrics::ObserveQueueWait(double seconds) {
  queue_wait_->Observe(seconds);
}

void Metrics::ObserveEncode(double seconds) {
  response_encode_->Observe(seconds);
}

void Metrics::ObserveBatch(int rows, double seconds) {
  batch_execute_->Observe(seconds);
  batch_rows_->Observe(rows);
  rows_sampled_->Increment(rows);
}

void Metrics::SetQueueRows(int64_t rows) {
  queue_rows_->Set(static_cast<double>(rows));
}

void Metrics::AddBatchesInFlight(int delta) {
  batches_in_flight_->Increment(delta);
}

void Metrics::SetDeviceMemoryBytes(int device, double bytes) {
  device_memory_->Add({{"device", std::to_string(device)}}).Set(bytes);
}

void Metrics::SetWeightsInfo(int64_t vocab, int64_t hidden,
                             absl::string_view dtype, int tp,
                             absl::string_view backend) {
  weights_info_
      ->Add({{"vocab", std::to_string(vocab)},
             {"hidden", std::to_string(hidden)},
             {"dtype", std::string(dtype)},
             {"tp", std::to_string(tp)},
             {"backend", std::string(backend)}})
      .Set(1);
}

void Metrics::SetServingState(ServingState state) {
  for (ServingState s : kAllStates) {
    state_gauges_[static_cast<int>(s)]->Set(s == state ? 1 : 0);
  }
}

void Metrics::SetLoadProgress(double ratio) { load_progress_->Set(ratio); }

void Metrics::CountExactFallback(absl::string_view reason, double rows) {
  exact_fallback_->Add({{"reason", std::string(reason)}}).Increment(rows);
}

std::string Metrics::TextExposition() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

void Metrics::BatchRowsSumAndCount(double* sum, uint64_t* count) const {
  const prometheus::ClientMetric metric = batch_rows_->Collect();
  *sum = metric.histogram.sample_sum;
  *count = metric.histogram.sample_count;
}

}  // namespace flashsampler
