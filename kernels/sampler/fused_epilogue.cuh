// The stage-1 epilogue shared by the mma.sync and wgmma kernels: turns each
// warp's m16 x n8 accumulator fragments into one (score, global token id)
// candidate per (batch row, sample) for the CTA's 128-row vocabulary tile.
//
// Both tensor-core paths leave a warp holding fragments in the same layout:
// lane (g = lane / 4, c = lane % 4) has vocab rows g and g + 8, batch columns
// 2c and 2c + 1. A token's noise comes from its block's Philox word
// (NoiseBlockOf: 16 consecutive global ids) and its own word (NoiseBits4:
// 4 consecutive ids per call), so a per-warp staging buffer transposes the
// fragments into runs of 4 consecutive vocab rows of one column per lane:
// the mma.sync path stages one fragment at a time (8 rows, 2 runs per lane,
// 4 lanes per column: ScoreFragments); the wgmma path stages four (16 rows,
// 4 runs per lane, 2 lanes per column: ScoreFragmentQuad), so that a lane
// holds one whole noise block. ScoreRuns scores a lane's runs; xor-shuffles
// and one shared 64-bit atomicMax per (warp, column) merge a column across
// the CTA.
//
// The noise is pruned exactly: cheap bounds on the scores (a whole block's
// from its one word, then each token's from its Philox word, then from the
// fast logarithm) discard the tokens that are strictly worse than a
// candidate already reached in this launch, and only the rest get the exact
// noise of kernels/noise/philox.h. The winner, ties included, is never
// discarded, so the result is the unpruned result bit for bit
// (docs/design.md#exactness-and-refusals).
#ifndef FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_
#define FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/noise/philox.h"
#include "kernels/sampler/device_ptx.cuh"
#include "kernels/sampler/fused_sampler_internal.h"

namespace flashsampler {
namespace fused {

// Element type of a DType the tensor cores take (bf16 or fp16).
template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kBf16> {
  using Type = __nv_bfloat16;
};
template <>
struct ElementOf<DType::kFp16> {
  using Type = __half;
};

// The noise of kernels/noise/philox.h computed without branches. AccurateLog's
// one division s = f / (2 + f) is the only non-straight-line operation there:
// __fdiv_rn compiles to a fast path (reciprocal, one Newton step, one FMA
// correction) guarded by FCHK and a call to a slow path for operands near
// the exponent limits, and that call splits the epilogue's four independent
// log chains into separate basic blocks (measured: ~3100 cycles per
// fragment, ~6x its instruction count). AccurateLog only divides f in
// [-0.30, 0.42] by 2 + f in [1.7, 2.5], where FCHK never fails, so the fast
// path alone is __fdiv_rn. DivideInLogRange is that fast path, instruction
// for instruction as nvcc emits it (MUFU.RCP, FFMA x5);
// NoiseSelfCheck compares the noise computed with it (FastBlockSlotGumbel,
// and -log(-log u)) with philox.h's for all 2^23 uniforms, bit for bit (a
// GPU test, and the CUDA engine at start).
__device__ __forceinline__ float DivideInLogRange(float f, float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(-d, r, 1.0f);
  r = __fmaf_rn(r, e, r);
  const float q = __fmaf_rn(f, r, 0.0f);
  const float remainder = __fmaf_rn(-d, q, f);
  return __fmaf_rn(r, remainder, q);
}

// AccurateLog (kernels/noise/philox.h) with DivideInLogRange for the division;
// every other operation is AccurateLog's own.
struct LogRangeDivide {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return DivideInLogRange(a, b);
  }
};

__device__ __forceinline__ float FastAccurateLog(float x) {
  return AccurateLogWithDivide(x, LogRangeDivide{});
}

// Bounds on GumbelScore(logit, inv_temperature, GumbelFromUniform(u))
// from `scaled` = __fmul_rn(logit, inv_temperature) (the exact first step
// of GumbelScore) and the fast logarithm. __logf is within 2^-21.41
// absolutely on [0.5, 2] and 3 ulp elsewhere; for u <= 1 - 2^-10 (so
// -log(u) >= 2^-10) that puts the same expression with lg2.approx (what
// __logf runs) within 4e-4 of the exact noise, well inside kPruneMargin. Above
// that u the noise is >= 6.93, and unbounded above. Rounding the sums down / up
// keeps the bounds valid for the round-to-nearest score: lower <= score <=
// upper. A token whose upper bound is below another token's lower bound is
// strictly worse, so it cannot be the winner; skipping it changes no result
// (ties included).
constexpr float kPruneMargin = 1.0f / 64.0f;
constexpr float kPruneMaxUniform = 1.0f - 1.0f / 1024.0f;
constexpr float kPruneGumbelAboveMax = 6.9f;

__device__ __forceinline__ float FastLog2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void PruneBounds(float scaled, float u, float* lower,
                                            float* upper) {
  // Branch-free: finite for every u the noise takes. lg2.approx.ftz is
  // __logf without its subnormal rescaling (u >= 2^-24 and -log(u) >= 5e-8
  // are normal).
  constexpr float kLn2 = 0.693147182f;
  const float t = __fmul_rn(-kLn2, FastLog2(u));
  const float g = __fmul_rn(-kLn2, FastLog2(t));
  const bool near_one = u > kPruneMaxUniform;
  *lower = __fadd_rd(
      scaled, near_one ? kPruneGumbelAboveMax : __fadd_rd(g, -kPruneMargin));
  *upper = near_one ? __int_as_float(0x7f800000)  // +inf
                    : __fadd_ru(scaled, __fadd_ru(g, kPruneMargin));
}

// An upper bound on the score from the token's Philox word alone, no
// logarithm. The uniform is v = (2m + 1) 2^-24 with m the word's top 23
// bits; let k be the number of leading one bits of m (0 .. 23). Then
// v < 1 - 2^-(k+1), and since -ln(1 - x) > x the Gumbel of v alone,
// -ln(-ln v), is < (k + 1) ln 2. A token that does not hold its block's
// minimum has noise -ln(E_min - ln v) < -ln(-ln v) (philox.h, NoiseBlockOf);
// the fp32 noise is within 1e-5 of the real one, inside the 2^-10 margin,
// and the sum is rounded upwards as in PruneBounds.
constexpr float kWordBoundLn2 = 0.693147182f;
constexpr float kWordBoundMargin = 1.0f / 1024.0f;

__device__ __forceinline__ float WordUpperBound(float scaled, uint32_t word) {
  const float kf = static_cast<float>(min(__clz(~word), 23));
  return __fadd_ru(scaled,
                   __fmaf_ru(kf + 1.0f, kWordBoundLn2, kWordBoundMargin));
}

// A lower bound on the score of a token that does not hold its block's
// minimum, from its word and the block's uniform U, for the thresholds of
// calls without a floor. Its noise is -ln(E_min + E') with E_min =
// -ln(U) / 16 and E' = -ln v. With k leading one bits in the word's top 23,
// v >= 1 - 2^-k, so E' <= -ln(1 - 2^-k) <= 2^-k + 2^-2k for k >= 1 (x <= 1/2:
// -ln(1 - x) <= x + x^2), and E' <= 24 ln 2 < 16.64 for k = 0 (v >= 2^-24).
// E_min is bounded above from the fast logarithm (lg2.approx is within
// 2^-21.4 absolutely on [0.5, 2], 3 ulp elsewhere: a relative 2^-10 and an
// absolute 2^-24 cover it), and the noise below from the fast logarithm of
// the sum, less kPruneMargin; the sum with `scaled` rounds down.
__device__ __forceinline__ float WordLowerBound(float scaled, uint32_t word,
                                                float uniform) {
  constexpr float kLn2 = 0.693147182f;
  const int k = min(__clz(~word), 23);
  // 2^-k exactly, from the exponent bits.
  const float x = __int_as_float((127 - k) << 23);
  const float exponential_word = k == 0 ? 16.64f : __fmaf_ru(x, x, x);
  const float min_exponential =
      __fmaf_ru(__fmul_ru(-kLn2 / 16.0f, FastLog2(uniform)),
                1.0f + 1.0f / 1024.0f, 5.9604645e-08f);
  const float noise =
      __fmul_rd(-kLn2, FastLog2(__fadd_ru(min_exponential, exponential_word)));
  return __fadd_rd(scaled, __fadd_rd(noise, -kPruneMargin));
}

// Bounds on the score of a block's first slot, whose noise -ln(-ln(U) / 16)
// is G(U) + ln 16 with G(U) = -ln(-ln U) (the fp32 value within 1e-5 of it),
// from `scaled` of that token and the block's uniform U. PruneBounds
// brackets scaled' + G(U) within kPruneMargin; moving scaled' by ln 16
// rounded outwards keeps each bound on its side. Every other slot of the
// block has a smaller noise (E_min + E' > E_min), so BlockUpperBound of a
// block's largest scaled logit bounds every score in the block: a block
// whose bound is below a score already reached cannot hold the winner.
constexpr float kLn16Down = 2.7725885f;  // ln 16 = 2.77258872...
constexpr float kLn16Up = 2.7725887f;

__device__ __forceinline__ float BlockUpperBound(float scaled, float uniform) {
  float lower;
  float upper;
  PruneBounds(__fadd_ru(scaled, kLn16Up), uniform, &lower, &upper);
  return upper;
}

__device__ __forceinline__ float BlockFirstLowerBound(float scaled,
                                                      float uniform) {
  float lower;
  float upper;
  PruneBounds(__fadd_rd(scaled, kLn16Down), uniform, &lower, &upper);
  return lower;
}

// The noise of one slot of a block (BlockSlotGumbel) with the epilogue's
// branch-free logarithm: bit for bit the same (NoiseSelfCheck).
__device__ __forceinline__ float FastBlockSlotGumbel(const NoiseBlock& block,
                                                     bool first_slot,
                                                     uint32_t word) {
  return BlockSlotGumbel(BlockMinExponential(block.uniform, LogRangeDivide{}),
                         first_slot, word, LogRangeDivide{});
}

// Staging of the mma.sync path (ScoreFragments): one m16 x n8 fragment at a
// time, 16 rows + 4 padding floats per column, so that the four scalar
// stores of a fragment hit 32 distinct banks.
constexpr int kStagingStride = 20;
constexpr int kStagingFloats = 8 * kStagingStride;
// Staging of the wgmma path (ScoreFragmentQuad): four fragments, 16 columns
// x 32 rows, 32 rows + 4 padding floats per column (stores hit 32 distinct
// banks; each quarter-warp's 16-byte loads cover all 32 banks once).
constexpr int kQuadStagingStride = 36;
constexpr int kQuadStagingFloats = 16 * kQuadStagingStride;

// Epilogue shared memory of a CTA with kWarps epilogue warps and kBlockN
// batch columns, kStaging floats of staging per warp, and the noise words
// of kWordBlocks blocks per column (FillBlockWords; 1 and unused where the
// lanes make their own block calls). The rows' steps are read from global
// memory where needed: with the words of a 128-row tile, two full copies of
// this struct and a ring of 192 KB fill the 227 KB of shared memory.
template <int kBlockN, int kWarps, int kStaging = kStagingFloats,
          int kWordBlocks = 1>
struct EpilogueShared {
  static constexpr int kColumns = kBlockN;
  static constexpr int kBlocks = kWordBlocks;
  float inv_temperature[kBlockN];
  uint64_t seed[kBlockN];
  unsigned long long best[kBlockN];  // packed candidates, one sample at a time
  // The in-kernel stage 2's keys of the columns (ColumnKey), read once per
  // item and sample (LoadFloorKeys; wgmma path only).
  unsigned long long floor_key[kBlockN];
  // block_word[k][col]: the noise word (NoiseBlockOf's) of the item's k-th
  // block of 16 rows for column col, this sample (wgmma path only).
  uint32_t block_word[kWordBlocks][kBlockN];
  float staging[kWarps][kStaging];
};

// Packs a candidate into a 64-bit key whose unsigned order is CandidateBetter:
// the score's bits made monotone in the high word, ~token_id in the low word
// (equal scores -> the lower id has the larger key). Never called with NaN
// (CandidateBetter never selects one); -0 is folded into +0, which compare
// equal as floats.
__device__ __forceinline__ unsigned long long PackCandidate(float score,
                                                            int32_t token_id) {
  if (score == 0.0f) score = 0.0f;
  uint32_t bits = __float_as_uint(score);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<unsigned long long>(bits) << 32) |
         static_cast<unsigned long long>(~static_cast<uint32_t>(token_id));
}

__device__ __forceinline__ Candidate UnpackCandidate(unsigned long long key) {
  uint32_t bits = static_cast<uint32_t>(key >> 32);
  bits = (bits & 0x80000000u) ? (bits & 0x7fffffffu) : ~bits;
  Candidate candidate;
  candidate.score = __uint_as_float(bits);
  candidate.token_id =
      static_cast<int32_t>(~static_cast<uint32_t>(key & 0xffffffffu));
  return candidate;
}

// Loads the per-column sampling parameters of the CTA's batch columns.
template <typename Shared>
__device__ __forceinline__ void LoadColumnParams(const FusedArgs& args,
                                                 int batch_base, int thread,
                                                 int num_threads,
                                                 Shared& shared) {
  constexpr int kBlockN = Shared::kColumns;
  for (int i = thread; i < kBlockN; i += num_threads) {
    const int b = batch_base + i;
    const bool valid = b < args.batch;
    shared.inv_temperature[i] = valid ? args.inv_temperature[b] : 0.0f;
    shared.seed[i] = valid ? args.seeds[b] : 0;
  }
}

// The best candidate any CTA has published so far for (sample, batch row b)
// into the in-kernel stage-2 keys (0 when none, or without keys), and its
// score as a floor (-inf for none). The final winner scores at least that much,
// so a token whose score is bounded below it cannot win (PruneBounds). Where
// per-tile candidates are written (StoreCandidates), every key is also one of
// them, so a tile pruned against it may report a dominated candidate without
// changing the reduction; without them the keys are the reduction. Keys are
// zero at the start of every launch (the last CTA re-zeroes them), and every
// non-zero key is a real candidate of this launch; a stale read is still a
// valid floor since keys only grow. The wgmma epilogue reads its columns'
// keys once per item (LoadFloorKeys), and again at a scoring call for a
// column that had none (a launch's first calls): the sampled rows'
// candidates are published as soon as they are found (PublishFloor), so
// later calls of any CTA prune against them. Reading every call's keys
// afresh instead (8 times the requests to the few L2 lines that every CTA
// reads and updates) cost 6% at qwen B = 128 on H200
// (docs/performance.md).
__device__ __forceinline__ unsigned long long ColumnKey(const FusedArgs& args,
                                                        int sample, int b) {
  if (args.keys == nullptr || b >= args.batch) return 0ull;
  return *reinterpret_cast<const volatile unsigned long long*>(
      &args.keys[sample * args.batch + b]);
}

// Reads the keys of the CTA's batch columns into shared.floor_key, one load
// per column, item and sample (the mma.sync path leaves the array unused).
template <typename Shared>
__device__ __forceinline__ void LoadFloorKeys(const FusedArgs& args, int sample,
                                              int batch_base, int thread,
                                              int num_threads, Shared& shared) {
  for (int i = thread; i < Shared::kColumns; i += num_threads) {
    shared.floor_key[i] = ColumnKey(args, sample, batch_base + i);
  }
}

// Whether the wgmma epilogue takes its lanes' block words from
// EpilogueShared::block_word: on shards whose offset is a multiple of 64
// (uniform over the launch), a 128-row tile is two whole block groups.
__device__ __forceinline__ bool BlockWordsFilled(const FusedArgs& args) {
  constexpr int64_t kGroupTokens = kNoiseBlockTokens * kNoiseBlocksPerGroup;
  return (args.vocab_offset & (kGroupTokens - 1)) == 0;
}

// Makes the block-group calls (philox.h, NoiseBlockWords) of vocab tile
// `tile` for the sampled columns from batch_base, one per (column, group),
// into shared.block_word: two calls per column for a 128-row tile where the
// lanes' own block calls were eight (one per block of 16 rows, each in the
// warp that holds those rows). The caller's next barrier publishes them.
template <typename Shared>
__device__ __forceinline__ void FillBlockWords(const FusedArgs& args,
                                               int sample, int64_t tile,
                                               int batch_base, int thread,
                                               int num_threads,
                                               Shared& shared) {
  constexpr int kGroups =
      Shared::kBlocks / static_cast<int>(kNoiseBlocksPerGroup);
  static_assert(
      Shared::kBlocks * static_cast<int>(kNoiseBlockTokens) == kTileRows,
      "one word per block of the tile");
  if (!BlockWordsFilled(args)) return;
  const int64_t group0 = (args.vocab_offset + tile * kTileRows) >>
                         (kNoiseBlockShift + kNoiseGroupShift);
  for (int i = thread; i < kGroups * Shared::kColumns; i += num_threads) {
    const int col = i % Shared::kColumns;
    const int group = i / Shared::kColumns;
    const int b = batch_base + col;
    // Greedy rows and columns past the batch never read their words. The
    // row's parameters come from global memory: LoadColumnParams' shared
    // copies are written by other threads (at block_n < 128) with no
    // barrier before this.
    if (b >= args.batch || args.inv_temperature[b] == 0.0f) continue;
    const Philox4x32 words = NoiseBlockWords(
        args.seeds[b], args.steps[b], static_cast<uint32_t>(sample),
        static_cast<uint32_t>(group0 + group));
#pragma unroll
    for (int k = 0; k < static_cast<int>(kNoiseBlocksPerGroup); ++k) {
      shared.block_word[kNoiseBlocksPerGroup * group + k][col] = words.v[k];
    }
  }
}

__device__ __forceinline__ float FloorOfKey(unsigned long long key) {
  return key == 0 ? -__int_as_float(0x7f800000) : UnpackCandidate(key).score;
}

// The column, of the 16 of a quad, that a lane scores in the wgmma staging
// (ScoreStagedQuad: two lanes per column).
__device__ __forceinline__ int StagedLaneColumn() {
  return (threadIdx.x & 31) >> 1;
}

// ColumnKey of the column a lane scores in the wgmma staging of the 16
// columns from col0.
__device__ __forceinline__ unsigned long long StagedLaneKey(
    const FusedArgs& args, int sample, int batch_base, int col0) {
  return ColumnKey(args, sample, batch_base + col0 + StagedLaneColumn());
}

__device__ __forceinline__ void PublishFloor(const FusedArgs& args, int sample,
                                             int b, unsigned long long key) {
  if (args.keys != nullptr) atomicMax(&args.keys[sample * args.batch + b], key);
}

// Logit sources for ScoreRuns: a lane's kRuns x 4 logits in registers
// (RegisterLogits), or 16 consecutive floats of a staging buffer
// (StagedLogits).
template <int kRuns>
struct RegisterLogits {
  const float (&values)[kRuns][4];
  __device__ __forceinline__ float4 Run(int f) const {
    return make_float4(values[f][0], values[f][1], values[f][2], values[f][3]);
  }
  __device__ __forceinline__ float At(int i) const {
    float logit = 0.0f;
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (i == 4 * f + q) logit = values[f][q];
      }
    }
    return logit;
  }
};

struct StagedLogits {
  const float* base;  // 16-byte aligned
  __device__ __forceinline__ float4 Run(int f) const {
    return *reinterpret_cast<const float4*>(base + 4 * f);
  }
  __device__ __forceinline__ float At(int i) const { return base[i]; }
};

// A noise block whose bound did not rule it out (ScoreRuns' block path),
// with what the lanes that score its tokens need.
struct SurvivingBlock {
  const float* logits;  // its 16 staged logits
  int32_t token0;       // global id of its first token (a multiple of 16)
  int col;              // CTA-local batch column
  int row;              // its batch row
  int valid_tokens;     // tokens before the shard's end (0 .. 16)
  uint32_t first_slot;  // NoiseBlockOf's slot and uniform
  float uniform;
  float inv_temperature;  // of its row
  float threshold;        // a score its winner must reach (a real candidate's)
};

__device__ __forceinline__ SurvivingBlock
ShuffleSurvivingBlock(const SurvivingBlock& block, int source) {
  constexpr unsigned kAll = 0xffffffffu;
  SurvivingBlock out;
  out.logits = reinterpret_cast<const float*>(__shfl_sync(
      kAll, reinterpret_cast<unsigned long long>(block.logits), source));
  out.token0 = __shfl_sync(kAll, block.token0, source);
  out.col = __shfl_sync(kAll, block.col, source);
  out.row = __shfl_sync(kAll, block.row, source);
  out.valid_tokens = __shfl_sync(kAll, block.valid_tokens, source);
  out.first_slot = __shfl_sync(kAll, block.first_slot, source);
  out.uniform = __shfl_sync(kAll, block.uniform, source);
  out.inv_temperature = __shfl_sync(kAll, block.inv_temperature, source);
  out.threshold = __shfl_sync(kAll, block.threshold, source);
  return out;
}

// Scores the tokens of the warp's surviving blocks (`pending`: the lanes
// whose block survived; `mine`: this lane's, read only where its bit is
// set), eight blocks at a time: four lanes per block, each with one Philox
// call of token words for 4 of its tokens. A warp with a few surviving
// blocks (the usual case once a floor is known) then pays one call's
// latency, not every lane's four. Each token is bounded by its word (or,
// the first slot, by the block's word), then by the fast logarithm, against
// the block's threshold and the lane's best exact score; the rest get the
// exact noise, and each lane merges its best into shared.best and
// publishes it as a floor directly.
template <typename Shared>
__device__ __forceinline__ void ScoreSurvivingBlocks(uint32_t pending,
                                                     const SurvivingBlock& mine,
                                                     int sample,
                                                     const FusedArgs& args,
                                                     Shared& shared) {
  const int lane = threadIdx.x & 31;
  const int task = lane >> 2;  // which of this round's blocks
  const int part = lane & 3;   // which run of 4 of its tokens
  while (pending != 0) {       // warp-uniform
    const uint32_t source = __fns(pending, 0, task + 1);  // >= 32: none
    const bool active = source < 32;
    const SurvivingBlock block =
        ShuffleSurvivingBlock(mine, active ? static_cast<int>(source) : lane);
    // Clear the round's (up to) eight blocks.
    const uint32_t last = __fns(pending, 0, 8);
    pending = last < 31 ? pending & (0xfffffffeu << last) : 0u;
    if (!active) continue;
    const Philox4x32 words =
        NoiseBits4(shared.seed[block.col], args.steps[block.row],
                   static_cast<uint32_t>(sample),
                   static_cast<uint32_t>((block.token0 >> 2) + part));
    const NoiseBlock noise_block{block.first_slot, block.uniform};
    // Bounds first, for the lane's 4 tokens: from the word (the first
    // slot: from the block's word) against the threshold. Strictly below a
    // score reached: strictly worse than that token, so it cannot win.
    uint32_t candidates = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int slot = 4 * part + q;
      const float scaled = __fmul_rn(block.logits[slot], block.inv_temperature);
      const float upper = static_cast<uint32_t>(slot) == block.first_slot
                              ? BlockUpperBound(scaled, block.uniform)
                              : WordUpperBound(scaled, words.v[q]);
      if (slot < block.valid_tokens && upper >= block.threshold) {
        candidates |= 1u << q;
      }
    }
    // Then the exact noise, one token per lane at a time (few lanes have
    // more than one), after the fast logarithm's bound.
    float best_score = -__int_as_float(0x7f800000);  // -inf
    int32_t best_id = kNoToken;
    while (candidates != 0) {
      const int q = __ffs(candidates) - 1;
      candidates &= candidates - 1;
      const int slot = 4 * part + q;
      const uint32_t word = PhiloxWord(words, static_cast<uint32_t>(q));
      const float logit = block.logits[slot];
      const float scaled = __fmul_rn(logit, block.inv_temperature);
      const bool first = static_cast<uint32_t>(slot) == block.first_slot;
      if (!first) {
        float fast_lower;
        float fast_upper;
        PruneBounds(scaled, UniformFromBits(word), &fast_lower, &fast_upper);
        if (fast_upper < fmaxf(block.threshold, best_score)) continue;
      }
      const float score =
          GumbelScore(logit, block.inv_temperature,
                      FastBlockSlotGumbel(noise_block, first, word));
      const int32_t id = block.token0 + slot;
      if (CandidateBetter(score, id, best_score, best_id)) {
        best_score = score;
        best_id = id;
      }
    }
    if (best_id != kNoToken) {
      const unsigned long long key = PackCandidate(best_score, best_id);
      atomicMax(&shared.best[block.col], key);
      PublishFloor(args, sample, block.row, key);
    }
  }
}

// Scores one lane's share of a column: kRuns runs of 4 consecutive vocab rows
// (shard-local rows row0 + f * run_stride .. + 3, logits.Run(f)) of CTA-local
// batch column `col`, for sample `sample`, and merges the column's best into
// shared.best. kLanesPerColumn aligned lanes hold the same column (4 for the
// mma.sync staging, 2 for the wgmma one); all 32 lanes of the warp call this
// together. More runs per lane give the noise more independent chains to
// interleave (a single epilogue warp per scheduler is latency-bound in the
// device profiles; docs/design.md#performance-model).
// `logits` gives the lane's logits: Run(f) the 4 of run f, At(i) logit i = 4f
// + q; the wgmma path reads them from its staging buffer when needed rather
// than keeping 16 of them live next to the 128 accumulators. With
// `use_floor`, `floor` is a score already reached in this launch for the
// lane's column (FloorOfKey; -inf when none), and sampled rows' candidates
// are published as floors (PublishFloor).
template <int kRuns, int kLanesPerColumn, typename Logits, typename Shared>
__device__ __forceinline__ void ScoreRuns(const Logits& logits, int64_t row0,
                                          int run_stride, int col, int sample,
                                          bool store_logits, int batch_base,
                                          const FusedArgs& args, Shared& shared,
                                          bool use_floor, float floor) {
  static_assert(kLanesPerColumn == 2 || kLanesPerColumn == 4, "lane groups");
  // Rows as arithmetic, not an array: a run-time pick into an array of
  // rows put it in local memory.
  const auto row = [row0, run_stride](int f) { return row0 + f * run_stride; };
  // Rows at or past the shard's end are TMA's zero padding. Counted once in
  // 32 bits from row0: a 64-bit compare per token cost ~50 instructions per
  // call.
  const int64_t rows_after_row0 = args.vocab_rows - row0;
  const int valid_rows =
      rows_after_row0 <= 0
          ? 0
          : static_cast<int>(rows_after_row0 < kRuns * run_stride
                                 ? rows_after_row0
                                 : kRuns * run_stride);
  const auto valid = [run_stride, valid_rows](int f, int q) {
    return f * run_stride + q < valid_rows;
  };
  const int lane = threadIdx.x & 31;
  const int b = batch_base + col;
  const bool in_batch = b < args.batch;
  const float inv_temperature = in_batch ? shared.inv_temperature[col] : 0.0f;
  const bool noisy = in_batch && inv_temperature != 0.0f;
  // Calls visit(f, q, logit) for each of the lane's rows before the
  // shard's end.
  const auto for_each_valid = [&](auto visit) {
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
      const float4 run = logits.Run(f);
      const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (valid(f, q)) visit(f, q, values[q]);
      }
    }
  };
  if (in_batch && store_logits && args.logits_out != nullptr) {
    // A run's 4 consecutive rows as one 16-byte streaming store where the
    // address allows: scalar stores made writing [128, 151936] fp32 logits
    // cost 0.21 ms over the plain kernel on an H100.
    float* out = args.logits_out + static_cast<int64_t>(b) * args.vocab_rows;
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
      const float4 run = logits.Run(f);
      float* dst = out + row(f);
      if (valid(f, 3) && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
        __stcs(reinterpret_cast<float4*>(dst), run);
      } else {
        const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (valid(f, q)) dst[q] = values[q];
        }
      }
    }
  }
  float best_score = -__int_as_float(0x7f800000);  // -inf
  int32_t best_id = kNoToken;
  float threshold = -__int_as_float(0x7f800000);  // -inf
  uint64_t seed = 0;
  uint64_t step = 0;
  if (noisy) {
    seed = shared.seed[col];
    step = args.steps[b];
    if (use_floor) threshold = floor;
  }
  // Exact pruning. A token's noise is at most its block's largest
  // (philox.h, NoiseBlockOf), so where a lane's 16 tokens are one noise
  // block (the wgmma staging, on a shard whose offset is a multiple of 16)
  // one Philox word and the block's largest logit bound all 16 scores. Once
  // the launch's floor is known, a block below the threshold (the floor,
  // the CTA's best so far) needs no token words at all: ~99.5% of the
  // blocks of the benchmark's flat rows (docs/performance.md); the few
  // left are scored by ScoreSurvivingBlocks, four lanes each.
  constexpr bool kBlockLayout =
      kRuns * 4 == static_cast<int>(kNoiseBlockTokens) &&
      std::is_same<Logits, StagedLogits>::value;
  // Once every sampled column of the warp has a floor (warp-uniform), the
  // block path below prunes whole blocks; before that (a CTA's first
  // scoring calls, launches without the keys, the mma.sync layout) most
  // blocks would survive, and every lane bounds its own tokens instead.
  const bool floors_known =
      use_floor &&
      __all_sync(0xffffffffu,
                 !noisy || threshold > -__int_as_float(0x7f800000));
  // In the wgmma staging, on a shard whose offset is a multiple of 16
  // (uniform over the launch), a lane's 16 tokens are one noise block.
  const bool lane_holds_block =
      kBlockLayout && run_stride == 4 &&
      (args.vocab_offset & (kNoiseBlockTokens - 1)) == 0;
  // The noise block of a lane that holds one: its word from the table
  // (FillBlockWords) where the kernel keeps one and the shard allows it,
  // else its own call.
  const auto lane_block = [&]() {
    const int64_t token0 = args.vocab_offset + row(0);
    if constexpr (Shared::kBlocks * static_cast<int>(kNoiseBlockTokens) ==
                  kTileRows) {
      if (BlockWordsFilled(args)) {
        return NoiseBlockFromWord(
            shared.block_word[(row0 >> kNoiseBlockShift) &
                              (Shared::kBlocks - 1)][col]);
      }
    }
    return NoiseBlockOf(seed, step, static_cast<uint32_t>(sample),
                        static_cast<uint32_t>(token0 >> kNoiseBlockShift));
  };
  bool block_path = false;
  if constexpr (kBlockLayout) {
    block_path = floors_known && lane_holds_block;
    if (block_path) {
      // Warp-uniform branch; `noisy` differs between columns, so the
      // shuffles and votes below sit outside the per-lane branches.
      const int64_t token0 = args.vocab_offset + row(0);
      NoiseBlock block{};
      float block_upper = -__int_as_float(0x7f800000);
      if (noisy) {
        block = lane_block();
        float max_logit = -__int_as_float(0x7f800000);
        if (valid_rows == kRuns * 4) {  // every tile but a shard's last
#pragma unroll
          for (int f = 0; f < kRuns; ++f) {
            const float4 run = logits.Run(f);
            max_logit = fmaxf(fmaxf(max_logit, fmaxf(run.x, run.y)),
                              fmaxf(run.z, run.w));
          }
        } else {
          for_each_valid([&](int, int, float logit) {
            max_logit = fmaxf(max_logit, logit);
          });
        }
        if (valid_rows > 0) {
          block_upper = BlockUpperBound(__fmul_rn(max_logit, inv_temperature),
                                        block.uniform);
        }
        // The CTA's best for this column so far (other warps' blocks of
        // this item) is a real candidate of this launch, so a valid floor.
        const unsigned long long best_key =
            *reinterpret_cast<const volatile unsigned long long*>(
                &shared.best[col]);
        threshold = fmaxf(threshold, UnpackCandidate(best_key).score);
      }
      const bool survives = noisy && block_upper >= threshold;
      const uint32_t pending = __ballot_sync(0xffffffffu, survives);
      if (pending != 0) {  // warp-uniform; few calls
        SurvivingBlock mine;
        mine.logits = logits.base;
        mine.token0 = static_cast<int32_t>(token0);
        mine.col = col;
        mine.row = b;
        mine.valid_tokens = valid_rows;
        mine.first_slot = block.first_slot;
        mine.uniform = block.uniform;
        mine.inv_temperature = inv_temperature;
        mine.threshold = threshold;
        ScoreSurvivingBlocks(pending, mine, sample, args, shared);
      }
    }
  }
  // Without floors where a lane holds a noise block (the wgmma staging: a
  // launch's first calls), every token is scored exactly, one word call per
  // run of 4 and no bounds: with no floor to prune against, bounding the
  // tokens left most of them to score anyway, each survivor with its word
  // call made again, and such a call took 18 us against 1.5 us for one
  // with floors (docs/performance.md).
  bool scored_exactly = false;
  if constexpr (kBlockLayout) {
    scored_exactly = !block_path && lane_holds_block;  // warp-uniform
    if (scored_exactly && noisy) {
      const int64_t token0 = args.vocab_offset + row(0);
      const NoiseBlock block = lane_block();
      // FastBlockSlotGumbel's first step, once for the block.
      const float min_exponential =
          BlockMinExponential(block.uniform, LogRangeDivide{});
      // Not unrolled: the code of one run, not four, beside the others.
#pragma unroll 1
      for (int f = 0; f < kRuns; ++f) {
        const Philox4x32 words =
            NoiseBits4(seed, step, static_cast<uint32_t>(sample),
                       static_cast<uint32_t>((token0 >> 2) + f));
        const float4 run = logits.Run(f);
        const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (!valid(f, q)) continue;
          const uint32_t slot = static_cast<uint32_t>(4 * f + q);
          const float score = GumbelScore(
              values[q], inv_temperature,
              BlockSlotGumbel(min_exponential, slot == block.first_slot,
                              words.v[q], LogRangeDivide{}));
          const int32_t id = static_cast<int32_t>(token0 + slot);
          if (CandidateBetter(score, id, best_score, best_id)) {
            best_score = score;
            best_id = id;
          }
        }
      }
    }
  }
  if (!block_path && !scored_exactly) {  // warp-uniform
    // Every token of the lane is bounded by its own word, or by its block's
    // call where it holds the block's minimum: from above, and, without a
    // floor, from below for the threshold (the column's best lower bound).
    // Then, against the threshold and the best exact score so far, by the
    // fast logarithm; the rest get the exact noise. A run of 4 that starts
    // on a token group (shard offset a multiple of 4, uniform over the
    // launch) shares one word call and lies in one block. Only the upper
    // bounds stay live: a survivor's Philox calls are made again (survivors
    // are few). Lanes that hold a whole noise block never come here (the
    // block path, or scored exactly above).
    const auto token_word = [&](int64_t token) {
      return PhiloxWord(NoiseBits4(seed, step, static_cast<uint32_t>(sample),
                                   static_cast<uint32_t>(token >> 2)),
                        static_cast<uint32_t>(token & 3));
    };
    const auto block_of = [&](int64_t token) {
      return NoiseBlockOf(seed, step, static_cast<uint32_t>(sample),
                          static_cast<uint32_t>(token >> kNoiseBlockShift));
    };
    const auto is_first = [](int64_t token, const NoiseBlock& token_block) {
      return static_cast<uint32_t>(token & (kNoiseBlockTokens - 1)) ==
             token_block.first_slot;
    };
    float upper[kRuns][4];
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
#pragma unroll
      for (int q = 0; q < 4; ++q) upper[f][q] = -__int_as_float(0x7f800000);
    }
    if (noisy) {
#pragma unroll
      for (int f = 0; f < kRuns; ++f) {
        const int64_t token0 = args.vocab_offset + row(f);
        const bool grouped = (token0 & 3) == 0;
        Philox4x32 words{};
        NoiseBlock run_block{};
        if (grouped) {
          words = NoiseBits4(seed, step, static_cast<uint32_t>(sample),
                             static_cast<uint32_t>(token0 >> 2));
          run_block = block_of(token0);
        }
        const float4 run = logits.Run(f);
        const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (!valid(f, q)) continue;
          const int64_t token = token0 + q;
          const NoiseBlock token_block = grouped ? run_block : block_of(token);
          const float scaled = __fmul_rn(values[q], inv_temperature);
          if (is_first(token, token_block)) {
            upper[f][q] = BlockUpperBound(scaled, token_block.uniform);
            if (!floors_known) {
              threshold = fmaxf(
                  threshold, BlockFirstLowerBound(scaled, token_block.uniform));
            }
          } else {
            const uint32_t word = grouped ? words.v[q] : token_word(token);
            upper[f][q] = WordUpperBound(scaled, word);
            if (!floors_known) {
              threshold = fmaxf(
                  threshold, WordLowerBound(scaled, word, token_block.uniform));
            }
          }
        }
      }
    }
    // The lanes of a column hold the same `noisy`; the others pass -inf.
#pragma unroll
    for (int offset = 1; offset < kLanesPerColumn; offset <<= 1) {
      threshold =
          fmaxf(threshold, __shfl_xor_sync(0xffffffffu, threshold, offset));
    }
    uint32_t survivors = 0;
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (noisy && valid(f, q) && upper[f][q] >= threshold) {
          survivors |= 1u << (4 * f + q);
        }
      }
    }
    while (survivors != 0) {
      const int pick = __ffs(survivors) - 1;
      survivors &= survivors - 1;
      const float logit = logits.At(pick);
      const int64_t token = args.vocab_offset + row(pick / 4) + (pick & 3);
      const NoiseBlock token_block = block_of(token);
      const bool first = is_first(token, token_block);
      const float scaled = __fmul_rn(logit, inv_temperature);
      uint32_t word = 0;
      float fast_upper;
      if (first) {
        fast_upper = BlockUpperBound(scaled, token_block.uniform);
      } else {
        word = token_word(token);
        float fast_lower;
        PruneBounds(scaled, UniformFromBits(word), &fast_lower, &fast_upper);
      }
      // Strictly below a score reached: strictly worse than that token, so
      // it cannot win.
      if (fast_upper < fmaxf(threshold, best_score)) continue;
      const float score =
          GumbelScore(logit, inv_temperature,
                      FastBlockSlotGumbel(token_block, first, word));
      const int32_t id = static_cast<int32_t>(token);
      if (CandidateBetter(score, id, best_score, best_id)) {
        best_score = score;
        best_id = id;
      }
    }
  }
  if (!noisy && in_batch) {
    // Greedy: argmax of the logit itself, no noise.
    for_each_valid([&](int f, int q, float logit) {
      const int32_t id = static_cast<int32_t>(args.vocab_offset + row(f) + q);
      if (CandidateBetter(logit, id, best_score, best_id)) {
        best_score = logit;
        best_id = id;
      }
    });
  }
  // With pruning most calls leave no candidate in the whole warp: skip the
  // merge then (warp-uniform).
  if (!__any_sync(0xffffffffu, best_id != kNoToken)) return;
#pragma unroll
  for (int offset = 1; offset < kLanesPerColumn; offset <<= 1) {
    const float other_score = __shfl_xor_sync(0xffffffffu, best_score, offset);
    const int32_t other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
    if (CandidateBetter(other_score, other_id, best_score, best_id)) {
      best_score = other_score;
      best_id = other_id;
    }
  }
  if ((lane & (kLanesPerColumn - 1)) == 0 && in_batch && best_id != kNoToken) {
    const unsigned long long key = PackCandidate(best_score, best_id);
    atomicMax(&shared.best[col], key);
    // Sampled rows prune against the keys: publish now rather than at the
    // item's end (greedy rows do not prune; StoreCandidates publishes them).
    if (noisy && use_floor) PublishFloor(args, sample, b, key);
  }
}

// The mma.sync path: scores kCount m16 x n8 fragments that cover the same 8
// batch columns (vocab rows row0 + 16 f .. + 15 for fragment f). `col0` is the
// CTA-local batch column of fragment column 0. The per-warp staging buffer
// transposes each fragment so that a lane holds 4 consecutive vocab rows of
// one column (one Philox call serves them); 4 lanes share a column.
template <int kCount, typename Shared>
__device__ __forceinline__ void ScoreFragments(
    const float (&frags)[kCount][4], int64_t row0, int col0, int sample,
    bool store_logits, int batch_base, const FusedArgs& args, float* staging,
    Shared& shared, bool use_floor = false) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  float logits[kCount][4];
#pragma unroll
  for (int f = 0; f < kCount; ++f) {
    staging[(2 * c) * kStagingStride + g] = frags[f][0];
    staging[(2 * c + 1) * kStagingStride + g] = frags[f][1];
    staging[(2 * c) * kStagingStride + g + 8] = frags[f][2];
    staging[(2 * c + 1) * kStagingStride + g + 8] = frags[f][3];
    __syncwarp();
    const float4 v = *reinterpret_cast<const float4*>(
        &staging[(lane >> 2) * kStagingStride + 4 * (lane & 3)]);
    __syncwarp();
    logits[f][0] = v.x;
    logits[f][1] = v.y;
    logits[f][2] = v.z;
    logits[f][3] = v.w;
  }
  ScoreRuns<kCount, 4>(RegisterLogits<kCount>{logits}, row0 + 4 * (lane & 3),
                       16, col0 + (lane >> 2), sample, store_logits, batch_base,
                       args, shared, use_floor, -__int_as_float(0x7f800000));
}

// The wgmma path: scores four m16 x n8 fragments of a warp, frags[h][v] for
// batch columns col0 + 8h .. + 7 and vocab rows row0 + 64 v .. + 15 (v = 0,
// 1: the warp's rows of the two m64 halves). The staging buffer
// (kQuadStagingFloats per warp) regroups them so that a lane holds 16
// consecutive vocab rows of one column, 4 Philox calls and 16 tokens with a
// single seed: two lanes share a column.
//
// In two steps, so that a quad can be scored by another warp than the one
// whose accumulators hold it (the wgmma kernel's shared last epilogue):
// StageFragmentQuad writes a warp's fragments into a kQuadStagingFloats
// buffer, ScoreStagedQuad scores such a buffer.
__device__ __forceinline__ void StageFragmentQuad(const float (&frags)[2][2][4],
                                                  float* staging) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  // Element (row r, column n) of the quad at staging[n * stride + r], rows
  // 0-15 from half 0 and 16-31 from half 1.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float* base = staging + (8 * h + 2 * c) * kQuadStagingStride + 16 * v + g;
      base[0] = frags[h][v][0];
      base[kQuadStagingStride] = frags[h][v][1];
      base[8] = frags[h][v][2];
      base[kQuadStagingStride + 8] = frags[h][v][3];
    }
  }
}

// Writes a staged quad's logits into args.logits_out: four lanes write a
// column's 16 consecutive rows of one m64 half (64 bytes, two whole
// sectors) with one 16-byte store each, so that every store instruction
// writes whole sectors. With each lane storing its own 16 rows in four
// stores, every store wrote half a sector: at [256, 151936] on an H100
// that made 14.6M L2 write requests and 80 MB of DRAM reads on top of the
// 148 MB written, and the kernel took 620 us (now 518-535) against
// 468-483 without logits. Streaming stores: caching the logits in L2 for the
// sampler that reads them next measured the same (two A/B rounds).
__device__ __forceinline__ void StoreStagedQuadLogits(const float* staging,
                                                      int64_t row0, int col0,
                                                      int batch_base,
                                                      const FusedArgs& args) {
  const int lane = threadIdx.x & 31;
  const int half = (lane >> 2) & 1;
  const int run = lane & 3;
  // Rows at or past the shard's end are TMA's zero padding.
  const int64_t first_row = row0 + 64 * half + 4 * run;
  const int64_t rows_left = args.vocab_rows - first_row;
  const int valid =
      rows_left <= 0 ? 0 : (rows_left < 4 ? static_cast<int>(rows_left) : 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // A quarter-warp reads one column's 32 staged floats: all 32 banks.
    const int column = 4 * i + (lane >> 3);
    const int b = batch_base + col0 + column;
    if (b >= args.batch || valid == 0) continue;
    const float4 values = *reinterpret_cast<const float4*>(
        staging + column * kQuadStagingStride + 16 * half + 4 * run);
    float* dst =
        args.logits_out + static_cast<int64_t>(b) * args.vocab_rows + first_row;
    if (valid == 4 && (reinterpret_cast<uintptr_t>(dst) & 15u) == 0) {
      __stcs(reinterpret_cast<float4*>(dst), values);
    } else {
      const float scalars[4] = {values.x, values.y, values.z, values.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (q < valid) dst[q] = scalars[q];
      }
    }
  }
}

// controls::OrderKey(FoldZero(v)) (kernels/controls/controlled_math.h):
// the float's bits made monotone, -0 as +0. v + 0 is +0 for -0 and v
// otherwise (round to nearest), and the sign's mask flips the bits of a
// negative value: one FADD, one shift and one LOP3, without a compare or a
// select.
__device__ __forceinline__ uint32_t UnitOrderKey(float v) {
  const uint32_t bits = __float_as_uint(__fadd_rn(v, 0.0f));
  const uint32_t sign = static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31);
  return bits ^ (sign | 0x80000000u);
}

// The inverse of UnitOrderKey.
__device__ __forceinline__ float UnitKeyValue(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Column b's UnitCandidates::token_classes word for shard rows first_row ..
// first_row + 15, or null where the launch has no classes or writes no
// units, or b or first_row is past the batch or the shard.
__device__ __forceinline__ const uint32_t* UnitClassesWordAt(
    int b, int64_t first_row, const FusedArgs& args) {
  const UnitCandidates& units = args.unit_candidates;
  if (units.token_classes == nullptr || units.records == nullptr ||
      b >= args.batch || first_row >= args.vocab_rows) {
    return nullptr;
  }
  const int64_t class_row = units.token_classes_shared ? 0 : b;
  return units.token_classes +
         class_row * UnitClassWordsPerRow(args.vocab_rows) + first_row / 16;
}

// The token-classes word of the unit a lane ranks in the quad of the 16
// columns from col0 (StoreStagedQuadUnits), or 0xffff (every row ranked)
// where UnitClassesWordAt has none. The epilogue loads the next quad's word
// while it scores the current quad, so that the load's latency hides
// behind a quad's scoring: loaded where it is used, a row of classes per
// batch row (9.7 MB at qwen B = 256) took every control with raw logprobs
// there to 685-696 us against 652-673 (H100, alternating runs;
// docs/performance.md).
__device__ __forceinline__ uint32_t LaneUnitClasses(int64_t row0, int col0,
                                                    int batch_base,
                                                    const FusedArgs& args) {
  const int half = threadIdx.x & 1;
  const uint32_t* word = UnitClassesWordAt(
      batch_base + col0 + StagedLaneColumn(), row0 + 64 * half, args);
  return word != nullptr ? *word : 0xffffu;
}

// Brings into L2 the token-classes words of column b for the 128 rows of
// vocab tile `tile` (one 32-byte sector: words 8 tile .. 8 tile + 7 of the
// row), where the launch has a row of classes per batch row. Called by each
// consumer thread for its column as the piece's epilogue starts, so that
// the quads' own loads (LaneUnitClasses) find the words in L2 rather than
// in DRAM: the fused kernel's W traffic evicts the classes' kernel's
// output long before a tile's turn comes. evict_last, as the unit records
// are kept: with an evict_normal prefetch, qwen B = 256 with every control
// and raw logprobs took 534-539 against 516-519 us for the classes' and
// fused kernels (H100, alternating builds in one call). One row of classes
// for all rows stays in L1 and L2 without it.
__device__ __forceinline__ void PrefetchPieceUnitClasses(
    int64_t tile, int b, const FusedArgs& args) {
  if (args.unit_candidates.token_classes_shared) return;
  const uint32_t* words = UnitClassesWordAt(b, tile * kTileRows, args);
  if (words != nullptr) {
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(words));
  }
}

// Writes a staged quad's unit candidates (FusedSampleParams::
// unit_candidates): lanes 2c and 2c + 1 hold column c's rows row0 + {0..15}
// and row0 + 64 + {0..15}, one unit (slots 0-15 and 16-31). A logit ranks by
// its order key with the low 5 bits replaced by its slot, so that the keys
// are distinct and carry their slots: each lane finds the top 5 of its 16
// by sorting networks (unit_candidates.h; a row past the shard's end, or
// one token_classes does not rank, keys 0 and is in no tail, and an
// entry's logit goes to entry_logits), the pair merges the two lists, and
// the pair writes the unit's record: the logits of the top 4 whose key,
// slot bits aside, is above the 5th's, and that 5th's key with its low 5
// bits set as the bound (every logit left out is at or below it). A record
// per (row, unit), each one sector written whole by its lane pair, so that
// the merge kernel reads a row's records as one contiguous run. The row's
// highest bound and highest key are atomic maxima (one each per record).
// `classes` is the lane's LaneUnitClasses. All 32 lanes call it.
__device__ __forceinline__ void StoreStagedQuadUnits(const float* staging,
                                                     int64_t row0, int col0,
                                                     int batch_base,
                                                     uint32_t classes,
                                                     const FusedArgs& args) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr uint32_t kSlotBits = 0x1fu;
  const int lane = threadIdx.x & 31;
  const int column = StagedLaneColumn();
  const int half = lane & 1;
  const int b = batch_base + col0 + column;
  const float* column_values = staging + column * kQuadStagingStride;
  // Rows at or past the shard's end are TMA's zero padding.
  const int64_t rows_left = args.vocab_rows - (row0 + 64 * half);
  const int valid =
      rows_left <= 0 ? 0 : (rows_left < 16 ? static_cast<int>(rows_left) : 16);
  // `classes`' bit i: the lane's row i is ranked; bit 16 + i: its logit is
  // an entry's. Bit i here: row i is in the shard and ranked.
  const uint32_t ranked =
      classes & (valid >= 16 ? 0xffffu : (1u << valid) - 1u);
  const uint32_t slot_base = 16u * static_cast<uint32_t>(half);
  // NaN or infinite when a logit is; rows past the shard's end add their
  // zeros.
  float sum = 0.0f;
  // Each run of four keys sorted (SortUnitKeys4), runs 0-1 and 2-3 merged
  // into their top fives, those into the lane's.
  uint32_t top[5];
  uint32_t pair_top[5];
  uint32_t first_run[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 run =
        *reinterpret_cast<const float4*>(column_values + 16 * half + 4 * q);
    const float run_values[4] = {run.x, run.y, run.z, run.w};
    uint32_t keys[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = 4 * q + k;
      const float v = run_values[k];
      sum = __fadd_rn(sum, v);
      // A unit with a non-finite logit writes kUnitNonFinite as its bound,
      // and the merge kernel reads nothing else of such a row: such a
      // logit's key need not be kept out of the list.
      keys[k] = (UnitOrderKey(v) & ~kSlotBits) | (slot_base + i);
      if ((ranked & (1u << i)) == 0u) keys[k] = 0u;
    }
    SortUnitKeys4(keys);
    if (q % 2 == 0) {
#pragma unroll
      for (int k = 0; k < 4; ++k) first_run[k] = keys[k];
    } else if (q == 1) {
      TopFiveUnitKeysOf4And4(first_run, keys, top);
    } else {
      TopFiveUnitKeysOf4And4(first_run, keys, pair_top);
      TopFiveUnitKeysOf5And5(top, pair_top);
    }
  }
  // The unit's top 5: merge the partner's descending list into this one.
#pragma unroll
  for (int j = 0; j < 5; ++j) pair_top[j] = __shfl_xor_sync(kAll, top[j], 1);
  TopFiveUnitKeysOf5And5(top, pair_top);
  const bool non_finite =
      !isfinite(__fadd_rn(sum, __shfl_xor_sync(kAll, sum, 1)));
  // 0 when the unit has at most 4 finite logits: all are written.
  const uint32_t bound = top[4] == 0u ? 0u : (top[4] | kSlotBits);
  const uint32_t cut = top[4] & ~kSlotBits;
  // The left-out logits' mass below the bound for rows that ask (each lane
  // its own logits), -1 for the others. Left out are the logits whose key,
  // slot bits aside, is at most `cut`: on finite logits, those at or below
  // the largest value with such a key, or, where that is -0, the negative
  // ones (-0 keys as +0, above the cut). Each term exp(d), d = x - x_bound
  // at most 0, is 2^(d log2 e) within 1.8e-5 of exact (ex2.approx.ftz within
  // 2 ulp, the subtraction's and the product's roundings and log2 e's own
  // within 1.3|d| ulp, for d >= -87.4, below which the term is under 2^-126
  // of the bound's and flushes to zero), the unit's sum of at most 31 within
  // 2e-5: inside the merge kernel's 1e-3 of headroom (UnseenMassFromApprox).
  // With expf and a key per logit, the fused kernel with its units took
  // 698-720 against 652 us at qwen B = 256 (H100, two alternating runs;
  // docs/performance.md); with __expf, whose ex2 (no .ftz) takes extra
  // instructions to keep subnormal results, top_p 0.9 took 1.29-1.30x the
  // plain kernel call for call there, against 1.15-1.16x with
  // ex2.approx.ftz.
  const float inv_t =
      b < args.batch && args.unit_candidates.tail_inv_temperature != nullptr
          ? args.unit_candidates.tail_inv_temperature[b]
          : 0.0f;
  float tail = inv_t > 0.0f ? 0.0f : -1.0f;
  if (inv_t > 0.0f && bound != 0u) {
    const float top_scaled = __fmul_rn(UnitKeyValue(bound), inv_t);
    float cut_value = UnitKeyValue(cut | kSlotBits);
    if (cut_value == 0.0f) cut_value = -__int_as_float(1);
      // Read again as the selection read them, four floats a load: one float
      // a load put the pair's lanes of 4 columns on each bank.
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 run =
          *reinterpret_cast<const float4*>(column_values + 16 * half + 4 * q);
      const float run_values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float v = run_values[k];
        if ((ranked & (1u << (4 * q + k))) != 0u && v <= cut_value) {
          tail = __fadd_rn(tail, ptx::Exp2FlushSubnormal(__fmul_rn(
                                     __fsub_rn(__fmul_rn(v, inv_t), top_scaled),
                                     ptx::kLog2e)));
        }
      }
    }
  }
  tail = __fadd_rn(tail, __shfl_xor_sync(kAll, tail, 1));
  if (b >= args.batch) return;  // both lanes of the pair
  const UnitCandidates& out = args.unit_candidates;
  if ((classes >> 16) != 0u) {
    // The entries' raw logits, for the merge kernel (rows past the shard's
    // end have no class bits).
    float* row_logits =
        out.entry_logits + b * args.vocab_rows + row0 + 64 * half;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((classes >> (16 + i)) & 1u)
        row_logits[i] = column_values[16 * half + i];
    }
  }
  const int64_t unit = row0 / 128 * kUnitsPerTile + row0 % 128 / 16;
  const int64_t at = b * UnitsPerRow(args.vocab_rows) + unit;
  const uint32_t record_bound = non_finite ? kUnitNonFinite : bound;
  // Lane 2c writes the record's first 16 bytes (the raws), lane 2c + 1 the
  // other 16: one store instruction writes the warp's 16 records, each a
  // whole sector.
  uint4 part;
  if (half == 0) {
    float raws[kUnitCandidates];
#pragma unroll
    for (int j = 0; j < kUnitCandidates; ++j) {
      const bool written = top[j] != 0u && (top[j] & ~kSlotBits) > cut;
      raws[j] = written ? column_values[top[j] & kSlotBits] : 0.0f;
    }
    part = make_uint4(__float_as_uint(raws[0]), __float_as_uint(raws[1]),
                      __float_as_uint(raws[2]), __float_as_uint(raws[3]));
  } else {
    uint32_t slots = 0u;
#pragma unroll
    for (int j = 0; j < kUnitCandidates; ++j) {
      const bool written = top[j] != 0u && (top[j] & ~kSlotBits) > cut;
      const uint32_t slot = top[j] & kSlotBits;
      slots |= (written ? slot : static_cast<uint32_t>(kUnitNoSlot)) << (8 * j);
    }
    part = make_uint4(slots, record_bound, __float_as_uint(tail), 0u);
  }
  // The records' trip to DRAM, not their bytes, is what they cost: a
  // build that selected every unit's candidates but stored no record took
  // 433 against 456 us at qwen B = 128 (plain kernel 426), where the 19 MB
  // would take 6.5 us of DRAM's bandwidth. Where L2 is set aside for
  // persisting accesses (FusedSampleSetAsideL2ForUnits) the launch marks
  // the records persisting and the merge kernel discards them once read,
  // so they never leave L2: 438 against 457 us at B = 128, 442 against 455
  // at 64 (H100, alternating runs). Without it, up to 64 rows (9.7 MB at
  // qwen's V) an evict-last hint keeps most of them there (the fused
  // kernel 448 against 453 us at B = 64), and no store policy (streaming,
  // evict-first, evict-last) or record layout (unit-major whole lines,
  // packed 16-byte records, no record for a unit below the row's running
  // bound) took more than 5 us off at 128 rows.
  if (args.batch <= 64) {
    ptx::StoreGlobalHinted(reinterpret_cast<uint4*>(out.records + at) + half,
                           part, ptx::kL2EvictLast);
  } else {
    reinterpret_cast<uint4*>(out.records + at)[half] = part;
  }
  if (half == 0) {
    atomicMax(out.row_bound + b, record_bound);
    if (top[0] != 0u) {
      atomicMax(out.row_top + b,
                UnitOrderKey(column_values[top[0] & kSlotBits]));
    }
  }
}

// `classes`: the lane's LaneUnitClasses for this quad.
template <typename Shared>
__device__ __forceinline__ void ScoreStagedQuad(
    const float* staging, int64_t row0, int col0, int sample, bool store_logits,
    int batch_base, uint32_t classes, const FusedArgs& args, Shared& shared,
    float floor) {
  const int lane = threadIdx.x & 31;
  const int column = StagedLaneColumn();
  const int half = lane & 1;
  if (store_logits && args.logits_out != nullptr) {
    StoreStagedQuadLogits(staging, row0, col0, batch_base, args);
  }
  if (store_logits && args.unit_candidates.records != nullptr) {
    StoreStagedQuadUnits(staging, row0, col0, batch_base, classes, args);
  }
  const StagedLogits lane_logits{staging + column * kQuadStagingStride +
                                 16 * half};
  ScoreRuns<4, 2>(lane_logits, row0 + 64 * half, 4, col0 + column, sample,
                  /*store_logits=*/false, batch_base, args, shared,
                  /*use_floor=*/true, floor);
}

template <typename Shared>
__device__ __forceinline__ void ScoreFragmentQuad(
    const float (&frags)[2][2][4], int64_t row0, int col0, int sample,
    bool store_logits, int batch_base, uint32_t classes, const FusedArgs& args,
    float* staging, Shared& shared, float floor) {
  StageFragmentQuad(frags, staging);
  __syncwarp();
  ScoreStagedQuad(staging, row0, col0, sample, store_logits, batch_base,
                  classes, args, shared, floor);
  // Every lane is done with the staging buffer before the next call's
  // stores (ScoreRuns' last shuffles need not run).
  __syncwarp();
}

// Moves accumulator block 0 (an n8 block's 4 floats) to the end of the
// array: the mma.sync epilogue walks the n8 blocks with a run-time loop that
// always reads block 0, so the scoring code is emitted once instead of once
// per block (else 480 KB of SASS per kernel). After kBlocks
// rotations the array is back in its original order.
template <int kBlocks>
__device__ __forceinline__ void RotateBlocks(float (&acc)[kBlocks][4]) {
  float first[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) first[e] = acc[0][e];
#pragma unroll
  for (int j = 0; j + 1 < kBlocks; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = acc[j + 1][e];
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[kBlocks - 1][e] = first[e];
}

// Copies accumulator blocks 2 * pair and 2 * pair + 1 (floats 8 * pair ..
// 8 * pair + 7) of both m64 halves out of acc0 / acc1 into
// out[block][half][4], without a run-time index into the arrays (which would
// move them to local memory): one switch on the warp-uniform pair number, one
// small case per pair. One switch rather than one per block: four of them
// made ptxas spill the copies.
template <int kCount>
__device__ __forceinline__ void ReadBlockQuad(const float (&acc0)[kCount],
                                              const float (&acc1)[kCount],
                                              int pair, float (&out)[2][2][4]) {
  static_assert(kCount % 8 == 0 && kCount <= 64, "up to 8 pairs of blocks");
#define FS_READ_PAIR(i)                                      \
  case i:                                                    \
    if constexpr (8 * (i) < kCount) {                        \
      _Pragma("unroll") for (int e = 0; e < 8; ++e) {        \
        out[e / 4][0][e % 4] = acc0[(8 * (i) + e) % kCount]; \
        out[e / 4][1][e % 4] = acc1[(8 * (i) + e) % kCount]; \
      }                                                      \
    }                                                        \
    break;
  switch (pair) {
    FS_READ_PAIR(0)
    FS_READ_PAIR(1)
    FS_READ_PAIR(2)
    FS_READ_PAIR(3)
    FS_READ_PAIR(4)
    FS_READ_PAIR(5)
    FS_READ_PAIR(6)
    FS_READ_PAIR(7)
    default:
      break;
  }
#undef FS_READ_PAIR
}

// Identity of the packed reduction (loses to every real candidate).
__device__ __forceinline__ unsigned long long IdentityKey() {
  return PackCandidate(-__int_as_float(0x7f800000), kNoToken);
}

// Publishes the winners of one sample over the first `columns` batch
// columns (a half piece owns only half of them): candidates [tile][sample]
// [batch] when asked for, and/or a global atomicMax into the in-kernel
// stage-2 keys [sample][batch].
// `known_keys` (optional, [columns]): keys read earlier in this launch
// (LoadFloorKeys); a winner at or below its column's needs no atomic, since
// keys only grow.
template <typename Shared>
__device__ __forceinline__ void StoreCandidates(
    const FusedArgs& args, int64_t tile, int sample, int batch_base,
    int columns, int thread, int num_threads, const Shared& shared,
    const unsigned long long* known_keys = nullptr) {
  for (int i = thread; i < columns; i += num_threads) {
    const int b = batch_base + i;
    if (b < args.batch) {
      const unsigned long long key = shared.best[i];
      if (args.candidates != nullptr) {
        args.candidates[(tile * args.num_samples + sample) * args.batch + b] =
            UnpackCandidate(key);
      }
      if (args.keys != nullptr &&
          (known_keys == nullptr || key > known_keys[i])) {
        atomicMax(&args.keys[sample * args.batch + b], key);
      }
    }
  }
}

// In-kernel stage 2: every participant (a CTA, or a consumer warpgroup)
// calls this once at the end with its own barrier; the last of
// `participants` to arrive decodes the keys into token ids and re-zeroes
// the workspace for the next launch (CUDA's threadFenceReduction pattern).
template <typename Barrier>
__device__ __forceinline__ void FinishInKernelReduce(
    const FusedArgs& args, int thread, int num_threads,
    unsigned int participants, int* last_flag, Barrier barrier) {
  if (args.keys == nullptr) return;
  __threadfence();  // this thread's key updates before the arrival below
  barrier();
  if (thread == 0) {
    const unsigned int before = atomicAdd(args.counter, 1u);
    *last_flag = before == participants - 1 ? 1 : 0;
  }
  barrier();
  if (*last_flag == 0) return;
  __threadfence();
  const int pairs = args.num_samples * args.batch;
  for (int i = thread; i < pairs; i += num_threads) {
    const unsigned long long key = atomicExch(&args.keys[i], 0ull);
    const Candidate best =
        key == 0 ? Candidate{-__int_as_float(0x7f800000), kNoToken}
                 : UnpackCandidate(key);
    // [n][batch], the layout of one tile's candidates: i itself.
    if (args.shard_winners != nullptr) args.shard_winners[i] = best;
    if (args.token_ids == nullptr) continue;  // no stage 2 on this GPU
    const int sample = i / args.batch;
    const int b = i % args.batch;
    args.token_ids[b * args.num_samples + sample] = best.token_id;
    if (args.winning_scores != nullptr) {
      args.winning_scores[b * args.num_samples + sample] = best.score;
    }
  }
  if (thread == 0) atomicExch(args.counter, 0u);
}

}  // namespace fused
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_
