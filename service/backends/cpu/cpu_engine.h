// The CPU backend as an Engine: wraps CpuSampler (W converted to fp32 once)
// and gives each slot its own fp32 input buffer, so that the batcher drives it
// exactly like the CUDA backend. Used when no GPU is present and in tests.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_ENGINE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_ENGINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "service/backends/cpu/cpu_sampler.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "service/weights/weights.h"

namespace flashsampler {

struct CpuEngineOptions {
  CpuSamplerOptions sampler;  // threads and chunking of the sampler
  int max_batch_rows = 256;   // rows per Sample() call (size of each slot)
  int slots = 1;              // batches that may run at once
};

class CpuEngine : public Engine {
 public:
  // Converts W (bf16, fp16 or fp32) to fp32 once. ResourceExhausted, naming
  // the buffer and its size in bytes, when memory for the fp32 copy, a slot
  // buffer or the sampler's padded last tile cannot be allocated.
  static absl::StatusOr<std::unique_ptr<CpuEngine>> Create(
      const Weights& weights, const CpuEngineOptions& options);
  // W already in fp32 [vocab, hidden]; `declared_weight_dtype` is what
  // info() reports (the checkpoint's dtype before conversion).
  static absl::StatusOr<std::unique_ptr<CpuEngine>> CreateFromFloat(
      std::shared_ptr<const std::vector<float>> w, int64_t vocab,
      int64_t hidden, DType declared_weight_dtype,
      const CpuEngineOptions& options);

  const EngineInfo& info() const override { return info_; }
  int max_slots() const override { return static_cast<int>(slots_.size()); }
  // fp32 [max_batch_rows, hidden].
  void* slot_input(int slot) override;
  absl::Status Sample(const BatchView& batch,
                      std::vector<RowResult>* results) override;

  CpuSampler& sampler() { return *sampler_; }

 private:
  CpuEngine(std::unique_ptr<CpuSampler> sampler, EngineInfo info,
            std::vector<std::vector<float>> slots);

  std::unique_ptr<CpuSampler> sampler_;
  EngineInfo info_;
  std::vector<std::vector<float>> slots_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_ENGINE_H_
