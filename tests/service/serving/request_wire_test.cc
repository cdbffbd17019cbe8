// Tests of SplitHiddenStates and of decoding a request from pieces: for any
// way the transport cuts a message, the split parses to the message protobuf
// parses from the whole (its rows on one thread or on a pool), and the
// pieces decode as the contiguous bytes do (the same rows, the same first
// non-finite row), and CopyFinitePieces, the batch's copy of rows left
// unchecked, copies them whole and names the first non-finite row.
#include "service/serving/request_wire.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
  for (int row = 0; row < 3; ++row) {
    v1::SamplingParams* p = request.add_row_params();
    p->set_top_p(0.5f + 0.1f * row);
    p->add_prompt_token_ids(row);
    p->add_logit_bias()->set_token_id(7 * row);
  }
  return request;
}

// Parses a split message back into one SampleRequest by ParseSplitRequest
// (with `pool`, when given), and its bytes joined, which must agree.
v1::SampleRequest Rejoin(const SplitRequest& split, bool* ok,
                         ThreadPool* pool = nullptr) {
  v1::SampleRequest request;
  *ok = ParseSplitRequest(split, pool, &request);
  v1::SampleRequest joined;
  bool joined_ok = joined.ParseFromString(Join(split.rest));
  for (const std::vector<absl::string_view>& row : split.row_params) {
    joined_ok =
        joined_ok && joined.add_row_params()->ParseFromString(Join(row));
  }
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

// Rows of 64 KB and more in all are parsed on the pool: the same message,
// and a row that does not parse fails the request, wherever it is.
TEST(RequestWireTest, RowsParsedOnAPoolGiveTheWholeMessage) {
  v1::SampleRequest request = testing::MakeRequest(64, kHidden, 3);
  for (int row = 0; row < 64; ++row) {
    v1::SamplingParams* p = request.add_row_params();
    p->set_temperature(0.01f * row);
    p->set_allowed_token_bitmask_bytes(
        std::string(2048, static_cast<char>(row)));
    for (int i = 0; i < 16; ++i) p->add_logit_bias()->set_token_id(row + i);
  }
  const std::string bytes = request.SerializeAsString();
  ThreadPool pool(3);
  std::mt19937 gen(4);
  for (size_t max_piece : {size_t{999}, bytes.size()}) {
    const std::vector<absl::string_view> pieces = Cut(bytes, max_piece, gen);
    SplitRequest split;
    ASSERT_EQ(SplitHiddenStates(pieces, &split), SplitResult::kSplit);
    ASSERT_EQ(split.row_params.size(), 64u);
    ASSERT_GE(split.row_params_bytes, kParallelRowParamsBytes);
    bool ok = false;
    v1::SampleRequest back = Rejoin(split, &ok, &pool);
    ASSERT_TRUE(ok);
    back.mutable_hidden_states()->set_data(Join(split.data));
    EXPECT_EQ(back.SerializeAsString(), bytes);
  }
  // The bad row's 64 KB bitmask tag (field 15, wire type 2) made a group
  // start (wire type 3) that never ends.
  for (int bad : {0, 40, 63}) {
    v1::SampleRequest broken = request;
    broken.mutable_row_params(bad)->Clear();
    broken.mutable_row_params(bad)->set_allowed_token_bitmask_bytes(
        std::string(kParallelRowParamsBytes, 'b'));
    std::string broken_bytes = broken.SerializeAsString();
    const std::string tag = {static_cast<char>(15 << 3 | 2)};
    const size_t at = broken_bytes.find(tag + std::string("\x80\x80\x04"));
    ASSERT_NE(at, std::string::npos);
    broken_bytes[at] = static_cast<char>(15 << 3 | 3);
    SplitRequest split;
    ASSERT_EQ(SplitHiddenStates({broken_bytes}, &split), SplitResult::kSplit);
    v1::SampleRequest whole;
    EXPECT_FALSE(whole.ParseFromString(broken_bytes));
    v1::SampleRequest parsed;
    EXPECT_FALSE(ParseSplitRequest(split, &pool, &parsed)) << "row " << bad;
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

// A server's codec leaves rows in the engine's dtype unchecked, as pieces
// (the batch checks them as it copies them); rows it converts are still
// checked here.
TEST(RequestWireTest, RowsCheckedWhenCopiedAreLeftAsPieces) {
  v1::SampleRequest request = testing::MakeRequest(3, kHidden, 1);
  const float nan = std::nanf("");
  std::memcpy(&(*request.mutable_hidden_states()->mutable_data())[kHidden * 4],
              &nan, sizeof(nan));
  const std::string data = request.hidden_states().data();
  std::mt19937 gen(5);
  const std::vector<absl::string_view> pieces = Cut(data, 40, gen);
  CodecConfig config = Config(DType::kFp32);
  config.rows_checked_when_copied = true;
  for (bool split : {false, true}) {
    DecodedRequest decoded;
    ASSERT_TRUE((split ? DecodeSampleRequest(request, pieces, config, &decoded)
                       : DecodeSampleRequest(request, config, &decoded))
                    .ok());
    EXPECT_EQ(decoded.hidden, nullptr);
    EXPECT_EQ(Join(decoded.hidden_pieces), data);
    std::string copy(data.size(), '\0');
    const absl::Status copied = CopyFinitePieces(
        DType::kFp32, decoded.hidden_pieces, kHidden, copy.data());
    EXPECT_EQ(copied.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(copied.message(),
              "hidden_states.data: must be finite, row 1 holds NaN or Inf");
  }
  // An fp16 engine converts the rows at decode: they are checked there.
  config.input_dtype = DType::kFp16;
  DecodedRequest decoded;
  const absl::Status status = DecodeSampleRequest(request, config, &decoded);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("row 1"), absl::string_view::npos) << status;
}

// Rows larger and smaller than the copy's 64 KB chunks, cut anywhere: every
// byte arrives, and the first non-finite element's row is the one named
// (never a later one, whatever chunk or piece it shares with others).
TEST(RequestWireTest, CopyFinitePiecesCopiesEveryCutAndNamesTheFirstBadRow) {
  std::mt19937 gen(11);
  for (DType dtype : {DType::kBf16, DType::kFp32}) {
    for (int64_t hidden : {int64_t{24}, int64_t{6000}, int64_t{40000}}) {
      const int rows = static_cast<int>(std::max<int64_t>(3, 600000 / hidden));
      std::vector<float> values(static_cast<size_t>(rows * hidden));
      for (size_t i = 0; i < values.size(); ++i) {
        values[i] = 0.001f * static_cast<float>(i % 977);
      }
      const int64_t count = rows * hidden;
      for (int64_t bad :
           {int64_t{-1}, int64_t{0}, hidden - 1, count / 2, count - 1}) {
        std::vector<float> planted = values;
        if (bad >= 0) {
          planted[static_cast<size_t>(bad)] =
              bad % 2 == 0 ? std::nanf("")
                           : -std::numeric_limits<float>::infinity();
        }
        std::string data(planted.size() * DTypeSize(dtype), '\0');
        ConvertDType(DType::kFp32, planted.data(), planted.size(), dtype,
                     data.data());
        for (size_t max_piece : {size_t{13}, size_t{70000}, data.size()}) {
          SCOPED_TRACE(::testing::Message()
                       << DTypeName(dtype) << " D " << hidden << " bad " << bad
                       << " pieces <= " << max_piece);
          std::string copy(data.size(), '\0');
          const absl::Status status = CopyFinitePieces(
              dtype, Cut(data, max_piece, gen), hidden, copy.data());
          if (bad < 0) {
            ASSERT_TRUE(status.ok()) << status;
            EXPECT_EQ(copy, data);
            continue;
          }
          const int64_t row = bad / hidden;
          EXPECT_EQ(status.message(),
                    absl::StrCat("hidden_states.data: must be finite, row ",
                                 row, " holds NaN or Inf"));
          const size_t before =
              static_cast<size_t>(row * hidden) * DTypeSize(dtype);
          EXPECT_EQ(copy.substr(0, before), data.substr(0, before));
        }
      }
    }
  }
}

// Rows decoded on a pool are the rows decoded on one thread, and the error
// is the first failing row's, whichever thread met it first.
TEST(RequestWireTest, RowsDecodedOnAPoolGiveTheSameRowsAndFirstError) {
  constexpr int kRows = 8;
  v1::SampleRequest request = testing::MakeRequest(kRows, kHidden, 5);
  for (int row = 0; row < kRows; ++row) {
    v1::SamplingParams* p = request.add_row_params();
    p->set_top_k(row + 1);
    p->add_banned_token_ids(row);
    p->add_logit_bias()->set_token_id(3 * row);
  }
  const std::string data = request.hidden_states().data();
  const std::vector<absl::string_view> pieces = {data};
  ThreadPool pool(3);
  DecodedRequest serial;
  DecodedRequest pooled;
  ASSERT_TRUE(
      DecodeSampleRequest(request, pieces, Config(DType::kFp32), &serial).ok());
  ASSERT_TRUE(
      DecodeSampleRequest(request, pieces, Config(DType::kFp32), &pooled, &pool)
          .ok());
  ASSERT_EQ(pooled.params.size(), serial.params.size());
  for (int row = 0; row < kRows; ++row) {
    EXPECT_EQ(pooled.params[row].top_k, row + 1);
    EXPECT_EQ(pooled.params[row].banned_token_ids,
              serial.params[row].banned_token_ids);
    EXPECT_EQ(pooled.specs[row].params, &pooled.params[row]);
  }
  request.mutable_row_params(6)->set_top_p(2.0f);
  request.mutable_row_params(2)->add_banned_token_ids(5000);
  for (int trial = 0; trial < 20; ++trial) {
    const absl::Status got = DecodeSampleRequest(
        request, pieces, Config(DType::kFp32), &pooled, &pool);
    EXPECT_EQ(got, DecodeSampleRequest(request, pieces, Config(DType::kFp32),
                                       &serial));
    EXPECT_NE(got.message().find("row_params[2].banned_token_ids[1]"),
              absl::string_view::npos)
        << got;
  }
}

}  // namespace
}  // namespace flashsampler
