// CpuEngine: slot buffers and argument checks around CpuSampler.
#include "service/backends/cpu/cpu_engine.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype_convert.h"
#include "common/status_macros.h"

namespace flashsampler {

CpuEngine::CpuEngine(std::unique_ptr<CpuSampler> sampler, EngineInfo info,
                     int slots)
    : sampler_(std::move(sampler)), info_(std::move(info)) {
  slots_.resize(slots);
  for (std::vector<float>& slot : slots_) {
    slot.assign(static_cast<size_t>(info_.max_batch_rows) * info_.hidden_size,
                0.0f);
  }
}

absl::StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::Create(
    const Weights& weights, const CpuEngineOptions& options) {
  const int64_t vocab = weights.vocab_size();
  const int64_t hidden = weights.hidden_size();
  if (vocab < 1 || hidden < 1 || weights.data() == nullptr) {
    return absl::InvalidArgumentError("CpuEngine: weights are empty");
  }
  auto w = std::make_shared<std::vector<float>>(static_cast<size_t>(vocab) *
                                                static_cast<size_t>(hidden));
  ConvertDType(weights.dtype(), weights.data(), w->size(), DType::kFp32,
               w->data());
  return CreateFromFloat(std::move(w), vocab, hidden, weights.dtype(), options);
}

absl::StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::CreateFromFloat(
    std::shared_ptr<const std::vector<float>> w, int64_t vocab, int64_t hidden,
    DType declared_weight_dtype, const CpuEngineOptions& options) {
  if (options.max_batch_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_rows must be >= 1, got ", options.max_batch_rows));
  }
  if (options.slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots must be >= 1, got ", options.slots));
  }
  FS_ASSIGN_OR_RETURN(
      std::unique_ptr<CpuSampler> sampler,
      CpuSampler::Create(std::move(w), vocab, hidden, options.sampler));
  EngineInfo info;
  info.backend = "cpu";
  info.vocab_size = vocab;
  info.hidden_size = hidden;
  info.weight_dtype = declared_weight_dtype;
  info.input_dtype = DType::kFp32;
  info.max_batch_rows = options.max_batch_rows;
  info.shards.push_back(ShardInfo{0, -1, 0, vocab});
  info.supported_controls = sampler->SupportedControls();
  return std::unique_ptr<CpuEngine>(
      new CpuEngine(std::move(sampler), std::move(info), options.slots));
}

void* CpuEngine::slot_input(int slot) {
  if (slot < 0 || slot >= max_slots()) return nullptr;
  return slots_[slot].data();
}

absl::Status CpuEngine::Sample(const BatchView& batch,
                               std::vector<RowResult>* results) {
  if (batch.slot < 0 || batch.slot >= max_slots()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "slot ", batch.slot, " out of range [0, ", max_slots(), ")"));
  }
  if (batch.rows < 0 || batch.rows > info_.max_batch_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", batch.rows, " rows; at most ", info_.max_batch_rows));
  }
  const absl::Status status = sampler_->Sample(
      slots_[batch.slot].data(), batch.rows, batch.specs, results);
  // Row-level failures travel in RowResult::error (Engine contract); only a
  // failure no row owns fails the batch.
  if (absl::IsInvalidArgument(status)) {
    for (const RowResult& row : *results) {
      if (!row.error.empty()) return absl::OkStatus();
    }
  }
  return status;
}

}  // namespace flashsampler
