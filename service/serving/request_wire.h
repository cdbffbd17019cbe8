// Reads a SampleRequest off gRPC's receive buffers without copying its
// hidden states: the message minus hidden_states.data is parsed by protobuf,
// and the data's bytes are left where the transport put them, as pieces, to
// be validated there and copied once, straight into the batch's input.
#ifndef FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
#define FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace flashsampler {

enum class SplitResult {
  kSplit,        // `rest` and `data` hold the message
  kUnsupported,  // a form the splitter does not follow (groups, a malformed
                 // or truncated field): parse the whole message instead
};

// Splits a serialized flashsampler.v1.SampleRequest, given as `pieces` in
// order, into `rest` (the same message with every hidden_states.data field
// left out) and `data` (the bytes of the last hidden_states.data field, as
// views into `pieces`; empty when there is none). Parsing `rest` and setting
// hidden_states.data to the concatenation of `data` gives exactly the
// message protobuf parses from the whole: a later data field replaces an
// earlier one, and everything else is passed through for protobuf to merge
// and validate.
SplitResult SplitHiddenStates(const std::vector<absl::string_view>& pieces,
                              std::string* rest,
                              std::vector<absl::string_view>* data);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_REQUEST_WIRE_H_
