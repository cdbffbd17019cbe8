// The CUDA backend: W sharded by vocabulary rows over one or more GPUs, the
// fused stage-1 kernel on every rank writing its candidates straight into
// the reducing rank's buffer through kernels/tp/tp_exchange.h (NCCL's device
// API, or CUDA peer access), stage 2 on rank 0, token ids back to the host.
// One GPU reduces inside the stage-1 kernel. Slots have their own pinned
// staging, streams and exchange so that two batches overlap. Every sampling
// control is served: a batch with controls beyond temperature and n samples
// over materialized fp32 logits (kernels/controls/, see cuda_engine.cc).
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_H_

#include <atomic>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "service/backends/engine.h"
#include "service/weights/weights.h"

namespace flashsampler {

// How tensor-parallel ranks hand their candidates to rank 0.
enum class CudaTpTransport {
  kAuto,        // NCCL's device API; CUDA peer access if it cannot be set up
  kNcclDevice,  // NCCL's device API, or fail
  kCudaPeer,    // CUDA peer access
};

struct CudaEngineOptions {
  // CUDA ordinals, one per tensor-parallel rank (rank 0 reduces); empty =
  // every visible device.
  std::vector<int> devices;
  // Largest batch one Sample() takes (1 .. 256, the fused kernel's limit).
  int max_batch_rows = 256;
  // Batches in flight at once, each with its own staging and streams.
  int slots = 2;
  CudaTpTransport tp_transport = CudaTpTransport::kAuto;
  // One GPU, a batch without controls and one sample per row: its input
  // copy, fused kernel and token copy are recorded once per (slot, batch
  // rows) as a CUDA graph and replayed with one launch, instead of three
  // enqueues of 6-16 us of host time each on a virtual machine (one
  // caller's p50 on an H100: 0.53 against 0.55-0.56 ms;
  // docs/performance.md#service). A controlled batch served from unit
  // candidates whose other rows take one sample replays its input copy and
  // fused kernel the same way (the sampler's launches, whose packed
  // controls change from batch to batch, follow call by call). A batch
  // that waits for another slot's sampler between its copies and its fused
  // kernel goes call by call. Off: every batch enqueues them one by one
  // (the tests compare the two).
  bool replay_graphs = true;
  // One GPU with the wgmma kernel (sm_90): a controlled batch whose
  // controlled rows the units can serve (ServedFromUnitCandidates: a filter
  // that closes the set where there are per-token transforms or logprobs,
  // and one tail a unit) takes its candidates from the fused kernel
  // (FusedSampleParams::unit_candidates, 1 byte a token) instead of its
  // fp32 logits (4 bytes a token); a batch with a row those cannot certify
  // is sampled again from materialized logits. Off: every controlled batch
  // materializes its logits (the tests compare the two).
  bool unit_candidates = true;
  // Test-only; never set by the daemon: counts the batches launched as a
  // replayed graph (replay_graphs).
  std::shared_ptr<std::atomic<int64_t>> graph_launches_for_tests;
  // Test-only; never set by the daemon: counts the batches whose candidates
  // came from unit candidates (unit_candidates).
  std::shared_ptr<std::atomic<int64_t>> unit_batches_for_tests;
  // Test-only; never set by the daemon. While it points at true, the next
  // Sample() first launches a kernel that traps (kernels/testing/) on rank
  // 0's stream and sets it back to false: the CUDA context then holds the
  // sticky error a device fault (an Xid) leaves, and the tests check that the
  // batch fails UNAVAILABLE (IsFatalDeviceError), that health turns
  // NOT_SERVING and that nothing waits forever. The error poisons the
  // process's CUDA context for good: run such a test in its own process.
  std::shared_ptr<std::atomic<bool>> trap_next_batch_for_tests;
};

// Number of usable CUDA devices; 0 when there is no GPU or no driver. Never
// aborts (the CPU backend serves then).
int CudaDeviceCount();

// Uploads each rank's shard of `weights` (bf16 or fp16; D a multiple of 64)
// and allocates every workspace. info().shards[r].device_bytes is what the
// engine holds on rank r's device: every cudaMalloc it keeps (weights,
// inputs, workspaces, token, logits and controlled-path buffers of every
// slot) at its requested size, plus, tensor parallel, the drop in the
// device's free memory while the NCCL communicators and candidate exchanges
// were made (their buffers are allocated inside kernels/tp and NCCL). Errors:
// INVALID_ARGUMENT for weights or options the backend cannot serve,
// FAILED_PRECONDITION when ranks lack peer access to rank 0, RESOURCE_EXHAUSTED
// when device memory runs out, UNAVAILABLE for a device that cannot run at all.
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(
    std::shared_ptr<const Weights> weights, const CudaEngineOptions& options);

// For tests of the failure path: makes every tensor-parallel barrier of
// `engine` (made by CreateCudaEngine) return at once as aborted, as a rank
// that stopped answering would after the barrier timeout. Returns false for
// an engine with one GPU (no barrier) or not made by CreateCudaEngine.
bool AbortCudaEngineBarriersForTest(Engine* engine);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_H_
