// CUDA runtime errors and NCCL results as absl::Status (CUDA builds only; the
// codes then reach gRPC through common/status_util.h). Sticky device errors
// and NCCL system/remote failures become fatal device errors (UNAVAILABLE,
// IsFatalDeviceError true) so health goes NOT_SERVING.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_STATUS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace flashsampler {

// True for errors after which the CUDA context (or the device) cannot be used
// again in this process: sticky kernel faults (illegal address, launch
// failure, device assert, ...), uncorrectable ECC/NVLink errors, and a driver
// or device that cannot run us at all.
bool IsFatalCudaError(cudaError_t error);
// True for NCCL failures that leave the communicator unusable: system errors,
// a failed remote peer, an unhandled CUDA error inside NCCL.
bool IsFatalNcclResult(ncclResult_t result);

// OK for cudaSuccess. Otherwise: RESOURCE_EXHAUSTED for out of memory, a fatal
// device error (UNAVAILABLE) for IsFatalCudaError, INTERNAL for the rest (an
// invalid value reaching the runtime is our bug, not the client's). The
// message reads "<context>: CUDA error <name> (<description>)".
absl::Status CudaToStatus(cudaError_t error, absl::string_view context);

// OK for ncclSuccess. Fatal device error for IsFatalNcclResult, INTERNAL
// otherwise (invalid argument/usage is our bug). The message names the
// result, NCCL's description and, when `comm` is given, ncclGetLastError.
absl::Status NcclToStatus(ncclResult_t result, absl::string_view context,
                          ncclComm_t comm = nullptr);

}  // namespace flashsampler

// Returns CudaToStatus(expr, "<expr> at file:line") when expr is not
// cudaSuccess. For functions returning absl::Status or absl::StatusOr<T>.
#define FS_RETURN_IF_CUDA_ERROR(expr)                                      \
  do {                                                                     \
    const cudaError_t fs_cuda_error_ = (expr);                             \
    if (ABSL_PREDICT_FALSE(fs_cuda_error_ != cudaSuccess)) {               \
      return ::flashsampler::CudaToStatus(                                 \
          fs_cuda_error_, #expr " at " __FILE__ ":" FS_CUDA_STATUS_LINE_); \
    }                                                                      \
  } while (false)

// Same for NCCL calls.
#define FS_RETURN_IF_NCCL_ERROR(expr)                                       \
  do {                                                                      \
    const ncclResult_t fs_nccl_result_ = (expr);                            \
    if (ABSL_PREDICT_FALSE(fs_nccl_result_ != ncclSuccess)) {               \
      return ::flashsampler::NcclToStatus(                                  \
          fs_nccl_result_, #expr " at " __FILE__ ":" FS_CUDA_STATUS_LINE_); \
    }                                                                       \
  } while (false)

#define FS_CUDA_STATUS_STRINGIFY_(x) #x
#define FS_CUDA_STATUS_STRINGIFY2_(x) FS_CUDA_STATUS_STRINGIFY_(x)
#define FS_CUDA_STATUS_LINE_ FS_CUDA_STATUS_STRINGIFY2_(__LINE__)

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CUDA_STATUS_H_
