// The methods the fused sampler is measured against, in the same library so
// that one benchmark run times all of them on the same data:
//   (c) cuBLAS GEMM alone (what PyTorch's `H @ W.T` runs): the lower bound
//       of every sampler that materializes logits;
//   (a) cuBLAS GEMM + softmax + multinomial kernels;
//   (b) cuBLAS GEMM + a Gumbel-max kernel over the logits (FlashInfer's
//       sampling-from-logits approach) with the fused kernel's exact noise;
// plus a streaming-read kernel for the HBM ceiling of the same run. The
// Gumbel kernel over fp32 logits is also the GPU tests' reference.
#ifndef FLASHSAMPLER_KERNELS_BASELINES_BASELINES_H_
#define FLASHSAMPLER_KERNELS_BASELINES_BASELINES_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {

// logits[b, v] = hidden[b, :] . weights[v, :] through cublasGemmEx: inputs of
// `dtype` (bf16 or fp16; fp32 gives cudaErrorInvalidValue), fp32 compute,
// logits of `logits_dtype` (kFp32 or the input dtype), row-major
// [batch, vocab]. cuBLAS failures map to cudaErrorInvalidValue (bad
// arguments), cudaErrorNotSupported, cudaErrorMemoryAllocation or
// cudaErrorUnknown.
cudaError_t CublasLogits(cublasHandle_t handle, const void* weights,
                         const void* hidden, DType dtype, int64_t vocab,
                         int hidden_size, int batch, void* logits,
                         DType logits_dtype, cudaStream_t stream);

// probs[b, :] = softmax(logits[b, :] * inv_temperature[b]) in fp32; one block
// per row (max pass, sum pass, write pass).
cudaError_t LaunchSoftmax(const void* logits, DType logits_dtype, int64_t vocab,
                          int batch, const float* inv_temperature, float* probs,
                          cudaStream_t stream);

// One token per row by inverse-CDF sampling of probs[b, :] with a uniform
// from the row's Philox stream; one block per row, block-wide prefix sums
// chunk by chunk until the running mass passes the uniform.
cudaError_t LaunchMultinomial(const float* probs, int64_t vocab, int batch,
                              const uint64_t* seeds, const uint64_t* steps,
                              int32_t* token_ids, cudaStream_t stream);

// Gumbel-max over materialized logits with the fused kernel's noise and
// tie-break: per vocabulary chunk of GumbelLogitsChunkRows() tokens, one
// candidate per (sample, row), laid out [chunk][sample][batch] for
// LaunchReduceCandidates. inv_temperature 0 = greedy. Global token id =
// vocab_offset + column.
int GumbelLogitsChunkRows();
int64_t GumbelLogitsNumChunks(int64_t vocab);
cudaError_t LaunchGumbelOverLogits(const void* logits, DType logits_dtype,
                                   int64_t vocab, int64_t vocab_offset,
                                   int batch, int num_samples,
                                   const float* inv_temperature,
                                   const uint64_t* seeds, const uint64_t* steps,
                                   Candidate* candidates, cudaStream_t stream);

// Fills `count` elements with uniform values in [-scale, scale) from a
// Philox stream keyed by `seed` (benchmark and test inputs).
cudaError_t LaunchFillUniform(void* data, int64_t count, DType dtype,
                              uint64_t seed, float scale, cudaStream_t stream);

// Reads `bytes` (a multiple of 64, 16-byte aligned) once with 16-byte
// loads; `sink` (one word) is written only to keep the loads alive.
cudaError_t LaunchStreamRead(const void* data, size_t bytes,
                             unsigned long long* sink, cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_BASELINES_BASELINES_H_
