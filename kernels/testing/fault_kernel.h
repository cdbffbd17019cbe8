// A kernel that traps, for tests of the device-fault path: it leaves the
// CUDA context with the sticky error an Xid-class fault leaves
// (cudaErrorLaunchFailure), so that the service's handling of a dead device
// can be exercised on a healthy one. Linked by the CUDA engine, launched only
// when a test asks for it (CudaEngineOptions::trap_next_batch_for_tests).
#ifndef FLASHSAMPLER_KERNELS_TESTING_FAULT_KERNEL_H_
#define FLASHSAMPLER_KERNELS_TESTING_FAULT_KERNEL_H_

#include <cuda_runtime_api.h>

namespace flashsampler {

// Queues one block that executes the PTX `trap` instruction on `stream`.
// Returns the launch's error (cudaSuccess: the fault comes asynchronously,
// at the next synchronization with the stream, as a sticky error).
cudaError_t LaunchTrapKernel(cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_TESTING_FAULT_KERNEL_H_
