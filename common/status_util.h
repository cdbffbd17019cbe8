// The one place that maps error codes between layers: absl::Status <-> gRPC
// status for the service boundary, and the "fatal device error" marker that
// CUDA/NCCL failures carry (service/backends/cuda/cuda_status.h) so health can
// go NOT_SERVING without parsing messages.
#ifndef FLASHSAMPLER_COMMON_STATUS_UTIL_H_
#define FLASHSAMPLER_COMMON_STATUS_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/field_violation.h"
#include "grpcpp/support/status.h"

namespace flashsampler {

// Canonical codes are the same 17 values in absl and gRPC; anything outside
// them becomes UNKNOWN.
grpc::StatusCode ToGrpcCode(absl::StatusCode code);
absl::StatusCode FromGrpcCode(grpc::StatusCode code);

// Same code and message. A status carrying a field violation
// (common/field_violation.h) also gets grpc-status-details-bin: a
// google.rpc.Status whose details are a google.rpc.BadRequest (the field
// path as the caller wrote it and the description) and a google.rpc.ErrorInfo
// (domain "flashsampler", reason INVALID_SAMPLING_PARAMS for params and
// row_params, INVALID_HIDDEN_STATES for hidden_states, else INVALID_REQUEST;
// metadata "field"). A fatal device error gets an ErrorInfo with reason
// FATAL_DEVICE_ERROR. Other payloads stay on the server.
grpc::Status ToGrpcStatus(const absl::Status& status);
// Same code and message; the first field violation in the details (if any)
// comes back as the payload GetFieldViolation() reads, the ErrorInfo reason
// as the one ErrorReason() reads.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Every google.rpc.BadRequest field violation in `status`'s details.
std::vector<FieldViolation> FieldViolations(const grpc::Status& status);
// The google.rpc.ErrorInfo reason in `status`'s details ("" if none).
std::string ErrorReason(const grpc::Status& status);
// The reason FromGrpcStatus kept ("" if none).
std::string ErrorReason(const absl::Status& status);
inline constexpr absl::string_view kErrorDomain = "flashsampler";
inline constexpr absl::string_view kErrorReasonPayload =
    "type.flashsampler.dev/flashsampler.v1.ErrorReason";

// Text every fatal device error's message carries, for logs and clients.
inline constexpr absl::string_view kFatalDeviceErrorMarker =
    "fatal device error";
// Type URL of the payload that marks a status as a fatal device error.
inline constexpr absl::string_view kFatalDeviceErrorPayload =
    "type.flashsampler.dev/flashsampler.v1.FatalDeviceError";

// UNAVAILABLE "<message> [fatal device error]" with the marker payload: the
// device (or the NCCL group) is unusable until the process restarts, e.g. a
// sticky CUDA error after an illegal address.
absl::Status FatalDeviceError(absl::string_view message);
// True for statuses made by FatalDeviceError (or carrying its payload).
bool IsFatalDeviceError(const absl::Status& status);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_STATUS_UTIL_H_
