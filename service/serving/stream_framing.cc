// gRPC length-prefixed message framing of a SampleStream's request bytes,
// each message parsed as a SampleRequest or refused with a status naming it.
#include "service/serving/stream_framing.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flashsampler {

std::vector<StreamFrame> SplitSampleStream(absl::string_view bytes,
                                           size_t max_message_bytes) {
  std::vector<StreamFrame> frames;
  size_t at = 0;
  while (at < bytes.size()) {
    StreamFrame frame;
    frame.index = static_cast<int>(frames.size());
    frame.offset = at;
    const size_t left = bytes.size() - at;
    if (left < kGrpcFrameHeaderBytes) {
      frame.length = left;
      frame.status = absl::DataLossError(
          absl::StrCat("frame ", frame.index, ": stream ends after ", left,
                       " of the 5 header bytes"));
      frames.push_back(std::move(frame));
      break;
    }
    const auto* header = reinterpret_cast<const uint8_t*>(bytes.data() + at);
    const uint8_t flag = header[0];
    const uint64_t declared = (uint64_t{header[1]} << 24) |
                              (uint64_t{header[2]} << 16) |
                              (uint64_t{header[3]} << 8) | uint64_t{header[4]};
    const size_t body = at + kGrpcFrameHeaderBytes;
    const size_t available = bytes.size() - body;
    if (declared > available) {
      frame.length = available;
      frame.status = absl::DataLossError(
          absl::StrCat("frame ", frame.index, ": declares ", declared,
                       " message bytes but the stream ends after ", available));
      frames.push_back(std::move(frame));
      break;
    }
    frame.length = static_cast<size_t>(declared);
    const absl::string_view message = bytes.substr(body, frame.length);
    if (flag > 1) {
      frame.status = absl::InvalidArgumentError(
          absl::StrCat("frame ", frame.index, ": compressed flag is ",
                       int{flag}, ", must be 0 or 1"));
    } else if (flag == 1) {
      // The server negotiates no message compression.
      frame.status = absl::InvalidArgumentError(
          absl::StrCat("frame ", frame.index,
                       ": compressed, but no compression was negotiated"));
    } else if (frame.length > max_message_bytes ||
               frame.length > static_cast<size_t>(INT32_MAX)) {
      frame.status = absl::InvalidArgumentError(
          absl::StrCat("frame ", frame.index, ": message of ", frame.length,
                       " bytes exceeds the limit of ", max_message_bytes));
    } else if (!frame.request.ParseFromArray(message.data(),
                                             static_cast<int>(frame.length))) {
      frame.request.Clear();
      frame.status = absl::InvalidArgumentError(absl::StrCat(
          "frame ", frame.index, ": ", frame.length,
          " message bytes do not parse as a flashsampler.v1.SampleRequest"));
    }
    at = body + frame.length;
    frames.push_back(std::move(frame));
  }
  return frames;
}

void AppendGrpcFrame(absl::string_view message, std::string* out) {
  const uint32_t length = static_cast<uint32_t>(message.size());
  out->push_back('\0');
  for (int shift = 24; shift >= 0; shift -= 8) {
    out->push_back(static_cast<char>((length >> shift) & 0xff));
  }
  out->append(message.data(), message.size());
}

}  // namespace flashsampler
