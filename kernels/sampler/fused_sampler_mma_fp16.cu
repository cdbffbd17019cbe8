// Explicit instantiations of the mma.sync stage-1 kernel for fp16 (one file
// per dtype and path keeps each nvcc run short and parallel).
#include "kernels/sampler/fused_sampler_mma.cuh"

namespace flashsampler {
namespace fused {

template cudaError_t LaunchMma<DType::kFp16, 16>(const FusedArgs&,
                                                 cudaStream_t);
template cudaError_t LaunchMma<DType::kFp16, 64>(const FusedArgs&,
                                                 cudaStream_t);
template cudaError_t LaunchMma<DType::kFp16, 128>(const FusedArgs&,
                                                  cudaStream_t);

}  // namespace fused
}  // namespace flashsampler
