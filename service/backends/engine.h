// The backend interface the batcher drives: one synchronous Sample() per
// batch, on one of the engine's slots. A slot owns a host input buffer (pinned
// on CUDA) and, on GPU backends, its own stream and device buffers, so that
// max_slots() batches can be in flight at once and copies overlap compute.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_ENGINE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_ENGINE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {

struct ShardInfo {
  int rank = 0;
  int device = -1;  // CUDA ordinal; -1 on the CPU backend
  int64_t vocab_begin = 0;
  int64_t vocab_end = 0;
  // Device memory the engine holds on `device` (weights, workspaces, slot
  // buffers, tensor-parallel buffers); 0 on the CPU backend.
  int64_t device_bytes = 0;
};

struct EngineInfo {
  std::string backend;  // "cpu" or "cuda"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  DType weight_dtype = DType::kFp32;
  // dtype the engine wants hidden states in; the batcher converts into it.
  DType input_dtype = DType::kFp32;
  int max_batch_rows = 0;
  std::vector<ShardInfo> shards;  // one per tensor-parallel rank
  // Tensor parallel: how ranks hand candidates to rank 0 ("nccl_device" or
  // "cuda_peer", with the reason when "auto" fell back); empty on one rank.
  std::string tp_transport;
  // CUDA: where a controlled batch's candidates come from, for the startup
  // log: "unit candidates, 20 MiB of L2 set aside" (or why none is), or
  // "materialized logits"; empty on the CPU.
  std::string controls_path;
  // Sampling controls implemented exactly (names from AllSamplingControls()).
  std::vector<std::string> supported_controls;
};

// One batch handed to Sample(). The hidden states sit in the slot's input
// buffer, rows * hidden_size elements of info().input_dtype.
struct BatchView {
  int slot = 0;
  int rows = 0;
  const RowSpec* specs = nullptr;  // rows entries
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual const EngineInfo& info() const = 0;

  // Number of batches that may run concurrently, each on its own slot.
  virtual int max_slots() const = 0;

  // Host buffer of slot `slot` for max_batch_rows rows of hidden states.
  virtual void* slot_input(int slot) = 0;

  // Samples every row of `batch`; `results` is resized to batch.rows. Rows of
  // a batch are independent: a row's result does not depend on the others,
  // and a row that cannot be sampled reports RowResult::error while Sample()
  // returns OK, so one caller's bad row never fails another caller's rows.
  // Rows are checked with ValidateSamplingParams(..., SamplingRules::Engine())
  // (sampling_params.h), the check the request codec applies with the wire
  // rules.
  // A non-OK status means the whole batch failed (UNAVAILABLE: the device is
  // gone). Thread-safe across distinct slots.
  virtual absl::Status Sample(const BatchView& batch,
                              std::vector<RowResult>* results) = 0;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_ENGINE_H_
