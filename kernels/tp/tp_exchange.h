// Tensor-parallel candidate exchange: every rank's stage-1 kernel stores its
// per-tile candidates straight into the reducing rank's buffer (rank 0) as its
// tiles finish, a cross-rank barrier tells rank 0 that every store landed, and
// stage 2 runs on rank 0. One process drives all local GPUs. Two transports:
// NCCL 2.28's device API (symmetric window + LSA pointer + LSA barrier with a
// timeout) and plain CUDA peer access with cross-device events.
// docs/design.md#tensor-parallelism explains the calls, their order and why.
#ifndef FLASHSAMPLER_KERNELS_TP_TP_EXCHANGE_H_
#define FLASHSAMPLER_KERNELS_TP_TP_EXCHANGE_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/sampler/fused_sampler.h"
#include "kernels/tp/tp_layout.h"

namespace flashsampler {

// Sets NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and
// TORCH_SYMM_MEM_DISABLE_MULTICAST=1 in this process's environment. NVLink
// multicast can take a shared host's GPUs out of service
// (docs/design.md#tensor-parallelism), so every main() that may start NCCL
// calls this before the first NCCL call.
void DisableNvlinkMulticastEnv();

// Outcome of a setup, teardown or NCCL host call. `message` is empty on
// success and names the failing call otherwise; `cuda`/`nccl` keep the codes.
struct TpStatus {
  cudaError_t cuda = cudaSuccess;
  ncclResult_t nccl = ncclSuccess;
  std::string message;

  bool ok() const { return message.empty(); }
  static TpStatus Cuda(cudaError_t error, const std::string& what);
  static TpStatus Nccl(ncclResult_t error, const std::string& what);
  static TpStatus Invalid(const std::string& what);
};

// One NCCL communicator per local GPU (ncclCommInitAll), rank r on devices[r].
// Collective host calls on them (window registration, device communicators,
// finalize) run one thread per rank, so no call blocks waiting for a sibling
// that this thread has not reached yet.
class TpComms {
 public:
  // Needs >= 1 device; checks that the NCCL library loaded at run time is not
  // older than the headers this was compiled with (the device API's structs
  // are compiled in).
  static TpStatus Create(const std::vector<int>& devices,
                         std::unique_ptr<TpComms>* out);
  // Finalizes and destroys the communicators, or aborts them after
  // MarkFailed(). Streams using them must be idle.
  ~TpComms();
  TpComms(const TpComms&) = delete;
  TpComms& operator=(const TpComms&) = delete;

  int size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_[rank]; }
  const std::vector<int>& devices() const { return devices_; }
  ncclComm_t comm(int rank) const { return comms_[rank]; }
  // After a fatal error the communicators are aborted, not finalized: a dead
  // peer can never answer a finalize.
  void MarkFailed() { failed_ = true; }
  bool failed() const { return failed_; }
  // Frees `ptr` (from ncclMemAlloc on rank's device) after the communicators
  // are aborted or destroyed: NCCL may still map a window on it until then.
  void FreeAfterTeardown(int rank, void* ptr) {
    deferred_frees_.push_back({rank, ptr});
  }

 private:
  TpComms() = default;
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::pair<int, void*>> deferred_frees_;
  bool failed_ = false;
};

// Runs fn(rank) on one thread per rank (each with its device set) and returns
// the first failure. For collective NCCL host calls.
TpStatus RunPerRank(const std::vector<int>& devices,
                    const std::function<TpStatus(int rank)>& fn);

enum class TpTransport {
  kNcclDevice,  // ncclMemAlloc window + LSA pointer + LSA barrier (preferred)
  kCudaPeer,    // cudaMalloc on rank 0 + peer access + cross-device events
};
const char* TpTransportName(TpTransport transport);

// Barrier outcome, sticky until the exchange is destroyed.
enum class TpBarrierResult : int32_t {
  kOk = 0,
  kTimedOut = 1,  // a peer did not arrive within barrier_timeout_ns
  kAborted = 2,   // Abort() was called while a rank waited
};
const char* TpBarrierResultName(TpBarrierResult result);

struct TpExchangeOptions {
  TpTransport transport = TpTransport::kNcclDevice;
  int max_batch = kMaxFusedBatch;  // rows per step, upper bound
  int max_samples = 1;             // samples per row, upper bound
  // A rank that waits longer than this for its peers stops waiting and
  // reports kTimedOut instead of hanging the node. A healthy step's ranks
  // arrive within one stage-1 time of each other (~1 ms at B = 256, D = 8192),
  // so 5 s only fires for a dead or wedged peer.
  uint64_t barrier_timeout_ns = 5000000000ull;
  // Launch the barrier kernel with programmatic dependent launch so that it is
  // resident when stage 1's last block exits (saves the ~3 us launch gap);
  // it still waits for stage 1 to complete and flush before it arrives.
  bool programmatic_launch = true;
  // Step sends each rank's shard winners where it can (see Step); false
  // always sends every tile's candidate (the benchmark's comparison).
  bool send_shard_winners = true;
};

// The exchange for one TpLayout. Double-buffered: step k uses slot k % 2, so a
// rank may run stage 1 of step k+1 while rank 0 still reduces step k. The
// barrier of step k (NCCL) or the event of step k's reduce (peer) keeps step
// k+2 from overwriting a slot before rank 0 has read it.
//
// Per step, from one host thread, in this order:
//   for every rank r: BeforeStageOne(r, streams[r]);
//                     stage 1 with candidates = StageOneOutput(r, B, n);
//                     AfterStageOne(r, streams[r], streams[0]);
//   Reduce(B, n, token_ids, scores, streams[0]);   // advances the slot
// Step() does all of it.
class TpExchange {
 public:
  // `comms` is required for kNcclDevice (its devices are the ranks' devices)
  // and must outlive the exchange; for kCudaPeer pass `devices` (comms may be
  // null). The layout's rank count must equal the device count; rank 0
  // reduces. Allocates everything the steps need (no allocation per step).
  static TpStatus Create(const std::vector<int>& devices, TpComms* comms,
                         const TpLayout& layout,
                         const TpExchangeOptions& options,
                         std::unique_ptr<TpExchange>* out);
  // Streams that used the exchange must be idle. After a failed barrier it
  // frees memory without NCCL collectives and marks `comms` failed.
  ~TpExchange();
  TpExchange(const TpExchange&) = delete;
  TpExchange& operator=(const TpExchange&) = delete;

  const TpLayout& layout() const { return layout_; }
  const TpExchangeOptions& options() const { return options_; }
  // TpExchangeOptions::send_shard_winners, from the next Step on (the two
  // exchanges share the slots, so steps may alternate between them).
  void set_send_shard_winners(bool send) { options_.send_shard_winners = send; }
  // Whether the last successful Step sent the ranks' shard winners (false:
  // every tile's candidate).
  bool last_step_sent_winners() const { return last_step_sent_winners_; }
  int num_ranks() const { return layout_.num_ranks(); }

  // Where `rank`'s stage 1 of the current step writes its candidates: rank 0's
  // buffer, current slot, at the rank's tile offset. kNcclDevice: the LSA
  // pointer of rank 0's window as mapped for `rank`'s GPU (resolved once, with
  // ncclGetLsaPointer, at Create). kCudaPeer: rank 0's cudaMalloc pointer
  // (UVA; peer access enabled at Create).
  Candidate* StageOneOutput(int rank, int batch, int num_samples) const;

  // Before `rank`'s stage 1 (peer transport: waits for the reduce that last
  // read this slot; NCCL transport: nothing, the barriers order it).
  cudaError_t BeforeStageOne(int rank, cudaStream_t stream);
  // After `rank`'s stage 1. NCCL: launches the LSA barrier kernel (every rank
  // arrives, then waits for all others, with timeout and abort flag). Peer:
  // records an event that `reduce_stream` (rank 0's) waits on.
  cudaError_t AfterStageOne(int rank, cudaStream_t stream,
                            cudaStream_t reduce_stream);
  // Stage 2 on rank 0 over the current slot, then moves to the next slot.
  // token_ids: [batch][num_samples] int32 on rank 0's GPU.
  cudaError_t Reduce(int batch, int num_samples, int32_t* token_ids,
                     float* winning_scores, cudaStream_t stream);

  // One whole step. params[r] describes rank r's shard (its outputs are
  // ignored and replaced); workspaces[r] is null or holds
  // FusedSampleWorkspaceSize bytes on rank r's GPU, zero-filled once: then
  // rank r's tiles prune against its best candidate so far
  // (FusedSampleParams::floor_in_workspace). With every rank's workspace,
  // num_samples <= kMaxFusedInKernelSamples and send_shard_winners set,
  // each rank sends only its shard's winners (FusedSampleParams::
  // shard_winners) and rank 0 reduces those; otherwise every tile's
  // candidates, as in the manual sequence above.
  cudaError_t Step(const std::vector<FusedSampleParams>& params,
                   const std::vector<void*>& workspaces,
                   const std::vector<size_t>& workspace_bytes,
                   const std::vector<cudaStream_t>& streams, int32_t* token_ids,
                   float* winning_scores);

  // Barrier outcome of every step so far; read it after synchronizing the
  // streams. Anything but kOk means that step's tokens are garbage and the
  // exchange (and its communicators) must be torn down.
  TpBarrierResult status() const;
  // Makes every waiting and every later barrier kernel return at once with
  // kAborted. Safe from any thread (it only stores to pinned host memory).
  void Abort();

 private:
  TpExchange() = default;
  int slot() const { return static_cast<int>(step_ & 1); }
  // Where `rank`'s shard winners go when Step sends winners: the rank's
  // [n][batch] group at index `rank` of the current slot (the groups that
  // hold tiles' candidates otherwise).
  Candidate* ShardWinnersOutput(int rank, int batch, int num_samples) const;
  // Reduce over the current slot's first `groups` groups of [n][batch]
  // candidates (one per tile, or one per rank's winners), then advance the
  // slot.
  cudaError_t ReduceOver(int64_t groups, int batch, int num_samples,
                         int32_t* token_ids, float* winning_scores,
                         cudaStream_t stream);
  TpStatus InitNccl();
  TpStatus InitPeer();

  std::vector<int> devices_;
  TpComms* comms_ = nullptr;
  TpLayout layout_;
  TpExchangeOptions options_;
  bool last_step_sent_winners_ = false;
  int64_t slot_candidates_ = 0;  // total_tiles * max_samples * max_batch
  uint64_t step_ = 0;

  // Rank 0's candidate buffer, 2 slots (kNcclDevice: ncclMemAlloc on every
  // rank, same size, since window registration is symmetric; only rank 0's
  // is written).
  std::vector<void*> buffers_;
  // Per rank: the address of rank 0's buffer as `rank` stores to it.
  std::vector<Candidate*> remote_base_;

  // kNcclDevice state, one per rank (opaque here to keep nccl_device.h out of
  // host translation units).
  struct NcclRankState;
  std::vector<std::unique_ptr<NcclRankState>> nccl_;

  // kCudaPeer state: landed_[r] recorded after rank r's stage 1;
  // reduced_[slot] recorded after the reduce of that slot, on every rank's
  // device so that rank r's stream can wait on it.
  std::vector<cudaEvent_t> landed_;
  std::vector<cudaEvent_t> reduced_;  // [2] on rank 0's device

  // Pinned, mapped host words: [0] abort flag, [1 + r] rank r's barrier
  // result. Host-visible without a device sync, device-visible without a copy.
  int32_t* host_flags_ = nullptr;
  int32_t* device_flags_ = nullptr;   // the same words as the GPUs address them
  bool programmatic_launch_ = false;  // options_ and every GPU is sm_90+
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_TP_TP_EXCHANGE_H_
