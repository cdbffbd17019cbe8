// An INVALID_ARGUMENT status that names the request field at fault, as a
// payload beside the "<field>: <description>" message, so that the service
// boundary (common/status_util.h ToGrpcStatus) can send it as a
// google.rpc.BadRequest field violation. Header-only and protobuf-free:
// validation code (service/backends, service/serving) includes it.
#ifndef FLASHSAMPLER_COMMON_FIELD_VIOLATION_H_
#define FLASHSAMPLER_COMMON_FIELD_VIOLATION_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace flashsampler {

// Type URL of the payload; its value is the field path.
inline constexpr absl::string_view kFieldViolationPayload =
    "type.flashsampler.dev/flashsampler.v1.FieldViolation";

struct FieldViolation {
  // Path to the field as the caller wrote it, e.g. "row_params[3].top_p".
  std::string field;
  // What is wrong with it, e.g. "must be in (0, 1] (1 = off), got 1.5".
  std::string description;
};

// INVALID_ARGUMENT "<field>: <description>" carrying `field` as a payload.
inline absl::Status FieldViolationError(absl::string_view field,
                                        absl::string_view description) {
  absl::Status status =
      absl::InvalidArgumentError(absl::StrCat(field, ": ", description));
  status.SetPayload(kFieldViolationPayload, absl::Cord(field));
  return status;
}

// The violation for hidden states whose row `row` holds NaN or Inf, as the
// request's check, the batch's copy of its pieces and a shared-memory copy
// all word it; `detail` follows the description.
inline absl::Status NonFiniteRowError(absl::string_view field, int64_t row,
                                      absl::string_view detail = {}) {
  return FieldViolationError(field, absl::StrCat("must be finite, row ", row,
                                                 " holds NaN or Inf", detail));
}

// The violation a status made by FieldViolationError carries (also after
// FromGrpcStatus on the client side); nullopt for any other status.
inline std::optional<FieldViolation> GetFieldViolation(
    const absl::Status& status) {
  const auto payload = status.GetPayload(kFieldViolationPayload);
  if (!payload.has_value()) return std::nullopt;
  FieldViolation violation;
  violation.field = std::string(*payload);
  absl::string_view message = status.message();
  const std::string prefix = absl::StrCat(violation.field, ": ");
  if (absl::StartsWith(message, prefix)) message.remove_prefix(prefix.size());
  violation.description = std::string(message);
  return violation;
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_FIELD_VIOLATION_H_
