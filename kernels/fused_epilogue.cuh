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
// every other operation is the same round-to-nearest operation in the same
// order.
__device__ __forceinline__ float FastAccurateLog(float x) {
  constexpr float kLn2Hi = 6.9313812256e-01f;
  constexpr float kLn2Lo = 9.0580006145e-06f;
  constexpr float kLg1 = 0.66666662693f;
  constexpr float kLg2 = 0.40000972152f;
  constexpr float kLg3 = 0.28498786688f;
  constexpr float kLg4 = 0.24279078841f;
  uint32_t bits = __float_as_uint(x);
  bits += 0x3f800000u - 0x3f3504f3u;
  const int k = static_cast<int>(bits >> 23) - 0x7f;
  bits = (bits & 0x007fffffu) + 0x3f3504f3u;
  const float f = __fsub_rn(__uint_as_float(bits), 1.0f);
  const float s = DivideInLogRange(f, __fadd_rn(2.0f, f));
  const float z = __fmul_rn(s, s);
  const float w = __fmul_rn(z, z);
  const float t1 = __fmul_rn(w, __fadd_rn(kLg2, __fmul_rn(w, kLg4)));
  const float t2 = __fmul_rn(z, __fadd_rn(kLg1, __fmul_rn(w, kLg3)));
  const float r = __fadd_rn(t2, t1);
  const float hfsq = __fmul_rn(0.5f, __fmul_rn(f, f));
  const float dk = static_cast<float>(k);
  const float small =
      __fadd_rn(__fmul_rn(s, __fadd_rn(hfsq, r)), __fmul_rn(dk, kLn2Lo));
  return __fadd_rn(__fmul_rn(dk, kLn2Hi), __fsub_rn(f, __fsub_rn(hfsq, small)));
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
    float* staging, EpilogueShared<kBlockN, kWarps>& shared) {
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
    float scores[kCount][4];
    if (inv_temperature == 0.0f) {
      // Greedy: argmax of the logit itself, no noise.
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) scores[f][q] = logits[f][q];
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
#pragma unroll
      for (int f = 0; f < kCount; ++f) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const uint32_t index = o + q;  // 0 .. 6
          const uint32_t word = index < 4 ? SelectWord(lo[f], index)
                                          : SelectWord(hi[f], index - 4);
          scores[f][q] =
              GumbelScore(logits[f][q], inv_temperature,
                          FastGumbelFromUniform(UniformFromBits(word)));
        }
      }
    }
#pragma unroll
    for (int f = 0; f < kCount; ++f) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int32_t id = static_cast<int32_t>(args.vocab_offset + row[f] + q);
        if (row[f] + q < args.vocab_rows &&
            CandidateBetter(scores[f][q], id, best_score, best_id)) {
          best_score = scores[f][q];
          best_id = id;
        }
      }
    }
  }
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
