// Explicit instantiations of the wgmma (sm_90a) stage-1 kernel for bf16, and
// the query that tells the dispatcher whether this binary carries sm_90a
// code for the current device.
#include "kernels/sampler/fused_sampler_wgmma.cuh"

namespace flashsampler {
namespace fused {

template cudaError_t LaunchWgmma<DType::kBf16, 16, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 16, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 64, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 64, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 80, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 80, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 96, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 96, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 112, 1>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 112, 2>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 128, 1>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kBf16, 128, 2>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);

cudaError_t WgmmaKernelBinaryVersion(int* version) {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(
      &attributes,
      FusedWgmmaKernel<__nv_bfloat16, 16, WgmmaTileConfig<16, 1>::kStages, 1,
                       PairMulticast::kNone>);
  if (error != cudaSuccess) return error;
  *version = attributes.binaryVersion;
  return cudaSuccess;
}

}  // namespace fused
}  // namespace flashsampler
