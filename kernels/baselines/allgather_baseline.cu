// The all-gather baseline (allgather_baseline.h): per-rank cuBLAS GEMM into
// 16-bit logits, ncclAllGather, and a Gumbel-max sampling kernel over the
// gathered logits with the same noise and tie-break as the fused path.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "kernels/baselines/allgather_baseline.h"
#include "kernels/noise/philox.h"

namespace flashsampler {
namespace {

// 256 threads per (row, sample): at V = 128256 each thread handles ~125
// groups of 4 tokens, enough work to hide the logits' HBM latency.
constexpr int kSampleThreads = 256;
constexpr int kMaxRanks = 8;
// cuBLAS's recommended workspace on Hopper; allocated once per rank so that
// no GEMM allocates (cuBLAS would otherwise use its own pool per stream).
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Marks "no stream bound yet": differs from every real stream handle,
// the legacy default stream 0 included.
const cudaStream_t kNoStream = reinterpret_cast<cudaStream_t>(~uintptr_t{0});

__device__ __forceinline__ float LoadLogit(const void* base, int64_t index,
                                           DType dtype) {
  if (dtype == DType::kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  }
  return __half2float(static_cast<const __half*>(base)[index]);
}

__device__ __forceinline__ void Keep(float score, int32_t id, float* best,
                                     int32_t* best_id) {
  if (CandidateBetter(score, id, *best, *best_id)) {
    *best = score;
    *best_id = id;
  }
}

// One block per (row b = blockIdx.x, sample j = blockIdx.y). Walks each
// shard's columns in noise blocks of 16 global token ids (BlockNoise); a
// block that straddles a shard boundary is drawn once per side, and each
// side keeps its own tokens.
__global__ void __launch_bounds__(kSampleThreads)
    GatheredSampleKernel(const void* gathered, DType dtype, int num_ranks,
                         const int64_t* shard_table, int64_t row_stride,
                         int batch, int num_samples,
                         const float* inv_temperature, const uint64_t* seeds,
                         const uint64_t* steps, int32_t* token_ids) {
  const int b = blockIdx.x;
  const int j = blockIdx.y;
  const float inv_t = inv_temperature[b];
  const uint64_t seed = seeds[b];
  const uint64_t step = steps[b];
  const bool greedy = inv_t == 0.0f;
  float best = -INFINITY;
  int32_t best_id = kNoToken;
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t offset = shard_table[r];
    const int64_t rows = shard_table[num_ranks + r];
    const int64_t base = (static_cast<int64_t>(r) * batch + b) * row_stride;
    const int64_t first_block = offset >> kNoiseBlockShift;
    const int64_t last_block = (offset + rows - 1) >> kNoiseBlockShift;
    for (int64_t g = first_block + threadIdx.x; g <= last_block;
         g += blockDim.x) {
      float noise[kNoiseBlockTokens] = {};
      if (!greedy) {
        BlockNoise(seed, step, static_cast<uint32_t>(j),
                   static_cast<uint32_t>(g), noise);
      }
      // Unrolled: noise[] stays in registers.
#pragma unroll
      for (int slot = 0; slot < static_cast<int>(kNoiseBlockTokens); ++slot) {
        const int64_t id = g * kNoiseBlockTokens + slot;
        if (id < offset || id >= offset + rows) continue;
        const float logit = LoadLogit(gathered, base + (id - offset), dtype);
        const float score =
            greedy ? logit : GumbelScore(logit, inv_t, noise[slot]);
        Keep(score, static_cast<int32_t>(id), &best, &best_id);
      }
    }
  }
  // Warp then block argmax under CandidateBetter's total order, so the
  // winner does not depend on which thread saw it.
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    const float other = __shfl_down_sync(0xffffffffu, best, delta);
    const int32_t other_id = __shfl_down_sync(0xffffffffu, best_id, delta);
    Keep(other, other_id, &best, &best_id);
  }
  __shared__ float warp_best[kSampleThreads / 32];
  __shared__ int32_t warp_id[kSampleThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_id[warp] = best_id;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kSampleThreads / 32; ++w) {
      Keep(warp_best[w], warp_id[w], &best, &best_id);
    }
    token_ids[static_cast<int64_t>(b) * num_samples + j] = best_id;
  }
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&saved_);
    changed_ = saved_ != device;
    if (changed_) cudaSetDevice(device);
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

TpStatus Cublas(cublasStatus_t status, const std::string& what) {
  TpStatus s;
  if (status == CUBLAS_STATUS_SUCCESS) return s;
  s.cuda = cudaErrorUnknown;
  s.message = what + ": cuBLAS status " + std::to_string(status) + " (" +
              cublasGetStatusString(status) + ")";
  return s;
}

size_t ElementBytes(DType dtype) {
  return dtype == DType::kBf16 ? sizeof(__nv_bfloat16) : sizeof(__half);
}

}  // namespace

cudaError_t LaunchGatheredLogitsSample(
    const void* gathered, DType dtype, int num_ranks,
    const int64_t* shard_table, int64_t row_stride, int batch, int num_samples,
    const float* inv_temperature, const uint64_t* seeds, const uint64_t* steps,
    int32_t* token_ids, cudaStream_t stream) {
  if (gathered == nullptr || shard_table == nullptr || num_ranks < 1 ||
      num_ranks > kMaxRanks || batch < 1 || num_samples < 1 ||
      num_samples > 65535 || inv_temperature == nullptr || seeds == nullptr ||
      steps == nullptr || token_ids == nullptr || row_stride < 1 ||
      (dtype != DType::kBf16 && dtype != DType::kFp16)) {
    return cudaErrorInvalidValue;
  }
  GatheredSampleKernel<<<dim3(batch, num_samples), kSampleThreads, 0, stream>>>(
      gathered, dtype, num_ranks, shard_table, row_stride, batch, num_samples,
      inv_temperature, seeds, steps, token_ids);
  return cudaGetLastError();
}

TpStatus AllGatherBaseline::Create(TpComms* comms, const TpLayout& layout,
                                   const AllGatherBaselineOptions& options,
                                   std::unique_ptr<AllGatherBaseline>* out) {
  out->reset();
  std::string error;
  if (comms == nullptr) return TpStatus::Invalid("baseline needs TpComms");
  if (!ValidateTpLayout(layout, &error)) {
    return TpStatus::Invalid("bad TP layout: " + error);
  }
  if (layout.num_ranks() != comms->size() || layout.num_ranks() > kMaxRanks) {
    return TpStatus::Invalid("layout ranks " +
                             std::to_string(layout.num_ranks()) +
                             " must equal communicator ranks " +
                             std::to_string(comms->size()) + " (<= 8)");
  }
  if (options.hidden_size < 1 || options.max_batch < 1 ||
      options.max_samples < 1) {
    return TpStatus::Invalid("baseline: hidden_size, max_batch, max_samples");
  }
  if (options.dtype != DType::kBf16 && options.dtype != DType::kFp16) {
    return TpStatus::Invalid("baseline: dtype must be bf16 or fp16");
  }
  std::unique_ptr<AllGatherBaseline> bl(new AllGatherBaseline());
  bl->comms_ = comms;
  bl->layout_ = layout;
  bl->options_ = options;
  for (const TpShard& s : layout.shards) {
    if (s.vocab_rows > bl->max_rows_) bl->max_rows_ = s.vocab_rows;
  }
  const int n = layout.num_ranks();
  bl->cublas_.assign(n, nullptr);
  bl->cublas_workspace_.assign(n, nullptr);
  bl->cublas_stream_.assign(n, kNoStream);
  bl->local_.assign(n, nullptr);
  bl->gathered_.assign(n, nullptr);
  bl->shard_table_.assign(n, nullptr);
  const size_t elem = ElementBytes(options.dtype);
  const size_t local_bytes =
      static_cast<size_t>(options.max_batch) * bl->max_rows_ * elem;
  std::vector<int64_t> table(2 * n);
  for (int r = 0; r < n; ++r) {
    table[r] = layout.shards[r].vocab_offset;
    table[n + r] = layout.shards[r].vocab_rows;
  }
  for (int r = 0; r < n; ++r) {
    DeviceGuard guard(comms->device(r));
    const std::string who = "baseline rank " + std::to_string(r) + ": ";
    TpStatus s = Cublas(cublasCreate(&bl->cublas_[r]), who + "cublasCreate");
    if (!s.ok()) return s;
    s = TpStatus::Cuda(
        cudaMalloc(&bl->cublas_workspace_[r], kCublasWorkspaceBytes),
        who + "cudaMalloc(cuBLAS workspace)");
    if (!s.ok()) return s;
    s = Cublas(cublasSetWorkspace(bl->cublas_[r], bl->cublas_workspace_[r],
                                  kCublasWorkspaceBytes),
               who + "cublasSetWorkspace");
    if (!s.ok()) return s;
    s = TpStatus::Cuda(cudaMalloc(&bl->local_[r], local_bytes),
                       who + "cudaMalloc(logits)");
    if (!s.ok()) return s;
    s = TpStatus::Cuda(cudaMalloc(&bl->gathered_[r], local_bytes * n),
                       who + "cudaMalloc(gathered logits)");
    if (!s.ok()) return s;
    s = TpStatus::Cuda(
        cudaMalloc(&bl->shard_table_[r], sizeof(int64_t) * table.size()),
        who + "cudaMalloc(shard table)");
    if (!s.ok()) return s;
    s = TpStatus::Cuda(
        cudaMemcpy(bl->shard_table_[r], table.data(),
                   sizeof(int64_t) * table.size(), cudaMemcpyHostToDevice),
        who + "cudaMemcpy(shard table)");
    if (!s.ok()) return s;
  }
  *out = std::move(bl);
  return TpStatus{};
}

AllGatherBaseline::~AllGatherBaseline() {
  for (int r = 0; r < static_cast<int>(cublas_.size()); ++r) {
    DeviceGuard guard(comms_->device(r));
    if (cublas_[r] != nullptr) cublasDestroy(cublas_[r]);
    cudaFree(cublas_workspace_[r]);
    cudaFree(local_[r]);
    cudaFree(gathered_[r]);
    cudaFree(shard_table_[r]);
  }
}

TpStatus AllGatherBaseline::Step(const std::vector<FusedSampleParams>& params,
                                 const std::vector<int32_t*>& token_ids,
                                 const std::vector<cudaStream_t>& streams) {
  const int n = layout_.num_ranks();
  if (static_cast<int>(params.size()) != n ||
      static_cast<int>(token_ids.size()) != n ||
      static_cast<int>(streams.size()) != n) {
    return TpStatus::Invalid("baseline step: one entry per rank");
  }
  const int batch = params[0].batch;
  const int num_samples = params[0].num_samples;
  if (batch < 1 || batch > options_.max_batch || num_samples < 1 ||
      num_samples > options_.max_samples) {
    return TpStatus::Invalid(
        "baseline step: batch or num_samples out of range");
  }
  const cudaDataType_t type =
      options_.dtype == DType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  const float beta = 0.0f;
  for (int r = 0; r < n; ++r) {
    const FusedSampleParams& p = params[r];
    const TpShard& shard = layout_.shards[r];
    if (p.batch != batch || p.num_samples != num_samples ||
        p.vocab_rows != shard.vocab_rows ||
        p.vocab_offset != shard.vocab_offset ||
        p.hidden_size != options_.hidden_size || p.dtype != options_.dtype) {
      return TpStatus::Invalid("baseline step: rank " + std::to_string(r) +
                               " params do not match the layout");
    }
    DeviceGuard guard(comms_->device(r));
    TpStatus s;
    if (cublas_stream_[r] != streams[r]) {
      // cublasSetStream resets the handle to cuBLAS's default workspace, so
      // ours is set again after it; both only when the stream changes.
      s = Cublas(cublasSetStream(cublas_[r], streams[r]), "cublasSetStream");
      if (!s.ok()) return s;
      s = Cublas(cublasSetWorkspace(cublas_[r], cublas_workspace_[r],
                                    kCublasWorkspaceBytes),
                 "cublasSetWorkspace");
      if (!s.ok()) return s;
      cublas_stream_[r] = streams[r];
    }
    // Row-major logits[B][max_rows] = hidden[B][D] . W[rows][D]^T is, in
    // cuBLAS's column-major terms, C[rows x B] (ld max_rows) =
    // op_T(W as D x rows, ld D) * (hidden as D x B, ld D).
    s = Cublas(
        cublasGemmEx(cublas_[r], CUBLAS_OP_T, CUBLAS_OP_N,
                     static_cast<int>(shard.vocab_rows), batch,
                     options_.hidden_size, &alpha, p.weights, type,
                     options_.hidden_size, p.hidden, type, options_.hidden_size,
                     &beta, local_[r], type, static_cast<int>(max_rows_),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx rank " + std::to_string(r));
    if (!s.ok()) return s;
  }
  const ncclDataType_t nccl_type =
      options_.dtype == DType::kBf16 ? ncclBfloat16 : ncclFloat16;
  const size_t count = static_cast<size_t>(batch) * max_rows_;
  // One thread drives every rank: the group makes the per-rank calls one
  // collective instead of n calls that each wait for the others.
  ncclResult_t res = ncclGroupStart();
  if (res != ncclSuccess) return TpStatus::Nccl(res, "ncclGroupStart");
  for (int r = 0; r < n; ++r) {
    res = ncclAllGather(local_[r], gathered_[r], count, nccl_type,
                        comms_->comm(r), streams[r]);
    if (res != ncclSuccess) {
      ncclGroupEnd();
      return TpStatus::Nccl(res, "ncclAllGather rank " + std::to_string(r));
    }
  }
  res = ncclGroupEnd();
  if (res != ncclSuccess) return TpStatus::Nccl(res, "ncclGroupEnd");
  for (int r = 0; r < n; ++r) {
    const FusedSampleParams& p = params[r];
    DeviceGuard guard(comms_->device(r));
    const cudaError_t err = LaunchGatheredLogitsSample(
        gathered_[r], options_.dtype, n, shard_table_[r], max_rows_, batch,
        num_samples, p.inv_temperature, p.seeds, p.steps, token_ids[r],
        streams[r]);
    if (err != cudaSuccess) {
      return TpStatus::Cuda(err, "gathered sampling rank " + std::to_string(r));
    }
  }
  return TpStatus{};
}

}  // namespace flashsampler
