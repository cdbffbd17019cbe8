// Host API of the fused LM-head matmul + Gumbel-max sampler (stage 1) and the
// candidate reduction (stage 2). The [B, V] logits never reach device memory
// unless a caller asks for them (logits_out) to check the IO model. Every
// launcher returns cudaError_t and takes the stream last; no allocation
// happens in a launcher (workspaces are sized once with the *Size queries).
#ifndef FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_H_
#define FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/noise/philox.h"
#include "kernels/sampler/unit_candidates.h"

namespace flashsampler {

// Which tensor-core path runs stage 1. Both accumulate k-steps 0..D in order
// into one fp32 accumulator per logit, but they are different instructions
// (HMMA vs HGMMA), so one device must always use the same one: kAuto picks
// wgmma on sm_90 (when the binary carries sm_90a code) and mma.sync
// elsewhere, for every batch size (docs/design.md#invariance).
enum class FusedKernel { kAuto, kMmaSync, kWgmma };

// L2 eviction priority of the wgmma path's W loads.
enum class L2Hint { kAuto, kEvictFirst, kEvictNormal };

// Knobs the benchmark and the tests turn to compare schedules; production
// leaves every one at its default. On one path no knob changes a bit of
// any result (same k order, same tie-break); the defaults are the fastest
// measured schedule (docs/performance.md).
struct FusedTuning {
  // Tensor-core path; kAuto: the device's one path.
  FusedKernel kernel = FusedKernel::kAuto;
  // Batch columns per work item: 0 = the heuristic; else 16, 64 or 128, and
  // on the wgmma path also 80, 96 or 112.
  int block_n = 0;
  // wgmma W loads' L2 hint; kAuto: evict-first on small shards at block_n 16.
  L2Hint w_l2_hint = L2Hint::kAuto;
  // wgmma W tensor map's L2 promotion in bytes: 0 = auto, 128, 256 or -1.
  int w_l2_promotion = 0;
  // Elements of D per wgmma pipeline stage: 0 = auto, 64 or 128 (D not a
  // multiple of 128 takes 64).
  int w_stage_k = 0;
  // wgmma block_n 128: a half-empty last round runs as 64-column halves.
  bool split_last_round = true;
  // wgmma block_n >= 64: both consumer warpgroups score the CTA's last piece.
  bool share_last_epilogue = true;
  // wgmma block_n 128, B = 65..128: 2-CTA clusters multicast H by TMA
  // (where the GPU can hold the persistent grid's pairs at once).
  bool multicast_h = true;
  // wgmma, two batch tiles 128 wide, or 112 below D = 8192 (B = 193..256
  // on a whole vocabulary), launches without unit candidates: 2-CTA
  // clusters, each pair holding one vocab tile's two batch tiles, multicast
  // W by TMA (where the GPU can hold the pairs; PairsShareWeights).
  bool multicast_w = true;
  // Profiling (fs_bench --timeline): the wgmma path records, per (CTA,
  // consumer warpgroup, piece), the %globaltimer nanoseconds at which the
  // piece's wgmmas start (after the hand-off), end, and its scoring ends,
  // into timeline[((cta * 2 + consumer) * timeline_pieces + piece) * 3 +
  // event]; pieces past timeline_pieces are not recorded. Null: off.
  uint64_t* timeline = nullptr;
  int timeline_pieces = 0;
};

// Arguments of one stage-1 launch over one vocabulary shard.
struct FusedSampleParams {
  const void* weights = nullptr;  // [vocab_rows, hidden] row-major, dtype
  const void* hidden = nullptr;   // [batch, hidden] row-major, dtype
  // Rows of `hidden` the kernel may read: 0 (the batch) or >= batch. Rows
  // past the batch enter the tensor-core tiles but no result (a batch
  // column's logits use its own row of H alone), so any values do. The
  // wgmma path then declares H to TMA as the batch rounded up to the tile
  // width (within these rows), so that no H box crosses the tensor's end:
  // such boxes cost ~2.5 us per missing row per launch (qwen B = 136 ran
  // 1.45x slower on H200; docs/performance.md). The CUDA engine passes its
  // staging buffer's rows.
  int hidden_capacity_rows = 0;
  DType dtype = DType::kBf16;  // of weights and hidden: bf16 or fp16
  int64_t vocab_rows = 0;      // rows of `weights` (this shard)
  int64_t vocab_offset = 0;    // global token id of weights row 0
  int hidden_size = 0;         // D; a multiple of 64
  int batch = 0;               // B rows, 1 .. kMaxFusedBatch
  int num_samples = 1;         // n samples per row (sample index 0 .. n-1)
  // Per row [batch]: 1 / temperature; 0 marks a greedy row (argmax of the
  // logit, no noise).
  const float* inv_temperature = nullptr;
  const uint64_t* seeds = nullptr;  // [batch] Philox key
  const uint64_t* steps = nullptr;  // [batch] decode step (noise counter)
  // Stage-1 output: [num_tiles][num_samples][batch] candidates, where
  // num_tiles = FusedSampleNumTiles(vocab_rows). May point into a peer
  // GPU's memory (tensor parallel: candidates stream to the reducing rank).
  // May be null when token_ids is set.
  Candidate* candidates = nullptr;
  // Optional in-kernel stage 2 over this shard (one GPU: no second launch):
  // token ids [batch][num_samples] (and optionally the winning scores),
  // exactly what LaunchReduceCandidates would give. Needs the workspace
  // (FusedSampleWorkspaceSize bytes, zero-filled once after allocation;
  // each launch leaves it zeroed) and num_samples <= 64. Launches sharing
  // a workspace must be stream-ordered.
  int32_t* token_ids = nullptr;
  float* winning_scores = nullptr;
  // Optional, tensor parallel: the shard's best candidate per (sample, row),
  // [num_samples][batch] -- what LaunchReduceCandidates over this shard's
  // tiles would keep -- written by the in-kernel stage 2 (same workspace and
  // num_samples <= 64 as token_ids). May point into a peer GPU's memory:
  // the reducing rank then reduces one candidate per shard instead of one
  // per tile. Without candidates, token_ids may be null.
  Candidate* shard_winners = nullptr;
  // With candidates and no token_ids (tensor parallel): also keep each row's
  // best published candidate in the workspace (as token_ids needs it), so
  // that tiles skip the tokens that cannot beat it
  // (docs/design.md#tensor-parallelism). A tile that cannot hold the winner
  // may then report a dominated candidate or none (kNoToken at -inf);
  // LaunchReduceCandidates over all tiles gives the same tokens, bit for
  // bit. The workspace must be on this launch's GPU, zero-filled once and
  // used by one launch at a time (each leaves it zeroed). Has no effect
  // for num_samples > 64.
  bool floor_in_workspace = false;
  // Optional [batch, vocab_rows] fp32 logits: the controlled sampler's
  // input where it needs every logit, and the tests of the IO model.
  float* logits_out = nullptr;
  // Optional, wgmma path only (cudaErrorNotSupported on the other): each
  // row's highest logits of every 32-token unit with a bound on the rest
  // (unit_candidates.h), the controlled sampler's candidate path without
  // the logits: 1 byte a token written instead of logits_out's 4.
  // Off while unit_candidates.records is null. Where part of the GPU's L2
  // is set aside for persisting accesses (FusedSampleSetAsideL2ForUnits),
  // the launch keeps the batch's records there for the merge kernel.
  UnitCandidates unit_candidates;
  // Schedule knobs of the benchmark and the tests; production: defaults.
  FusedTuning tuning;
};

constexpr int kMaxFusedBatch = 256;
// Samples per row up to which the in-kernel stage 2 (token_ids,
// shard_winners) and the workspace's pruning floor work.
constexpr int kMaxFusedInKernelSamples = 64;

// Vocabulary rows per stage-1 tile; each tile emits one candidate per
// (sample, row). Fixed for all batch sizes so that nothing about a row's
// result depends on the batch it rides in.
int FusedSampleTileRows();

// Number of stage-1 tiles (candidates per row and sample) for a shard.
int64_t FusedSampleNumTiles(int64_t vocab_rows);

// Bytes of device scratch a launch with token_ids, shard_winners or
// floor_in_workspace set needs (none without): a counter and one 64-bit key
// per (sample, row), for num_samples <= kMaxFusedInKernelSamples.
size_t FusedSampleWorkspaceSize(int batch, int64_t vocab_rows, int hidden_size);

// The path kAuto resolves to on the current device (kMmaSync or kWgmma).
FusedKernel FusedSampleResolveKernel(FusedKernel requested);

// Sets aside `bytes` of the current GPU's L2 for persisting accesses
// (cudaLimitPersistingL2CacheSize; < 0: 2/5 of the L2, 0: none), clamped to
// what the GPU allows, so that the fused kernel's unit records stay in L2
// until the merge kernel has read them instead of going out to DRAM among
// the weights' reads; *set_aside gets the bytes set aside. The set-aside is
// the whole context's, and it costs the kernels that stream through the rest
// of the L2 even while no persisting line holds it (the default's numbers:
// fused_sampler.cc). Under MIG or MPS the GPU refuses (an error; nothing set
// aside here, and no error left pending).
cudaError_t FusedSampleSetAsideL2ForUnits(int64_t bytes, size_t* set_aside);

// Stage 1. Returns cudaErrorInvalidValue for unsupported operands (dtype
// fp32, hidden not a multiple of 64, batch outside 1..kMaxFusedBatch, null
// or misaligned pointers: weights and hidden must be 16-byte aligned; none of
// candidates, token_ids and shard_winners; token_ids, shard_winners or
// floor_in_workspace without a large enough workspace, or with
// num_samples > kMaxFusedInKernelSamples where the in-kernel stage 2 is
// needed), and cudaErrorNotSupported for a forced path or block_n
// (FusedTuning) this device or build lacks.
cudaError_t LaunchFusedSample(const FusedSampleParams& params, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream);

// Counts, into the device word `mismatches` (zeroed here), the uniforms --
// all 2^23 of them -- for which the kernels' branch-free Gumbel noise (its
// logarithm on -log(-log u), and the block noise of a first and another
// slot) differs in any bit from kernels/noise/philox.h's. Anything but 0 means
// this device must not serve (the CUDA engine checks at start).
cudaError_t LaunchNoiseSelfCheck(unsigned int* mismatches, cudaStream_t stream);

// The pruning brackets of the stage-1 epilogue (fused_epilogue.cuh): bounds
// on a token's score from its Philox word (WordUpperBound, and with its
// block's uniform WordLowerBound), from the fast logarithm (PruneBounds) and
// from its block's word (BlockUpperBound, BlockFirstLowerBound). Each upper
// bound is what a token or a whole block is compared with before it is
// skipped (against the launch's floor, the best exact score and, without a
// floor, the best lower bound); pruning is exact only if every bound holds.
enum NoiseBracket {
  kNoiseBracketWordUpper = 0,    // WordUpperBound >= another slot's score
  kNoiseBracketWordLower,        // WordLowerBound <= another slot's score
  kNoiseBracketLogLower,         // PruneBounds lower <= score of G(u)
  kNoiseBracketLogUpper,         // PruneBounds upper >= score of G(u)
  kNoiseBracketBlockFirstLower,  // BlockFirstLowerBound <= first slot's
  kNoiseBracketBlockFirstUpper,  // BlockUpperBound >= first slot's score
  kNoiseBracketBlockOtherUpper,  // BlockUpperBound >= another slot's score
  kNoiseBracketCount,
};

// Counts, into the device array violations[kNoiseBracketCount] (zeroed
// here), the cases -- every one of the 2^23 uniforms, both extremes of the
// Philox word's unused low bits, several (logit, inv_temperature) pairs --
// where an exact score (philox.h's noise) falls outside a bracket, as the
// kernels compute it. Anything but all 0 means pruning could change tokens:
// this device must not serve (the CUDA engine checks at start).
cudaError_t LaunchNoiseBracketCheck(unsigned int* violations,
                                    cudaStream_t stream);

// Stage 2: reduces [num_candidate_tiles][num_samples][batch] candidates to
// token ids [batch][num_samples] (row-major), best score, lowest id on ties.
// Optionally writes the winning scores too (winning_scores may be null).
cudaError_t LaunchReduceCandidates(const Candidate* candidates,
                                   int64_t num_candidate_tiles, int num_samples,
                                   int batch, int32_t* token_ids,
                                   float* winning_scores, cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_H_
