// The trapping kernel of fault_kernel.h.
#include <cuda_runtime.h>

#include "kernels/testing/fault_kernel.h"

namespace flashsampler {
namespace {

__global__ void TrapKernel() { asm volatile("trap;"); }

}  // namespace

cudaError_t LaunchTrapKernel(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace flashsampler
