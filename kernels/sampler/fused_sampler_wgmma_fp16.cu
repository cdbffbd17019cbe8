// Explicit instantiations of the wgmma (sm_90a) stage-1 kernel for fp16.
#include "kernels/sampler/fused_sampler_wgmma.cuh"

namespace flashsampler {
namespace fused {

template cudaError_t LaunchWgmma<DType::kFp16, 16, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 16, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 64, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 64, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 80, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 80, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 96, 1>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 96, 2>(const FusedArgs&,
                                                      const void*, const void*,
                                                      int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 112, 1>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 112, 2>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 128, 1>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);
template cudaError_t LaunchWgmma<DType::kFp16, 128, 2>(const FusedArgs&,
                                                       const void*, const void*,
                                                       int, cudaStream_t);

}  // namespace fused
}  // namespace flashsampler
