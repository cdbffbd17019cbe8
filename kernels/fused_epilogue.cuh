// The stage-1 epilogue shared by the mma.sync and wgmma kernels: turns each
// warp's m16 x n8 accumulator fragments into one (score, global token id)
// candidate per (batch row, sample) for the CTA's 128-row vocabulary tile.
//
// Both tensor-core paths leave a warp holding fragments in the same layout:
// lane (g = lane / 4, c = lane % 4) has vocab rows g and g + 8, batch columns
// 2c and 2c + 1. The noise of four consecutive global tokens 4t..4t+3 comes
// from one Philox call (NoiseBits4), so a 640-byte per-warp staging buffer
// transposes each fragment to "4 consecutive vocab rows x 1 column" per lane
// (4 shared stores + 1 vector load per 4 logits, against ~100 instructions
// of noise per logit). Four lanes then share a column; two xor-shuffles and
// one shared 64-bit atomicMax per (warp, column) merge them across the CTA.
//
// The noise is pruned exactly: cheap bounds on every token's score (from
// the Philox word alone, then from the fast logarithm) discard the tokens
// that are strictly worse than another token or than a candidate already
// published in this launch, and only the rest get the exact noise of
// kernels/philox.h. The winner, ties included, is never discarded, so the
// result is the unpruned result bit for bit (docs/perf/
// fused_kernel_attempts.md, attempts 4-6).
#ifndef FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_
#define FLASHSAMPLER_KERNELS_FUSED_EPILOGUE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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
__device__ __forceinline__ void WordBounds(float scaled, uint32_t word,
                                           float* lower, float* upper) {
  constexpr float kLn2 = 0.693147182f;
  constexpr float kMargin = 1.0f / 1024.0f;
  const int k = min(__clz(~word), 23);
  const float kf = static_cast<float>(k);
  const float noise_upper = __fmaf_ru(kf + 1.0f, kLn2, kMargin);
  const float noise_lower =
      k == 0 ? -2.8125f - kMargin : __fmaf_rd(kf, kLn2, -0.5f - kMargin);
  *lower = __fadd_rd(scaled, noise_lower);
  *upper = __fadd_ru(scaled, noise_upper);
}

// Floats per staged column: 16 rows + 4 padding, so that the four scalar
// stores of a fragment hit 32 distinct banks.
constexpr int kStagingStride = 20;
constexpr int kStagingFloats = 8 * kStagingStride;

// Epilogue shared memory of a CTA with kWarps epilogue warps and kBlockN
// batch columns.
template <int kBlockN, int kWarps>
struct EpilogueShared {
  float inv_temperature[kBlockN];
  uint64_t seed[kBlockN];
  uint64_t step[kBlockN];
  unsigned long long best[kBlockN];  // packed candidates, one sample at a time
  // Per column, a score some token of this launch already reached (see
  // LoadColumnFloors); -inf when unknown.
  float floor_score[kBlockN];
  float staging[kWarps][kStagingFloats];
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
template <int kBlockN, int kWarps>
__device__ __forceinline__ void LoadColumnParams(
    const FusedArgs& args, int batch_base, int thread, int num_threads,
    EpilogueShared<kBlockN, kWarps>& shared) {
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
// below it cannot win (PruneBounds). Only with the in-kernel stage 2 and no
// per-tile candidates: a tile's own candidate must stay exact when one is
// written out. Keys are zero at the start of every launch (the last CTA
// re-zeroes them), and every non-zero key is a real candidate of this
// launch; a stale read is still a valid floor since keys only grow.
template <int kBlockN, int kWarps>
__device__ __forceinline__ void LoadColumnFloors(
    const FusedArgs& args, int sample, int batch_base, int thread,
    int num_threads, EpilogueShared<kBlockN, kWarps>& shared) {
  const bool use = args.keys != nullptr && args.candidates == nullptr;
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

// Scores kCount m16 x n8 fragments that cover the same 8 batch columns
// (vocab rows row0[c] .. row0[c] + 15 each) for sample `sample`, and merges
// each column's best into shared.best. `col0` is the CTA-local batch column
// of fragment column 0. Taking several fragments at once gives the noise
// kCount x 4 independent chains to interleave. Called by all 32 lanes of a
// warp (the staging transpose is warp-synchronous).
template <int kCount, int kBlockN, int kWarps>
__device__ __forceinline__ void ScoreFragments(
    const float (&frags)[kCount][4], const int64_t (&row0)[kCount], int col0,
    int sample, bool store_logits, int batch_base, const FusedArgs& args,
    float* staging, EpilogueShared<kBlockN, kWarps>& shared,
    bool use_floor = false) {
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

  const int col = col0 + (lane >> 2);
  const int b = batch_base + col;
  int64_t row[kCount];  // shard-local row of logits[f][0]
#pragma unroll
  for (int f = 0; f < kCount; ++f) row[f] = row0[f] + 4 * (lane & 3);
  float best_score = -__int_as_float(0x7f800000);  // -inf
  int32_t best_id = kNoToken;
  if (b < args.batch) {
    if (store_logits && args.logits_out != nullptr) {
      float* out = args.logits_out + static_cast<int64_t>(b) * args.vocab_rows;
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (row[f] + q < args.vocab_rows) out[row[f] + q] = logits[f][q];
        }
      }
    }
    const float inv_temperature = shared.inv_temperature[col];
    if (inv_temperature == 0.0f) {
      // Greedy: argmax of the logit itself, no noise.
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int32_t id =
              static_cast<int32_t>(args.vocab_offset + row[f] + q);
          if (row[f] + q < args.vocab_rows &&
              CandidateBetter(logits[f][q], id, best_score, best_id)) {
            best_score = logits[f][q];
            best_id = id;
          }
        }
      }
    } else {
      const uint64_t seed = shared.seed[col];
      const uint64_t step = shared.step[col];
      // Tokens token0 .. token0 + 3 take words o .. o + 3 of the Philox
      // groups token0 / 4 and token0 / 4 + 1, o = token0 % 4. With shard
      // offsets a multiple of 4 (the usual case) o = 0 and one call serves
      // the four tokens; the second call runs only otherwise (o is the same
      // for the whole launch, so the branch never diverges).
      const uint32_t o = static_cast<uint32_t>(args.vocab_offset & 3);
      Philox4x32 lo[kCount];
      Philox4x32 hi[kCount];
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
        const uint32_t group =
            static_cast<uint32_t>((args.vocab_offset + row[f]) >> 2);
        lo[f] = NoiseBits4(seed, step, static_cast<uint32_t>(sample), group);
        hi[f] = lo[f];
        if (o != 0) {
          hi[f] =
              NoiseBits4(seed, step, static_cast<uint32_t>(sample), group + 1);
        }
      }
      // Exact pruning, in three steps of growing cost: bounds from the
      // Philox word alone (WordBounds, no logarithm) against the column's
      // best lower bound and the launch's floor; for the few tokens left,
      // bounds from the fast logarithm (PruneBounds) against that and the
      // best exact score so far; the exact noise only for what is left
      // (about 1 token per column early in a launch, almost none once the
      // floor is known).
      uint32_t words[kCount][4];
      bool valid[kCount][4];
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
        const int64_t rows_left = args.vocab_rows - row[f];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          valid[f][q] = q < rows_left;
          if (o == 0) {
            words[f][q] = lo[f].v[q];
          } else {
            const uint32_t index = o + q;  // 1 .. 6
            words[f][q] = index < 4 ? SelectWord(lo[f], index)
                                    : SelectWord(hi[f], index - 4);
          }
        }
      }
      float scaled[kCount][4];
      float upper[kCount][4];
      float threshold = use_floor ? shared.floor_score[col]
                                  : -__int_as_float(0x7f800000);  // -inf
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          scaled[f][q] = __fmul_rn(logits[f][q], inv_temperature);
          float lower;
          WordBounds(scaled[f][q], words[f][q], &lower, &upper[f][q]);
          if (valid[f][q]) threshold = fmaxf(threshold, lower);
        }
      }
      // The four lanes of a column take this branch together.
      const unsigned group_mask = 0xfu << (lane & ~3);
#pragma unroll
      for (int offset = 1; offset <= 2; offset <<= 1) {
        threshold =
            fmaxf(threshold, __shfl_xor_sync(group_mask, threshold, offset));
      }
      uint32_t survivors = 0;
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (valid[f][q] && upper[f][q] >= threshold) {
            survivors |= 1u << (4 * f + q);
          }
        }
      }
      while (survivors != 0) {
        const int pick = __ffs(survivors) - 1;
        survivors &= survivors - 1;
        float logit = 0.0f;
        float pick_scaled = 0.0f;
        uint32_t word = 0;
        int64_t pick_row = 0;
#pragma unroll
        for (int f = 0; f < kCount; ++f) {
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            if (pick == 4 * f + q) {
              logit = logits[f][q];
              pick_scaled = scaled[f][q];
              word = words[f][q];
              pick_row = row[f] + q;
            }
          }
        }
        const float u = UniformFromBits(word);
        float fast_lower;
        float fast_upper;
        PruneBounds(pick_scaled, u, &fast_lower, &fast_upper);
        // Strictly below a token's lower bound or an evaluated candidate:
        // strictly worse than that token, so it cannot win.
        if (fast_upper < fmaxf(threshold, best_score)) continue;
        const float score =
            GumbelScore(logit, inv_temperature, FastGumbelFromUniform(u));
        const int32_t id = static_cast<int32_t>(args.vocab_offset + pick_row);
        if (CandidateBetter(score, id, best_score, best_id)) {
          best_score = score;
          best_id = id;
        }
      }
    }
  }
  // With pruning most calls leave no candidate in the whole warp: skip the
  // merge then (warp-uniform).
  if (!__any_sync(0xffffffffu, best_id != kNoToken)) return;
    // Lanes 4k..4k+3 hold the same column.
#pragma unroll
  for (int offset = 1; offset <= 2; offset <<= 1) {
    const float other_score = __shfl_xor_sync(0xffffffffu, best_score, offset);
    const int32_t other_id = __shfl_xor_sync(0xffffffffu, best_id, offset);
    if (CandidateBetter(other_score, other_id, best_score, best_id)) {
      best_score = other_score;
      best_id = other_id;
    }
  }
  if ((lane & 3) == 0 && b < args.batch && best_id != kNoToken) {
    atomicMax(&shared.best[col], PackCandidate(best_score, best_id));
  }
}

// Moves accumulator block 0 (4 floats) to the end of the array: the
// epilogue walks the n8 blocks with a run-time loop that always reads block
// 0, so the ~1000-instruction scoring code is emitted once instead of once
// per block (device run 2: 480 KB of SASS per kernel). After kCount / 4
// rotations the array is back in its original order.
template <int kCount>
__device__ __forceinline__ void RotateBlocks(float (&acc)[kCount]) {
  const float t0 = acc[0];
  const float t1 = acc[1];
  const float t2 = acc[2];
  const float t3 = acc[3];
#pragma unroll
  for (int i = 0; i + 4 < kCount; ++i) acc[i] = acc[i + 4];
  acc[kCount - 4] = t0;
  acc[kCount - 3] = t1;
  acc[kCount - 2] = t2;
  acc[kCount - 1] = t3;
}

// Copies accumulator block `block` (floats 4 * block .. 4 * block + 3) out
// of `acc` without a run-time index into the array (which would move it to
// local memory): a switch on the warp-uniform block number, one small case
// per block. Costs a jump and 4 moves per call, where RotateBlocks costs
// kCount moves (the wgmma kernel: 128 moves per 8 logits per lane).
template <int kCount>
__device__ __forceinline__ void ReadBlock(const float (&acc)[kCount], int block,
                                          float (&out)[4]) {
  static_assert(kCount % 4 == 0 && kCount <= 64, "up to 16 blocks of 4");
#define FS_READ_BLOCK(i)                    \
  case i:                                   \
    if constexpr (4 * (i) < kCount) {       \
      out[0] = acc[4 * (i) % kCount];       \
      out[1] = acc[(4 * (i) + 1) % kCount]; \
      out[2] = acc[(4 * (i) + 2) % kCount]; \
      out[3] = acc[(4 * (i) + 3) % kCount]; \
    }                                       \
    break;
  switch (block) {
    FS_READ_BLOCK(0)
    FS_READ_BLOCK(1)
    FS_READ_BLOCK(2)
    FS_READ_BLOCK(3)
    FS_READ_BLOCK(4)
    FS_READ_BLOCK(5)
    FS_READ_BLOCK(6)
    FS_READ_BLOCK(7)
    FS_READ_BLOCK(8)
    FS_READ_BLOCK(9)
    FS_READ_BLOCK(10)
    FS_READ_BLOCK(11)
    FS_READ_BLOCK(12)
    FS_READ_BLOCK(13)
    FS_READ_BLOCK(14)
    FS_READ_BLOCK(15)
    default:
      break;
  }
#undef FS_READ_BLOCK
}

// Identity of the packed reduction (loses to every real candidate).
__device__ __forceinline__ unsigned long long IdentityKey() {
  return PackCandidate(-__int_as_float(0x7f800000), kNoToken);
}

// Publishes the CTA's winners of one sample: candidates [tile][sample]
// [batch] when asked for, and/or a global atomicMax into the in-kernel
// stage-2 keys [sample][batch].
template <int kBlockN, int kWarps>
__device__ __forceinline__ void StoreCandidates(
    const FusedArgs& args, int64_t tile, int sample, int batch_base, int thread,
    int num_threads, const EpilogueShared<kBlockN, kWarps>& shared) {
  for (int i = thread; i < kBlockN; i += num_threads) {
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
