// Reads a SampleRequest off gRPC's receive buffers without copying its
// bytes: the message minus hidden_states.data is parsed by protobuf straight
// from the transport's pieces, its row_params on several threads, and the
// data's bytes are left where the transport put them, as pieces, to be
// copied once, straight into the batch's input, and checked there
// (CopyFinitePieces).
#ifndef FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
#define FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_

#include <deque>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/thread_pool.h"
#include "flashsampler/v1/sampler.pb.h"
#include "google/protobuf/message_lite.h"

namespace flashsampler {

enum class SplitResult {
  kSplit,        // `rest` and `data` hold the message
  kUnsupported,  // a form the splitter does not follow (groups, a malformed
                 // or truncated field): parse the whole message instead
};

// A serialized flashsampler.v1.SampleRequest split by SplitHiddenStates.
struct SplitRequest {
  // The message with every hidden_states.data field and every row_params
  // field left out, in order: views into the pieces for the fields passed
  // through, and into `tensors` for each hidden_states field (its other
  // fields under a new length).
  std::vector<absl::string_view> rest;
  std::deque<std::string> tensors;
  // Each row_params field's value (a SamplingParams message), in order, as
  // views into the pieces, and their bytes in all.
  std::vector<std::vector<absl::string_view>> row_params;
  size_t row_params_bytes = 0;
  // The bytes of the last hidden_states.data field, as views into the
  // pieces; empty when there is none.
  std::vector<absl::string_view> data;
};

// Splits a serialized flashsampler.v1.SampleRequest, given as `pieces` in
// order, into `split`. Parsing it (ParseSplitRequest) and setting
// hidden_states.data to the concatenation of `split->data` gives exactly the
// message protobuf parses from the whole: a later data field replaces an
// earlier one, each row_params field is the next row, and everything else is
// passed through for protobuf to merge and validate. The views stay valid
// while `pieces`' bytes and `split` do.
SplitResult SplitHiddenStates(const std::vector<absl::string_view>& pieces,
                              SplitRequest* split);

// Parses the concatenation of `views` into `message` without joining them:
// a request's controls (a bitmask of 19 KB a row at V = 151936) are copied
// once, by protobuf, instead of into one string first.
bool ParseViews(const std::vector<absl::string_view>& views,
                google::protobuf::MessageLite* message);

// Row controls below this many bytes are parsed and decoded by the calling
// thread alone: waking a worker costs tens of microseconds on a virtual
// machine, and 64 KB of bias entries and penalty histories take protobuf
// about 0.3 ms.
inline constexpr size_t kParallelRowParamsBytes = 64 << 10;

// True when `split`'s rows hold kParallelRowParamsBytes or more: worth a
// pool's workers to parse (ParseSplitRequest) and decode.
inline bool RowsWorthAPool(const SplitRequest& split) {
  return split.row_params_bytes >= kParallelRowParamsBytes;
}

// Parses `split` (hidden_states.data aside) into `request`, which must be
// empty: the rest, then the rows, added in order and parsed on `pool`'s
// workers and the calling thread, or on the calling thread alone where
// `pool` is null (protobuf's arenas take allocations from several threads).
// False when the bytes are not a valid SampleRequest.
bool ParseSplitRequest(const SplitRequest& split, ThreadPool* pool,
                       v1::SampleRequest* request);

// The first row of the rows whose bytes are `pieces`, in order (rows of
// `hidden` elements of `dtype`), that holds NaN or Inf, or -1.
int FirstNonFiniteRowInPieces(DType dtype,
                              const std::vector<absl::string_view>& pieces,
                              int64_t hidden);

// Copies the rows whose bytes are `pieces`, in order (rows of `hidden`
// elements of `dtype`, as many as the pieces hold), to `dst`, checking each
// element as it is copied (CopyFinite): the transport's bytes are read once,
// where a check before the copy read them twice. INVALID_ARGUMENT
// "hidden_states.data: must be finite, row r holds NaN or Inf" names the
// first row that is not; the rows before it are copied, the rest may not be.
absl::Status CopyFinitePieces(DType dtype,
                              const std::vector<absl::string_view>& pieces,
                              int64_t hidden, char* dst);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
