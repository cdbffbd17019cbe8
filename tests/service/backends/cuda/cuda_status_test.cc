// Table-driven test of the CUDA/NCCL -> absl::Status mapping. It only maps
// codes (cudaGetErrorName and ncclGetErrorString are lookups), so it runs
// without a GPU.
#include "service/backends/cuda/cuda_status.h"

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/status_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flashsampler {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct CudaCase {
  cudaError_t error;
  const char* name;
  absl::StatusCode code;
  bool fatal;
};

TEST(CudaStatusTest, CudaErrorsMapByTable) {
  const std::vector<CudaCase> cases = {
      {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation",
       absl::StatusCode::kResourceExhausted, false},
      {cudaErrorInvalidValue, "cudaErrorInvalidValue",
       absl::StatusCode::kInternal, false},
      {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
       absl::StatusCode::kInternal, false},
      {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
       absl::StatusCode::kInternal, false},
      {cudaErrorNotReady, "cudaErrorNotReady", absl::StatusCode::kInternal,
       false},
      {cudaErrorUnknown, "cudaErrorUnknown", absl::StatusCode::kInternal,
       false},
      {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorLaunchFailure, "cudaErrorLaunchFailure",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorLaunchTimeout, "cudaErrorLaunchTimeout",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorECCUncorrectable, "cudaErrorECCUncorrectable",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorHardwareStackError, "cudaErrorHardwareStackError",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorIllegalInstruction, "cudaErrorIllegalInstruction",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorInvalidAddressSpace, "cudaErrorInvalidAddressSpace",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorInvalidPc, "cudaErrorInvalidPc", absl::StatusCode::kUnavailable,
       true},
      {cudaErrorAssert, "cudaErrorAssert", absl::StatusCode::kUnavailable,
       true},
      {cudaErrorNvlinkUncorrectable, "cudaErrorNvlinkUncorrectable",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorDevicesUnavailable, "cudaErrorDevicesUnavailable",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorNoDevice, "cudaErrorNoDevice", absl::StatusCode::kUnavailable,
       true},
      {cudaErrorInsufficientDriver, "cudaErrorInsufficientDriver",
       absl::StatusCode::kUnavailable, true},
      {cudaErrorNoKernelImageForDevice, "cudaErrorNoKernelImageForDevice",
       absl::StatusCode::kUnavailable, true},
  };
  for (const CudaCase& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status status = CudaToStatus(c.error, "stage-1 launch");
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_EQ(IsFatalDeviceError(status), c.fatal) << status;
    EXPECT_EQ(IsFatalCudaError(c.error), c.fatal);
    EXPECT_THAT(status.message(),
                AllOf(HasSubstr("stage-1 launch"), HasSubstr(c.name)));
    EXPECT_EQ(status.message().find(kFatalDeviceErrorMarker) !=
                  absl::string_view::npos,
              c.fatal);
    EXPECT_EQ(ToGrpcStatus(status).error_code(), ToGrpcCode(c.code));
  }
  EXPECT_TRUE(CudaToStatus(cudaSuccess, "anything").ok());
}

struct NcclCase {
  ncclResult_t result;
  const char* name;
  absl::StatusCode code;
  bool fatal;
};

TEST(CudaStatusTest, NcclResultsMapByTable) {
  const std::vector<NcclCase> cases = {
      {ncclUnhandledCudaError, "ncclUnhandledCudaError",
       absl::StatusCode::kUnavailable, true},
      {ncclSystemError, "ncclSystemError", absl::StatusCode::kUnavailable,
       true},
      {ncclRemoteError, "ncclRemoteError", absl::StatusCode::kUnavailable,
       true},
      {ncclInternalError, "ncclInternalError", absl::StatusCode::kInternal,
       false},
      {ncclInvalidArgument, "ncclInvalidArgument", absl::StatusCode::kInternal,
       false},
      {ncclInvalidUsage, "ncclInvalidUsage", absl::StatusCode::kInternal,
       false},
      {ncclInProgress, "ncclInProgress", absl::StatusCode::kInternal, false},
      {static_cast<ncclResult_t>(77), "ncclResult(unknown)",
       absl::StatusCode::kInternal, false},
  };
  for (const NcclCase& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status status = NcclToStatus(c.result, "candidate exchange");
    EXPECT_EQ(status.code(), c.code) << status;
    EXPECT_EQ(IsFatalDeviceError(status), c.fatal) << status;
    EXPECT_EQ(IsFatalNcclResult(c.result), c.fatal);
    EXPECT_THAT(status.message(),
                AllOf(HasSubstr("candidate exchange"), HasSubstr(c.name)));
  }
  EXPECT_TRUE(NcclToStatus(ncclSuccess, "anything").ok());
}

absl::Status ReturnsCudaError() {
  FS_RETURN_IF_CUDA_ERROR(cudaSuccess);
  FS_RETURN_IF_CUDA_ERROR(cudaErrorIllegalAddress);
  return absl::OkStatus();
}

absl::StatusOr<int> ReturnsNcclError() {
  FS_RETURN_IF_NCCL_ERROR(ncclSuccess);
  FS_RETURN_IF_NCCL_ERROR(ncclInvalidUsage);
  return 1;
}

TEST(CudaStatusTest, MacrosNameTheCallAndPlace) {
  const absl::Status cuda = ReturnsCudaError();
  EXPECT_TRUE(IsFatalDeviceError(cuda)) << cuda;
  EXPECT_THAT(cuda.message(), AllOf(HasSubstr("cudaErrorIllegalAddress at "),
                                    HasSubstr("cuda_status_test.cc:")));
  const absl::StatusOr<int> nccl = ReturnsNcclError();
  EXPECT_EQ(nccl.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(nccl.status().message(),
              AllOf(HasSubstr("ncclInvalidUsage at "),
                    HasSubstr("cuda_status_test.cc:")));
}

}  // namespace
}  // namespace flashsampler
