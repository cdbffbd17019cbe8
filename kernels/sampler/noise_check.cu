// The self-checks of the stage-1 kernels' noise: all 2^23 uniforms through
// the epilogue's branch-free noise (FastAccurateLog, FastBlockSlotGumbel)
// and philox.h's, compared bit for bit (see DivideInLogRange in
// fused_epilogue.cuh for why they agree), and through the pruning brackets
// (WordUpperBound, WordLowerBound, PruneBounds, the block bounds), which
// must contain the exact score or pruning would change tokens.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_epilogue.cuh"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {
namespace {

constexpr uint32_t kUniforms = 1u << 23;

__global__ void NoiseSelfCheckKernel(unsigned int* mismatches) {
  const uint32_t stride = gridDim.x * blockDim.x;
  unsigned int local = 0;
  for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m < kUniforms;
       m += stride) {
    const float u = UniformFromBits(m << 9);
    // The branch-free logarithm on both of GumbelFromUniform's arguments.
    const float fast = -fused::FastAccurateLog(-fused::FastAccurateLog(u));
    const float reference = GumbelFromUniform(u);
    if (__float_as_uint(fast) != __float_as_uint(reference)) ++local;
    // Block noise with U in cell m: the first slot, and another slot whose
    // word is a scrambled cell (so both logarithms see many mantissas).
    const NoiseBlock block{0, u};
    const uint32_t word = (m * 2654435761u) << 9;
    const float reference_min = BlockMinExponential(u, RoundedDivide{});
    for (int first = 0; first <= 1; ++first) {
      const float fast_block =
          fused::FastBlockSlotGumbel(block, first != 0, word);
      const float reference_block =
          BlockSlotGumbel(reference_min, first != 0, word, RoundedDivide{});
      if (__float_as_uint(fast_block) != __float_as_uint(reference_block)) {
        ++local;
      }
    }
  }
  if (local != 0) atomicAdd(mismatches, local);
}

// (logit, inv_temperature) pairs the brackets are checked at besides the
// bare noise (scaled = 0): the bounds round the sum scaled + noise outwards,
// so they must hold at every magnitude, where rounding absorbs most of the
// noise, not just at 0.
struct BracketScale {
  float logit;
  float inv_temperature;
};
__constant__ BracketScale kBracketScales[] = {
    {0.0f, 1.0f},      {3.5f, 1.0f}, {-17.25f, 0.5f},        {1000.0f, 1.7f},
    {-0.0375f, 10.0f}, {1.0f, 0.1f}, {-65536.0f, 1.4285715f}};
constexpr int kNumBracketScales =
    sizeof(kBracketScales) / sizeof(kBracketScales[0]);

// Counts, per bracket, the (uniform, word, scale) triples whose exact
// score lies outside it. The bounds come from the epilogue's own functions
// with the arguments ScoreRuns passes them (scaled = __fmul_rn(logit,
// inv_temperature), the Philox word, u = UniformFromBits(word), a block's
// uniform). Cell m is checked as a token's uniform v (its Gumbel
// -ln(-ln v), what PruneBounds brackets, and the noise of a slot that is not
// its block's first, under the smallest E_min, where that noise is largest,
// for WordUpperBound; under three block uniforms for WordLowerBound; with
// the word's 9 unused low bits all 0 and all 1: the word bounds read the
// whole word, UniformFromBits only the top 23 bits) and as a block's
// uniform U (the first slot's noise, and another slot's with v in the top
// cell, the largest other noise of that block).
// Comparisons are negated so that a NaN bound counts as a violation.
__global__ void NoiseBracketCheckKernel(unsigned int* violations) {
  const uint32_t stride = gridDim.x * blockDim.x;
  unsigned int local[kNoiseBracketCount] = {};
  const float smallest_min =
      BlockMinExponential(UniformFromBits(0xffffffffu), RoundedDivide{});
  for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m < kUniforms;
       m += stride) {
    const uint32_t word_low = m << 9;
    const float u = UniformFromBits(word_low);
    const float noise = GumbelFromUniform(u);
    const float other_noise =
        BlockSlotGumbel(smallest_min, false, word_low, RoundedDivide{});
    const float block_min = BlockMinExponential(u, RoundedDivide{});
    const float first_noise =
        BlockSlotGumbel(block_min, true, 0u, RoundedDivide{});
    const float largest_other_noise =
        BlockSlotGumbel(block_min, false, 0xffffffffu, RoundedDivide{});
    // WordLowerBound: cell m as the token's v under three block uniforms
    // (its own cell, a scrambled cell, the top cell: the smallest E_min).
    const float lower_uniforms[3] = {u, UniformFromBits((m * 2654435761u) << 9),
                                     UniformFromBits(0xffffffffu)};
    float lower_noise[3];
    for (int j = 0; j < 3; ++j) {
      lower_noise[j] = BlockSlotGumbel(
          BlockMinExponential(lower_uniforms[j], RoundedDivide{}), false,
          word_low, RoundedDivide{});
    }
    for (int i = 0; i < kNumBracketScales; ++i) {
      const float logit = kBracketScales[i].logit;
      const float inv_temperature = kBracketScales[i].inv_temperature;
      const float scaled = __fmul_rn(logit, inv_temperature);
      const float other_score =
          GumbelScore(logit, inv_temperature, other_noise);
      for (uint32_t low = 0; low <= 0x1ffu; low += 0x1ffu) {
        if (!(fused::WordUpperBound(scaled, word_low | low) >= other_score)) {
          ++local[kNoiseBracketWordUpper];
        }
        for (int j = 0; j < 3; ++j) {
          const float lower_score =
              GumbelScore(logit, inv_temperature, lower_noise[j]);
          if (!(fused::WordLowerBound(scaled, word_low | low,
                                      lower_uniforms[j]) <= lower_score)) {
            ++local[kNoiseBracketWordLower];
          }
        }
      }
      const float score = GumbelScore(logit, inv_temperature, noise);
      float lower;
      float upper;
      fused::PruneBounds(scaled, u, &lower, &upper);
      if (!(lower <= score)) ++local[kNoiseBracketLogLower];
      if (!(upper >= score)) ++local[kNoiseBracketLogUpper];
      const float first_score =
          GumbelScore(logit, inv_temperature, first_noise);
      const float block_upper = fused::BlockUpperBound(scaled, u);
      if (!(fused::BlockFirstLowerBound(scaled, u) <= first_score)) {
        ++local[kNoiseBracketBlockFirstLower];
      }
      if (!(block_upper >= first_score)) ++local[kNoiseBracketBlockFirstUpper];
      if (!(block_upper >=
            GumbelScore(logit, inv_temperature, largest_other_noise))) {
        ++local[kNoiseBracketBlockOtherUpper];
      }
    }
  }
  for (int b = 0; b < kNoiseBracketCount; ++b) {
    if (local[b] != 0) atomicAdd(&violations[b], local[b]);
  }
}

}  // namespace

cudaError_t LaunchNoiseBracketCheck(unsigned int* violations,
                                    cudaStream_t stream) {
  if (violations == nullptr) return cudaErrorInvalidValue;
  cudaError_t error = cudaMemsetAsync(
      violations, 0, kNoiseBracketCount * sizeof(unsigned int), stream);
  if (error != cudaSuccess) return error;
  NoiseBracketCheckKernel<<<1024, 256, 0, stream>>>(violations);
  return cudaGetLastError();
}

cudaError_t LaunchNoiseSelfCheck(unsigned int* mismatches,
                                 cudaStream_t stream) {
  if (mismatches == nullptr) return cudaErrorInvalidValue;
  cudaError_t error =
      cudaMemsetAsync(mismatches, 0, sizeof(unsigned int), stream);
  if (error != cudaSuccess) return error;
  NoiseSelfCheckKernel<<<1024, 256, 0, stream>>>(mismatches);
  return cudaGetLastError();
}

}  // namespace flashsampler
