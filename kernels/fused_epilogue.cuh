// The stage-1 epilogue shared by the mma.sync and wgmma kernels: turns each
// warp's m16 x n8 accumulator fragments into one (score, global token id)
// candidate per (batch row, sample) for the CTA's 128-row vocabulary tile.
//
// Both tensor-core paths leave a warp holding fragments in the same layout:
// lane (g = lane / 4, c = lane % 4) has vocab rows g and g + 8, batch columns
// 2c and 2c + 1. The noise of four consecutive global tokens 4t..4t+3 comes
// from one Philox call (NoiseBits4), so a per-warp staging buffer transposes
// the fragments into runs of 4 consecutive vocab rows of one column per
// lane: the mma.sync path stages one fragment at a time (8 rows, 2 runs per
// lane, 4 lanes per column: ScoreFragments); the wgmma path stages four
// (16 rows, 4 runs per lane, 2 lanes per column: ScoreFragmentQuad), which
// gives its single epilogue warp per scheduler 4 independent Philox chains.
// ScoreRuns scores a lane's runs; xor-shuffles and one shared 64-bit
// atomicMax per (warp, column) merge a column across the CTA.
//
// The noise is pruned exactly: cheap bounds on every token's score (from
// the Philox word alone, then from the fast logarithm) discard the tokens
// that are strictly worse than another token or than a candidate already
// published in this launch, and only the rest get the exact noise of
// kernels/philox.h. The winner, ties included, is never discarded, so the
// result is the unpruned result bit for bit (docs/perf/
// fused_kernel_attempts.md, attempts 4-6 and 10).
#ifndef FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_
#define FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fused_sampler_internal.h"
#include "kernels/philox.h"

namespace flashsampler {
namespace fused {

// Element type of a DTypeTag.
template <DTypeTag kDType>
struct ElementOf {
  using Type = __nv_bfloat16;
};
template <>
struct ElementOf<DTypeTag::kFp16> {
  using Type = __half;
};

// The noise of kernels/philox.h computed without branches. AccurateLog's one
// division s = f / (2 + f) is the only non-straight-line operation there:
// __fdiv_rn compiles to a fast path (reciprocal, one Newton step, one FMA
// correction) guarded by FCHK and a call to a slow path for operands near
// the exponent limits, and that call splits the epilogue's four independent
// log chains into separate basic blocks (device run 2: ~3100 cycles per
// fragment, ~6x its instruction count). AccurateLog only divides f in
// [-0.30, 0.42] by 2 + f in [1.7, 2.5], where FCHK never fails, so the fast
// path alone is __fdiv_rn. DivideInLogRange is that fast path, instruction
// for instruction as nvcc emits it (MUFU.RCP, FFMA x5);
// NoiseSelfCheck compares FastGumbelFromUniform with GumbelFromUniform for
// all 2^23 uniforms, bit for bit (a GPU test, and the CUDA engine at start).
__device__ __forceinline__ float DivideInLogRange(float f, float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(-d, r, 1.0f);
  r = __fmaf_rn(r, e, r);
  const float q = __fmaf_rn(f, r, 0.0f);
  const float remainder = __fmaf_rn(-d, q, f);
  return __fmaf_rn(r, remainder, q);
}

// AccurateLog (kernels/philox.h) with DivideInLogRange for the division;
// every other operation is AccurateLog's own.
struct LogRangeDivide {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return DivideInLogRange(a, b);
  }
};

__device__ __forceinline__ float FastAccurateLog(float x) {
  return AccurateLogWithDivide(x, LogRangeDivide{});
}

// bits.v[index] without a run-time index into an array (which would put
// the four words in local memory).
__device__ __forceinline__ uint32_t SelectWord(const Philox4x32& bits,
                                               uint32_t index) {
  const uint32_t low = (index & 1u) ? bits.v[1] : bits.v[0];
  const uint32_t high = (index & 1u) ? bits.v[3] : bits.v[2];
  return (index & 2u) ? high : low;
}

__device__ __forceinline__ float FastGumbelFromUniform(float u) {
  return -FastAccurateLog(-FastAccurateLog(u));
}

// Bounds on GumbelScore(logit, inv_temperature, FastGumbelFromUniform(u))
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

// Bounds on the same score from the Philox word alone, no logarithm. The
// uniform is u = (2m + 1) 2^-24 with m the word's top 23 bits; let k be the
// number of leading one bits of m (0 .. 23). Then u < 1 - 2^-(k+1), and
// since -ln(1 - x) > x the noise -ln(-ln u) < (k + 1) ln 2. For k >= 1,
// u > 1 - 2^-k and -ln(1 - x) <= x + x^2 for x <= 1/2 give a noise
// > k ln 2 - ln(1 + 2^-k) >= k ln 2 - 0.5; for k = 0 the noise is at least
// -ln(-ln 2^-24) = -2.8116. The exact fp32 noise is within 1e-5 of the
// real one, inside the 2^-10 margins; sums are rounded outwards as in
// PruneBounds.
constexpr float kWordBoundLn2 = 0.693147182f;
constexpr float kWordBoundMargin = 1.0f / 1024.0f;

__device__ __forceinline__ float WordUpperBound(float scaled, uint32_t word) {
  const float kf = static_cast<float>(min(__clz(~word), 23));
  return __fadd_ru(scaled,
                   __fmaf_ru(kf + 1.0f, kWordBoundLn2, kWordBoundMargin));
}

__device__ __forceinline__ void WordBounds(float scaled, uint32_t word,
                                           float* lower, float* upper) {
  const int k = min(__clz(~word), 23);
  const float noise_lower =
      k == 0 ? -2.8125f - kWordBoundMargin
             : __fmaf_rd(static_cast<float>(k), kWordBoundLn2,
                         -0.5f - kWordBoundMargin);
  *lower = __fadd_rd(scaled, noise_lower);
  *upper = WordUpperBound(scaled, word);
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
// batch columns, kStaging floats of staging per warp.
template <int kBlockN, int kWarps, int kStaging = kStagingFloats>
struct EpilogueShared {
  static constexpr int kColumns = kBlockN;
  float inv_temperature[kBlockN];
  uint64_t seed[kBlockN];
  uint64_t step[kBlockN];
  unsigned long long best[kBlockN];  // packed candidates, one sample at a time
  // Per column, a score some token of this launch already reached (see
  // LoadColumnFloors); -inf when unknown.
  float floor_score[kBlockN];
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
    shared.step[i] = valid ? args.steps[b] : 0;
  }
}

// Loads, per batch column, the score of the best candidate any CTA has
// published so far for (sample, row) into the in-kernel stage-2 keys. The
// final winner scores at least that much, so a token whose score is bounded
// below it cannot win (PruneBounds). Where per-tile candidates are written
// (StoreCandidates), every key is also one of them, so a tile pruned
// against it may report a dominated candidate without changing the
// reduction; without them the keys are the reduction. Keys are zero at the
// start of every launch (the last CTA re-zeroes them), and every non-zero
// key is a real candidate of this launch; a stale read is still a valid
// floor since keys only grow.
template <typename Shared>
__device__ __forceinline__ void LoadColumnFloors(const FusedArgs& args,
                                                 int sample, int batch_base,
                                                 int thread, int num_threads,
                                                 Shared& shared) {
  constexpr int kBlockN = Shared::kColumns;
  const bool use = args.keys != nullptr;
  for (int i = thread; i < kBlockN; i += num_threads) {
    const int b = batch_base + i;
    float floor = -__int_as_float(0x7f800000);  // -inf
    if (use && b < args.batch) {
      const unsigned long long key =
          *reinterpret_cast<const volatile unsigned long long*>(
              &args.keys[sample * args.batch + b]);
      if (key != 0) floor = UnpackCandidate(key).score;
    }
    shared.floor_score[i] = floor;
  }
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

// Scores one lane's share of a column: kRuns runs of 4 consecutive vocab rows
// (shard-local rows row0 + f * run_stride .. + 3, logits.Run(f)) of CTA-local
// batch column `col`, for sample `sample`, and merges the column's best into
// shared.best. kLanesPerColumn aligned lanes hold the same column (4 for the
// mma.sync staging, 2 for the wgmma one); all 32 lanes of the warp call this
// together. More runs per lane give the noise more independent chains to
// interleave (a single epilogue warp per scheduler is latency-bound: device
// profile 2026-11-22, docs/perf/fused_kernel_attempts.md attempt 10).
// `logits` gives the lane's logits: Run(f) the 4 of run f, At(i) logit i = 4f
// + q; the wgmma path reads them from its staging buffer when needed rather
// than keeping 16 of them live next to the 128 accumulators.
template <int kRuns, int kLanesPerColumn, typename Logits, typename Shared>
__device__ __forceinline__ void ScoreRuns(const Logits& logits, int64_t row0,
                                          int run_stride, int col, int sample,
                                          bool store_logits, int batch_base,
                                          const FusedArgs& args, Shared& shared,
                                          bool use_floor) {
  static_assert(kLanesPerColumn == 2 || kLanesPerColumn == 4, "lane groups");
  // Rows as arithmetic, not an array: a run-time pick into an array of
  // rows put it in local memory.
  const auto row = [row0, run_stride](int f) { return row0 + f * run_stride; };
  // Rows at or past the shard's end are TMA's zero padding. Counted once in
  // 32 bits from row0: a 64-bit compare per token cost ~50 instructions per
  // call (profile of attempt 10b).
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
  if (in_batch && store_logits && args.logits_out != nullptr) {
    float* out = args.logits_out + static_cast<int64_t>(b) * args.vocab_rows;
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
      const float4 run = logits.Run(f);
      const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (valid(f, q)) out[row(f) + q] = values[q];
      }
    }
  }
  float best_score = -__int_as_float(0x7f800000);  // -inf
  int32_t best_id = kNoToken;
  // Exact pruning, in three steps of growing cost: bounds from the Philox
  // word alone (WordBounds, no logarithm) against the column's best lower
  // bound and the launch's floor; for the few tokens left, bounds from the
  // fast logarithm (PruneBounds) against that and the best exact score so
  // far; the exact noise only for what is left (about 1 token per column
  // early in a launch, almost none once the floor is known).
  // Only the upper bounds stay live: a survivor's Philox word is computed
  // again (survivors are rare, and 16 more live registers per lane made the
  // 128-column wgmma kernel spill).
  float upper[kRuns][4];
  float threshold = -__int_as_float(0x7f800000);  // -inf
  uint64_t seed = 0;
  uint64_t step = 0;
  const bool floors_known =
      use_floor &&
      __all_sync(0xffffffffu, !noisy || shared.floor_score[col] >
                                            -__int_as_float(0x7f800000));
  if (noisy) {
    seed = shared.seed[col];
    step = shared.step[col];
    if (use_floor) threshold = shared.floor_score[col];
    // Tokens token0 .. token0 + 3 take words o .. o + 3 of the Philox
    // groups token0 / 4 and token0 / 4 + 1, o = token0 % 4. With shard
    // offsets a multiple of 4 (the usual case) o = 0 and one call serves
    // the four tokens; the second call runs only otherwise (o is the same
    // for the whole launch, so the branch never diverges).
    const uint32_t o = static_cast<uint32_t>(args.vocab_offset & 3);
    // with_lower: also the tokens' own lower bounds for the threshold.
    const auto bound_runs = [&](auto with_lower) {
#pragma unroll
      for (int f = 0; f < kRuns; ++f) {
        const uint32_t group =
            static_cast<uint32_t>((args.vocab_offset + row(f)) >> 2);
        const Philox4x32 lo =
            NoiseBits4(seed, step, static_cast<uint32_t>(sample), group);
        Philox4x32 hi = lo;
        if (o != 0) {
          hi = NoiseBits4(seed, step, static_cast<uint32_t>(sample), group + 1);
        }
        const float4 run = logits.Run(f);
        const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t word = lo.v[q];
          if (o != 0) {
            const uint32_t index = o + q;  // 1 .. 6
            word =
                index < 4 ? SelectWord(lo, index) : SelectWord(hi, index - 4);
          }
          const float scaled = __fmul_rn(values[q], inv_temperature);
          if constexpr (decltype(with_lower)::value) {
            float lower;
            WordBounds(scaled, word, &lower, &upper[f][q]);
            if (valid(f, q)) threshold = fmaxf(threshold, lower);
          } else {
            upper[f][q] = WordUpperBound(scaled, word);
          }
        }
      }
    };
    // Once every sampled column of the warp has a floor (after a CTA's
    // first items), a token's own lower bound almost never beats it: skip
    // them (warp-uniform; ~4 instructions per token). Pruning against the
    // floor alone is just as exact, only looser.
    if (floors_known) {
      bound_runs(std::false_type{});
    } else {
      bound_runs(std::true_type{});
    }
  }
  // The lanes of a column hold the same `noisy`; the others pass -inf.
#pragma unroll
  for (int offset = 1; offset < kLanesPerColumn; offset <<= 1) {
    threshold =
        fmaxf(threshold, __shfl_xor_sync(0xffffffffu, threshold, offset));
  }
  if (noisy) {
    uint32_t survivors = 0;
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (valid(f, q) && upper[f][q] >= threshold) {
          survivors |= 1u << (4 * f + q);
        }
      }
    }
    while (survivors != 0) {
      const int pick = __ffs(survivors) - 1;
      survivors &= survivors - 1;
      const float logit = logits.At(pick);
      const int64_t pick_row = row(pick / 4) + (pick & 3);
      const int64_t token = args.vocab_offset + pick_row;
      const uint32_t word =
          SelectWord(NoiseBits4(seed, step, static_cast<uint32_t>(sample),
                                static_cast<uint32_t>(token >> 2)),
                     static_cast<uint32_t>(token & 3));
      const float u = UniformFromBits(word);
      float fast_lower;
      float fast_upper;
      PruneBounds(__fmul_rn(logit, inv_temperature), u, &fast_lower,
                  &fast_upper);
      // Strictly below a token's lower bound or an evaluated candidate:
      // strictly worse than that token, so it cannot win.
      if (fast_upper < fmaxf(threshold, best_score)) continue;
      const float score =
          GumbelScore(logit, inv_temperature, FastGumbelFromUniform(u));
      const int32_t id = static_cast<int32_t>(token);
      if (CandidateBetter(score, id, best_score, best_id)) {
        best_score = score;
        best_id = id;
      }
    }
  } else if (in_batch) {
    // Greedy: argmax of the logit itself, no noise.
#pragma unroll
    for (int f = 0; f < kRuns; ++f) {
      const float4 run = logits.Run(f);
      const float values[4] = {run.x, run.y, run.z, run.w};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int32_t id = static_cast<int32_t>(args.vocab_offset + row(f) + q);
        if (valid(f, q) &&
            CandidateBetter(values[q], id, best_score, best_id)) {
          best_score = values[q];
          best_id = id;
        }
      }
    }
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
    atomicMax(&shared.best[col], PackCandidate(best_score, best_id));
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
                       args, shared, use_floor);
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

template <typename Shared>
__device__ __forceinline__ void ScoreStagedQuad(
    const float* staging, int64_t row0, int col0, int sample, bool store_logits,
    int batch_base, const FusedArgs& args, Shared& shared, bool use_floor) {
  const int lane = threadIdx.x & 31;
  const int column = lane >> 1;
  const int half = lane & 1;
  const StagedLogits lane_logits{staging + column * kQuadStagingStride +
                                 16 * half};
  ScoreRuns<4, 2>(lane_logits, row0 + 64 * half, 4, col0 + column, sample,
                  store_logits, batch_base, args, shared, use_floor);
}

template <typename Shared>
__device__ __forceinline__ void ScoreFragmentQuad(
    const float (&frags)[2][2][4], int64_t row0, int col0, int sample,
    bool store_logits, int batch_base, const FusedArgs& args, float* staging,
    Shared& shared, bool use_floor) {
  StageFragmentQuad(frags, staging);
  __syncwarp();
  ScoreStagedQuad(staging, row0, col0, sample, store_logits, batch_base, args,
                  shared, use_floor);
  // Every lane is done with the staging buffer before the next call's
  // stores (ScoreRuns' last shuffles need not run).
  __syncwarp();
}

// Moves accumulator block 0 (an n8 block's 4 floats) to the end of the
// array: the mma.sync epilogue walks the n8 blocks with a run-time loop that
// always reads block 0, so the scoring code is emitted once instead of once
// per block (device run 2: 480 KB of SASS per kernel). After kBlocks
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
// made ptxas spill the copies (attempt 10).
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
template <typename Shared>
__device__ __forceinline__ void StoreCandidates(const FusedArgs& args,
                                                int64_t tile, int sample,
                                                int batch_base, int columns,
                                                int thread, int num_threads,
                                                const Shared& shared) {
  for (int i = thread; i < columns; i += num_threads) {
    const int b = batch_base + i;
    if (b < args.batch) {
      const unsigned long long key = shared.best[i];
      if (args.candidates != nullptr) {
        args.candidates[(tile * args.num_samples + sample) * args.batch + b] =
            UnpackCandidate(key);
      }
      if (args.keys != nullptr) {
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
