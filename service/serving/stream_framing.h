// Splits a SampleStream's request bytes as they travel inside HTTP/2 DATA
// frames (gRPC length-prefixed messages: 1 compressed-flag byte, a 4-byte
// big-endian length, the message) and parses each message as a SampleRequest.
// gRPC does this itself in the server; this pure function mirrors it so tests
// and fuzzers can drive the per-message path without a transport.
#ifndef FLASHSAMPLER_SERVICE_SERVING_STREAM_FRAMING_H_
#define FLASHSAMPLER_SERVICE_SERVING_STREAM_FRAMING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "flashsampler/v1/sampler.pb.h"

namespace flashsampler {

// Bytes of the length prefix before each message.
inline constexpr size_t kGrpcFrameHeaderBytes = 5;

// One message of the stream: its place in the input and what became of it.
struct StreamFrame {
  int index = 0;      // 0-based message number within the stream
  size_t offset = 0;  // first byte of the 5-byte header within the input
  size_t length = 0;  // message bytes after the header (as declared)
  // OK: `request` holds the parsed message. INVALID_ARGUMENT: this message
  // alone is undecodable (compressed without negotiated compression, larger
  // than the limit, not a SampleRequest); the stream goes on with the next.
  // DATA_LOSS: the input ends inside this frame's header or message; it is
  // the last frame. Every message names "frame <index>".
  absl::Status status;
  v1::SampleRequest request;
};

// Splits `bytes` into frames and parses each. `max_message_bytes` is the
// server's receive limit: a longer message is refused without being parsed
// (and skipped: its length prefix still says where the next one starts).
// Offsets and lengths of the returned frames tile the input in order.
std::vector<StreamFrame> SplitSampleStream(absl::string_view bytes,
                                           size_t max_message_bytes);

// Appends one gRPC length-prefixed message to `out` (compressed flag clear).
void AppendGrpcFrame(absl::string_view message, std::string* out);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_STREAM_FRAMING_H_
