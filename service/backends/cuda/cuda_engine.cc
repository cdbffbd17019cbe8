// CUDA engine: weights uploaded once per device (each rank its shard), every
// buffer allocated at Create, and per batch: one H2D copy per rank of the
// pinned [row params | hidden states] staging, stage 1 on every rank (rank
// r's kernel stores its candidates into rank 0's buffer at its tile offset
// through the slot's TpExchange: NCCL device-API LSA pointers, or CUDA peer
// pointers), the exchange's barrier (or events) orders every rank's stores
// before rank 0's stage 2, then one D2H of the token ids.
//
// A batch where any row uses a control beyond temperature and n takes the
// materialized path (docs/design.md#exactness-and-refusals): stage 1 writes
// its fp32 logits (FusedSampleParams::logits_out) into the slot's [B, V]
// buffer on rank 0 (tensor parallel: each rank into its own [B, shard]
// buffer, copied into rank 0's at the shard's column offset), the
// controlled sampler (kernels/controls/) samples the controlled rows over
// them, then one D2H of tokens, logprobs, top lists and statuses; the
// batch's other rows keep stage 1's tokens. It costs 4 * V bytes written
// per row plus the controlled kernel's passes over them (at V = 151936:
// 0.6 MB written, a few MB read per row) where the fused path writes none.
// On one GPU with the wgmma kernel, a batch whose controlled rows the units
// can serve (ServedFromUnitCandidates) writes only each 32-token unit's
// highest logits instead (FusedSampleParams::unit_candidates; with
// per-token entries, ranked by the rows' token classes, the entries' logits
// written alone; with bitmask rows whose tails are summed, by classes that
// leave the masked tokens out, where the batch packs few bitmasks:
// kRowsPerPackedBitmask), and the controlled sampler's candidate
// path samples from them; a batch with a row it cannot certify then takes
// the materialized path above.
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
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/status_util.h"
#include "common/thread_pool.h"
#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_sampler.h"
#include "kernels/controls/controlled_types.h"
#include "kernels/sampler/fused_sampler.h"
#include "kernels/testing/fault_kernel.h"
#include "kernels/tp/tp_exchange.h"
#include "kernels/tp/tp_layout.h"
#include "service/backends/cuda/controlled_rows.h"
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

// Every batch size whose controlled rows allow it is served from unit
// candidates: on an H100 the units' path is the faster one from 1 to 256
// rows (qwen, top_k + top_p + min_p: 445 against 448 us at one row, 449
// against 465 at 16, 485 against 556 at 128, 712 against 725 at 256; top_p
// 0.9 at 256 rows 717 against 739; llama at 256 rows 944 against 1075;
// docs/performance.md#sampling-controls).
// After a batch the units could not certify (it paid stage 1 twice), the
// next this many controlled batches materialize their logits at once: a
// workload of rows the units cannot certify (flat rows at top_p 0.99) pays
// the second pass at most once in 17 batches.
constexpr int kUnitCandidatesPauseBatches = 16;

// What a batch with token classes copies before its fused kernel
// (PrepareTokenClasses, TokenClassInputs): 4 bytes an entry id and the
// rows, and where the classes hold the bitmasks, at most one 19 KB bitmask
// (V = 151936) per kRowsPerPackedBitmask rows; 4 MB is a million ids. A
// batch with more takes its logits.
constexpr size_t kClassInputBytes = size_t{4} << 20;

// A batch with bitmask rows whose tails the units sum (raw logprobs, or
// top_p that top_k does not bound: NeedsBitmaskInClasses) copies their
// bitmasks before the fused kernel, so that the token classes leave masked
// tokens out of every unit and tail; nothing hides that copy (19 KB a
// bitmask at V = 151936), where the units save each row of the batch
// 0.7-1.0 us of GPU time against its logits. Rows each with their own
// bitmask and raw logprobs took 1.60-1.66x the plain batch in the engine
// at qwen B = 64 that way against 1.35-1.36x from their logits, and 1.25-
// 1.27x against 1.18-1.19x at 16 (H100, fs_engine_bench). A request's
// shared params pack one bitmask: at most one per four rows takes the
// units.
constexpr int kRowsPerPackedBitmask = 4;

// The controls of a row riding in a controlled launch whose outputs are not
// used (a refused row, or one that keeps stage 1's tokens): greedy, which
// the candidates certify at once.
SamplingParams RideAlongParams() {
  SamplingParams params;
  params.temperature = 0.0f;
  return params;
}

size_t AlignUp(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The controlled sampler's outputs for `rows` rows with row strides
// `samples` and `top_n`, in one buffer (one D2H copy), each array 256-byte
// aligned.
struct ControlledOutputLayout {
  size_t token_ids = 0;         // int32 [rows, samples]
  size_t sampled_logprobs = 0;  // float [rows, samples]
  size_t sampled_ranks = 0;     // int32 [rows, samples]
  size_t logsumexp = 0;         // float [rows]
  size_t top_token_ids = 0;     // int32 [rows, top_n]
  size_t top_logprobs = 0;      // float [rows, top_n]
  size_t top_count = 0;         // int32 [rows]
  size_t status = 0;            // int32 [rows]
  size_t error_token = 0;       // int32 [rows]
  size_t certified = 0;         // int32 [rows]
  size_t total = 0;
};

ControlledOutputLayout MakeControlledOutputLayout(int rows, int samples,
                                                  int top_n) {
  const size_t r = static_cast<size_t>(rows);
  const size_t per_sample = 4 * r * static_cast<size_t>(samples);
  const size_t per_top = 4 * r * static_cast<size_t>(top_n);
  ControlledOutputLayout l;
  size_t at = 0;
  const auto take = [&at](size_t bytes) {
    const size_t offset = at;
    at = AlignUp(at + bytes, 256);
    return offset;
  };
  l.token_ids = take(per_sample);
  l.sampled_logprobs = take(per_sample);
  l.sampled_ranks = take(per_sample);
  l.logsumexp = take(4 * r);
  l.top_token_ids = take(per_top);
  l.top_logprobs = take(per_top);
  l.top_count = take(4 * r);
  l.status = take(4 * r);
  l.error_token = take(4 * r);
  l.certified = take(4 * r);
  l.total = at;
  return l;
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
  // Tensor parallel, materialized path: this rank's [max_batch_rows, rows]
  // fp32 logits, copied into the slot's [B, V] buffer on rank 0.
  float* shard_logits = nullptr;
  // Ranks >= 1: recorded after that copy; rank 0's stream waits on it.
  cudaEvent_t logits_copied = nullptr;
};

// Recorded graphs of one kind, by batch rows - 1: null until recorded,
// and for good where refused says the recording failed.
struct Stage1Graphs {
  std::vector<cudaGraphExec_t> execs;
  std::vector<char> refused;
};

struct Slot {
  void* host_input = nullptr;  // pinned [row params | hidden]
  std::vector<SlotRank> ranks;
  // Tensor parallel: this slot's candidate exchange (its own double-buffered
  // candidate buffer on rank 0 and barrier), so that slots run independently.
  std::unique_ptr<TpExchange> exchange;
  int32_t* device_tokens = nullptr;  // rank 0: [rows][n]
  int32_t* host_tokens = nullptr;    // pinned
  // One GPU (CudaEngineOptions::replay_graphs), by batch rows - 1:
  // plain_graphs replay a plain batch with one sample a row (its input
  // copy, stage 1 and token copy), units_graphs the input copy and stage 1
  // of a controlled batch served from unit candidates whose other rows take
  // one sample, classified_graphs the same with the token classes' kernel,
  // ranked by a row of classes each, classified_shared_graphs by one row of
  // classes for all (classes_shared). Each is recorded on that size's first
  // batch.
  Stage1Graphs plain_graphs;
  Stage1Graphs units_graphs;
  Stage1Graphs classified_graphs;
  Stage1Graphs classified_shared_graphs;

  // The materialized path, all on rank 0 (sizes in CudaEngine::Init).
  float* logits = nullptr;  // [max_batch_rows, V] fp32
  // One GPU: the fused kernel's unit candidates (unit_candidates.h),
  // [max_batch_rows, UnitsPerRow(V)] records, and the rows' maxima,
  // [2][max_batch_rows] (bound, then top; zero between batches: the merge
  // kernel resets them); null where the engine does not take that path.
  UnitRecord* unit_records = nullptr;
  uint32_t* unit_row_maxima = nullptr;
  // [max_batch_rows, UnitClassWordsPerRow(V)]: the token classes the units
  // rank by in a batch with per-token entries (their entries' logits land
  // in `logits`) or with bitmask rows whose tails are summed, and what they
  // are made from (kClassInputBytes, pinned and device).
  uint32_t* unit_token_classes = nullptr;
  // The batch's rows share one params (one request's): the classes are its
  // first row's alone, and every row ranks by them. With a row of classes
  // each, the epilogue loads every row's class words from L2 for every
  // unit: at qwen B = 256 with every control and raw logprobs, 1.34 against
  // 1.24x the plain kernel (H100, call for call).
  bool classes_shared = false;
  // The token classes' kernel (queued by EnqueueStage1 after the input
  // copy) reads no bitmask: its arguments then depend on the batch's size
  // and classes_shared alone, so the classified graphs hold it. A batch
  // whose classes read bitmasks goes call by call.
  bool classes_replayable = false;
  ControlledSampleParams class_params;  // into device_class_inputs
  TokenClassInputs class_inputs;
  void* host_class_inputs = nullptr;
  void* device_class_inputs = nullptr;
  void* controlled_workspace = nullptr;  // the controlled sampler's x = l / T
  void* host_plan = nullptr;             // pinned, kControlledPlanBudgetBytes
  void* device_plan = nullptr;           // kControlledPlanBudgetBytes
  void* host_outputs = nullptr;  // pinned ControlledOutputLayout at capacity
  void* device_outputs = nullptr;
  // One GPU: recorded on rank 0's stream after this slot's controlled
  // sampler; the other slot's next batch waits on it before its fused
  // kernel (CudaEngine::Sample says why).
  cudaEvent_t sampler_done = nullptr;
  // The other slots' sampler_done still pending as this slot's batch
  // began: its stage 1 queues its copies and the token classes' kernel,
  // then waits for them before the fused kernel (EnqueueStage1), call by
  // call. Emptied once waited for.
  std::vector<cudaEvent_t> samplers_ahead;
  // Rank 0: the packed controls' copy runs here, beside the fused kernel on
  // rank 0's stream, which waits for it (controls_copied) only before the
  // sampler (RunControlled).
  cudaStream_t controls_stream = nullptr;
  cudaEvent_t controls_copied = nullptr;
  // Host packing state, reused batch after batch (no allocation once warm).
  ControlledPlan plan;
  ControlledPackScratch pack_scratch;
  std::vector<size_t> row_bounds;
};

// Workers that help a slot's thread merge its batch's per-token entries
// (PackControlledRows) and copy its bitmasks into the pinned staging
// (WriteControls), while the fused kernel runs. Seven took one caller's 256
// rows each with its own 64 bias entries, 128 penalized ids and bitmask
// from 2.22-2.24x to 1.70-2.08x the plain batch in the engine (qwen, H100,
// fs_engine_bench) and gained nothing at the service, whose handler and
// parse threads share the host's cores (35k against 37-38k rows/s). The
// slots share them.
constexpr int kPackWorkers = 3;

// Bitmasks a batch's staging copy takes from this many on the pack pool.
// The copy runs beside the fused kernel (0.42 ms and more on an H100) and
// sets the batch's pace only once it takes longer: 256 bitmasks (4.9 MB at
// V = 151936) did, one caller's batch of 256 rows with their own bitmasks
// and raw logprobs executing in 1.78-1.80 ms copied on the pool against
// 2.05-2.43 on the slot's thread, where at 64 the pool gained nothing.
constexpr size_t kParallelCopyBitmasks = 128;

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
  // 1 / T of each row of a batch served from unit candidates, for the tail
  // masses the fused kernel sums (0: greedy or none wanted).
  size_t tail_inv_temperature_offset() const {
    return steps_offset() + sizeof(uint64_t) * options_.max_batch_rows;
  }

  absl::Status Check(cudaError_t error, const char* what);
  // cudaMalloc of `bytes` on rank `rank`'s device (the current device),
  // counted in device_bytes_[rank] when it succeeds.
  absl::Status DeviceMalloc(size_t rank, void** ptr, size_t bytes,
                            const char* what);
  // A pinned host buffer and a device buffer on rank 0 of `bytes` each,
  // the host side staging what is copied to (or from) the device side;
  // `what` names them in errors.
  absl::Status StagingMalloc(void** host, void** device, size_t bytes,
                             absl::string_view what);
  // What stage 1 writes besides its tokens.
  enum class Stage1Output { kTokens, kLogits, kUnits, kClassifiedUnits };
  // Stage 1 over rows [first_row, first_row + rows); kLogits also makes it
  // write the fp32 logits (the materialized path), kUnits the unit
  // candidates (one GPU), kClassifiedUnits those ranked by the slot's token
  // classes, with the entries' logits.
  absl::Status RunChunk(Slot& slot, int first_row, int rows, int num_samples,
                        Stage1Output output);
  // Queues the copy of the staging buffer's first `rows` rows (and every
  // row's parameters) to every rank, the token classes' kernel
  // (kClassifiedUnits), the waits for slot.samplers_ahead, then stage 1
  // over the rows in row chunks of at most capacity_pairs_ / num_samples
  // rows.
  absl::Status EnqueueStage1(Slot& slot, int rows, int num_samples,
                             Stage1Output output);
  // Queues stage 1 and the token copy of a plain batch of `rows` rows with
  // `num_samples` samples each (the copy on rank 0's stream).
  absl::Status EnqueuePlainBatch(Slot& slot, int rows, int num_samples);
  // Queues a batch's stage 1: EnqueuePlainBatch (kTokens, with the token
  // copy) or EnqueueStage1 (kLogits, kUnits, kClassifiedUnits), call by
  // call.
  absl::Status EnqueueBatchStage1(Slot& slot, int rows, int num_samples,
                                  Stage1Output output);
  // EnqueueBatchStage1 as one graph launch where it can be (one GPU, one
  // sample a row, kTokens, kUnits or kClassifiedUnits whose token classes
  // read no bitmask, no other slot's sampler to wait for:
  // slot.samplers_ahead; CudaEngineOptions::replay_graphs), recorded into
  // the slot's graphs of that output on that size's first batch; call by
  // call otherwise, and where the driver will not record it.
  absl::Status LaunchBatchStage1(Slot& slot, int rows, int num_samples,
                                 Stage1Output output);
  // Records EnqueueBatchStage1(slot, rows, 1, output) into `exec`.
  absl::Status RecordStage1Graph(Slot& slot, int rows, Stage1Output output,
                                 cudaGraphExec_t* exec);
  // The materialized path after stage 1: gathers the logits on rank 0 (tensor
  // parallel), packs and runs the controlled sampler over the batch's rows
  // (row chunks within kControlledPlanBudgetBytes) and queues the D2H of its
  // outputs on rank 0's stream. Rows with `valid[i]` false ride along as
  // greedy rows whose outputs are ignored.
  // `stage1`: what stage 1 wrote (kLogits, kUnits or kClassifiedUnits).
  // From unit candidates the sampler takes the candidate path over them
  // instead (LaunchControlledSampleFromUnits; kClassifiedUnits: ranked by
  // the slot's token classes); rows it cannot certify come back with
  // certified = 0 and nothing else. `bitmask_in_classes`: the token
  // classes were made with the bitmasks (PrepareTokenClasses).
  absl::Status RunControlled(Slot& slot, const BatchView& batch,
                             const std::vector<char>& valid, int max_samples,
                             int max_top_n, Stage1Output stage1,
                             bool bitmask_in_classes,
                             ControlledOutputLayout* layout);
  // Packs rows [first, end)'s controls into slot.plan (cleared first), a
  // refused row as a ride-along row.
  void PackControls(Slot& slot, const BatchView& batch,
                    const std::vector<char>& valid, int first, int end);
  // slot.plan's bytes into slot.host_plan, the bitmasks on the pack pool
  // from kParallelCopyBitmasks on.
  void WriteControls(Slot& slot);
  // Packs rows [first, end) and queues their copy to device_plan and the
  // merge of their pending rows' entries there: on the copy stream beside
  // stage 1, which rank 0's stream waits for before the sampler, or (a
  // later chunk) on rank 0's stream after the previous chunk's sampler.
  absl::Status UploadControls(Slot& slot, const BatchView& batch,
                              const std::vector<char>& valid, int first,
                              int end, bool beside);
  // Makes rank 0's stream wait for what the slot's copy stream has queued.
  absl::Status RootStreamWaitsForCopies(Slot& slot);
  // Before stage 1 of a batch served from unit candidates with per-token
  // entries, or with bitmask rows whose tails are summed (with_bitmask):
  // copies the rows' entry ids, and with_bitmask their bitmasks
  // (TokenClassInputs, nothing merged: the sampler's packing follows the
  // fused kernel's launch), on rank 0's stream, and binds the token
  // classes' kernel's arguments (one row of classes where every row has
  // the same params: slot.classes_shared), which stage 1 launches. False
  // in *classified where those exceed kClassInputBytes (the batch then
  // takes its logits).
  absl::Status PrepareTokenClasses(Slot& slot, const BatchView& batch,
                                   const std::vector<char>& valid,
                                   bool with_bitmask, bool* classified);
  // Reads the controlled sampler's outputs (in the slot's pinned buffer) into
  // `results` for the valid rows.
  absl::Status CollectControlled(Slot& slot, const BatchView& batch,
                                 const std::vector<char>& valid,
                                 const ControlledOutputLayout& layout,
                                 int max_samples, int max_top_n,
                                 std::vector<RowResult>* results);
  // A batch with controlled rows (by_controls[i]): stage 1 (unit
  // candidates where every controlled row allows them, else logits), the
  // controlled sampler, and the materialized path again where the units
  // left a row uncertified; the other valid rows keep stage 1's
  // stage1_samples tokens.
  absl::Status SampleControlled(Slot& slot, const BatchView& batch,
                                const std::vector<char>& by_controls,
                                bool units_serve, int stage1_samples,
                                int num_samples, int max_top_n,
                                std::vector<RowResult>* results);
  // Waits for the slot's batch on every rank and checks the tensor-parallel
  // barrier.
  absl::Status WaitForBatch(Slot& slot);
  // Row `row`'s n tokens from stage 1's pinned copy (`stride` per row).
  absl::Status TakeStage1Tokens(const Slot& slot, int row, int n, int stride,
                                RowResult* result);
  // Tensor parallel: one TpExchange per slot on the configured transport.
  absl::Status CreateExchanges();
  absl::Status CreateExchangesOn(TpTransport transport);
  void Release();

  std::shared_ptr<const Weights> weights_;
  CudaEngineOptions options_;
  EngineInfo info_;
  std::vector<Rank> ranks_;
  std::vector<Slot> slots_;
  ThreadPool pack_pool_{kPackWorkers};
  // Device memory held per rank (info().shards[r].device_bytes).
  std::vector<int64_t> device_bytes_;
  size_t element_bytes_ = 2;
  size_t params_bytes_ = 0;  // row params region, 256-byte aligned
  // params region + (max_batch_rows + kHiddenPadRows) x D
  size_t input_bytes_ = 0;
  TpLayout layout_;  // the shards as the candidate exchange sees them
  int64_t capacity_pairs_ = 0;
  size_t workspace_bytes_ = 0;
  // The controlled sampler's workspace per slot: its size for
  // max_batch_rows rows plus 256 bytes, so that a row chunk starting at row
  // f may use it from f * V floats on (ControlledSampleWorkspaceSize rounds
  // up to 256 bytes).
  size_t controlled_workspace_bytes_ = 0;
  size_t controlled_output_bytes_ = 0;  // ControlledOutputLayout at capacity
  // The slots hold unit candidates and eligible batches take that path
  // (CudaEngineOptions::unit_candidates; one GPU with the wgmma kernel, and
  // the candidate path runs at this V).
  bool units_path_ = false;
  std::atomic<bool> broken_{false};
  // Set once any slot has recorded its sampler_done: until then no batch
  // has a controlled sampler to wait for, and plain batches make no
  // cudaStreamWaitEvent call (host time on every batch otherwise).
  std::atomic<bool> sampler_recorded_{false};
  // NCCL communicators of the device-API transport; outlive the exchanges.
  std::unique_ptr<TpComms> tp_comms_;
  // Why kAuto fell back to CUDA peer access (empty otherwise).
  std::string tp_fallback_reason_;
  // The controls of a row riding along in a controlled launch.
  const SamplingParams ride_along_params_ = RideAlongParams();
  // Controlled batches left that take the materialized path directly
  // (kUnitCandidatesPauseBatches).
  std::atomic<int> unit_pause_batches_{0};
};

absl::Status CudaEngine::Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  absl::Status status = CudaToStatus(error, what);
  if (IsFatalDeviceError(status)) broken_.store(true);
  return status;
}

absl::Status CudaEngine::DeviceMalloc(size_t rank, void** ptr, size_t bytes,
                                      const char* what) {
  FS_RETURN_IF_ERROR(Check(cudaMalloc(ptr, bytes), what));
  device_bytes_[rank] += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

absl::Status CudaEngine::StagingMalloc(void** host, void** device, size_t bytes,
                                       absl::string_view what) {
  FS_RETURN_IF_ERROR(Check(cudaMallocHost(host, bytes),
                           absl::StrCat("cudaMallocHost(", what, ")").c_str()));
  return DeviceMalloc(0, device, bytes,
                      absl::StrCat("cudaMalloc(", what, ")").c_str());
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
  device_bytes_.assign(ranks_.size(), 0);
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
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& rank = ranks_[r];
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(rank.device), "cudaSetDevice"));
    const size_t bytes =
        static_cast<size_t>(rank.rows) * hidden * element_bytes_;
    FS_RETURN_IF_ERROR(
        DeviceMalloc(r, &rank.weights, bytes, "cudaMalloc(weights)"));
    FS_RETURN_IF_ERROR(
        Check(cudaMemcpy(rank.weights,
                         host_weights + rank.begin * hidden * element_bytes_,
                         bytes, cudaMemcpyHostToDevice),
              "cudaMemcpy(weights)"));
  }

  // Slots: pinned staging [inv_temperature | seeds | steps |
  // tail_inv_temperature | hidden], device copies on every rank, and rank
  // 0's candidate and token buffers.
  params_bytes_ = AlignUp(
      tail_inv_temperature_offset() + sizeof(float) * options_.max_batch_rows,
      256);
  input_bytes_ = params_bytes_ +
                 static_cast<size_t>(options_.max_batch_rows + kHiddenPadRows) *
                     hidden * element_bytes_;
  capacity_pairs_ = static_cast<int64_t>(options_.max_batch_rows) *
                    kSamplesPerLaunchAtFullBatch;
  workspace_bytes_ = FusedSampleWorkspaceSize(options_.max_batch_rows, vocab,
                                              static_cast<int>(hidden));
  const size_t max_tokens =
      static_cast<size_t>(options_.max_batch_rows) * kCudaMaxSamples;
  // The materialized path's buffers, per slot, never per request: at
  // V = 151936 and 256 rows the logits and the controlled workspace are
  // 156 MB each on rank 0, plus 16 MB of packed inputs (device and pinned)
  // and 0.7 MB of outputs; tensor parallel adds [256, shard] fp32 per rank.
  const size_t batch_logits_bytes =
      sizeof(float) * static_cast<size_t>(options_.max_batch_rows) *
      static_cast<size_t>(vocab);
  controlled_workspace_bytes_ =
      ControlledSampleWorkspaceSize(options_.max_batch_rows, vocab) + 256;
  controlled_output_bytes_ =
      MakeControlledOutputLayout(options_.max_batch_rows, kCudaMaxSamples,
                                 kCudaMaxTopLogprobs)
          .total;
  // Unit candidates: 32 bytes per unit of 32 tokens (39 MB per slot at
  // V = 151936 and 256 rows).
  bool candidate_path = false;
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  FS_RETURN_IF_ERROR(Check(ControlledCandidatePathFits(vocab, &candidate_path),
                           "ControlledCandidatePathFits"));
  units_path_ =
      options_.unit_candidates && num_ranks == 1 && candidate_path &&
      FusedSampleResolveKernel(FusedKernel::kAuto) == FusedKernel::kWgmma;
  info_.controls_path = "materialized logits";
  if (units_path_) {
    // Part of the L2 keeps the unit records there from the fused kernel to
    // the merge kernel (FusedSampleSetAsideL2ForUnits): qwen top_k + top_p +
    // min_p at B = 128 took 461 against 476 us (H100, fs_controls_bench).
    // A GPU that refuses (MIG, MPS) serves the units without it.
    size_t set_aside = 0;
    const cudaError_t set = FusedSampleSetAsideL2ForUnits(-1, &set_aside);
    info_.controls_path =
        set == cudaSuccess ? absl::StrCat("unit candidates, ", set_aside >> 20,
                                          " MiB of L2 set aside")
                           : absl::StrCat("unit candidates, no L2 set aside (",
                                          cudaGetErrorString(set), ")");
  }
  const size_t batch_units = static_cast<size_t>(options_.max_batch_rows) *
                             static_cast<size_t>(UnitsPerRow(vocab));
  slots_.resize(options_.slots);
  for (Slot& slot : slots_) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(Check(cudaMallocHost(&slot.host_input, input_bytes_),
                             "cudaMallocHost(staging)"));
    std::memset(slot.host_input, 0, input_bytes_);
    for (Stage1Graphs* graphs :
         {&slot.plain_graphs, &slot.units_graphs, &slot.classified_graphs,
          &slot.classified_shared_graphs}) {
      graphs->execs.assign(static_cast<size_t>(options_.max_batch_rows),
                           nullptr);
      graphs->refused.assign(static_cast<size_t>(options_.max_batch_rows), 0);
    }
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
      FS_RETURN_IF_ERROR(DeviceMalloc(r, &slot_rank.device_input, input_bytes_,
                                      "cudaMalloc(input)"));
      FS_RETURN_IF_ERROR(DeviceMalloc(r, &slot_rank.workspace, workspace_bytes_,
                                      "cudaMalloc(workspace)"));
      FS_RETURN_IF_ERROR(
          Check(cudaMemset(slot_rank.workspace, 0, workspace_bytes_),
                "cudaMemset(workspace)"));
      if (num_ranks > 1) {
        FS_RETURN_IF_ERROR(DeviceMalloc(
            r, reinterpret_cast<void**>(&slot_rank.shard_logits),
            sizeof(float) * static_cast<size_t>(options_.max_batch_rows) *
                static_cast<size_t>(ranks_[r].rows),
            "cudaMalloc(shard logits)"));
        if (r > 0) {
          FS_RETURN_IF_ERROR(
              Check(cudaEventCreateWithFlags(&slot_rank.logits_copied,
                                             cudaEventDisableTiming),
                    "cudaEventCreate"));
        }
      }
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(
        DeviceMalloc(0, reinterpret_cast<void**>(&slot.device_tokens),
                     sizeof(int32_t) * max_tokens, "cudaMalloc(tokens)"));
    FS_RETURN_IF_ERROR(DeviceMalloc(0, reinterpret_cast<void**>(&slot.logits),
                                    batch_logits_bytes, "cudaMalloc(logits)"));
    FS_RETURN_IF_ERROR(DeviceMalloc(0, &slot.controlled_workspace,
                                    controlled_workspace_bytes_,
                                    "cudaMalloc(controlled workspace)"));
    if (units_path_) {
      FS_RETURN_IF_ERROR(DeviceMalloc(
          0, reinterpret_cast<void**>(&slot.unit_records),
          sizeof(UnitRecord) * batch_units, "cudaMalloc(unit candidates)"));
      const size_t maxima_bytes =
          2 * sizeof(uint32_t) * static_cast<size_t>(options_.max_batch_rows);
      FS_RETURN_IF_ERROR(
          DeviceMalloc(0, reinterpret_cast<void**>(&slot.unit_row_maxima),
                       maxima_bytes, "cudaMalloc(unit row maxima)"));
      FS_RETURN_IF_ERROR(
          Check(cudaMemset(slot.unit_row_maxima, 0, maxima_bytes),
                "cudaMemset(unit row maxima)"));
      FS_RETURN_IF_ERROR(DeviceMalloc(
          0, reinterpret_cast<void**>(&slot.unit_token_classes),
          sizeof(uint32_t) * static_cast<size_t>(options_.max_batch_rows) *
              static_cast<size_t>(UnitClassWordsPerRow(vocab)),
          "cudaMalloc(unit token classes)"));
      FS_RETURN_IF_ERROR(StagingMalloc(&slot.host_class_inputs,
                                       &slot.device_class_inputs,
                                       kClassInputBytes, "token classes"));
    }
    FS_RETURN_IF_ERROR(StagingMalloc(&slot.host_plan, &slot.device_plan,
                                     kControlledPlanBudgetBytes, "controls"));
    FS_RETURN_IF_ERROR(StagingMalloc(&slot.host_outputs, &slot.device_outputs,
                                     controlled_output_bytes_,
                                     "controlled outputs"));
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(Check(
        cudaEventCreateWithFlags(&slot.sampler_done, cudaEventDisableTiming),
        "cudaEventCreate"));
    FS_RETURN_IF_ERROR(Check(
        cudaStreamCreateWithFlags(&slot.controls_stream, cudaStreamNonBlocking),
        "cudaStreamCreate"));
    FS_RETURN_IF_ERROR(Check(
        cudaEventCreateWithFlags(&slot.controls_copied, cudaEventDisableTiming),
        "cudaEventCreate"));
    slot.row_bounds.reserve(options_.max_batch_rows);
  }

  if (num_ranks > 1) {
    // The communicators and exchanges allocate inside kernels/tp and NCCL
    // (ncclMemAlloc windows, NCCL's own buffers): counted as the drop in
    // each device's free memory while they are made.
    std::vector<size_t> free_before(num_ranks, 0);
    for (int r = 0; r < num_ranks; ++r) {
      size_t total = 0;
      FS_RETURN_IF_ERROR(
          Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      FS_RETURN_IF_ERROR(
          Check(cudaMemGetInfo(&free_before[r], &total), "cudaMemGetInfo"));
    }
    FS_RETURN_IF_ERROR(CreateExchanges());
    for (int r = 0; r < num_ranks; ++r) {
      size_t free_after = 0;
      size_t total = 0;
      FS_RETURN_IF_ERROR(
          Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
      FS_RETURN_IF_ERROR(
          Check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo"));
      if (free_after < free_before[r]) {
        device_bytes_[r] += static_cast<int64_t>(free_before[r] - free_after);
      }
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
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
    shard.device_bytes = device_bytes_[r];
    info_.shards.push_back(shard);
  }
  // Every control: the fused kernel serves temperature and n, the
  // materialized path the rest (docs/design.md#exactness-and-refusals).
  info_.supported_controls = AllSamplingControls();
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
                                  int num_samples, Stage1Output output) {
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
    if (output == Stage1Output::kUnits ||
        output == Stage1Output::kClassifiedUnits) {
      // Row-major records, [max_batch_rows][units], and the rows' maxima
      // from the chunk's first row.
      const size_t at = static_cast<size_t>(first_row);
      params.unit_candidates.records =
          slot.unit_records + at * UnitsPerRow(info_.vocab_size);
      params.unit_candidates.row_bound = slot.unit_row_maxima + at;
      params.unit_candidates.row_top =
          slot.unit_row_maxima + options_.max_batch_rows + at;
      params.unit_candidates.tail_inv_temperature =
          reinterpret_cast<const float*>(input +
                                         tail_inv_temperature_offset()) +
          first_row;
      if (output == Stage1Output::kClassifiedUnits) {
        // One row of classes for all (slot.classes_shared), else the
        // chunk's.
        params.unit_candidates.token_classes =
            slot.unit_token_classes +
            (slot.classes_shared ? 0 : at) *
                UnitClassWordsPerRow(info_.vocab_size);
        params.unit_candidates.token_classes_shared = slot.classes_shared;
        params.unit_candidates.entry_logits =
            slot.logits + at * info_.vocab_size;
      }
    }
    if (output == Stage1Output::kLogits) {
      // [rows, vocab_rows] at the chunk's first row: one GPU writes straight
      // into the [B, V] buffer (its shard is all of V); tensor parallel
      // ranks write their own buffer, gathered by RunControlled.
      params.logits_out =
          num_ranks == 1
              ? slot.logits + static_cast<int64_t>(first_row) * rank.rows
              : slot_rank.shard_logits +
                    static_cast<int64_t>(first_row) * rank.rows;
    }
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

absl::Status CudaEngine::EnqueueStage1(Slot& slot, int rows, int num_samples,
                                       Stage1Output output) {
  const size_t copy_bytes = params_bytes_ + static_cast<size_t>(rows) *
                                                info_.hidden_size *
                                                element_bytes_;
  for (size_t r = 0; r < ranks_.size(); ++r) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(Check(
        cudaMemcpyAsync(slot.ranks[r].device_input, slot.host_input, copy_bytes,
                        cudaMemcpyHostToDevice, slot.ranks[r].stream),
        "cudaMemcpyAsync(input)"));
  }
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  if (output == Stage1Output::kClassifiedUnits) {
    FS_RETURN_IF_ERROR(
        Check(LaunchUnitTokenClasses(slot.class_params, slot.unit_token_classes,
                                     slot.ranks[0].stream),
              "LaunchUnitTokenClasses"));
  }
  // The copies and the token classes' kernel go before the wait: they run
  // while the other slot's fused kernel and sampler do, where after it they
  // would hold up this batch's fused kernel with the GPU idle (a 64-row
  // batch's 0.5 MB of hidden states and the classes' 7 us, qwen, H100).
  for (cudaEvent_t sampler : slot.samplers_ahead) {
    FS_RETURN_IF_ERROR(
        Check(cudaStreamWaitEvent(slot.ranks[0].stream, sampler, 0),
              "cudaStreamWaitEvent"));
  }
  slot.samplers_ahead.clear();
  const int rows_per_chunk =
      static_cast<int>(std::max<int64_t>(1, capacity_pairs_ / num_samples));
  for (int first = 0; first < rows; first += rows_per_chunk) {
    FS_RETURN_IF_ERROR(RunChunk(slot, first,
                                std::min(rows_per_chunk, rows - first),
                                num_samples, output));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::EnqueuePlainBatch(Slot& slot, int rows,
                                           int num_samples) {
  FS_RETURN_IF_ERROR(
      EnqueueStage1(slot, rows, num_samples, Stage1Output::kTokens));
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  return Check(cudaMemcpyAsync(slot.host_tokens, slot.device_tokens,
                               sizeof(int32_t) * rows * num_samples,
                               cudaMemcpyDeviceToHost, slot.ranks[0].stream),
               "cudaMemcpyAsync(tokens)");
}

absl::Status CudaEngine::EnqueueBatchStage1(Slot& slot, int rows,
                                            int num_samples,
                                            Stage1Output output) {
  return output == Stage1Output::kTokens
             ? EnqueuePlainBatch(slot, rows, num_samples)
             : EnqueueStage1(slot, rows, num_samples, output);
}

absl::Status CudaEngine::RecordStage1Graph(Slot& slot, int rows,
                                           Stage1Output output,
                                           cudaGraphExec_t* exec) {
  cudaStream_t stream = slot.ranks[0].stream;
  // Recorded from the same calls a batch of this size makes one by one;
  // every pointer and argument they take is fixed per slot and size.
  FS_RETURN_IF_ERROR(
      Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
            "cudaStreamBeginCapture"));
  const absl::Status enqueued = EnqueueBatchStage1(slot, rows, 1, output);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!enqueued.ok() || ended != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    FS_RETURN_IF_ERROR(enqueued);
    return Check(ended, "cudaStreamEndCapture");
  }
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    *exec = nullptr;
    return Check(made, "cudaGraphInstantiate");
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::LaunchBatchStage1(Slot& slot, int rows,
                                           int num_samples,
                                           Stage1Output output) {
  // Where a classified batch's token classes read a bitmask, their
  // kernel takes the offsets of this batch's bitmask words, and a batch
  // that waits for another slot's sampler waits between its copies and its
  // fused kernel: their stage 1 goes call by call.
  if (!options_.replay_graphs || ranks_.size() != 1 || num_samples != 1 ||
      output == Stage1Output::kLogits || !slot.samplers_ahead.empty() ||
      (output == Stage1Output::kClassifiedUnits && !slot.classes_replayable)) {
    return EnqueueBatchStage1(slot, rows, num_samples, output);
  }
  // A classified batch's stage 1 (its token classes' kernel included) reads
  // the slot's token classes, a row of them each or one for all: two
  // recordings of each size.
  Stage1Graphs& graphs =
      output == Stage1Output::kTokens ? slot.plain_graphs
      : output == Stage1Output::kUnits
          ? slot.units_graphs
          : (slot.classes_shared ? slot.classified_shared_graphs
                                 : slot.classified_graphs);
  const size_t index = static_cast<size_t>(rows) - 1;
  cudaGraphExec_t& exec = graphs.execs[index];
  if (exec == nullptr && !graphs.refused[index]) {
    const absl::Status recorded = RecordStage1Graph(slot, rows, output, &exec);
    if (!recorded.ok()) {
      if (broken_.load()) return recorded;
      // A size the driver would not record (the device is fine) is queued
      // call by call from now on.
      graphs.refused[index] = 1;
    }
  }
  if (exec == nullptr) return EnqueueBatchStage1(slot, rows, 1, output);
  if (options_.graph_launches_for_tests != nullptr) {
    options_.graph_launches_for_tests->fetch_add(1);
  }
  return Check(cudaGraphLaunch(exec, slot.ranks[0].stream), "cudaGraphLaunch");
}

void CudaEngine::PackControls(Slot& slot, const BatchView& batch,
                              const std::vector<char>& valid, int first,
                              int end) {
  slot.plan.Clear();
  // A refused row keeps its place (one CTA per logits row) as a plain row.
  PackControlledRows(batch.specs, valid, first, end, ride_along_params_,
                     &slot.pack_scratch, &slot.plan, &pack_pool_,
                     /*device_merge=*/info_.vocab_size <= kPendingMaxVocab);
}

void CudaEngine::WriteControls(Slot& slot) {
  ThreadPool* pool = slot.plan.packed_bitmasks() >= kParallelCopyBitmasks
                         ? &pack_pool_
                         : nullptr;
  slot.plan.WriteBytes(
      slot.host_plan, [pool](int64_t n, absl::FunctionRef<void(int64_t)> copy) {
        ParallelForOrInline(pool, n, copy);
      });
}

absl::Status CudaEngine::PrepareTokenClasses(Slot& slot, const BatchView& batch,
                                             const std::vector<char>& valid,
                                             bool with_bitmask,
                                             bool* classified) {
  *classified = false;
  slot.classes_replayable = false;
  // One request's rows (one params, every row controlled): one row of
  // classes, its first's, which every row ranks by.
  slot.classes_shared = batch.rows > 1;
  for (int i = 0; i < batch.rows && slot.classes_shared; ++i) {
    slot.classes_shared =
        valid[i] && batch.specs[i].params == batch.specs[0].params;
  }
  slot.class_inputs.Build(batch.specs, valid, batch.rows, ride_along_params_,
                          with_bitmask, slot.classes_shared);
  const size_t bytes = slot.class_inputs.byte_size();
  if (bytes > kClassInputBytes) return absl::OkStatus();
  slot.class_inputs.WriteBytes(slot.host_class_inputs);
  // On rank 0's stream, which is idle here (the slot's last batch is done
  // and a wait for another slot's sampler comes after stage 1's copies):
  // one call where a copy beside it, its event and the wait take three,
  // each 6-16 us of host time on a virtual machine.
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  FS_RETURN_IF_ERROR(Check(
      cudaMemcpyAsync(slot.device_class_inputs, slot.host_class_inputs, bytes,
                      cudaMemcpyHostToDevice, slot.ranks[0].stream),
      "cudaMemcpyAsync(token classes)"));
  slot.class_inputs.BindInputs(slot.device_class_inputs, info_.vocab_size,
                               &slot.class_params);
  *classified = true;
  slot.classes_replayable = slot.class_params.bitmask == nullptr;
  return absl::OkStatus();
}

absl::Status CudaEngine::UploadControls(Slot& slot, const BatchView& batch,
                                        const std::vector<char>& valid,
                                        int first, int end, bool beside) {
  PackControls(slot, batch, valid, first, end);
  const size_t bytes = slot.plan.byte_size();
  if (bytes > kControlledPlanBudgetBytes) {
    // SplitRowsByBudget's bounds make this unreachable.
    return absl::InternalError(
        absl::StrCat("packed controls of ", bytes, " bytes exceed the ",
                     kControlledPlanBudgetBytes, "-byte staging"));
  }
  WriteControls(slot);
  // The first chunk's copy runs beside the fused kernel, not after it: a
  // batch's bitmasks are 19 KB a row at V = 151936 (1.2 MB at 64 rows).
  // One caller of 64 rows with a bitmask and raw logprobs: batch
  // execution 0.65 against 0.69-0.70 ms (H100, two alternating rounds).
  // Nothing else of this batch reads device_plan before the sampler, and
  // the slot's previous batch has finished; a later chunk's copy follows
  // the previous chunk's sampler, which read device_plan, on root.stream.
  cudaStream_t stream = beside ? slot.controls_stream : slot.ranks[0].stream;
  FS_RETURN_IF_ERROR(
      Check(cudaMemcpyAsync(slot.device_plan, slot.host_plan, bytes,
                            cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync(controls)"));
  // The rows left pending are merged where the copy lands, beside the fused
  // kernel as the copy is (or as its blocks retire).
  PendingMerges merges;
  slot.plan.BindPendingMerges(slot.device_plan, &merges);
  FS_RETURN_IF_ERROR(Check(LaunchMergePendingEntries(merges, stream),
                           "LaunchMergePendingEntries"));
  return beside ? RootStreamWaitsForCopies(slot) : absl::OkStatus();
}

absl::Status CudaEngine::RootStreamWaitsForCopies(Slot& slot) {
  FS_RETURN_IF_ERROR(
      Check(cudaEventRecord(slot.controls_copied, slot.controls_stream),
            "cudaEventRecord"));
  return Check(
      cudaStreamWaitEvent(slot.ranks[0].stream, slot.controls_copied, 0),
      "cudaStreamWaitEvent");
}

absl::Status CudaEngine::RunControlled(Slot& slot, const BatchView& batch,
                                       const std::vector<char>& valid,
                                       int max_samples, int max_top_n,
                                       Stage1Output stage1,
                                       bool bitmask_in_classes,
                                       ControlledOutputLayout* layout) {
  const bool from_units = stage1 == Stage1Output::kUnits ||
                          stage1 == Stage1Output::kClassifiedUnits;
  const int64_t vocab = info_.vocab_size;
  const size_t num_ranks = ranks_.size();
  SlotRank& root = slot.ranks[0];
  if (num_ranks > 1 && !from_units) {
    // Each rank's [rows, shard] logits land at its shard's columns of rank
    // 0's [B, V] buffer: one 2-D copy per rank on its own stream, so after
    // its stage 1 (cudaMemcpyDefault under unified addressing: a peer copy
    // for ranks >= 1, whose peer access Init enabled); rank 0's stream waits
    // for the other ranks' copies. Copies, not a strided logits_out: the
    // fused kernel stays as it is and the copies are exact.
    for (size_t r = 0; r < num_ranks; ++r) {
      const Rank& rank = ranks_[r];
      SlotRank& slot_rank = slot.ranks[r];
      FS_RETURN_IF_ERROR(Check(cudaSetDevice(rank.device), "cudaSetDevice"));
      FS_RETURN_IF_ERROR(Check(
          cudaMemcpy2DAsync(slot.logits + rank.begin, sizeof(float) * vocab,
                            slot_rank.shard_logits, sizeof(float) * rank.rows,
                            sizeof(float) * rank.rows, batch.rows,
                            cudaMemcpyDefault, slot_rank.stream),
          "cudaMemcpy2DAsync(logits)"));
      if (r > 0) {
        FS_RETURN_IF_ERROR(
            Check(cudaEventRecord(slot_rank.logits_copied, slot_rank.stream),
                  "cudaEventRecord"));
      }
    }
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    for (size_t r = 1; r < num_ranks; ++r) {
      FS_RETURN_IF_ERROR(Check(
          cudaStreamWaitEvent(root.stream, slot.ranks[r].logits_copied, 0),
          "cudaStreamWaitEvent"));
    }
  }
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));

  // One output layout for the whole batch: every row chunk writes with the
  // batch's strides at its first row.
  *layout = MakeControlledOutputLayout(batch.rows, max_samples, max_top_n);
  char* out = static_cast<char*>(slot.device_outputs);
  slot.row_bounds.clear();
  for (int i = 0; i < batch.rows; ++i) {
    slot.row_bounds.push_back(
        valid[i] ? ControlledRowBytesBound(*batch.specs[i].params)
                 : ControlledRowBytesBound(ride_along_params_));
  }
  const std::vector<std::pair<int, int>> chunks =
      SplitRowsByBudget(slot.row_bounds, kControlledPlanBudgetBytes);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int first = chunks[c].first;
    const int end = chunks[c].second;
    if (c > 0) {
      // The previous chunk's H2D copy reads the pinned staging until done.
      FS_RETURN_IF_ERROR(
          Check(cudaStreamSynchronize(root.stream), "cudaStreamSynchronize"));
    }
    FS_RETURN_IF_ERROR(
        UploadControls(slot, batch, valid, first, end, /*beside=*/c == 0));
    ControlledSampleParams params;
    slot.plan.BindInputs(slot.device_plan, vocab, &params);
    params.max_samples = max_samples;
    params.max_top_n = max_top_n;
    params.logits = slot.logits + static_cast<int64_t>(first) * vocab;
    params.logits_row_stride = vocab;
    const int64_t sample_at = static_cast<int64_t>(first) * max_samples;
    const int64_t top_at = static_cast<int64_t>(first) * max_top_n;
    params.token_ids =
        reinterpret_cast<int32_t*>(out + layout->token_ids) + sample_at;
    params.sampled_logprobs =
        reinterpret_cast<float*>(out + layout->sampled_logprobs) + sample_at;
    params.sampled_ranks =
        reinterpret_cast<int32_t*>(out + layout->sampled_ranks) + sample_at;
    params.logsumexp =
        reinterpret_cast<float*>(out + layout->logsumexp) + first;
    params.top_token_ids =
        reinterpret_cast<int32_t*>(out + layout->top_token_ids) + top_at;
    params.top_logprobs =
        reinterpret_cast<float*>(out + layout->top_logprobs) + top_at;
    params.top_count =
        reinterpret_cast<int32_t*>(out + layout->top_count) + first;
    params.status = reinterpret_cast<int32_t*>(out + layout->status) + first;
    params.error_token =
        reinterpret_cast<int32_t*>(out + layout->error_token) + first;
    params.certified =
        reinterpret_cast<int32_t*>(out + layout->certified) + first;
    // A chunk uses the workspace from its first row on, so every row's
    // processed logits stay readable until the batch ends (the non-finite
    // message reads one).
    const size_t offset =
        sizeof(float) * static_cast<size_t>(first) * static_cast<size_t>(vocab);
    void* workspace = static_cast<char*>(slot.controlled_workspace) + offset;
    const size_t workspace_bytes = controlled_workspace_bytes_ - offset;
    if (from_units) {
      const size_t at = static_cast<size_t>(first);
      ControlledUnits units;
      units.records = slot.unit_records + at * UnitsPerRow(vocab);
      units.row_bound = slot.unit_row_maxima + at;
      units.row_top = slot.unit_row_maxima + options_.max_batch_rows + at;
      units.tail_inv_temperature =
          reinterpret_cast<const float*>(
              static_cast<const char*>(root.device_input) +
              tail_inv_temperature_offset()) +
          first;
      if (stage1 == Stage1Output::kClassifiedUnits) {
        units.token_classes =
            slot.unit_token_classes + at * UnitClassWordsPerRow(vocab);
        units.bitmask_in_classes = bitmask_in_classes;
      }
      FS_RETURN_IF_ERROR(
          Check(LaunchControlledSampleFromUnits(params, units, workspace,
                                                workspace_bytes, root.stream),
                "LaunchControlledSampleFromUnits"));
    } else {
      FS_RETURN_IF_ERROR(
          Check(LaunchControlledSample(params, workspace, workspace_bytes,
                                       root.stream),
                "LaunchControlledSample"));
    }
  }
  FS_RETURN_IF_ERROR(Check(cudaEventRecord(slot.sampler_done, root.stream),
                           "cudaEventRecord"));
  sampler_recorded_.store(true, std::memory_order_release);
  return Check(
      cudaMemcpyAsync(slot.host_outputs, slot.device_outputs, layout->total,
                      cudaMemcpyDeviceToHost, root.stream),
      "cudaMemcpyAsync(controlled outputs)");
}

absl::Status CudaEngine::CollectControlled(Slot& slot, const BatchView& batch,
                                           const std::vector<char>& valid,
                                           const ControlledOutputLayout& layout,
                                           int max_samples, int max_top_n,
                                           std::vector<RowResult>* results) {
  const int64_t vocab = info_.vocab_size;
  const char* out = static_cast<const char*>(slot.host_outputs);
  const auto* tokens = reinterpret_cast<const int32_t*>(out + layout.token_ids);
  const auto* sampled =
      reinterpret_cast<const float*>(out + layout.sampled_logprobs);
  const auto* ranks =
      reinterpret_cast<const int32_t*>(out + layout.sampled_ranks);
  const auto* lse = reinterpret_cast<const float*>(out + layout.logsumexp);
  const auto* top_ids =
      reinterpret_cast<const int32_t*>(out + layout.top_token_ids);
  const auto* top_logprobs =
      reinterpret_cast<const float*>(out + layout.top_logprobs);
  const auto* top_count =
      reinterpret_cast<const int32_t*>(out + layout.top_count);
  const auto* status = reinterpret_cast<const int32_t*>(out + layout.status);
  const auto* error_token =
      reinterpret_cast<const int32_t*>(out + layout.error_token);
  const auto* certified =
      reinterpret_cast<const int32_t*>(out + layout.certified);
  for (int i = 0; i < batch.rows; ++i) {
    if (!valid[i]) continue;
    RowResult& result = (*results)[i];
    const SamplingParams& p = *batch.specs[i].params;
    if (status[i] != kControlledOk) {
      float raw = 0.0f;
      float processed = 0.0f;
      const int32_t token = error_token[i];
      if (status[i] == kControlledNonFinite && token >= 0 && token < vocab) {
        // The offending raw and processed logits, read back for the message
        // only (the CPU sampler's text carries both).
        const size_t at = static_cast<size_t>(i) * static_cast<size_t>(vocab) +
                          static_cast<size_t>(token);
        FS_RETURN_IF_ERROR(
            Check(cudaMemcpy(&raw, slot.logits + at, sizeof(float),
                             cudaMemcpyDeviceToHost),
                  "cudaMemcpy(raw logit)"));
        FS_RETURN_IF_ERROR(
            Check(cudaMemcpy(
                      &processed,
                      static_cast<const float*>(slot.controlled_workspace) + at,
                      sizeof(float), cudaMemcpyDeviceToHost),
                  "cudaMemcpy(processed logit)"));
      }
      result.error = ControlledRowError(status[i], token, raw, processed);
      continue;
    }
    if (certified[i] == 0) result.exact_fallback = kFullRowPassFallback;
    const int64_t sample_at = static_cast<int64_t>(i) * max_samples;
    for (int j = 0; j < p.n; ++j) {
      const int32_t token = tokens[sample_at + j];
      if (token < 0 || token >= vocab) {
        return absl::InternalError(absl::StrCat(
            "row ", i, ": the controlled sampler returned token ", token));
      }
      result.token_ids.push_back(token);
      if (p.logprobs.sampled) {
        result.sampled_logprobs.push_back(sampled[sample_at + j]);
      }
      if (p.logprobs.rank) result.sampled_ranks.push_back(ranks[sample_at + j]);
    }
    if (p.logprobs.logsumexp) result.logsumexp = lse[i];
    if (p.logprobs.top_n > 0) {
      const int count = std::min(top_count[i], max_top_n);
      const int64_t top_at = static_cast<int64_t>(i) * max_top_n;
      for (int t = 0; t < count; ++t) {
        result.top_token_ids.push_back(top_ids[top_at + t]);
        result.top_logprobs.push_back(top_logprobs[top_at + t]);
      }
    }
  }
  return absl::OkStatus();
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
  for (int i = 0; i < batch.rows; ++i) {
    if (batch.specs[i].params == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", i, " has no sampling parameters"));
    }
  }
  Slot& slot = slots_[batch.slot];
  char* host = static_cast<char*>(slot.host_input);
  float* inv_temperature = reinterpret_cast<float*>(host);
  uint64_t* seeds = reinterpret_cast<uint64_t*>(host + seeds_offset());
  uint64_t* steps = reinterpret_cast<uint64_t*>(host + steps_offset());
  float* tail_inv_temperature =
      reinterpret_cast<float*>(host + tail_inv_temperature_offset());
  results->assign(batch.rows, RowResult());
  std::vector<char> valid(batch.rows, 1);
  // Valid rows with a control beyond temperature and n: the controlled
  // sampler samples them. A batch with any takes the controlled path; its
  // other valid rows keep stage 1's tokens (the fused kernel's exact
  // samples, which the controlled sampler would give them too) and ride in
  // the controlled launch as greedy rows, which its candidates certify at
  // once.
  std::vector<char> by_controls(batch.rows, 0);
  int valid_rows = 0;
  bool controlled = false;
  bool units_serve = true;  // every controlled row can take unit candidates
  int num_samples = 1;      // the batch's largest n
  int stage1_samples = 1;   // the largest n among rows keeping stage-1 tokens
  int max_top_n = 0;
  // A request's rows share one params: checked once.
  const SamplingParams* checked = nullptr;
  absl::Status row_status;
  for (int i = 0; i < batch.rows; ++i) {
    const RowSpec& spec = batch.specs[i];
    const SamplingParams& params = *spec.params;
    if (spec.params != checked) {
      checked = spec.params;
      row_status = ValidateCudaRow(params, info_.vocab_size);
    }
    if (!row_status.ok()) {
      // This row alone fails (Engine::Sample's contract); it rides along as
      // a greedy row whose result is dropped.
      (*results)[i].error = std::string(row_status.message());
      valid[i] = 0;
      inv_temperature[i] = 0.0f;
      seeds[i] = 0;
      steps[i] = 0;
      continue;
    }
    ++valid_rows;
    const bool row_controlled = NeedsControlledSampler(params);
    by_controls[i] = row_controlled;
    controlled = controlled || row_controlled;
    if (row_controlled) {
      units_serve =
          units_serve && ServedFromUnitCandidates(params, info_.vocab_size);
    } else {
      stage1_samples = std::max(stage1_samples, static_cast<int>(params.n));
    }
    // 1 / T rounded to fp32 once, as every backend does; 0 = greedy
    // (SamplingParams::greedy(), which also covers tiny temperatures).
    inv_temperature[i] = params.greedy() ? 0.0f : 1.0f / params.temperature;
    seeds[i] = spec.seed;
    steps[i] = spec.step;
    num_samples = std::max(num_samples, static_cast<int>(params.n));
    max_top_n =
        std::max<int>(max_top_n, static_cast<int>(std::min<int64_t>(
                                     params.logprobs.top_n, info_.vocab_size)));
  }
  if (valid_rows == 0) return absl::OkStatus();
  if (controlled) {
    // A controlled row's stage-1 tokens are not used, so it runs greedy
    // there: an argmax per column instead of the pruned noise. Served from
    // unit candidates, the kernel sums its tail mass at its 1 / T where the
    // merge kernel reads it (controls::UnitTailWanted).
    for (int i = 0; i < batch.rows; ++i) {
      tail_inv_temperature[i] = 0.0f;
      if (!by_controls[i]) continue;
      const SamplingParams& params = *batch.specs[i].params;
      if (controls::UnitTailWanted(params.greedy() ? 0.0f : params.temperature,
                                   params.top_k, params.top_p,
                                   info_.vocab_size)) {
        tail_inv_temperature[i] = inv_temperature[i];
      }
      // Raw logprobs: the mass at T = 1 (ServedFromUnitCandidates takes no
      // row whose top_p tail is also wanted).
      if (params.logprobs.any() && params.logprobs.raw) {
        tail_inv_temperature[i] = 1.0f;
      }
      inv_temperature[i] = 0.0f;
    }
  }

  if (options_.trap_next_batch_for_tests != nullptr &&
      options_.trap_next_batch_for_tests->exchange(false)) {
    // Test-only (CudaEngineOptions): the fault an Xid would leave.
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
    FS_RETURN_IF_ERROR(
        Check(LaunchTrapKernel(slot.ranks[0].stream), "LaunchTrapKernel"));
  }
  slot.samplers_ahead.clear();
  if (ranks_.size() == 1 && sampler_recorded_.load(std::memory_order_acquire)) {
    // A batch queued beside a controlled one waits for that batch's
    // sampler before its fused kernel: else its fused kernel, queued first,
    // takes every SM as the other's fused kernel ends, and the other's
    // sampler kernels wait the whole kernel out behind it (64 single-row
    // callers with controls on an H100: 44.9k against 41.1k requests/s).
    // Under tensor parallelism rank 0's stage 1 meets the other ranks' in
    // the exchange, so it is not held back alone. A sampler already done
    // is not waited for, and the batch may replay its recorded stage 1.
    for (const Slot& other : slots_) {
      if (&other == &slot) continue;
      const cudaError_t done = cudaEventQuery(other.sampler_done);
      if (done == cudaErrorNotReady) {
        slot.samplers_ahead.push_back(other.sampler_done);
      } else {
        FS_RETURN_IF_ERROR(Check(done, "cudaEventQuery"));
      }
    }
  }
  if (controlled) {
    return SampleControlled(slot, batch, by_controls, units_serve,
                            stage1_samples, num_samples, max_top_n, results);
  }
  FS_RETURN_IF_ERROR(
      LaunchBatchStage1(slot, batch.rows, num_samples, Stage1Output::kTokens));
  FS_RETURN_IF_ERROR(WaitForBatch(slot));
  for (int i = 0; i < batch.rows; ++i) {
    if (!valid[i]) continue;
    FS_RETURN_IF_ERROR(TakeStage1Tokens(slot, i, batch.specs[i].params->n,
                                        num_samples, &(*results)[i]));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::WaitForBatch(Slot& slot) {
  FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[0].device), "cudaSetDevice"));
  FS_RETURN_IF_ERROR(Check(cudaStreamSynchronize(slot.ranks[0].stream),
                           "cudaStreamSynchronize"));
  if (slot.exchange == nullptr) return absl::OkStatus();
  // Every rank's barrier has reported once its stream is idle.
  for (size_t r = 1; r < ranks_.size(); ++r) {
    FS_RETURN_IF_ERROR(Check(cudaSetDevice(ranks_[r].device), "cudaSetDevice"));
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
  return absl::OkStatus();
}

absl::Status CudaEngine::TakeStage1Tokens(const Slot& slot, int row, int n,
                                          int stride, RowResult* result) {
  for (int j = 0; j < n; ++j) {
    const int32_t token = slot.host_tokens[row * stride + j];
    if (token < 0 || token >= info_.vocab_size) {
      // Only NaN logits (overflowing hidden states) leave no candidate.
      return absl::InvalidArgumentError(absl::StrCat(
          "row ", row,
          ": no finite score (the hidden state overflows the logits)"));
    }
    result->token_ids.push_back(token);
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::SampleControlled(Slot& slot, const BatchView& batch,
                                          const std::vector<char>& by_controls,
                                          bool units_serve, int stage1_samples,
                                          int num_samples, int max_top_n,
                                          std::vector<RowResult>* results) {
  bool from_units = units_path_ && units_serve;
  if (from_units && unit_pause_batches_.load(std::memory_order_relaxed) > 0) {
    unit_pause_batches_.fetch_sub(1, std::memory_order_relaxed);
    from_units = false;
  }
  // Per-token entries, and bitmask rows whose tails are summed: the units
  // rank by token classes.
  bool classified = false;
  bool bitmask_in_classes = false;
  if (from_units) {
    bool entries = false;
    bool masked_tails = false;
    for (int i = 0; i < batch.rows; ++i) {
      if (!by_controls[i]) continue;
      const SamplingParams& p = *batch.specs[i].params;
      entries = entries || HasTokenEntries(p);
      masked_tails = masked_tails || NeedsBitmaskInClasses(p, info_.vocab_size);
    }
    // Decided from the specs: rows each with their own bitmask take their
    // logits before any bitmask is copied.
    if (masked_tails && CountPackedBitmasks(batch.specs, by_controls, 0,
                                            batch.rows, ride_along_params_) *
                                kRowsPerPackedBitmask >
                            static_cast<size_t>(batch.rows)) {
      from_units = false;
    } else if (entries || masked_tails) {
      FS_RETURN_IF_ERROR(PrepareTokenClasses(slot, batch, by_controls,
                                             masked_tails, &classified));
      from_units = classified;
      bitmask_in_classes = classified && masked_tails;
    }
  }
  if (from_units && options_.unit_batches_for_tests != nullptr) {
    options_.unit_batches_for_tests->fetch_add(1);
  }
  const Stage1Output stage1 = !from_units  ? Stage1Output::kLogits
                              : classified ? Stage1Output::kClassifiedUnits
                                           : Stage1Output::kUnits;
  ControlledOutputLayout layout;
  // The sampler's launches follow call by call: its packed controls differ
  // from batch to batch.
  FS_RETURN_IF_ERROR(
      LaunchBatchStage1(slot, batch.rows, stage1_samples, stage1));
  FS_RETURN_IF_ERROR(RunControlled(slot, batch, by_controls, num_samples,
                                   max_top_n, stage1, bitmask_in_classes,
                                   &layout));
  bool keeps_stage1 = false;
  for (int i = 0; i < batch.rows; ++i) {
    keeps_stage1 =
        keeps_stage1 || (!by_controls[i] && (*results)[i].error.empty());
  }
  if (keeps_stage1) {
    // Queued after the sampler's outputs, and only for batches with such
    // rows: nothing stands between stage 1 and the sampler.
    FS_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(slot.host_tokens, slot.device_tokens,
                              sizeof(int32_t) * batch.rows * stage1_samples,
                              cudaMemcpyDeviceToHost, slot.ranks[0].stream),
              "cudaMemcpyAsync(tokens)"));
  }
  FS_RETURN_IF_ERROR(WaitForBatch(slot));
  std::vector<char> uncertified(batch.rows, 0);
  if (from_units) {
    const auto* certified = reinterpret_cast<const int32_t*>(
        static_cast<const char*>(slot.host_outputs) + layout.certified);
    bool any_uncertified = false;
    for (int i = 0; i < batch.rows; ++i) {
      uncertified[i] = by_controls[i] && certified[i] == 0;
      any_uncertified = any_uncertified || uncertified[i];
    }
    if (any_uncertified) {
      unit_pause_batches_.store(kUnitCandidatesPauseBatches,
                                std::memory_order_relaxed);
      // Every controlled row again from materialized logits: the same
      // tokens for the rows certified above (both paths are exact). Stage 1
      // draws the other rows' tokens again, the same ones, already copied.
      FS_RETURN_IF_ERROR(EnqueueStage1(slot, batch.rows, stage1_samples,
                                       Stage1Output::kLogits));
      FS_RETURN_IF_ERROR(RunControlled(slot, batch, by_controls, num_samples,
                                       max_top_n, Stage1Output::kLogits,
                                       /*bitmask_in_classes=*/false, &layout));
      FS_RETURN_IF_ERROR(WaitForBatch(slot));
    }
  }
  FS_RETURN_IF_ERROR(CollectControlled(slot, batch, by_controls, layout,
                                       num_samples, max_top_n, results));
  for (int i = 0; i < batch.rows; ++i) {
    RowResult& result = (*results)[i];
    if (by_controls[i]) {
      if (uncertified[i] && result.exact_fallback == nullptr &&
          result.error.empty()) {
        result.exact_fallback = kMaterializedLogitsFallback;
      }
    } else if (result.error.empty()) {
      FS_RETURN_IF_ERROR(TakeStage1Tokens(slot, i, batch.specs[i].params->n,
                                          stage1_samples, &result));
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
    if (slot.controls_stream != nullptr &&
        cudaSetDevice(ranks_[0].device) == cudaSuccess) {
      cudaStreamSynchronize(slot.controls_stream);
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
      if (slot_rank.shard_logits != nullptr) cudaFree(slot_rank.shard_logits);
      if (slot_rank.logits_copied != nullptr) {
        cudaEventDestroy(slot_rank.logits_copied);
      }
    }
    if (!ranks_.empty() && cudaSetDevice(ranks_[0].device) == cudaSuccess) {
      for (const Stage1Graphs* graphs :
           {&slot.plain_graphs, &slot.units_graphs, &slot.classified_graphs,
            &slot.classified_shared_graphs}) {
        for (cudaGraphExec_t exec : graphs->execs) {
          if (exec != nullptr) cudaGraphExecDestroy(exec);
        }
      }
      if (slot.device_tokens != nullptr) cudaFree(slot.device_tokens);
      if (slot.logits != nullptr) cudaFree(slot.logits);
      if (slot.unit_records != nullptr) cudaFree(slot.unit_records);
      if (slot.unit_row_maxima != nullptr) cudaFree(slot.unit_row_maxima);
      if (slot.unit_token_classes != nullptr) {
        cudaFree(slot.unit_token_classes);
      }
      if (slot.device_class_inputs != nullptr) {
        cudaFree(slot.device_class_inputs);
      }
      if (slot.controlled_workspace != nullptr) {
        cudaFree(slot.controlled_workspace);
      }
      if (slot.device_plan != nullptr) cudaFree(slot.device_plan);
      if (slot.device_outputs != nullptr) cudaFree(slot.device_outputs);
      if (slot.sampler_done != nullptr) cudaEventDestroy(slot.sampler_done);
      if (slot.controls_copied != nullptr) {
        cudaEventDestroy(slot.controls_copied);
      }
      if (slot.controls_stream != nullptr) {
        cudaStreamDestroy(slot.controls_stream);
      }
    }
    if (slot.host_input != nullptr) cudaFreeHost(slot.host_input);
    if (slot.host_tokens != nullptr) cudaFreeHost(slot.host_tokens);
    if (slot.host_plan != nullptr) cudaFreeHost(slot.host_plan);
    if (slot.host_class_inputs != nullptr) {
      cudaFreeHost(slot.host_class_inputs);
    }
    if (slot.host_outputs != nullptr) cudaFreeHost(slot.host_outputs);
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
