// absl <-> gRPC status mapping and the fatal-device-error marker. An explicit
// switch rather than a cast: the two enums agree today, and a test proves it
// code by code, but nothing in either library promises it.
#include "common/status_util.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

namespace flashsampler {

grpc::StatusCode ToGrpcCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return grpc::StatusCode::OK;
    case absl::StatusCode::kCancelled:
      return grpc::StatusCode::CANCELLED;
    case absl::StatusCode::kUnknown:
      return grpc::StatusCode::UNKNOWN;
    case absl::StatusCode::kInvalidArgument:
      return grpc::StatusCode::INVALID_ARGUMENT;
    case absl::StatusCode::kDeadlineExceeded:
      return grpc::StatusCode::DEADLINE_EXCEEDED;
    case absl::StatusCode::kNotFound:
      return grpc::StatusCode::NOT_FOUND;
    case absl::StatusCode::kAlreadyExists:
      return grpc::StatusCode::ALREADY_EXISTS;
    case absl::StatusCode::kPermissionDenied:
      return grpc::StatusCode::PERMISSION_DENIED;
    case absl::StatusCode::kResourceExhausted:
      return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case absl::StatusCode::kFailedPrecondition:
      return grpc::StatusCode::FAILED_PRECONDITION;
    case absl::StatusCode::kAborted:
      return grpc::StatusCode::ABORTED;
    case absl::StatusCode::kOutOfRange:
      return grpc::StatusCode::OUT_OF_RANGE;
    case absl::StatusCode::kUnimplemented:
      return grpc::StatusCode::UNIMPLEMENTED;
    case absl::StatusCode::kInternal:
      return grpc::StatusCode::INTERNAL;
    case absl::StatusCode::kUnavailable:
      return grpc::StatusCode::UNAVAILABLE;
    case absl::StatusCode::kDataLoss:
      return grpc::StatusCode::DATA_LOSS;
    case absl::StatusCode::kUnauthenticated:
      return grpc::StatusCode::UNAUTHENTICATED;
    default:
      return grpc::StatusCode::UNKNOWN;
  }
}

absl::StatusCode FromGrpcCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return absl::StatusCode::kOk;
    case grpc::StatusCode::CANCELLED:
      return absl::StatusCode::kCancelled;
    case grpc::StatusCode::UNKNOWN:
      return absl::StatusCode::kUnknown;
    case grpc::StatusCode::INVALID_ARGUMENT:
      return absl::StatusCode::kInvalidArgument;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return absl::StatusCode::kDeadlineExceeded;
    case grpc::StatusCode::NOT_FOUND:
      return absl::StatusCode::kNotFound;
    case grpc::StatusCode::ALREADY_EXISTS:
      return absl::StatusCode::kAlreadyExists;
    case grpc::StatusCode::PERMISSION_DENIED:
      return absl::StatusCode::kPermissionDenied;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return absl::StatusCode::kResourceExhausted;
    case grpc::StatusCode::FAILED_PRECONDITION:
      return absl::StatusCode::kFailedPrecondition;
    case grpc::StatusCode::ABORTED:
      return absl::StatusCode::kAborted;
    case grpc::StatusCode::OUT_OF_RANGE:
      return absl::StatusCode::kOutOfRange;
    case grpc::StatusCode::UNIMPLEMENTED:
      return absl::StatusCode::kUnimplemented;
    case grpc::StatusCode::INTERNAL:
      return absl::StatusCode::kInternal;
    case grpc::StatusCode::UNAVAILABLE:
      return absl::StatusCode::kUnavailable;
    case grpc::StatusCode::DATA_LOSS:
      return absl::StatusCode::kDataLoss;
    case grpc::StatusCode::UNAUTHENTICATED:
      return absl::StatusCode::kUnauthenticated;
    default:
      return absl::StatusCode::kUnknown;
  }
}

namespace {

constexpr absl::string_view kTypeUrlPrefix = "type.googleapis.com/";

std::string ReasonForField(absl::string_view field) {
  if (absl::StartsWith(field, "params") ||
      absl::StartsWith(field, "row_params")) {
    return "INVALID_SAMPLING_PARAMS";
  }
  if (absl::StartsWith(field, "hidden_states")) return "INVALID_HIDDEN_STATES";
  return "INVALID_REQUEST";
}

void AddDetail(const google::protobuf::Message& detail,
               google::rpc::Status* status) {
  google::protobuf::Any* any = status->add_details();
  any->set_type_url(
      absl::StrCat(kTypeUrlPrefix, detail.GetDescriptor()->full_name()));
  any->set_value(detail.SerializeAsString());
}

// The google.rpc.Status of grpc-status-details-bin; false when absent or
// unreadable.
bool ParseDetails(const grpc::Status& status, google::rpc::Status* details) {
  return !status.error_details().empty() &&
         details->ParseFromString(status.error_details());
}

bool IsType(const google::protobuf::Any& any,
            const google::protobuf::Message& message) {
  return any.type_url() ==
         absl::StrCat(kTypeUrlPrefix, message.GetDescriptor()->full_name());
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const grpc::StatusCode code = ToGrpcCode(status.code());
  std::string message(status.message());
  google::rpc::ErrorInfo info;
  google::rpc::Status details;
  if (std::optional<FieldViolation> violation = GetFieldViolation(status)) {
    google::rpc::BadRequest bad_request;
    google::rpc::BadRequest::FieldViolation* v =
        bad_request.add_field_violations();
    v->set_field(violation->field);
    v->set_description(violation->description);
    AddDetail(bad_request, &details);
    info.set_reason(ReasonForField(violation->field));
    (*info.mutable_metadata())["field"] = violation->field;
  } else if (IsFatalDeviceError(status)) {
    info.set_reason("FATAL_DEVICE_ERROR");
  } else {
    return grpc::Status(code, std::move(message));
  }
  info.set_domain(std::string(kErrorDomain));
  AddDetail(info, &details);
  details.set_code(static_cast<int32_t>(code));
  details.set_message(message);
  return grpc::Status(code, std::move(message), details.SerializeAsString());
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status result(FromGrpcCode(status.error_code()),
                      status.error_message());
  const std::vector<FieldViolation> violations = FieldViolations(status);
  if (!violations.empty()) {
    result.SetPayload(kFieldViolationPayload,
                      absl::Cord(violations.front().field));
  }
  const std::string reason = ErrorReason(status);
  if (!reason.empty())
    result.SetPayload(kErrorReasonPayload, absl::Cord(reason));
  return result;
}

std::vector<FieldViolation> FieldViolations(const grpc::Status& status) {
  std::vector<FieldViolation> violations;
  google::rpc::Status details;
  if (!ParseDetails(status, &details)) return violations;
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::BadRequest bad_request;
    if (!IsType(any, bad_request) ||
        !bad_request.ParseFromString(any.value())) {
      continue;
    }
    for (const auto& v : bad_request.field_violations()) {
      violations.push_back({v.field(), v.description()});
    }
  }
  return violations;
}

std::string ErrorReason(const grpc::Status& status) {
  google::rpc::Status details;
  if (!ParseDetails(status, &details)) return "";
  for (const google::protobuf::Any& any : details.details()) {
    google::rpc::ErrorInfo info;
    if (IsType(any, info) && info.ParseFromString(any.value())) {
      return info.reason();
    }
  }
  return "";
}

std::string ErrorReason(const absl::Status& status) {
  const auto reason = status.GetPayload(kErrorReasonPayload);
  return reason.has_value() ? std::string(*reason) : "";
}

absl::Status FatalDeviceError(absl::string_view message) {
  absl::Status status(
      absl::StatusCode::kUnavailable,
      absl::StrCat(message, " [", kFatalDeviceErrorMarker, "]"));
  status.SetPayload(kFatalDeviceErrorPayload, absl::Cord("1"));
  return status;
}

bool IsFatalDeviceError(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable &&
         status.GetPayload(kFatalDeviceErrorPayload).has_value();
}

}  // namespace flashsampler
