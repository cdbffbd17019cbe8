// FS_RETURN_IF_ERROR / FS_ASSIGN_OR_RETURN: early return of a non-OK
// absl::Status, so service code reads as its happy path (errors are values;
// docs/design.md#errors). Header-only, needs only absl.
#ifndef FLASHSAMPLER_COMMON_STATUS_MACROS_H_
#define FLASHSAMPLER_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace flashsampler::status_internal {

inline const absl::Status& AsStatus(const absl::Status& status) {
  return status;
}
template <typename T>
const absl::Status& AsStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

}  // namespace flashsampler::status_internal

// Evaluates `expr` (an absl::Status or absl::StatusOr<T>) once and returns its
// status from the enclosing function (returning absl::Status or StatusOr<U>)
// when it is not OK.
#define FS_RETURN_IF_ERROR(expr)                                        \
  do {                                                                  \
    const auto& fs_status_or_value_ = (expr);                           \
    const ::absl::Status& fs_status_ =                                  \
        ::flashsampler::status_internal::AsStatus(fs_status_or_value_); \
    if (ABSL_PREDICT_FALSE(!fs_status_.ok())) return fs_status_;        \
  } while (false)

// FS_ASSIGN_OR_RETURN(lhs, rexpr): evaluates `rexpr` (an absl::StatusOr<T>);
// on error returns its status, else moves the value into `lhs`, which may be a
// declaration (`auto x`, `std::unique_ptr<Foo> foo`) or an existing variable.
// `lhs` must not contain an unparenthesized comma; expands to several
// statements, so do not use it as the body of an unbraced if/else.
#define FS_ASSIGN_OR_RETURN(lhs, rexpr)                                        \
  FS_ASSIGN_OR_RETURN_IMPL_(FS_STATUS_MACROS_CONCAT_(fs_status_or_, __LINE__), \
                            lhs, rexpr)

#define FS_ASSIGN_OR_RETURN_IMPL_(status_or, lhs, rexpr) \
  auto status_or = (rexpr);                              \
  if (ABSL_PREDICT_FALSE(!status_or.ok())) {             \
    return std::move(status_or).status();                \
  }                                                      \
  lhs = std::move(status_or).value()

#define FS_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define FS_STATUS_MACROS_CONCAT_(x, y) FS_STATUS_MACROS_CONCAT_INNER_(x, y)

#endif  // FLASHSAMPLER_COMMON_STATUS_MACROS_H_
