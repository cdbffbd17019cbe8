// The self-checks of the stage-1 kernels' noise: all 2^23 uniforms through
// FastGumbelFromUniform and GumbelFromUniform, compared bit for bit (see
// DivideInLogRange in fused_epilogue.cuh for why they agree), and through
// the pruning brackets (WordBounds, PruneBounds), which must contain the
// exact score or pruning would change tokens.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fused_epilogue.cuh"
#include "kernels/fused_sampler.h"
#include "kernels/philox.h"

namespace flashsampler {
namespace {

constexpr uint32_t kUniforms = 1u << 23;

__global__ void NoiseSelfCheckKernel(unsigned int* mismatches) {
  const uint32_t stride = gridDim.x * blockDim.x;
  unsigned int local = 0;
  for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m < kUniforms;
       m += stride) {
    const float u = UniformFromBits(m << 9);
    const float fast = fused::FastGumbelFromUniform(u);
    const float reference = GumbelFromUniform(u);
    if (__float_as_uint(fast) != __float_as_uint(reference)) ++local;
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
// score GumbelScore(logit, inv_temperature, GumbelFromUniform(u)) lies
// outside it. The bounds come from the epilogue's own functions with the
// arguments ScoreRuns passes them (scaled = __fmul_rn(logit,
// inv_temperature), the Philox word, u = UniformFromBits(word)). Each
// uniform is checked with the word's 9 unused low bits all 0 and all 1:
// WordBounds reads the whole word (__clz), UniformFromBits only the top 23
// bits. Comparisons are negated so that a NaN bound counts as a violation.
__global__ void NoiseBracketCheckKernel(unsigned int* violations) {
  const uint32_t stride = gridDim.x * blockDim.x;
  unsigned int local[kNoiseBracketCount] = {};
  for (uint32_t m = blockIdx.x * blockDim.x + threadIdx.x; m < kUniforms;
       m += stride) {
    const uint32_t word_low = m << 9;
    const float u = UniformFromBits(word_low);
    const float noise = GumbelFromUniform(u);
    for (int i = 0; i < kNumBracketScales; ++i) {
      const float logit = kBracketScales[i].logit;
      const float inv_temperature = kBracketScales[i].inv_temperature;
      const float scaled = __fmul_rn(logit, inv_temperature);
      const float score = GumbelScore(logit, inv_temperature, noise);
      for (uint32_t low = 0; low <= 0x1ffu; low += 0x1ffu) {
        float lower;
        float upper;
        fused::WordBounds(scaled, word_low | low, &lower, &upper);
        if (!(lower <= score)) ++local[kNoiseBracketWordLower];
        if (!(upper >= score)) ++local[kNoiseBracketWordUpper];
      }
      float lower;
      float upper;
      fused::PruneBounds(scaled, u, &lower, &upper);
      if (!(lower <= score)) ++local[kNoiseBracketLogLower];
      if (!(upper >= score)) ++local[kNoiseBracketLogUpper];
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
