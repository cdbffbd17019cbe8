// Host API of the fused LM-head matmul + Gumbel-max sampler (stage 1) and the
// candidate reduction (stage 2). The [B, V] logits never reach device memory
// unless a caller asks for them (logits_out) to check the IO model. Every
// launcher returns cudaError_t and takes the stream last; no allocation
// happens in a launcher (workspaces are sized once with the *Size queries).
#ifndef FLASHSAMPLER_KERNELS_FUSED_SAMPLER_H_
#define FLASHSAMPLER_KERNELS_FUSED_SAMPLER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/philox.h"

namespace flashsampler {

enum class KernelDType { kBf16, kFp16 };

// Arguments of one stage-1 launch over one vocabulary shard.
struct FusedSampleParams {
  const void* weights = nullptr;  // [vocab_rows, hidden] row-major, dtype
  const void* hidden = nullptr;   // [batch, hidden] row-major, dtype
  KernelDType dtype = KernelDType::kBf16;
  int64_t vocab_rows = 0;    // rows of `weights` (this shard)
  int64_t vocab_offset = 0;  // global token id of weights row 0
  int hidden_size = 0;       // D; a multiple of 64
  int batch = 0;             // B rows, 1 .. kMaxFusedBatch
  int num_samples = 1;       // n samples per row (sample index 0 .. n-1)
  // Per row [batch]: 1 / temperature; 0 marks a greedy row (argmax of the
  // logit, no noise).
  const float* inv_temperature = nullptr;
  const uint64_t* seeds = nullptr;  // [batch] Philox key
  const uint64_t* steps = nullptr;  // [batch] decode step (noise counter)
  // Stage-1 output: [num_tiles][num_samples][batch] candidates, where
  // num_tiles = FusedSampleNumTiles(vocab_rows). May point into a peer
  // GPU's memory (tensor parallel: candidates stream to the reducing rank).
  Candidate* candidates = nullptr;
  // Optional [batch, vocab_rows] fp32 logits (tests of the IO model only).
  float* logits_out = nullptr;
};

constexpr int kMaxFusedBatch = 256;

// Vocabulary rows per stage-1 tile; each tile emits one candidate per
// (sample, row). Fixed for all batch sizes so that nothing about a row's
// result depends on the batch it rides in.
int FusedSampleTileRows();

// Number of stage-1 tiles (candidates per row and sample) for a shard.
int64_t FusedSampleNumTiles(int64_t vocab_rows);

// Bytes of device scratch a launch needs beyond `candidates` (may be 0).
size_t FusedSampleWorkspaceSize(int batch, int64_t vocab_rows, int hidden_size);

// Stage 1. Returns cudaErrorInvalidValue for unsupported shapes (hidden not a
// multiple of 64, batch outside 1..kMaxFusedBatch, null pointers).
cudaError_t LaunchFusedSample(const FusedSampleParams& params, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

// Stage 2: reduces [num_candidate_tiles][num_samples][batch] candidates to
// token ids [batch][num_samples] (row-major), best score, lowest id on ties.
// Optionally writes the winning scores too (winning_scores may be null).
cudaError_t LaunchReduceCandidates(const Candidate* candidates,
                                   int64_t num_candidate_tiles,
                                   int num_samples, int batch,
                                   int32_t* token_ids, float* winning_scores,
                                   cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_FUSED_SAMPLER_H_
