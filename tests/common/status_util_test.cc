// Table-driven tests of the absl <-> gRPC status mapping, the fatal device
// error marker and the FS_RETURN_IF_ERROR / FS_ASSIGN_OR_RETURN macros.
#include "common/status_util.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;

struct CodePair {
  absl::StatusCode absl_code;
  grpc::StatusCode grpc_code;
};

const std::vector<CodePair>& AllCodes() {
  static const auto* const kCodes = new std::vector<CodePair>{
      {absl::StatusCode::kOk, grpc::StatusCode::OK},
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded,
       grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied,
       grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted,
       grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition,
       grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  return *kCodes;
}

TEST(StatusUtilTest, EveryCanonicalCodeMapsBothWays) {
  ASSERT_EQ(AllCodes().size(), 17u);
  for (const CodePair& pair : AllCodes()) {
    SCOPED_TRACE(absl::StatusCodeToString(pair.absl_code));
    EXPECT_EQ(ToGrpcCode(pair.absl_code), pair.grpc_code);
    EXPECT_EQ(FromGrpcCode(pair.grpc_code), pair.absl_code);
    // The two enums agree numerically too, code by code.
    EXPECT_EQ(static_cast<int>(pair.absl_code),
              static_cast<int>(pair.grpc_code));
  }
}

TEST(StatusUtilTest, StatusesKeepCodeAndMessage) {
  for (const CodePair& pair : AllCodes()) {
    if (pair.absl_code == absl::StatusCode::kOk) continue;
    SCOPED_TRACE(absl::StatusCodeToString(pair.absl_code));
    const absl::Status status(pair.absl_code, "field 'top_p': must be > 0");
    const grpc::Status grpc_status = ToGrpcStatus(status);
    EXPECT_EQ(grpc_status.error_code(), pair.grpc_code);
    EXPECT_EQ(grpc_status.error_message(), "field 'top_p': must be > 0");
    EXPECT_EQ(FromGrpcStatus(grpc_status), status);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(StatusUtilTest, OutOfRangeCodesBecomeUnknown) {
  EXPECT_EQ(ToGrpcCode(static_cast<absl::StatusCode>(99)),
            grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(FromGrpcCode(static_cast<grpc::StatusCode>(99)),
            absl::StatusCode::kUnknown);
  EXPECT_EQ(FromGrpcCode(grpc::StatusCode::DO_NOT_USE),
            absl::StatusCode::kUnknown);
}

TEST(StatusUtilTest, FatalDeviceErrorIsMarked) {
  const absl::Status fatal = FatalDeviceError("stage 1 on rank 3");
  EXPECT_EQ(fatal.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(fatal.message(), HasSubstr("stage 1 on rank 3"));
  EXPECT_THAT(fatal.message(), HasSubstr(kFatalDeviceErrorMarker));
  EXPECT_TRUE(IsFatalDeviceError(fatal));
  // The marker survives copies and the macros; clients see it in the message.
  const absl::Status copy = fatal;
  EXPECT_TRUE(IsFatalDeviceError(copy));
  const grpc::Status wire = ToGrpcStatus(fatal);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(wire.error_message(), HasSubstr(kFatalDeviceErrorMarker));

  // Ordinary UNAVAILABLE (loading, draining) is not fatal, even when its
  // message happens to contain the words.
  EXPECT_FALSE(IsFatalDeviceError(absl::UnavailableError("draining")));
  EXPECT_FALSE(IsFatalDeviceError(
      absl::UnavailableError("client said: fatal device error")));
  EXPECT_FALSE(IsFatalDeviceError(absl::OkStatus()));
  EXPECT_FALSE(IsFatalDeviceError(FromGrpcStatus(wire)));
}

absl::Status Fails() { return absl::DataLossError("boom"); }
absl::Status Succeeds() { return absl::OkStatus(); }
absl::StatusOr<int> Number(bool ok) {
  if (!ok) return absl::NotFoundError("no number");
  return 42;
}
absl::StatusOr<std::unique_ptr<int>> Pointer() {
  return std::make_unique<int>(7);
}

absl::Status ReturnIfError(bool fail, int* reached) {
  FS_RETURN_IF_ERROR(Succeeds());
  ++*reached;
  if (fail) FS_RETURN_IF_ERROR(Fails());
  ++*reached;
  FS_RETURN_IF_ERROR(Number(!fail));  // a StatusOr works too
  return absl::OkStatus();
}

absl::StatusOr<int> AssignOrReturn(bool ok) {
  FS_ASSIGN_OR_RETURN(const int number, Number(ok));
  FS_ASSIGN_OR_RETURN(std::unique_ptr<int> pointer, Pointer());  // move-only
  int existing = 0;
  FS_ASSIGN_OR_RETURN(existing, Number(true));
  return number + *pointer + existing;
}

TEST(StatusUtilTest, FieldViolationTravelsAsBadRequest) {
  const absl::Status status =
      FieldViolationError("row_params[3].top_p", "must be in (0, 1], got 2");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "row_params[3].top_p: must be in (0, 1], got 2");

  const grpc::Status wire = ToGrpcStatus(status);
  EXPECT_EQ(wire.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(wire.error_message(), status.message());
  // The trailer is a plain google.rpc.Status any gRPC client can read.
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(wire.error_details()));
  EXPECT_EQ(details.code(), 3);
  EXPECT_EQ(details.message(), status.message());
  ASSERT_EQ(details.details_size(), 2);
  EXPECT_EQ(details.details(0).type_url(),
            "type.googleapis.com/google.rpc.BadRequest");
  google::rpc::BadRequest bad_request;
  ASSERT_TRUE(bad_request.ParseFromString(details.details(0).value()));
  ASSERT_EQ(bad_request.field_violations_size(), 1);
  EXPECT_EQ(bad_request.field_violations(0).field(), "row_params[3].top_p");
  EXPECT_EQ(bad_request.field_violations(0).description(),
            "must be in (0, 1], got 2");
  EXPECT_EQ(details.details(1).type_url(),
            "type.googleapis.com/google.rpc.ErrorInfo");
  google::rpc::ErrorInfo info;
  ASSERT_TRUE(info.ParseFromString(details.details(1).value()));
  EXPECT_EQ(info.reason(), "INVALID_SAMPLING_PARAMS");
  EXPECT_EQ(info.domain(), "flashsampler");
  EXPECT_EQ(info.metadata().at("field"), "row_params[3].top_p");

  // And back: the client's absl::Status keeps field, description, reason.
  const absl::Status back = FromGrpcStatus(wire);
  const std::optional<FieldViolation> violation = GetFieldViolation(back);
  ASSERT_TRUE(violation.has_value());
  EXPECT_EQ(violation->field, "row_params[3].top_p");
  EXPECT_EQ(violation->description, "must be in (0, 1], got 2");
  EXPECT_EQ(ErrorReason(back), "INVALID_SAMPLING_PARAMS");
  ASSERT_EQ(FieldViolations(wire).size(), 1u);
}

TEST(StatusUtilTest, PlainErrorsCarryNoDetails) {
  const grpc::Status wire =
      ToGrpcStatus(absl::InvalidArgumentError("no field here"));
  EXPECT_TRUE(wire.error_details().empty());
  EXPECT_TRUE(FieldViolations(wire).empty());
  EXPECT_EQ(ErrorReason(wire), "");
  EXPECT_FALSE(GetFieldViolation(FromGrpcStatus(wire)).has_value());
  EXPECT_EQ(
      ErrorReason(ToGrpcStatus(FatalDeviceError("cuda: illegal address"))),
      "FATAL_DEVICE_ERROR");
}

TEST(StatusMacrosTest, ReturnIfError) {
  int reached = 0;
  EXPECT_TRUE(ReturnIfError(false, &reached).ok());
  EXPECT_EQ(reached, 2);
  reached = 0;
  const absl::Status status = ReturnIfError(true, &reached);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "boom");
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturn) {
  absl::StatusOr<int> result = AssignOrReturn(true);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(*result, 42 + 7 + 42);
  result = AssignOrReturn(false);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(result.status().message(), "no number");
}

}  // namespace
}  // namespace flashsampler
