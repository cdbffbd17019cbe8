// The one place that maps error codes between layers: absl::Status <-> gRPC
// status for the service boundary, and the "fatal device error" marker that
// CUDA/NCCL failures carry (service/backends/cuda/cuda_status.h) so health can
// go NOT_SERVING without parsing messages.
#ifndef FLASHSAMPLER_COMMON_STATUS_UTIL_H_
#define FLASHSAMPLER_COMMON_STATUS_UTIL_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace flashsampler {

// Canonical codes are the same 17 values in absl and gRPC; anything outside
// them becomes UNKNOWN.
grpc::StatusCode ToGrpcCode(absl::StatusCode code);
absl::StatusCode FromGrpcCode(grpc::StatusCode code);

// Same code and message. Payloads (e.g. the fatal-device marker) stay on the
// server: clients see only the code and the message.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

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
