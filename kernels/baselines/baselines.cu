// Baseline kernels and the cuBLAS GEMM they start from (see baselines.h).
// They are deliberately ordinary implementations of the unfused pipeline:
// materialize [B, V] logits, then sample from them.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/baselines/baselines.h"

namespace flashsampler {
namespace {

cudaError_t FromCublas(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return cudaSuccess;
    case CUBLAS_STATUS_INVALID_VALUE:
      return cudaErrorInvalidValue;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return cudaErrorNotSupported;
    case CUBLAS_STATUS_ALLOC_FAILED:
      return cudaErrorMemoryAllocation;
    default:
      return cudaErrorUnknown;
  }
}

__device__ __forceinline__ float LoadLogit(const void* logits, DType dtype,
                                           int64_t index) {
  switch (dtype) {
    case DType::kBf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(logits)[index]);
    case DType::kFp16:
      return __half2float(static_cast<const __half*>(logits)[index]);
    default:
      return static_cast<const float*>(logits)[index];
  }
}

struct MaxOp {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const {
    return a < b ? b : a;
  }
};

constexpr int kRowThreads = 1024;

__global__ void __launch_bounds__(kRowThreads)
    SoftmaxKernel(const void* logits, DType dtype, int64_t vocab,
                  const float* inv_temperature, float* probs) {
  using Reduce = cub::BlockReduce<float, kRowThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ float shared_value;
  const int64_t row_offset = static_cast<int64_t>(blockIdx.x) * vocab;
  const float scale =
      inv_temperature[blockIdx.x] == 0.0f ? 1.0f : inv_temperature[blockIdx.x];
  float local_max = -__int_as_float(0x7f800000);
  for (int64_t i = threadIdx.x; i < vocab; i += kRowThreads) {
    local_max = fmaxf(local_max, LoadLogit(logits, dtype, row_offset + i));
  }
  const float row_max = Reduce(storage).Reduce(local_max, MaxOp());
  if (threadIdx.x == 0) shared_value = row_max * scale;
  __syncthreads();
  const float scaled_max = shared_value;
  float local_sum = 0.0f;
  for (int64_t i = threadIdx.x; i < vocab; i += kRowThreads) {
    local_sum +=
        __expf(LoadLogit(logits, dtype, row_offset + i) * scale - scaled_max);
  }
  __syncthreads();
  const float row_sum = Reduce(storage).Sum(local_sum);
  if (threadIdx.x == 0) shared_value = 1.0f / row_sum;
  __syncthreads();
  const float inv_sum = shared_value;
  for (int64_t i = threadIdx.x; i < vocab; i += kRowThreads) {
    probs[row_offset + i] =
        __expf(LoadLogit(logits, dtype, row_offset + i) * scale - scaled_max) *
        inv_sum;
  }
}

__global__ void __launch_bounds__(kRowThreads)
    MultinomialKernel(const float* probs, int64_t vocab, const uint64_t* seeds,
                      const uint64_t* steps, int32_t* token_ids) {
  using Scan = cub::BlockScan<float, kRowThreads>;
  __shared__ typename Scan::TempStorage storage;
  __shared__ int found;
  __shared__ float carried;
  const float* row = probs + static_cast<int64_t>(blockIdx.x) * vocab;
  // Counter word 1 = 0xffffffff keeps this stream apart from Gumbel noise.
  const Philox4x32 bits = Philox4x32_10(
      Philox4x32{{0u, 0xffffffffu, static_cast<uint32_t>(steps[blockIdx.x]),
                  static_cast<uint32_t>(steps[blockIdx.x] >> 32)}},
      static_cast<uint32_t>(seeds[blockIdx.x]),
      static_cast<uint32_t>(seeds[blockIdx.x] >> 32));
  const float u = UniformFromBits(bits.v[0]);
  if (threadIdx.x == 0) {
    found = kNoToken;
    carried = 0.0f;
  }
  __syncthreads();
  int last_positive = -1;
  constexpr int kPerThread = 4;
  for (int64_t base = 0; base < vocab; base += kRowThreads * kPerThread) {
    float values[kPerThread];
    float local = 0.0f;
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = base + threadIdx.x * kPerThread + j;
      values[j] = i < vocab ? row[i] : 0.0f;
      local += values[j];
      if (values[j] > 0.0f) last_positive = static_cast<int>(i);
    }
    float before = 0.0f;
    float chunk_total = 0.0f;
    Scan(storage).ExclusiveSum(local, before, chunk_total);
    float running = carried + before;
    for (int j = 0; j < kPerThread; ++j) {
      const float next = running + values[j];
      if (running <= u && u < next && values[j] > 0.0f) {
        atomicMin(&found,
                  static_cast<int>(base + threadIdx.x * kPerThread + j));
      }
      running = next;
    }
    __syncthreads();
    if (threadIdx.x == 0) carried += chunk_total;
    __syncthreads();
    if (found != kNoToken) break;
  }
  // Rounding can leave the total just under u: take the last token with
  // mass (the largest positive index any thread saw).
  using ReduceInt = cub::BlockReduce<int, kRowThreads>;
  __shared__ typename ReduceInt::TempStorage int_storage;
  const int fallback = ReduceInt(int_storage).Reduce(last_positive, MaxOp());
  if (threadIdx.x == 0) {
    token_ids[blockIdx.x] = found != kNoToken ? found : fallback;
  }
}

constexpr int kGumbelThreads = 256;
constexpr int kGumbelChunk = 8192;  // tokens per block: 32 per thread

__global__ void __launch_bounds__(kGumbelThreads)
    GumbelOverLogitsKernel(const void* logits, DType dtype, int64_t vocab,
                           int64_t vocab_offset, int batch, int num_samples,
                           const float* inv_temperature, const uint64_t* seeds,
                           const uint64_t* steps, Candidate* candidates) {
  __shared__ Candidate warp_best[kGumbelThreads / 32];
  const int row = blockIdx.y;
  const int64_t chunk = blockIdx.x;
  const int64_t row_offset = static_cast<int64_t>(row) * vocab;
  const float inv_t = inv_temperature[row];
  const uint64_t seed = seeds[row];
  const uint64_t step = steps[row];
  for (int sample = 0; sample < num_samples; ++sample) {
    float best_score = -__int_as_float(0x7f800000);
    int32_t best_id = kNoToken;
    // One noise block (16 consecutive token ids, philox.h) per step. A
    // chunk that starts off a block boundary (a shard offset that is not a
    // multiple of 16) takes each token's noise whole (GumbelNoise).
    for (int block = threadIdx.x;
         block < kGumbelChunk / static_cast<int>(kNoiseBlockTokens);
         block += kGumbelThreads) {
      const int64_t first = chunk * kGumbelChunk + block * kNoiseBlockTokens;
      if (first >= vocab) break;
      const int64_t token0 = vocab_offset + first;
      const bool aligned = (token0 & (kNoiseBlockTokens - 1)) == 0;
      float noise[kNoiseBlockTokens] = {};
      if (inv_t != 0.0f && aligned) {
        BlockNoise(seed, step, static_cast<uint32_t>(sample),
                   static_cast<uint32_t>(token0 >> kNoiseBlockShift), noise);
      }
      // Unrolled: noise[] stays in registers.
#pragma unroll
      for (int slot = 0; slot < static_cast<int>(kNoiseBlockTokens); ++slot) {
        if (first + slot >= vocab) break;
        const float logit = LoadLogit(logits, dtype, row_offset + first + slot);
        const int32_t id = static_cast<int32_t>(token0 + slot);
        float score = logit;
        if (inv_t != 0.0f) {
          score = GumbelScore(
              logit, inv_t,
              aligned ? noise[slot]
                      : GumbelNoise(seed, step, static_cast<uint32_t>(sample),
                                    static_cast<uint32_t>(id)));
        }
        if (CandidateBetter(score, id, best_score, best_id)) {
          best_score = score;
          best_id = id;
        }
      }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_score =
          __shfl_xor_sync(0xffffffffu, best_score, offset);
      const int32_t other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
      if (CandidateBetter(other_score, other_id, best_score, best_id)) {
        best_score = other_score;
        best_id = other_id;
      }
    }
    if ((threadIdx.x & 31) == 0) {
      warp_best[threadIdx.x >> 5] = Candidate{best_score, best_id};
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      Candidate best = warp_best[0];
      for (int w = 1; w < kGumbelThreads / 32; ++w) {
        if (CandidateBetter(warp_best[w].score, warp_best[w].token_id,
                            best.score, best.token_id)) {
          best = warp_best[w];
        }
      }
      candidates[(chunk * num_samples + sample) * batch + row] = best;
    }
    __syncthreads();
  }
}

// Each block reads contiguous 64 KB chunks (512 threads x 8 x 16 B, every
// load coalesced across its warp), blocks striding over chunks: DRAM pages
// are read whole and eight loads per thread are in flight.
constexpr int kStreamThreads = 512;
constexpr int kStreamUnroll = 8;

__global__ void __launch_bounds__(kStreamThreads)
    StreamReadKernel(const uint4* data, size_t count,
                     unsigned long long* sink) {
  constexpr size_t kChunk = static_cast<size_t>(kStreamThreads) * kStreamUnroll;
  uint32_t acc = 0;
  for (size_t base = static_cast<size_t>(blockIdx.x) * kChunk; base < count;
       base += static_cast<size_t>(gridDim.x) * kChunk) {
    uint4 v[kStreamUnroll];
#pragma unroll
    for (int j = 0; j < kStreamUnroll; ++j) {
      const size_t i = base + threadIdx.x + j * kStreamThreads;
      v[j] = i < count ? __ldcs(&data[i]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kStreamUnroll; ++j) {
      acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // practically never; keeps the loads
}

__global__ void FillUniformKernel(void* data, int64_t count, DType dtype,
                                  uint64_t seed, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    const Philox4x32 bits = Philox4x32_10(
        Philox4x32{{static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32),
                    0x5eedu, 0u}},
        static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    const float value = (2.0f * UniformFromBits(bits.v[0]) - 1.0f) * scale;
    switch (dtype) {
      case DType::kBf16:
        static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(value);
        break;
      case DType::kFp16:
        static_cast<__half*>(data)[i] = __float2half(value);
        break;
      default:
        static_cast<float*>(data)[i] = value;
    }
  }
}

}  // namespace

cudaError_t LaunchFillUniform(void* data, int64_t count, DType dtype,
                              uint64_t seed, float scale, cudaStream_t stream) {
  if (data == nullptr || count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  FillUniformKernel<<<1024, 256, 0, stream>>>(data, count, dtype, seed, scale);
  return cudaGetLastError();
}

cudaError_t CublasLogits(cublasHandle_t handle, const void* weights,
                         const void* hidden, DType dtype, int64_t vocab,
                         int hidden_size, int batch, void* logits,
                         DType logits_dtype, cudaStream_t stream) {
  if (vocab < 1 || vocab > INT32_MAX || hidden_size < 1 || batch < 1) {
    return cudaErrorInvalidValue;
  }
  cudaDataType_t in_type;
  switch (dtype) {
    case DType::kBf16:
      in_type = CUDA_R_16BF;
      break;
    case DType::kFp16:
      in_type = CUDA_R_16F;
      break;
    default:
      return cudaErrorInvalidValue;  // the fused kernel's operands only
  }
  cublasStatus_t status = cublasSetStream(handle, stream);
  if (status != CUBLAS_STATUS_SUCCESS) return FromCublas(status);
  cudaDataType_t out_type = CUDA_R_32F;
  if (logits_dtype == DType::kBf16) out_type = CUDA_R_16BF;
  if (logits_dtype == DType::kFp16) out_type = CUDA_R_16F;
  const float alpha = 1.0f;
  const float beta = 0.0f;
  // Column-major view: logits^T [V, B] = W [V, D] (stored as D x V, so
  // transposed) x hidden^T [D, B].
  status = cublasGemmEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(vocab), batch,
      hidden_size, &alpha, weights, in_type, hidden_size, hidden, in_type,
      hidden_size, &beta, logits, out_type, static_cast<int>(vocab),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return FromCublas(status);
}

cudaError_t LaunchSoftmax(const void* logits, DType logits_dtype, int64_t vocab,
                          int batch, const float* inv_temperature, float* probs,
                          cudaStream_t stream) {
  if (logits == nullptr || probs == nullptr || inv_temperature == nullptr ||
      vocab < 1 || batch < 1) {
    return cudaErrorInvalidValue;
  }
  SoftmaxKernel<<<batch, kRowThreads, 0, stream>>>(logits, logits_dtype, vocab,
                                                   inv_temperature, probs);
  return cudaGetLastError();
}

cudaError_t LaunchMultinomial(const float* probs, int64_t vocab, int batch,
                              const uint64_t* seeds, const uint64_t* steps,
                              int32_t* token_ids, cudaStream_t stream) {
  if (probs == nullptr || seeds == nullptr || steps == nullptr ||
      token_ids == nullptr || vocab < 1 || vocab > INT32_MAX || batch < 1) {
    return cudaErrorInvalidValue;
  }
  MultinomialKernel<<<batch, kRowThreads, 0, stream>>>(probs, vocab, seeds,
                                                       steps, token_ids);
  return cudaGetLastError();
}

int GumbelLogitsChunkRows() { return kGumbelChunk; }

int64_t GumbelLogitsNumChunks(int64_t vocab) {
  return (vocab + kGumbelChunk - 1) / kGumbelChunk;
}

cudaError_t LaunchGumbelOverLogits(const void* logits, DType logits_dtype,
                                   int64_t vocab, int64_t vocab_offset,
                                   int batch, int num_samples,
                                   const float* inv_temperature,
                                   const uint64_t* seeds, const uint64_t* steps,
                                   Candidate* candidates, cudaStream_t stream) {
  if (logits == nullptr || candidates == nullptr ||
      inv_temperature == nullptr || seeds == nullptr || steps == nullptr ||
      vocab < 1 || vocab_offset < 0 || vocab_offset + vocab > INT32_MAX ||
      batch < 1 || batch > 65535 || num_samples < 1) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(GumbelLogitsNumChunks(vocab)), batch);
  GumbelOverLogitsKernel<<<grid, kGumbelThreads, 0, stream>>>(
      logits, logits_dtype, vocab, vocab_offset, batch, num_samples,
      inv_temperature, seeds, steps, candidates);
  return cudaGetLastError();
}

cudaError_t LaunchStreamRead(const void* data, size_t bytes,
                             unsigned long long* sink, cudaStream_t stream) {
  if (data == nullptr || sink == nullptr || bytes % 64 != 0 ||
      (reinterpret_cast<uintptr_t>(data) & 15u) != 0) {
    return cudaErrorInvalidValue;
  }
  int device = 0;
  int sms = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (error != cudaSuccess) return error;
  StreamReadKernel<<<sms * 4, kStreamThreads, 0, stream>>>(
      static_cast<const uint4*>(data), bytes / 16, sink);
  return cudaGetLastError();
}

}  // namespace flashsampler
