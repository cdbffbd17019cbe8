// CpuEngine: slot buffers and argument checks around CpuSampler.
#include "service/backends/cpu/cpu_engine.h"

#include <cstddef>
#include <limits>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype_convert.h"
#include "common/status_macros.h"

namespace flashsampler {

namespace {

// Running out of memory at start-up is a deployment error (a model too big
// for the host or its memory limit): it comes back as a status naming the
// buffer and its size, so that the daemon exits 1 saying so, instead of an
// uncaught std::bad_alloc aborting it (SIGABRT, no message).
absl::Status AllocationError(absl::string_view what, uint64_t bytes) {
  return absl::ResourceExhaustedError(
      absl::StrCat("CpuEngine: cannot allocate ", what, ": ", bytes, " bytes"));
}

// `count` floats, zeroed; ResourceExhausted naming `what` if the memory
// cannot be had.
absl::StatusOr<std::vector<float>> AllocateFloats(uint64_t count,
                                                  absl::string_view what) {
  if (count > std::numeric_limits<size_t>::max() / sizeof(float)) {
    return AllocationError(what, count * uint64_t{sizeof(float)});
  }
  try {
    return std::vector<float>(static_cast<size_t>(count), 0.0f);
  } catch (const std::bad_alloc&) {
    return AllocationError(what, count * uint64_t{sizeof(float)});
  }
}

}  // namespace

CpuEngine::CpuEngine(std::unique_ptr<CpuSampler> sampler, EngineInfo info,
                     std::vector<std::vector<float>> slots)
    : sampler_(std::move(sampler)),
      info_(std::move(info)),
      slots_(std::move(slots)) {}

absl::StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::Create(
    const Weights& weights, const CpuEngineOptions& options) {
  const int64_t vocab = weights.vocab_size();
  const int64_t hidden = weights.hidden_size();
  if (vocab < 1 || hidden < 1 || weights.data() == nullptr) {
    return absl::InvalidArgumentError("CpuEngine: weights are empty");
  }
  FS_ASSIGN_OR_RETURN(
      std::vector<float> w_fp32,
      AllocateFloats(
          static_cast<uint64_t>(vocab) * static_cast<uint64_t>(hidden),
          absl::StrCat("the fp32 copy of W [", vocab, ", ", hidden, "]")));
  auto w = std::make_shared<std::vector<float>>(std::move(w_fp32));
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
  // Slot buffers before the sampler: the sampler's start-up self-check runs
  // OpenBLAS, whose own buffer allocation retries forever instead of failing
  // when memory has run out, so every large allocation comes first.
  std::vector<std::vector<float>> slots;
  slots.reserve(options.slots);
  for (int slot = 0; slot < options.slots; ++slot) {
    FS_ASSIGN_OR_RETURN(
        std::vector<float> buffer,
        AllocateFloats(
            static_cast<uint64_t>(options.max_batch_rows) *
                static_cast<uint64_t>(hidden),
            absl::StrCat("the input buffer of slot ", slot, " [",
                         options.max_batch_rows, ", ", hidden, "]")));
    slots.push_back(std::move(buffer));
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
      new CpuEngine(std::move(sampler), std::move(info), std::move(slots)));
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
