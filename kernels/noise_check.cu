// The self-check of the stage-1 kernels' branch-free noise: all 2^23
// uniforms through FastGumbelFromUniform and GumbelFromUniform, compared bit
// for bit (see DivideInLogRange in fused_epilogue.cuh for why they agree).
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

}  // namespace

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
