// Tests of SplitHiddenStates and of decoding a request from pieces: for any
// way the transport cuts a message, the split parses to the message protobuf
// parses from the whole, and the pieces decode as the contiguous bytes do
// (the same rows, the same first non-finite row).
#include "service/serving/request_wire.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/dtype_convert.h"
#include "gtest/gtest.h"
#include "service/serving/request_codec.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

constexpr int64_t kHidden = 16;

// `bytes` cut at random places (pieces of 0 to `max_piece` bytes).
std::vector<absl::string_view> Cut(const std::string& bytes, size_t max_piece,
                                   std::mt19937& gen) {
  std::vector<absl::string_view> pieces;
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n =
        std::min(bytes.size() - at,
                 std::uniform_int_distribution<size_t>(0, max_piece)(gen));
    pieces.push_back(absl::string_view(bytes).substr(at, n));
    at += n;
  }
  return pieces;
}

std::string Join(const std::vector<absl::string_view>& pieces) {
  std::string out;
  for (absl::string_view p : pieces) out.append(p.data(), p.size());
  return out;
}

v1::SampleRequest RichRequest() {
  v1::SampleRequest request = testing::MakeRequest(3, kHidden, 7);
  request.set_request_id("req-42");
  request.mutable_params()->set_temperature(0.5f);
  request.mutable_params()->set_top_k(40);
  request.mutable_params()->add_banned_token_ids(3);
  request.add_steps(1);
  request.add_steps(2);
  request.add_steps(3);
  return request;
}

// Parses a split message back into one SampleRequest: its rest by
// ParseRest, and the same bytes joined, which must agree.
v1::SampleRequest Rejoin(const SplitRequest& split, bool* ok) {
  v1::SampleRequest request;
  *ok = ParseRest(split.rest, &request);
  v1::SampleRequest joined;
  const bool joined_ok = joined.ParseFromString(Join(split.rest));
  EXPECT_EQ(joined_ok, *ok);
  if (*ok && joined_ok) {
    EXPECT_EQ(request.SerializeAsString(), joined.SerializeAsString());
  }
  if (!split.data.empty()) {
    request.mutable_hidden_states()->set_data(Join(split.data));
  }
  return request;
}

TEST(RequestWireTest, SplitParsesToTheWholeMessageForEveryCut) {
  const std::string bytes = RichRequest().SerializeAsString();
  std::mt19937 gen(1);
  for (size_t max_piece : {size_t{1}, size_t{3}, size_t{64}, bytes.size()}) {
    for (int trial = 0; trial < 20; ++trial) {
      const std::vector<absl::string_view> pieces = Cut(bytes, max_piece, gen);
      SplitRequest split;
      ASSERT_EQ(SplitHiddenStates(pieces, &split), SplitResult::kSplit);
      EXPECT_LT(Join(split.rest).size(), bytes.size() - 3 * kHidden * 4 + 1);
      bool ok = false;
      const v1::SampleRequest back = Rejoin(split, &ok);
      ASSERT_TRUE(ok);
      EXPECT_EQ(back.SerializeAsString(), bytes);
    }
  }
}

TEST(RequestWireTest, RepeatedHiddenStatesMergeAsProtobufMerges) {
  // Two messages back to back parse as one merged message: the later
  // data replaces the earlier, shapes append, the later dtype wins.
  v1::SampleRequest first = RichRequest();
  v1::SampleRequest second;
  second.mutable_hidden_states()->set_dtype(v1::DTYPE_FP16);
  second.mutable_hidden_states()->set_data(std::string(10, 'x'));
  v1::SampleRequest third;  // hidden_states without data: keeps the 'x's
  third.mutable_hidden_states()->add_shape(5);
  const std::string bytes = first.SerializeAsString() +
                            second.SerializeAsString() +
                            third.SerializeAsString();
  v1::SampleRequest expected;
  ASSERT_TRUE(expected.ParseFromString(bytes));
  std::mt19937 gen(2);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<absl::string_view> pieces = Cut(bytes, 7, gen);
    SplitRequest split;
    ASSERT_EQ(SplitHiddenStates(pieces, &split), SplitResult::kSplit);
    bool ok = false;
    const v1::SampleRequest back = Rejoin(split, &ok);
    ASSERT_TRUE(ok);
    EXPECT_EQ(back.SerializeAsString(), expected.SerializeAsString());
  }
}

TEST(RequestWireTest, TruncatedOrGroupEncodedMessagesAreLeftToProtobuf) {
  const std::string bytes = RichRequest().SerializeAsString();
  for (size_t cut = 1; cut < bytes.size(); cut += 7) {
    const std::string truncated = bytes.substr(0, cut);
    SplitRequest split;
    v1::SampleRequest whole;
    const bool parses = whole.ParseFromString(truncated);
    if (SplitHiddenStates({truncated}, &split) == SplitResult::kSplit) {
      // Cut between two fields: a valid, shorter message either way.
      bool ok = false;
      const v1::SampleRequest back = Rejoin(split, &ok);
      EXPECT_EQ(ok, parses) << "cut at " << cut;
      if (ok) {
        EXPECT_EQ(back.SerializeAsString(), whole.SerializeAsString());
      }
    }
  }
  // An unknown field encoded as a group (start tag 99, end tag 99).
  std::string group = bytes;
  group.push_back(static_cast<char>(((99 << 3 | 3) & 0x7f) | 0x80));
  group.push_back(static_cast<char>(99 >> 4));
  group.push_back(static_cast<char>(((99 << 3 | 4) & 0x7f) | 0x80));
  group.push_back(static_cast<char>(99 >> 4));
  SplitRequest split;
  EXPECT_EQ(SplitHiddenStates({group}, &split), SplitResult::kUnsupported);
}

CodecConfig Config(DType input_dtype) {
  CodecConfig config;
  config.vocab_size = 1000;
  config.hidden_size = kHidden;
  config.max_batch_rows = 8;
  config.input_dtype = input_dtype;
  config.backend = "test";
  config.supported_controls = AllSamplingControls();
  return config;
}

TEST(RequestWireTest, PiecesDecodeLikeContiguousBytes) {
  constexpr int kRows = 4;
  std::mt19937 gen(3);
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    // Clean rows, then a NaN planted at each element in turn.
    for (int bad = -1; bad < kRows * kHidden; bad += (bad < 0 ? 1 : 5)) {
      std::vector<float> values(kRows * kHidden);
      for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * i;
      if (bad >= 0) values[bad] = std::nanf("");
      std::string data(values.size() * DTypeSize(dtype), '\0');
      ConvertDType(DType::kFp32, values.data(), values.size(), dtype,
                   data.data());
      v1::SampleRequest request = testing::MakeRequest(kRows, kHidden, 1);
      request.mutable_hidden_states()->set_dtype(
          dtype == DType::kBf16   ? v1::DTYPE_BF16
          : dtype == DType::kFp16 ? v1::DTYPE_FP16
                                  : v1::DTYPE_FP32);
      request.mutable_hidden_states()->set_data(data);
      for (DType input : {dtype, DType::kFp32}) {
        DecodedRequest whole;
        const absl::Status want =
            DecodeSampleRequest(request, Config(input), &whole);
        for (size_t max_piece : {size_t{1}, size_t{5}, size_t{77}}) {
          const std::vector<absl::string_view> pieces =
              Cut(data, max_piece, gen);
          DecodedRequest split;
          const absl::Status got =
              DecodeSampleRequest(request, pieces, Config(input), &split);
          ASSERT_EQ(got, want) << DTypeName(dtype) << " bad " << bad;
          if (!got.ok()) continue;
          std::string rows;
          if (split.hidden != nullptr) {
            rows.assign(static_cast<const char*>(split.hidden), data.size());
          } else {
            EXPECT_EQ(input, dtype);
            rows = Join(split.hidden_pieces);
          }
          EXPECT_EQ(rows, data);
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashsampler
