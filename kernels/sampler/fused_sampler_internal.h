// Internals shared by the stage-1 dispatcher (fused_sampler.cc) and the
// kernel instantiation files: the device-side argument struct and the typed
// launchers, one explicit instantiation per (path, dtype, block_n).
#ifndef FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_
#define FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {
namespace fused {

// Vocabulary rows per CTA tile and per candidate (FusedSampleTileRows()).
constexpr int kTileRows = 128;
// Elements of D per pipeline stage: one 128-byte row of bf16/fp16.
constexpr int kBlockK = 64;

// Everything a stage-1 kernel reads, passed by value (flash-attn's params
// struct). Shapes were validated by LaunchFusedSample.
struct FusedArgs {
  const void* weights;           // [vocab_rows, hidden_size]
  const void* hidden;            // [batch, hidden_size]
  int64_t vocab_rows;            // rows of this shard
  int64_t vocab_offset;          // global token id of row 0
  int hidden_size;               // D, a multiple of kBlockK
  int batch;                     // B
  int num_samples;               // n
  const float* inv_temperature;  // [batch]; 0 = greedy
  const uint64_t* seeds;         // [batch]
  const uint64_t* steps;         // [batch]
  Candidate* candidates;         // optional [num_tiles][n][batch]
  float* logits_out;             // optional [batch, vocab_rows]
  // In-kernel stage 2 (all null when off): packed per-(sample, row) winners
  // [n][batch], zero between launches; the arrival counter; the outputs
  // (token ids, and/or the shard's winners for a tensor-parallel reduce).
  // With per-tile candidates, keys and counter alone: the pruning floor
  // (FusedSampleParams::floor_in_workspace), token_ids null.
  unsigned long long* keys;
  unsigned int* counter;
  int32_t* token_ids;        // [batch][n]
  float* winning_scores;     // optional [batch][n]
  Candidate* shard_winners;  // optional [n][batch]
  uint64_t w_cache_hint;     // TMA L2 hint for W (wgmma path)
  bool split_last_round;     // wgmma path (FusedSampleParams)
  bool share_last_epilogue;  // wgmma path (FusedSampleParams)
  bool multicast_h;          // wgmma path (FusedSampleParams)
  uint64_t* timeline;        // wgmma path (FusedSampleParams), or null
  int timeline_pieces;
};

// Workspace of the in-kernel stage 2: the counter, then the keys.
constexpr size_t kWorkspaceCounterBytes = 256;
constexpr int kMaxInKernelReduceSamples = kMaxFusedInKernelSamples;

// Typed launchers; T is __nv_bfloat16 or __half. Defined in the
// fused_sampler_{mma,wgmma}_{bf16,fp16}.cu instantiation files.
enum class DTypeTag { kBf16, kFp16 };
template <DTypeTag kDType, int kBlockN>
cudaError_t LaunchMma(const FusedArgs& args, cudaStream_t stream);
// tensor_map_h: two CUtensorMaps of H, kBlockN-row and kBlockN / 2-row
// boxes.
template <DTypeTag kDType, int kBlockN, int kHalves>
cudaError_t LaunchWgmma(const FusedArgs& args, const void* tensor_map_w,
                        const void* tensor_map_h, int grid,
                        cudaStream_t stream);

// Binary version (e.g. 90) of the wgmma kernel image the current device would
// run; only 90 (sm_90a code) carries the wgmma instructions.
cudaError_t WgmmaKernelBinaryVersion(int* version);

}  // namespace fused
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_
