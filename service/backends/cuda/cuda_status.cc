// CUDA/NCCL -> absl::Status. Which errors are fatal follows the CUDA runtime
// documentation: errors marked "the process is left in an inconsistent state
// and any further CUDA work will return the same error" are sticky.
#include "service/backends/cuda/cuda_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_util.h"

namespace flashsampler {

bool IsFatalCudaError(cudaError_t error) {
  switch (error) {
    // Sticky: the context is corrupt; every later call fails the same way.
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorContextIsDestroyed:
    // Hardware faults.
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    // No usable device, driver or kernel image: nothing will ever run.
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorStartupFailure:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return true;
    default:
      return false;
  }
}

bool IsFatalNcclResult(ncclResult_t result) {
  return result == ncclUnhandledCudaError || result == ncclSystemError ||
         result == ncclRemoteError;
}

absl::Status CudaToStatus(cudaError_t error, absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Both lookups are pure tables in the runtime: they work without a device.
  const std::string message =
      absl::StrCat(context, ": CUDA error ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(message);
  }
  if (IsFatalCudaError(error)) return FatalDeviceError(message);
  return absl::InternalError(message);
}

namespace {

const char* NcclResultName(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    default:
      return "ncclResult(unknown)";
  }
}

}  // namespace

absl::Status NcclToStatus(ncclResult_t result, absl::string_view context,
                          ncclComm_t comm) {
  if (result == ncclSuccess) return absl::OkStatus();
  std::string message =
      absl::StrCat(context, ": NCCL error ", NcclResultName(result), " (",
                   ncclGetErrorString(result), ")");
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && last[0] != '\0') {
      absl::StrAppend(&message, "; last NCCL error: ", last);
    }
  }
  if (IsFatalNcclResult(result)) return FatalDeviceError(message);
  return absl::InternalError(message);
}

}  // namespace flashsampler
