// CUDA engine: weights uploaded once per device (each rank its shard), every
// buffer allocated at Create, and per batch: one H2D copy per rank of the
// pinned [row params | hidden states] staging, stage 1 on every rank (rank
// r's kernel stores its candidates into rank 0's buffer at its tile offset
// through the slot's TpExchange: NCCL device-API LSA pointers, or CUDA peer
// pointers), the exchange's barrier (or events) orders every rank's stores
// before rank 0's stage 2, then one D2H of the token ids.
#include "service/backends/cuda/cuda_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/status_util.h"
#include "kernels/sampler/fused_sampler.h"
#include "kernels/tp/tp_exchange.h"
#include "kernels/tp/tp_layout.h"
#include "service/backends/cuda/cuda_status.h"

namespace flashsampler {
namespace {

// Candidate pairs (samples x rows) one launch can hold: full batches with up
// to 4 samples per row; a batch asking for more samples runs in row chunks.
constexpr int kSamplesPerLaunchAtFullBatch = 4;

// Vocabulary split granularity: one stage-1 tile, so shard offsets keep
// tiles whole and Philox groups (4 tokens) aligned.
constexpr int64_t kShardGranularity = 128;

// Rows of hidden-state staging past max_batch_rows, so that a launch's H
// is readable up to its batch rounded up to the widest tile (128 rows):
// the kernel then never loads a box of H that crosses the tensor's end,
// which made launches between B = 129 and 255 up to 1.45x slower
// (FusedSampleParams::hidden_capacity_rows). Their contents are never
// used.
constexpr int kHiddenPadRows = 128;

size_t AlignUp(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

std::string TransportDescription(const TpExchange& exchange,
                                 const std::string& fallback_reason) {
  std::string text = TpTransportName(exchange.options().transport);
  if (!fallback_reason.empty()) {
    absl::StrAppend(&text, " (NCCL device API unavailable: ", fallback_reason,
                    ")");
  }
  return text;
}

struct Rank {
  int device = 0;
  int64_t begin = 0;  // global token id of the shard's first row
  int64_t rows = 0;
  void* weights = nullptr;  // [rows, D] on `device`
};

struct SlotRank {
  cudaStream_t stream = nullptr;
  void* device_input = nullptr;  // [row params | hidden] on the device
  // Zeroed once; every launch leaves it zeroed (fused_sampler.h). One GPU:
  // the in-kernel stage 2; tensor parallel: the pruning floor.
  void* workspace = nullptr;
};

struct Slot {
  void* host_input = nullptr;  // pinned [row params | hidden]
  std::vector<SlotRank> ranks;
  // Tensor parallel: this slot's candidate exchange (its own double-buffered
  // candidate buffer on rank 0 and barrier), so that slots run independently.
  std::unique_ptr<TpExchange> exchange;
  int32_t* device_tokens = nullptr;  // rank 0: [rows][n]
  int32_t* host_tokens = nullptr;    // pinned
};

class CudaEngine final : public Engine {
 public:
  CudaEngine(std::shared_ptr<const Weights> weights,
             const CudaEngineOptions& options)
      : weights_(std::move(weights)), options_(options) {}

  ~CudaEngine() override { Release(); }

  absl::Status Init();

  const EngineInfo& info() const override { return info_; }
  int max_slots() const override { return static_cast<int>(slots_.size()); }
  void* slot_input(int slot) override {
    if (slot < 0 || slot >= max_slots()) return nullptr;
    return static_cast<char*>(slots_[slot].host_input) + params_bytes_;
  }
  absl::Status Sample(const BatchView& batch,
                      std::vector<RowResult>* results) override;

  bool AbortBarriers() {
    bool any = false;
    for (Slot& slot : slots_) {
      if (slot.exchange != nullptr) {
        slot.exchange->Abort();
        any = true;
      }
    }
    return any;
  }

 private:
  // Byte offsets of the row parameters at the front of the staging buffer.
  size_t seeds_offset() const {
    return AlignUp(sizeof(float) * options_.max_batch_rows, 8);
  }
  size_t steps_offset() const {
    return seeds_offset() + sizeof(uint64_t) * options_.max_batch_rows;
  }

  absl::Status Check(cudaError_t error, const char* what);
  absl::Status RunChunk(Slot& slot, int first_row, int rows, int num_samples);
  // Tensor parallel: one TpExchange per slot on the configured transport.
  absl::Status CreateExchanges();
  absl::Status CreateExchangesOn(TpTransport transport);
  void Release();

  std::shared_ptr<const Weights> weights_;
  CudaEngineOptions options_;
  EngineInfo info_;
  std::vector<Rank> ranks_;
  std::vector<Slot> slots_;
  size_t element_bytes_ = 2;
  size_t params_bytes_ = 0;  // row params region, 256-byte aligned
  // params region + (max_batch_rows + kHiddenPadRows) x D
  size_t input_bytes_ = 0;
  TpLayout layout_;  // the shards as the candidate exchange sees them
  int64_t capacity_pairs_ = 0;
  size_t workspace_bytes_ = 0;
  std::atomic<bool> broken_{false};
  // NCCL communicators of the device-API transport; outlive the exchanges.
  std::unique_ptr<TpComms> tp_comms_;
  // Why kAuto fell back to CUDA peer access (empty otherwise).
  std::string tp_fallback_reason_;
};

absl::Status CudaEngine::Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  absl::Status status = CudaToStatus(error, what);
  if (IsFatalDeviceError(status)) broken_.store(true);
  return status;
}

absl::Status CudaEngine::Init() {
  const Weights& weights = *weights_;
  if (weights.dtype() != DType::kBf16 && weights.dtype() != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend serves bf16 or fp16 weights; got ",
                     DTypeName(weights.dtype()),
                     " (convert the checkpoint, or use the CPU backend)"));
  }
  if (weights.hidden_size() % 64 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA backend needs hidden_size a multiple of 64; "
                     "got ",
                     weights.hidden_size()));
  }
  if (options_.max_batch_rows < 1 || options_.max_batch_rows > kMaxFusedBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_batch_rows must be in 1..", kMaxFusedBatch, "; got ",
                     options_.max_batch_rows));
  }
  if (options_.slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots must be >= 1; got ", options_.slots));
  }
  const int count = CudaDeviceCount();
  if (count == 0) return FatalDeviceError("no CUDA device is usable");
  std::vector<int> devices = options_.devices;
  if (devices.empty()) {
    for (int d = 0; d < count; ++d) devices.push_back(d);
  }
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device ", devices[i], " does not exist (", count, " visible)"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (devices[j] == devices[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("device ", devices[i], " listed twice"));
      }
    }
  }
  element_bytes_ = DTypeSize(weights.dtype());
  const int64_t vocab = weights.vocab_size();
  const int64_t hidden = weights.hidden_size();

  // Shards: equal multiples of one tile, the last rank takes the rest
  // (V = 1001 over 2 -> 512 + 489).
  const int num_ranks = static_cast<int>(devices.size());
  const int64_t per_rank = (vocab + num_ranks * kShardGranularity - 1) /
                           (num_ranks * kShardGranularity) * kShardGranularity;
  for (int r = 0; r < num_ranks; ++r) {
    Rank rank;
    rank.device = devices[r];
    rank.begin = std::min(vocab, r * per_rank);
    rank.rows = std::min(vocab, rank.begin + per_rank) - rank.begin;
    if (rank.rows < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "vocabulary of ", vocab, " rows is too small for ", num_ranks,
          " devices (", kShardGranularity, " rows per shard at least)"));
    }
    ranks_.push_back(rank);
  }
  // The exchange's view of the same shards, with their tiles in rank 0's
  // candidate buffer: parts equal to the row counts make MakeTpLayout give
  // exactly these rows.
  std::vector<int64_t> shard_rows;
  for (const Rank& rank : ranks_) shard_rows.push_back(rank.rows);
  std::string layout_error;
  if (!MakeTpLayout(vocab, shard_rows, FusedSampleTileRows(), &layout_,
                    &layout_error)) {
    return absl::InternalError(
        absl::StrCat("tensor-parallel layout: ", layout_error));
  }

  // Peer access: rank r's kernel stores into rank 0's candidate buffer.
  for (int r = 1; r < num_ranks; ++r) {
    int can_access = 0;
    FS_RETURN_IF_ERROR(
        Check(cudaDeviceCanAccessPeer(&can_access, ranks_[r].device,
                                      ranks_[0].device),
              "cudaDeviceCanAccessPeer"));
    if (!can_access) {
      return absl::FailedPreconditionError(
          absl::StrCat("device ", ranks_[r].device, " cannot access device ",
                       ranks_[0].device,
                       "'s memory (peer access), which tensor parallel needs"));
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
    const cudaError_t error = cudaDeviceEnablePeerAccess(ranks_[0].device, 0);
    if (error == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not an error: clear it
    } else {
      FS_RETURN_IF_ERROR(Check(error, "cudaDeviceEnablePeerAccess"));
    }
  }

  // The kernels' branch-free noise must equal the reference on this device
  // (all 2^23 uniforms, ~1 ms); otherwise samples would silently differ.
  for (const Rank& rank : ranks_) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(rank.device), "cudaSetDevice"));
    unsigned int* mismatches = nullptr;
    FS_RETURN_IF_ERROR(Check(
        cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(unsigned int)),
        "cudaMalloc(self-check)"));
    unsigned int host_mismatches = 0;
    cudaError_t error = LaunchNoiseSelfCheck(mismatches, nullptr);
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
    if (error == cudaSuccess) {
      error = cudaMemcpy(&host_mismatches, mismatches, sizeof(unsigned int),
                         cudaMemcpyDeviceToHost);
    }
    cudaFree(mismatches);
    FS_RETURN_IF_ERROR(Check(error, "LaunchNoiseSelfCheck"));
    if (host_mismatches != 0) {
      return absl::InternalError(absl::StrCat(
          "device ", rank.device,
          ": the kernels' Gumbel noise differs from "
          "the reference for ",
          host_mismatches, " of 2^23 uniforms; refusing to serve"));
    }
    // The pruning brackets must contain every exact score (all 2^23
    // uniforms), or pruning could skip the winner.
    unsigned int* violations = nullptr;
    FS_RETURN_IF_ERROR(
        Check(cudaMalloc(reinterpret_cast<void**>(&violations),
                         kNoiseBracketCount * sizeof(unsigned int)),
              "cudaMalloc(bracket check)"));
    unsigned int host_violations[kNoiseBracketCount] = {};
    error = LaunchNoiseBracketCheck(violations, nullptr);
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
    if (error == cudaSuccess) {
      error = cudaMemcpy(host_violations, violations, sizeof(host_violations),
                         cudaMemcpyDeviceToHost);
    }
    cudaFree(violations);
    FS_RETURN_IF_ERROR(Check(error, "LaunchNoiseBracketCheck"));
    for (int b = 0; b < kNoiseBracketCount; ++b) {
      if (host_violations[b] != 0) {
        return absl::InternalError(
            absl::StrCat("device ", rank.device, ": pruning bracket ", b,
                         " (NoiseBracket) misses the exact score in ",
                         host_violations[b], " cases; refusing to serve"));
      }
    }
  }

  // Weights, once per device.
  const char* host_weights = static_cast<const char*>(weights.data());
  for (Rank& rank : ranks_) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(rank.device), "cudaSetDevice"));
    const size_t bytes =
        static_cast<size_t>(rank.rows) * hidden * element_bytes_;
    FS_RETURN_IF_ERROR(
        Check(cudaMalloc(&rank.weights, bytes), "cudaMalloc(weights)"));
    FS_RETURN_IF_ERROR(
        Check(cudaMemcpy(rank.weights,
                         host_weights + rank.begin * hidden * element_bytes_,
                         bytes, cudaMemcpyHostToDevice),
              "cudaMemcpy(weights)"));
  }

  // Slots: pinned staging [inv_temperature | seeds | steps | hidden], device
  // copies on every rank, and rank 0's candidate and token buffers.
  params_bytes_ =
      AlignUp(steps_offset() + sizeof(uint64_t) * options_.max_batch_rows, 256);
  input_bytes_ = params_bytes_ +
                 static_cast<size_t>(options_.max_batch_rows + kHiddenPadRows) *
                     hidden * element_bytes_;
  capacity_pairs_ = static_cast<int64_t>(options_.max_batch_rows) *
                    kSamplesPerLaunchAtFullBatch;
  workspace_bytes_ = FusedSampleWorkspaceSize(options_.max_batch_rows, vocab,
                                              static_cast<int>(hidden));
  const size_t max_tokens =
      static_cast<size_t>(options_.max_batch_rows) * 64;  // n <= 64 per row
  slots_.resize(options_.slots);
  for (Slot& slot : slots_) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(Check(cudaMallocHost(&slot.host_input, input_bytes_),
                             "cudaMallocHost(staging)"));
    std::memset(slot.host_input, 0, input_bytes_);
    FS_RETURN_IF_ERROR(
        Check(cudaMallocHost(reinterpret_cast<void**>(&slot.host_tokens),
                             sizeof(int32_t) * max_tokens),
              "cudaMallocHost(tokens)"));
    slot.ranks.resize(ranks_.size());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      SlotRank& slot_rank = slot.ranks[r];
      FS_RETURN_IF_ERROR(
          Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      FS_RETURN_IF_ERROR(Check(
          cudaStreamCreateWithFlags(&slot_rank.stream, cudaStreamNonBlocking),
          "cudaStreamCreate"));
      FS_RETURN_IF_ERROR(
          Check(cudaMalloc(&slot_rank.device_input, input_bytes_),
                "cudaMalloc(input)"));
      FS_RETURN_IF_ERROR(
          Check(cudaMalloc(&slot_rank.workspace, workspace_bytes_),
                "cudaMalloc(workspace)"));
      FS_RETURN_IF_ERROR(
          Check(cudaMemset(slot_rank.workspace, 0, workspace_bytes_),
                "cudaMemset(workspace)"));
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(
        Check(cudaMalloc(reinterpret_cast<void**>(&slot.device_tokens),
                         sizeof(int32_t) * max_tokens),
              "cudaMalloc(tokens)"));
  }

  if (num_ranks > 1) {
    FS_RETURN_IF_ERROR(CreateExchanges());
    info_.tp_transport =
        TransportDescription(*slots_[0].exchange, tp_fallback_reason_);
  }

  info_.backend = "cuda";
  info_.vocab_size = vocab;
  info_.hidden_size = hidden;
  info_.weight_dtype = weights.dtype();
  info_.input_dtype = weights.dtype();
  info_.max_batch_rows = options_.max_batch_rows;
  for (int r = 0; r < num_ranks; ++r) {
    ShardInfo shard;
    shard.rank = r;
    shard.device = ranks_[r].device;
    shard.vocab_begin = ranks_[r].begin;
    shard.vocab_end = ranks_[r].begin + ranks_[r].rows;
    info_.shards.push_back(shard);
  }
  info_.supported_controls = {"temperature", "n"};
  return absl::OkStatus();
}

absl::Status CudaEngine::CreateExchangesOn(TpTransport transport) {
  std::vector<int> devices;
  for (const Rank& rank : ranks_) devices.push_back(rank.device);
  if (transport == TpTransport::kNcclDevice && tp_comms_ == nullptr) {
    // Never NVLink multicast (docs/design.md#tensor-parallelism), also
    // inside NCCL.
    DisableNvlinkMulticastEnv();
    const TpStatus status = TpComms::Create(devices, &tp_comms_);
    if (!status.ok()) {
      return absl::UnavailableError(
          absl::StrCat("NCCL communicators: ", status.message));
    }
  }
  TpExchangeOptions options;
  options.transport = transport;
  options.max_batch = options_.max_batch_rows;
  // Chunks hold at most capacity_pairs_ (row, sample) pairs.
  options.max_samples = kSamplesPerLaunchAtFullBatch;
  for (Slot& slot : slots_) {
    const TpStatus status = TpExchange::Create(
        devices, tp_comms_.get(), layout_, options, &slot.exchange);
    if (!status.ok()) {
      return absl::UnavailableError(absl::StrCat(
          TpTransportName(transport), " exchange: ", status.message));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::CreateExchanges() {
  if (options_.tp_transport == CudaTpTransport::kCudaPeer) {
    return CreateExchangesOn(TpTransport::kCudaPeer);
  }
  absl::Status status = CreateExchangesOn(TpTransport::kNcclDevice);
  if (status.ok() || options_.tp_transport == CudaTpTransport::kNcclDevice) {
    return status;
  }
  // kAuto: the peer transport serves where the device API cannot be set up
  // (e.g. an NCCL older than the headers, or no symmetric windows).
  for (Slot& slot : slots_) slot.exchange.reset();
  tp_comms_.reset();
  tp_fallback_reason_ = std::string(status.message());
  return CreateExchangesOn(TpTransport::kCudaPeer);
}

absl::Status CudaEngine::RunChunk(Slot& slot, int first_row, int rows,
                                  int num_samples) {
  const size_t num_ranks = ranks_.size();
  std::vector<FusedSampleParams> all_params(num_ranks);
  std::vector<void*> workspaces(num_ranks);
  std::vector<size_t> workspace_bytes(num_ranks, workspace_bytes_);
  std::vector<cudaStream_t> streams(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    const Rank& rank = ranks_[r];
    SlotRank& slot_rank = slot.ranks[r];
    char* input = static_cast<char*>(slot_rank.device_input);
    FusedSampleParams& params = all_params[r];
    params.weights = rank.weights;
    params.hidden =
        input + params_bytes_ +
        static_cast<size_t>(first_row) * info_.hidden_size * element_bytes_;
    params.dtype = weights_->dtype();
    params.vocab_rows = rank.rows;
    params.vocab_offset = rank.begin;
    params.hidden_size = static_cast<int>(info_.hidden_size);
    params.batch = rows;
    params.hidden_capacity_rows =
        options_.max_batch_rows + kHiddenPadRows - first_row;
    params.num_samples = num_samples;
    params.inv_temperature = reinterpret_cast<const float*>(input) + first_row;
    params.seeds =
        reinterpret_cast<const uint64_t*>(input + seeds_offset()) + first_row;
    params.steps =
        reinterpret_cast<const uint64_t*>(input + steps_offset()) + first_row;
    workspaces[r] = slot_rank.workspace;
    streams[r] = slot_rank.stream;
  }
  int32_t* tokens =
      slot.device_tokens + static_cast<int64_t>(first_row) * num_samples;
  if (num_ranks == 1) {
    // One GPU: stage 2 runs inside the stage-1 kernel (no second launch).
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    all_params[0].token_ids = tokens;
    return Check(LaunchFusedSample(all_params[0], workspaces[0],
                                   workspace_bytes_, streams[0]),
                 "LaunchFusedSample");
  }
  // Every rank's stage 1 sends its shard's best candidate per row into rank
  // 0's buffer (pruning against its own best so far), the exchange's
  // barrier (or events) orders them before stage 2 on rank 0. The exchange
  // is double-buffered, so the next chunk may start before this one's stage
  // 2.
  const cudaError_t error = slot.exchange->Step(
      all_params, workspaces, workspace_bytes, streams, tokens, nullptr);
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  return Check(error, "TpExchange::Step");
}

absl::Status CudaEngine::Sample(const BatchView& batch,
                                std::vector<RowResult>* results) {
  if (broken_.load()) {
    return FatalDeviceError(
        "the CUDA engine hit a fatal device error earlier and cannot serve");
  }
  if (batch.slot < 0 || batch.slot >= max_slots()) {
    return absl::InvalidArgumentError(
        absl::StrCat("slot ", batch.slot, " outside 0..", max_slots() - 1));
  }
  if (batch.rows < 1 || batch.rows > options_.max_batch_rows ||
      batch.specs == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", batch.rows, " rows outside 1..", options_.max_batch_rows));
  }
  Slot& slot = slots_[batch.slot];
  char* host = static_cast<char*>(slot.host_input);
  float* inv_temperature = reinterpret_cast<float*>(host);
  uint64_t* seeds = reinterpret_cast<uint64_t*>(host + seeds_offset());
  uint64_t* steps = reinterpret_cast<uint64_t*>(host + steps_offset());
  int num_samples = 1;
  for (int i = 0; i < batch.rows; ++i) {
    const RowSpec& spec = batch.specs[i];
    if (spec.params == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", i, " has no sampling parameters"));
    }
    const SamplingParams& params = *spec.params;
    const std::string unsupported =
        FirstUnsupportedControl(params, info_.supported_controls);
    if (!unsupported.empty()) {
      return absl::UnimplementedError(absl::StrCat(
          "the CUDA backend does not implement ", unsupported,
          " (supported: ", absl::StrJoin(info_.supported_controls, ", "), ")"));
    }
    if (!(params.temperature >= 0.0f) || params.n < 1 || params.n > 64) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", i, ": temperature must be >= 0 and n in 1..64"));
    }
    // 1 / T rounded to fp32 once, as every backend does; 0 = greedy.
    inv_temperature[i] =
        params.temperature == 0.0f ? 0.0f : 1.0f / params.temperature;
    seeds[i] = spec.seed;
    steps[i] = spec.step;
    num_samples = std::max(num_samples, static_cast<int>(params.n));
  }

  const size_t copy_bytes = params_bytes_ + static_cast<size_t>(batch.rows) *
                                                info_.hidden_size *
                                                element_bytes_;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(Check(
        cudaMemcpyAsync(slot.ranks[r].device_input, slot.host_input, copy_bytes,
                        cudaMemcpyHostToDevice, slot.ranks[r].stream),
        "cudaMemcpyAsync(input)"));
  }
  const int rows_per_chunk =
      static_cast<int>(std::max<int64_t>(1, capacity_pairs_ / num_samples));
  for (int first = 0; first < batch.rows; first += rows_per_chunk) {
    const int rows = std::min(rows_per_chunk, batch.rows - first);
    FS_RETURN_IF_ERROR(RunChunk(slot, first, rows, num_samples));
  }
  SlotRank& root = slot.ranks[0];
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  FS_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(slot.host_tokens, slot.device_tokens,
                            sizeof(int32_t) * batch.rows * num_samples,
                            cudaMemcpyDeviceToHost, root.stream),
            "cudaMemcpyAsync(tokens)"));
  FS_RETURN_IF_ERROR(
      Check(cudaStreamSynchronize(root.stream), "cudaStreamSynchronize"));
  if (slot.exchange != nullptr) {
    // Every rank's barrier has reported once its stream is idle.
    for (size_t r = 1; r < ranks_.size(); ++r) {
      FS_RETURN_IF_ERROR(
          Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      FS_RETURN_IF_ERROR(Check(cudaStreamSynchronize(slot.ranks[r].stream),
                               "cudaStreamSynchronize"));
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    const TpBarrierResult barrier = slot.exchange->status();
    if (barrier != TpBarrierResult::kOk) {
      // A rank never arrived: its tokens are garbage and the exchange is
      // unusable. Health turns NOT_SERVING (broken_), calls fail UNAVAILABLE.
      broken_.store(true);
      return FatalDeviceError(absl::StrCat("tensor-parallel barrier ",
                                           TpBarrierResultName(barrier),
                                           ": a GPU stopped answering"));
    }
  }

  results->resize(batch.rows);
  for (int i = 0; i < batch.rows; ++i) {
    RowResult& result = (*results)[i];
    result = RowResult();
    const int n = batch.specs[i].params->n;
    for (int j = 0; j < n; ++j) {
      const int32_t token = slot.host_tokens[i * num_samples + j];
      if (token < 0 || token >= info_.vocab_size) {
        // Only NaN logits (overflowing hidden states) leave no candidate.
        return absl::InvalidArgumentError(
            absl::StrCat("row ", i,
                         ": no finite score (the hidden state overflows the "
                         "logits)"));
      }
      result.token_ids.push_back(token);
    }
  }
  return absl::OkStatus();
}

void CudaEngine::Release() {
  // Order: finish every stream, drop the exchanges (they free their buffers
  // and barriers) and then the communicators, then free device memory, then
  // host memory.
  for (Slot& slot : slots_) {
    for (size_t r = 0; r < slot.ranks.size(); ++r) {
      if (slot.ranks[r].stream != nullptr &&
          cudaSetDevice(ranks_[r].device) == cudaSuccess) {
        cudaStreamSynchronize(slot.ranks[r].stream);
      }
    }
  }
  for (Slot& slot : slots_) slot.exchange.reset();
  tp_comms_.reset();
  for (Slot& slot : slots_) {
    for (size_t r = 0; r < slot.ranks.size(); ++r) {
      SlotRank& slot_rank = slot.ranks[r];
      if (cudaSetDevice(ranks_[r].device) != cudaSuccess) continue;
      // Idle since the first loop above.
      if (slot_rank.stream != nullptr) cudaStreamDestroy(slot_rank.stream);
      if (slot_rank.device_input != nullptr) cudaFree(slot_rank.device_input);
      if (slot_rank.workspace != nullptr) cudaFree(slot_rank.workspace);
    }
    if (!ranks_.empty() && cudaSetDevice(ranks_[0].device) == cudaSuccess) {
      if (slot.device_tokens != nullptr) cudaFree(slot.device_tokens);
    }
    if (slot.host_input != nullptr) cudaFreeHost(slot.host_input);
    if (slot.host_tokens != nullptr) cudaFreeHost(slot.host_tokens);
  }
  slots_.clear();
  for (Rank& rank : ranks_) {
    if (rank.weights != nullptr && cudaSetDevice(rank.device) == cudaSuccess) {
      cudaFree(rank.weights);
    }
  }
  ranks_.clear();
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error
    return 0;
  }
  return count;
}

bool AbortCudaEngineBarriersForTest(Engine* engine) {
  auto* cuda = dynamic_cast<CudaEngine*>(engine);
  return cuda != nullptr && cuda->AbortBarriers();
}

absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(
    std::shared_ptr<const Weights> weights, const CudaEngineOptions& options) {
  if (weights == nullptr) {
    return absl::InvalidArgumentError("CreateCudaEngine: no weights");
  }
  auto engine = std::make_unique<CudaEngine>(std::move(weights), options);
  FS_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace flashsampler
