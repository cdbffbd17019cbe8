// The CUDA backend: W sharded by vocabulary rows over one or more GPUs
// (tensor parallel through plain CUDA peer access), the fused stage-1 kernel
// on every rank writing its candidates straight into the reducing rank's
// buffer, stage 2 on rank 0, token ids back to the host. Slots have their
// own pinned staging and streams so that two batches overlap.
#ifndef FLASHSAMPLER_SERVICE_CUDA_ENGINE_H_
#define FLASHSAMPLER_SERVICE_CUDA_ENGINE_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "service/engine.h"
#include "service/weights.h"

namespace flashsampler {

struct CudaEngineOptions {
  // CUDA ordinals, one per tensor-parallel rank (rank 0 reduces); empty =
  // every visible device.
  std::vector<int> devices;
  // Largest batch one Sample() takes (1 .. 256, the fused kernel's limit).
  int max_batch_rows = 256;
  // Batches in flight at once, each with its own staging and streams.
  int slots = 2;
};

// Number of usable CUDA devices; 0 when there is no GPU or no driver. Never
// aborts (the CPU backend serves then).
int CudaDeviceCount();

// Uploads each rank's shard of `weights` (bf16 or fp16; D a multiple of 64)
// and allocates every workspace. Errors: INVALID_ARGUMENT for weights or
// options the backend cannot serve, FAILED_PRECONDITION when ranks lack peer
// access to rank 0, RESOURCE_EXHAUSTED when device memory runs out,
// UNAVAILABLE for a device that cannot run at all.
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(
    std::shared_ptr<const Weights> weights, const CudaEngineOptions& options);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_CUDA_ENGINE_H_
