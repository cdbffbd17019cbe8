// Tensor-parallel candidate exchange (see tp_exchange.h and
// docs/design.md#tensor-parallelism): NCCL 2.28 device-API plumbing (symmetric
// window, LSA pointer, LSA barrier with a timeout) and the plain CUDA peer
// fallback.
#include <cuda_runtime.h>
#include <nccl.h>

#include "kernels/tp/tp_exchange.h"
// NCCL's device headers trip -Wunused-parameter in code this file never uses
// (GIN); they are third-party, so their warnings are silenced here only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <nccl_device.h>
#pragma GCC diagnostic pop

#include <cstdlib>
#include <cstring>
#include <thread>

#include "kernels/sampler/device_ptx.cuh"

namespace flashsampler {
namespace {

// The barrier kernel is one warp: it only stores one flag per peer and polls
// one inbox per peer (7 peers at TP = 8), so a larger block buys nothing.
constexpr int kBarrierThreads = 32;
// Polls of the local inbox between two looks at the clock and the abort flag:
// the abort flag lives in host memory (about 1 us per read over PCIe), the
// inbox in local HBM, so the fast path is not slowed by the slow read.
constexpr int kPollsPerCheck = 32;

// Rounds up to the 2 MiB granularity of cuMem allocations: ncclMemAlloc
// rounds up anyway, and a window must be 4 KiB aligned
// (NCCL_WIN_REQUIRED_ALIGNMENT).
constexpr size_t kWindowGranularity = size_t{2} << 20;

size_t RoundUp(size_t bytes, size_t granularity) {
  return (bytes + granularity - 1) / granularity * granularity;
}

// Sets the current device for a scope and restores the caller's on exit:
// kernels must be launched with their stream's device current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&saved_);
    if (saved_ != device) cudaSetDevice(device);
    changed_ = saved_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool changed_ = false;
};

// Resolves, on `rank`'s GPU, the address of byte `offset` of LSA peer
// `peer`'s window. The address stays valid until the window is deregistered,
// so it is computed once and handed to the stage-1 kernel as a plain pointer:
// the fused kernel needs no NCCL code to stream its candidates to rank 0.
__global__ void ResolveLsaPointerKernel(ncclWindow_t window, size_t offset,
                                        int peer, void** out) {
  *out = ncclGetLsaPointer(window, offset, peer);
}

// The cross-rank barrier of one step, one warp per rank. It arrives through
// NCCL's LSA barrier session (a release store of the next epoch into every
// peer's inbox in the NCCL resource window) and then waits like
// ncclLsaBarrierSession::wait, but gives up after `timeout_ns` or when the
// host raises the abort flag, so a dead peer cannot hang the node.
// flags[0]: abort flag (host writes); flags[1 + rank]: result (this writes).
__global__ void __launch_bounds__(kBarrierThreads)
    LsaBarrierKernel(ncclDevComm comm, int32_t* flags, uint64_t timeout_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of stage 1: wait until stage 1 has
  // completed and its stores (to rank 0, over NVLink) are performed.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  // Stage 1's peer stores precede this kernel in stream order; the system
  // fence and the release store below publish them to rank 0 (cumulativity).
  __threadfence_system();
  volatile int32_t* abort_flag = flags;
  // multimem=false: unicast inboxes only. NVLink multicast is never used
  // (docs/design.md#tensor-parallelism); the constant folds the session's
  // multimem branches away.
  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamLsa(comm),
                                         comm.lsaBarrier,
                                         /*index=*/0, /*multimem=*/false);
  int result = static_cast<int>(TpBarrierResult::kOk);
  // One decision for the whole block (arrive() synchronises the block, so
  // threads must not split on a flag the host may flip between their reads).
  if (__syncthreads_or(*abort_flag != 0)) {
    result = static_cast<int>(TpBarrierResult::kAborted);
  } else {
    bar.arrive(ncclCoopCta(), cuda::memory_order_release);
    const ncclTeam team = bar.team;
    const uint64_t start = ptx::GlobalTimerNs();
    // Same inbox, epoch arithmetic and wrap-around test as NCCL 2.28.9's
    // ncclLsaBarrierSession::wait (unicast path), plus the exits.
    for (int i = threadIdx.x; i < team.nRanks - 1; i += blockDim.x) {
      const int peer = i + (team.rank <= i ? 1 : 0);
      cuda::atomic_ref<uint32_t> inbox(*bar.ucInbox(team.rank, peer));
      for (int polls = 1;; ++polls) {
        const uint32_t got = inbox.load(cuda::memory_order_acquire);
        if (got - (bar.epoch + 1) <= (uint32_t(-1) >> 1)) break;
        if (polls % kPollsPerCheck == 0) {
          if (*abort_flag != 0) {
            result = static_cast<int>(TpBarrierResult::kAborted);
            break;
          }
          if (ptx::GlobalTimerNs() - start > timeout_ns) {
            result = static_cast<int>(TpBarrierResult::kTimedOut);
            break;
          }
        }
      }
      if (result != static_cast<int>(TpBarrierResult::kOk)) break;
    }
  }
  __shared__ int block_result;
  if (threadIdx.x == 0) block_result = 0;
  __syncthreads();
  if (result != 0) atomicMax(&block_result, result);
  __syncthreads();
  if (block_result == 0) {
    // Every thread holds its own copy of the session; thread 0's epoch is
    // the one the destructor stores for the next step's session.
    bar.epoch += 1;
  } else if (threadIdx.x == 0) {
    // A failed barrier leaves the epochs out of step for good: the exchange
    // is unusable from here on, which status() reports.
    volatile int32_t* mine = flags + 1 + comm.rank;
    *mine = block_result;
  }
}

}  // namespace

void DisableNvlinkMulticastEnv() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
}

TpStatus TpStatus::Cuda(cudaError_t error, const std::string& what) {
  TpStatus s;
  if (error == cudaSuccess) return s;
  s.cuda = error;
  s.message = what + ": " + cudaGetErrorName(error) + " (" +
              cudaGetErrorString(error) + ")";
  return s;
}

TpStatus TpStatus::Nccl(ncclResult_t error, const std::string& what) {
  TpStatus s;
  if (error == ncclSuccess) return s;
  s.nccl = error;
  s.message = what + ": " + ncclGetErrorString(error);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0')
    s.message += std::string(" (") + last + ")";
  return s;
}

TpStatus TpStatus::Invalid(const std::string& what) {
  TpStatus s;
  s.cuda = cudaErrorInvalidValue;
  s.message = what;
  return s;
}

#define TP_RETURN_IF_CUDA(expr, what)                                 \
  do {                                                                \
    const cudaError_t tp_err_ = (expr);                               \
    if (tp_err_ != cudaSuccess) return TpStatus::Cuda(tp_err_, what); \
  } while (0)

#define TP_RETURN_IF_NCCL(expr, what)                                 \
  do {                                                                \
    const ncclResult_t tp_res_ = (expr);                              \
    if (tp_res_ != ncclSuccess) return TpStatus::Nccl(tp_res_, what); \
  } while (0)

#define TP_RETURN_IF_ERROR(expr)             \
  do {                                       \
    TpStatus tp_status_ = (expr);            \
    if (!tp_status_.ok()) return tp_status_; \
  } while (0)

TpStatus RunPerRank(const std::vector<int>& devices,
                    const std::function<TpStatus(int rank)>& fn) {
  const int n = static_cast<int>(devices.size());
  std::vector<TpStatus> results(n);
  auto body = [&](int rank) {
    const cudaError_t set = cudaSetDevice(devices[rank]);
    if (set != cudaSuccess) {
      results[rank] = TpStatus::Cuda(
          set, "cudaSetDevice(" + std::to_string(devices[rank]) + ")");
      return;
    }
    results[rank] = fn(rank);
  };
  if (n == 1) {
    DeviceGuard guard(devices[0]);
    body(0);
  } else {
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
    for (std::thread& t : threads) t.join();
  }
  for (int r = 0; r < n; ++r) {
    if (!results[r].ok()) {
      results[r].message =
          "rank " + std::to_string(r) + ": " + results[r].message;
      return results[r];
    }
  }
  return TpStatus{};
}

// ---------------------------------------------------------------- TpComms --

TpStatus TpComms::Create(const std::vector<int>& devices,
                         std::unique_ptr<TpComms>* out) {
  out->reset();
  if (devices.empty()) return TpStatus::Invalid("TpComms needs >= 1 device");
  DisableNvlinkMulticastEnv();
  int version = 0;
  TP_RETURN_IF_NCCL(ncclGetVersion(&version), "ncclGetVersion");
  if (version < NCCL_VERSION_CODE) {
    return TpStatus::Invalid(
        "NCCL library " + std::to_string(version) +
        " is older than the headers this was built with (" +
        std::to_string(NCCL_VERSION_CODE) +
        "); put NCCL >= 2.28.9 first on LD_LIBRARY_PATH");
  }
  int count = 0;
  TP_RETURN_IF_CUDA(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count) {
      return TpStatus::Invalid("device " + std::to_string(devices[i]) +
                               " does not exist (" + std::to_string(count) +
                               " visible)");
    }
    for (size_t j = 0; j < i; ++j) {
      if (devices[i] == devices[j]) {
        return TpStatus::Invalid("NCCL needs one rank per GPU; device " +
                                 std::to_string(devices[i]) + " repeats");
      }
    }
  }
  std::unique_ptr<TpComms> comms(new TpComms());
  comms->devices_ = devices;
  comms->comms_.assign(devices.size(), nullptr);
  int saved = 0;
  cudaGetDevice(&saved);
  const ncclResult_t init = ncclCommInitAll(
      comms->comms_.data(), static_cast<int>(devices.size()), devices.data());
  cudaSetDevice(saved);
  if (init != ncclSuccess) {
    comms->comms_.clear();
    return TpStatus::Nccl(init, "ncclCommInitAll");
  }
  *out = std::move(comms);
  return TpStatus{};
}

TpComms::~TpComms() {
  if (!comms_.empty()) {
    const bool failed = failed_;
    RunPerRank(devices_, [&](int rank) {
      ncclComm_t comm = comms_[rank];
      if (comm == nullptr) return TpStatus{};
      if (failed) {
        ncclCommAbort(comm);
      } else {
        if (ncclCommFinalize(comm) == ncclSuccess) {
          ncclCommDestroy(comm);
        } else {
          ncclCommAbort(comm);
        }
      }
      return TpStatus{};
    });
  }
  for (const auto& [rank, ptr] : deferred_frees_) {
    DeviceGuard guard(devices_[rank]);
    ncclMemFree(ptr);
  }
}

// ------------------------------------------------------------- TpExchange --

const char* TpTransportName(TpTransport transport) {
  switch (transport) {
    case TpTransport::kNcclDevice:
      return "nccl_device";
    case TpTransport::kCudaPeer:
      return "cuda_peer";
  }
  return "unknown";
}

const char* TpBarrierResultName(TpBarrierResult result) {
  switch (result) {
    case TpBarrierResult::kOk:
      return "ok";
    case TpBarrierResult::kTimedOut:
      return "timed_out";
    case TpBarrierResult::kAborted:
      return "aborted";
  }
  return "unknown";
}

struct TpExchange::NcclRankState {
  ncclWindow_t window = nullptr;
  ncclDevComm dev_comm{};
  bool dev_comm_created = false;
};

TpStatus TpExchange::Create(const std::vector<int>& devices, TpComms* comms,
                            const TpLayout& layout,
                            const TpExchangeOptions& options,
                            std::unique_ptr<TpExchange>* out) {
  out->reset();
  std::string error;
  if (!ValidateTpLayout(layout, &error)) {
    return TpStatus::Invalid("bad TP layout: " + error);
  }
  if (static_cast<int>(devices.size()) != layout.num_ranks()) {
    return TpStatus::Invalid(
        "layout has " + std::to_string(layout.num_ranks()) + " ranks but " +
        std::to_string(devices.size()) + " devices were given");
  }
  if (layout.tile_rows != FusedSampleTileRows()) {
    return TpStatus::Invalid(
        "layout tile_rows " + std::to_string(layout.tile_rows) +
        " != FusedSampleTileRows() " + std::to_string(FusedSampleTileRows()));
  }
  for (int r = 0; r < layout.num_ranks(); ++r) {
    const TpShard& s = layout.shards[r];
    if (FusedSampleNumTiles(s.vocab_rows) != s.num_tiles) {
      return TpStatus::Invalid(
          "rank " + std::to_string(r) + ": layout has " +
          std::to_string(s.num_tiles) + " tiles, the kernel makes " +
          std::to_string(FusedSampleNumTiles(s.vocab_rows)));
    }
  }
  if (options.max_batch < 1 || options.max_batch > kMaxFusedBatch) {
    return TpStatus::Invalid("max_batch must be in 1.." +
                             std::to_string(kMaxFusedBatch));
  }
  if (options.max_samples < 1) {
    return TpStatus::Invalid("max_samples must be >= 1");
  }
  if (options.transport == TpTransport::kNcclDevice) {
    if (comms == nullptr) {
      return TpStatus::Invalid("the NCCL transport needs TpComms");
    }
    if (comms->devices() != devices) {
      return TpStatus::Invalid("TpComms devices differ from the exchange's");
    }
  }
  std::unique_ptr<TpExchange> ex(new TpExchange());
  ex->devices_ = devices;
  ex->comms_ = comms;
  ex->layout_ = layout;
  ex->options_ = options;
  ex->slot_candidates_ =
      layout.CandidateCount(options.max_samples, options.max_batch);

  bool all_sm90 = true;
  for (int device : devices) {
    int major = 0;
    TP_RETURN_IF_CUDA(cudaDeviceGetAttribute(
                          &major, cudaDevAttrComputeCapabilityMajor, device),
                      "cudaDeviceGetAttribute");
    all_sm90 = all_sm90 && major >= 9;
  }
  ex->programmatic_launch_ = options.programmatic_launch && all_sm90;

  const int n = layout.num_ranks();
  {
    DeviceGuard guard(devices[0]);
    void* flags = nullptr;
    TP_RETURN_IF_CUDA(
        cudaHostAlloc(&flags, sizeof(int32_t) * (1 + n),
                      cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc(barrier flags)");
    ex->host_flags_ = static_cast<int32_t*>(flags);
    std::memset(flags, 0, sizeof(int32_t) * (1 + n));
    void* device_flags = nullptr;
    TP_RETURN_IF_CUDA(cudaHostGetDevicePointer(&device_flags, flags, 0),
                      "cudaHostGetDevicePointer");
    ex->device_flags_ = static_cast<int32_t*>(device_flags);
  }
  ex->remote_base_.assign(n, nullptr);
  if (options.transport == TpTransport::kNcclDevice) {
    TP_RETURN_IF_ERROR(ex->InitNccl());
  } else {
    TP_RETURN_IF_ERROR(ex->InitPeer());
  }
  *out = std::move(ex);
  return TpStatus{};
}

TpStatus TpExchange::InitNccl() {
  const int n = num_ranks();
  const size_t bytes =
      RoundUp(2 * static_cast<size_t>(slot_candidates_) * sizeof(Candidate),
              kWindowGranularity);
  buffers_.assign(n, nullptr);
  nccl_.clear();
  for (int r = 0; r < n; ++r) nccl_.emplace_back(new NcclRankState());
  // Every step below is collective over the ranks (the window registration
  // and the device communicator exchange handles and barrier through NCCL's
  // bootstrap), hence one thread per rank.
  return RunPerRank(devices_, [&](int rank) -> TpStatus {
    NcclRankState& st = *nccl_[rank];
    ncclComm_t comm = comms_->comm(rank);
    // 1. Symmetric memory: same size on every rank (a window is collective
    //    and symmetric even though only rank 0's is written).
    TP_RETURN_IF_NCCL(ncclMemAlloc(&buffers_[rank], bytes), "ncclMemAlloc");
    TP_RETURN_IF_CUDA(cudaMemset(buffers_[rank], 0, bytes), "cudaMemset");
    // 2. Register it as a window: NCCL maps every rank's buffer into each
    //    rank's flat LSA address range.
    TP_RETURN_IF_NCCL(
        ncclCommWindowRegister(comm, buffers_[rank], bytes, &st.window,
                               NCCL_WIN_COLL_SYMMETRIC),
        "ncclCommWindowRegister");
    if (st.window == nullptr) {
      // NCCL returns success and no window when the communicator has no
      // symmetric-memory support (no cuMem, or not all-P2P).
      return TpStatus::Invalid(
          "ncclCommWindowRegister gave no window: this communicator lacks "
          "symmetric memory support (NCCL_CUMEM_ENABLE, P2P); use the "
          "cuda_peer transport");
    }
    // 3. The device communicator with one LSA barrier (index 0) and no
    //    multimem: zero-initialised requirements (2.28.9 has no initializer
    //    macro) and lsaMultimem stays false.
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));
    reqs.lsaBarrierCount = 1;
    reqs.lsaMultimem = false;
    TP_RETURN_IF_NCCL(ncclDevCommCreate(comm, &reqs, &st.dev_comm),
                      "ncclDevCommCreate");
    st.dev_comm_created = true;
    if (st.dev_comm.lsaSize != n || st.dev_comm.lsaRank != rank ||
        st.dev_comm.rank != rank) {
      return TpStatus::Invalid("all ranks must form one LSA team: lsaSize " +
                               std::to_string(st.dev_comm.lsaSize) +
                               ", lsaRank " +
                               std::to_string(st.dev_comm.lsaRank));
    }
    // 4. The address of rank 0's window as this rank's GPU reaches it.
    void** resolved = nullptr;
    TP_RETURN_IF_CUDA(cudaMalloc(&resolved, sizeof(void*)), "cudaMalloc");
    ResolveLsaPointerKernel<<<1, 1>>>(st.window, 0, /*peer=*/0, resolved);
    void* host_ptr = nullptr;
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) {
      err = cudaMemcpy(&host_ptr, resolved, sizeof(void*),
                       cudaMemcpyDeviceToHost);
    }
    cudaFree(resolved);
    TP_RETURN_IF_CUDA(err, "resolving the LSA pointer");
    remote_base_[rank] = static_cast<Candidate*>(host_ptr);
    return TpStatus{};
  });
}

TpStatus TpExchange::InitPeer() {
  const int n = num_ranks();
  const int device0 = devices_[0];
  const size_t bytes =
      2 * static_cast<size_t>(slot_candidates_) * sizeof(Candidate);
  buffers_.assign(1, nullptr);
  {
    DeviceGuard guard(device0);
    TP_RETURN_IF_CUDA(cudaMalloc(&buffers_[0], bytes), "cudaMalloc(rank 0)");
    TP_RETURN_IF_CUDA(cudaMemset(buffers_[0], 0, bytes), "cudaMemset");
    reduced_.assign(2, nullptr);
    for (cudaEvent_t& e : reduced_) {
      TP_RETURN_IF_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                        "cudaEventCreate");
    }
  }
  landed_.assign(n, nullptr);
  for (int r = 0; r < n; ++r) {
    DeviceGuard guard(devices_[r]);
    TP_RETURN_IF_CUDA(
        cudaEventCreateWithFlags(&landed_[r], cudaEventDisableTiming),
        "cudaEventCreate");
    if (devices_[r] != device0) {
      int can = 0;
      TP_RETURN_IF_CUDA(cudaDeviceCanAccessPeer(&can, devices_[r], device0),
                        "cudaDeviceCanAccessPeer");
      if (!can) {
        return TpStatus::Invalid("device " + std::to_string(devices_[r]) +
                                 " cannot access device " +
                                 std::to_string(device0) + " as a peer");
      }
      const cudaError_t err = cudaDeviceEnablePeerAccess(device0, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clears the sticky-free "already enabled" note
      } else {
        TP_RETURN_IF_CUDA(err, "cudaDeviceEnablePeerAccess");
      }
    }
    remote_base_[r] = static_cast<Candidate*>(buffers_[0]);
  }
  return TpStatus{};
}

TpExchange::~TpExchange() {
  const bool failed = status() != TpBarrierResult::kOk ||
                      (host_flags_ != nullptr && host_flags_[0] != 0);
  if (options_.transport == TpTransport::kNcclDevice && !nccl_.empty()) {
    if (failed) {
      // The barrier epochs are out of step and a peer may be gone: no NCCL
      // collective may run. The communicators get aborted (which tears the
      // windows down) and the buffers are freed after that.
      comms_->MarkFailed();
      for (int r = 0; r < static_cast<int>(buffers_.size()); ++r) {
        if (buffers_[r] != nullptr) comms_->FreeAfterTeardown(r, buffers_[r]);
      }
    } else {
      RunPerRank(devices_, [&](int rank) {
        NcclRankState& st = *nccl_[rank];
        ncclComm_t comm = comms_->comm(rank);
        if (st.dev_comm_created) ncclDevCommDestroy(comm, &st.dev_comm);
        if (st.window != nullptr) ncclCommWindowDeregister(comm, st.window);
        if (buffers_[rank] != nullptr) ncclMemFree(buffers_[rank]);
        return TpStatus{};
      });
    }
  } else if (!buffers_.empty() && buffers_[0] != nullptr) {
    DeviceGuard guard(devices_[0]);
    cudaFree(buffers_[0]);
  }
  for (int r = 0; r < static_cast<int>(landed_.size()); ++r) {
    if (landed_[r] == nullptr) continue;
    DeviceGuard guard(devices_[r]);
    cudaEventDestroy(landed_[r]);
  }
  for (cudaEvent_t e : reduced_) {
    if (e == nullptr) continue;
    DeviceGuard guard(devices_[0]);
    cudaEventDestroy(e);
  }
  if (host_flags_ != nullptr) cudaFreeHost(host_flags_);
}

Candidate* TpExchange::StageOneOutput(int rank, int batch,
                                      int num_samples) const {
  return remote_base_[rank] + slot() * slot_candidates_ +
         layout_.CandidateOffset(rank, num_samples, batch);
}

Candidate* TpExchange::ShardWinnersOutput(int rank, int batch,
                                          int num_samples) const {
  return remote_base_[rank] + slot() * slot_candidates_ +
         static_cast<int64_t>(rank) * num_samples * batch;
}

cudaError_t TpExchange::BeforeStageOne(int rank, cudaStream_t stream) {
  if (rank < 0 || rank >= num_ranks()) return cudaErrorInvalidValue;
  if (options_.transport != TpTransport::kCudaPeer) return cudaSuccess;
  // The reduce of two steps ago read this slot; an event never recorded
  // (the first two steps) is complete, so the wait is a no-op then.
  DeviceGuard guard(devices_[rank]);
  return cudaStreamWaitEvent(stream, reduced_[slot()], 0);
}

cudaError_t TpExchange::AfterStageOne(int rank, cudaStream_t stream,
                                      cudaStream_t reduce_stream) {
  if (rank < 0 || rank >= num_ranks()) return cudaErrorInvalidValue;
  if (options_.transport == TpTransport::kCudaPeer) {
    {
      DeviceGuard guard(devices_[rank]);
      const cudaError_t err = cudaEventRecord(landed_[rank], stream);
      if (err != cudaSuccess) return err;
    }
    DeviceGuard guard(devices_[0]);
    return cudaStreamWaitEvent(reduce_stream, landed_[rank], 0);
  }
  DeviceGuard guard(devices_[rank]);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1);
  config.blockDim = dim3(kBarrierThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic_launch_ ? 1 : 0;
  return cudaLaunchKernelEx(&config, LsaBarrierKernel, nccl_[rank]->dev_comm,
                            device_flags_, options_.barrier_timeout_ns);
}

cudaError_t TpExchange::Reduce(int batch, int num_samples, int32_t* token_ids,
                               float* winning_scores, cudaStream_t stream) {
  return ReduceOver(layout_.total_tiles, batch, num_samples, token_ids,
                    winning_scores, stream);
}

cudaError_t TpExchange::ReduceOver(int64_t groups, int batch, int num_samples,
                                   int32_t* token_ids, float* winning_scores,
                                   cudaStream_t stream) {
  if (batch < 1 || batch > options_.max_batch || num_samples < 1 ||
      num_samples > options_.max_samples || token_ids == nullptr) {
    return cudaErrorInvalidValue;
  }
  DeviceGuard guard(devices_[0]);
  // Rank 0 reads its own buffer through its ordinary pointer.
  const Candidate* candidates =
      static_cast<const Candidate*>(buffers_[0]) + slot() * slot_candidates_;
  cudaError_t err =
      LaunchReduceCandidates(candidates, groups, num_samples, batch, token_ids,
                             winning_scores, stream);
  if (err != cudaSuccess) return err;
  if (options_.transport == TpTransport::kCudaPeer) {
    err = cudaEventRecord(reduced_[slot()], stream);
    if (err != cudaSuccess) return err;
  }
  ++step_;
  return cudaSuccess;
}

cudaError_t TpExchange::Step(const std::vector<FusedSampleParams>& params,
                             const std::vector<void*>& workspaces,
                             const std::vector<size_t>& workspace_bytes,
                             const std::vector<cudaStream_t>& streams,
                             int32_t* token_ids, float* winning_scores) {
  const int n = num_ranks();
  if (static_cast<int>(params.size()) != n ||
      static_cast<int>(workspaces.size()) != n ||
      static_cast<int>(workspace_bytes.size()) != n ||
      static_cast<int>(streams.size()) != n) {
    return cudaErrorInvalidValue;
  }
  const int batch = params[0].batch;
  const int num_samples = params[0].num_samples;
  if (batch < 1 || batch > options_.max_batch || num_samples < 1 ||
      num_samples > options_.max_samples) {
    return cudaErrorInvalidValue;
  }
  for (int r = 0; r < n; ++r) {
    const TpShard& shard = layout_.shards[r];
    if (params[r].batch != batch || params[r].num_samples != num_samples ||
        params[r].vocab_rows != shard.vocab_rows ||
        params[r].vocab_offset != shard.vocab_offset) {
      return cudaErrorInvalidValue;
    }
  }
  // With every rank's workspace, a rank's stage 1 keeps its best candidate
  // per (sample, row) there anyway (the pruning floor); its last CTA then
  // sends only those (FusedSampleParams::shard_winners), and rank 0 reduces
  // one candidate per rank instead of one per tile (1187 at V = 151936).
  bool shard_winners =
      options_.send_shard_winners && num_samples <= kMaxFusedInKernelSamples;
  for (int r = 0; r < n; ++r) {
    shard_winners = shard_winners && workspaces[r] != nullptr;
  }
  for (int r = 0; r < n; ++r) {
    cudaError_t err = BeforeStageOne(r, streams[r]);
    if (err != cudaSuccess) return err;
    FusedSampleParams p = params[r];
    Candidate* output = shard_winners
                            ? ShardWinnersOutput(r, batch, num_samples)
                            : StageOneOutput(r, batch, num_samples);
    p.candidates = shard_winners ? nullptr : output;
    p.shard_winners = shard_winners ? output : nullptr;
    p.token_ids = nullptr;
    p.floor_in_workspace = workspaces[r] != nullptr;
    {
      DeviceGuard guard(devices_[r]);
      err = LaunchFusedSample(p, workspaces[r], workspace_bytes[r], streams[r]);
    }
    if (err != cudaSuccess) return err;
    err = AfterStageOne(r, streams[r], streams[0]);
    if (err != cudaSuccess) return err;
  }
  const cudaError_t err =
      ReduceOver(shard_winners ? n : layout_.total_tiles, batch, num_samples,
                 token_ids, winning_scores, streams[0]);
  if (err == cudaSuccess) last_step_sent_winners_ = shard_winners;
  return err;
}

TpBarrierResult TpExchange::status() const {
  if (host_flags_ == nullptr) return TpBarrierResult::kOk;
  int32_t worst = 0;
  for (int r = 0; r < num_ranks(); ++r) {
    const int32_t v = __atomic_load_n(host_flags_ + 1 + r, __ATOMIC_ACQUIRE);
    if (v > worst) worst = v;
  }
  return static_cast<TpBarrierResult>(worst);
}

void TpExchange::Abort() {
  if (host_flags_ != nullptr) {
    __atomic_store_n(host_flags_, 1, __ATOMIC_RELEASE);
  }
}

}  // namespace flashsampler
