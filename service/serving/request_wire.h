// Reads a SampleRequest off gRPC's receive buffers without copying its
// bytes: the message minus hidden_states.data is parsed by protobuf straight
// from the transport's pieces, and the data's bytes are left where the
// transport put them, as pieces, to be validated there and copied once,
// straight into the batch's input.
#ifndef FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
#define FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_

#include <deque>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"

namespace flashsampler {

enum class SplitResult {
  kSplit,        // `rest` and `data` hold the message
  kUnsupported,  // a form the splitter does not follow (groups, a malformed
                 // or truncated field): parse the whole message instead
};

// A serialized flashsampler.v1.SampleRequest split by SplitHiddenStates.
struct SplitRequest {
  // The message with every hidden_states.data field left out, in order: views
  // into the pieces for the fields passed through, and into `tensors` for
  // each hidden_states field (its other fields under a new length).
  std::vector<absl::string_view> rest;
  std::deque<std::string> tensors;
  // The bytes of the last hidden_states.data field, as views into the
  // pieces; empty when there is none.
  std::vector<absl::string_view> data;
};

// Splits a serialized flashsampler.v1.SampleRequest, given as `pieces` in
// order, into `split`. Parsing `split->rest` (ParseRest) and setting
// hidden_states.data to the concatenation of `split->data` gives exactly the
// message protobuf parses from the whole: a later data field replaces an
// earlier one, and everything else is passed through for protobuf to merge
// and validate. The views stay valid while `pieces`' bytes and `split` do.
SplitResult SplitHiddenStates(const std::vector<absl::string_view>& pieces,
                              SplitRequest* split);

// Parses the concatenation of `rest` into `message` without joining the
// views: a request's controls (a bitmask of 19 KB a row at V = 151936) are
// copied once, by protobuf, instead of into one string first.
bool ParseRest(const std::vector<absl::string_view>& rest,
               google::protobuf::MessageLite* message);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
