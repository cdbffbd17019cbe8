// Fuzz target: a SampleStream's request bytes split into gRPC length-prefixed
// messages, each parsed and run through the request codec, as the server
// does per message. Frames must tile the input in order; every frame either
// decodes into a request the codec accepts or refuses with a status, or is
// reported undecodable with a status naming its index; only the last frame
// may be truncated.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/stubs/logging.h"
#include "service/backends/sampling_params.h"
#include "service/serving/request_codec.h"
#include "service/serving/stream_framing.h"
#include "tests/fuzz/fuzz_check.h"

// Protobuf logs every string field with invalid UTF-8 it refuses to parse:
// noise at thousands of inputs a second.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashsampler;
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  // A small receive limit so that the too-large path is reachable.
  constexpr size_t kMaxMessage = 1024;
  const std::vector<StreamFrame> frames = SplitSampleStream(bytes, kMaxMessage);
  CodecConfig config;
  config.vocab_size = 300;
  config.hidden_size = 8;
  config.max_batch_rows = 8;
  config.backend = "fuzz";
  config.supported_controls = AllSamplingControls();
  size_t at = 0;
  for (size_t i = 0; i < frames.size(); ++i) {
    const StreamFrame& frame = frames[i];
    FUZZ_CHECK(frame.index == static_cast<int>(i), "index %d at %zu",
               frame.index, i);
    FUZZ_CHECK(frame.offset == at, "frame %zu at %zu, expected %zu", i,
               frame.offset, at);
    if (frame.status.code() == absl::StatusCode::kDataLoss) {
      FUZZ_CHECK(i + 1 == frames.size(), "truncated frame %zu not last", i);
      FUZZ_CHECK(frame.offset + frame.length <= size, "past the input");
      at = size;
      continue;
    }
    at = frame.offset + kGrpcFrameHeaderBytes + frame.length;
    FUZZ_CHECK(at <= size, "frame %zu ends past the input", i);
    if (!frame.status.ok()) {
      FUZZ_CHECK(frame.status.code() == absl::StatusCode::kInvalidArgument,
                 "%s", frame.status.ToString().c_str());
      FUZZ_CHECK(absl::StrContains(frame.status.message(),
                                   absl::StrCat("frame ", i, ":")),
                 "%s does not name its frame", frame.status.ToString().c_str());
      continue;
    }
    // The frame's message round-trips through the framing.
    std::string reframed;
    AppendGrpcFrame(
        bytes.substr(frame.offset + kGrpcFrameHeaderBytes, frame.length),
        &reframed);
    const std::vector<StreamFrame> again =
        SplitSampleStream(reframed, kMaxMessage);
    FUZZ_CHECK(again.size() == 1 && again[0].status.ok() &&
                   again[0].length == frame.length,
               "frame %zu does not re-frame", i);
    DecodedRequest decoded;
    const absl::Status status =
        DecodeSampleRequest(frame.request, config, &decoded);
    FUZZ_CHECK(status.ok() ||
                   status.code() == absl::StatusCode::kInvalidArgument ||
                   status.code() == absl::StatusCode::kUnimplemented,
               "frame %zu: %s", i, status.ToString().c_str());
    if (status.ok()) {
      FUZZ_CHECK(decoded.rows >= 1 && decoded.rows <= config.max_batch_rows &&
                     decoded.specs.size() == static_cast<size_t>(decoded.rows),
                 "frame %zu: %d rows", i, decoded.rows);
    }
  }
  FUZZ_CHECK(at == size, "frames cover %zu of %zu bytes", at, size);
  return 0;
}
