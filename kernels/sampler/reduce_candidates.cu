// Stage 2: the argmax over stage-1 candidates [tiles][samples][batch] (tiles
// of one shard, or of every tensor-parallel rank laid back to back), best
// score first and lowest global id on ties (CandidateBetter), so the result
// does not depend on how the vocabulary was tiled or sharded.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {
namespace {

constexpr int kReduceThreads = 1024;

// A block reduces kPairs (sample, row) pairs; its 1024 / kPairs slices of
// threads split the tiles. Consecutive threads read consecutive pairs of one
// tile (coalesced), and with at most 8 pairs per block even B = 256 spreads
// over 32 blocks, so each thread reads ~10 candidates for V = 151936.
template <int kPairs>
__global__ void __launch_bounds__(kReduceThreads)
    ReduceCandidatesKernel(const Candidate* __restrict__ candidates,
                           int64_t num_tiles, int num_samples, int batch,
                           int32_t* __restrict__ token_ids,
                           float* __restrict__ winning_scores) {
  constexpr int kSlices = kReduceThreads / kPairs;
  __shared__ Candidate partial[kReduceThreads];
  const int local_pair = threadIdx.x % kPairs;
  const int slice = threadIdx.x / kPairs;
  const int64_t pairs = static_cast<int64_t>(num_samples) * batch;
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kPairs + local_pair;
  float best_score = -__int_as_float(0x7f800000);
  int32_t best_id = kNoToken;
  if (pair < pairs) {
    const int2* words = reinterpret_cast<const int2*>(candidates);
#pragma unroll 4
    for (int64_t tile = slice; tile < num_tiles; tile += kSlices) {
      const int2 word = __ldg(&words[tile * pairs + pair]);
      const float score = __int_as_float(word.x);
      if (CandidateBetter(score, word.y, best_score, best_id)) {
        best_score = score;
        best_id = word.y;
      }
    }
  }
  partial[threadIdx.x] = Candidate{best_score, best_id};
  __syncthreads();
  for (int stride = kSlices / 2; stride > 0; stride >>= 1) {
    if (slice < stride) {
      const Candidate other = partial[threadIdx.x + stride * kPairs];
      if (CandidateBetter(other.score, other.token_id, best_score, best_id)) {
        best_score = other.score;
        best_id = other.token_id;
        partial[threadIdx.x] = other;
      }
    }
    __syncthreads();
  }
  if (slice == 0 && pair < pairs) {
    const int sample = static_cast<int>(pair / batch);
    const int row = static_cast<int>(pair % batch);
    const int64_t out = static_cast<int64_t>(row) * num_samples + sample;
    token_ids[out] = best_id;
    if (winning_scores != nullptr) winning_scores[out] = best_score;
  }
}

template <int kPairs>
cudaError_t Launch(const Candidate* candidates, int64_t num_tiles,
                   int num_samples, int batch, int32_t* token_ids,
                   float* winning_scores, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(num_samples) * batch;
  const int64_t blocks = (pairs + kPairs - 1) / kPairs;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  ReduceCandidatesKernel<kPairs>
      <<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(
          candidates, num_tiles, num_samples, batch, token_ids, winning_scores);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchReduceCandidates(const Candidate* candidates,
                                   int64_t num_candidate_tiles, int num_samples,
                                   int batch, int32_t* token_ids,
                                   float* winning_scores, cudaStream_t stream) {
  if (candidates == nullptr || token_ids == nullptr ||
      num_candidate_tiles < 1 || num_samples < 1 || batch < 1 ||
      (reinterpret_cast<uintptr_t>(candidates) & 7u) != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = static_cast<int64_t>(num_samples) * batch;
  if (pairs == 1) {
    return Launch<1>(candidates, num_candidate_tiles, num_samples, batch,
                     token_ids, winning_scores, stream);
  }
  if (pairs == 2) {
    return Launch<2>(candidates, num_candidate_tiles, num_samples, batch,
                     token_ids, winning_scores, stream);
  }
  if (pairs <= 4) {
    return Launch<4>(candidates, num_candidate_tiles, num_samples, batch,
                     token_ids, winning_scores, stream);
  }
  return Launch<8>(candidates, num_candidate_tiles, num_samples, batch,
                   token_ids, winning_scores, stream);
}

}  // namespace flashsampler
