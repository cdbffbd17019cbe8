// Unit tests of the request codec: every malformed input is INVALID_ARGUMENT
// naming its field, controls a backend lacks are UNIMPLEMENTED, missing seeds
// are drawn and returned, and results encode as [B, n].
#include "service/serving/request_codec.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/dtype_convert.h"
#include "common/field_violation.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int64_t kVocab = 1000;
constexpr int64_t kHidden = 16;
constexpr int kMaxRows = 8;

CodecConfig Config() {
  CodecConfig config;
  config.vocab_size = kVocab;
  config.hidden_size = kHidden;
  config.max_batch_rows = kMaxRows;
  config.backend = "test";
  config.supported_controls = AllSamplingControls();
  return config;
}

TEST(RequestCodecTest, ValidRequestDecodes) {
  v1::SampleRequest request = testing::MakeRequest(3, kHidden, 100);
  request.add_steps(5);
  request.add_steps(6);
  request.add_steps(7);
  request.mutable_params()->set_temperature(0.5f);
  request.mutable_params()->set_top_k(40);
  DecodedRequest decoded;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_EQ(decoded.rows, 3);
  EXPECT_EQ(decoded.dtype, DType::kFp32);
  ASSERT_EQ(decoded.specs.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(decoded.specs[r].seed, 100u + r);
    EXPECT_EQ(decoded.specs[r].step, 5u + r);
    EXPECT_EQ(decoded.specs[r].params->temperature, 0.5f);
    EXPECT_EQ(decoded.specs[r].params->top_k, 40);
  }
  EXPECT_EQ(decoded.hidden, request.hidden_states().data().data());
}

TEST(RequestCodecTest, DefaultsMatchTheProto) {
  v1::SampleRequest request = testing::MakeRequest(1, kHidden, 1);
  DecodedRequest decoded;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  const SamplingParams& p = decoded.params[0];
  EXPECT_EQ(p.temperature, 1.0f);
  EXPECT_EQ(p.top_p, 1.0f);
  EXPECT_EQ(p.repetition_penalty, 1.0f);
  EXPECT_EQ(p.n, 1);
  EXPECT_EQ(FirstUnsupportedControl(p, {}), "");
}

// RAW is the wire's default space (as vLLM's raw_logprobs), and the space
// counts only where a logprob is asked for: a row without logprobs is not
// a raw-logprobs row (a control the backend must support).
TEST(RequestCodecTest, LogprobsDefaultToTheRawSpace) {
  v1::SampleRequest request = testing::MakeRequest(1, kHidden, 1);
  request.mutable_params()->mutable_logprobs()->set_sampled_logprob(true);
  DecodedRequest decoded;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_TRUE(decoded.params[0].logprobs.raw);
  request.mutable_params()->mutable_logprobs()->set_space(
      v1::LogprobOptions::PROCESSED);
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_FALSE(decoded.params[0].logprobs.raw);
  request.mutable_params()->mutable_logprobs()->set_sampled_logprob(false);
  request.mutable_params()->mutable_logprobs()->set_space(
      v1::LogprobOptions::RAW);
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_FALSE(decoded.params[0].logprobs.raw);
  EXPECT_EQ(FirstUnsupportedControl(decoded.params[0], {}), "");
}

TEST(RequestCodecTest, MissingSeedsAreDrawnPerRow) {
  v1::SampleRequest request = testing::MakeRequest(kMaxRows, kHidden, 0);
  DecodedRequest a;
  DecodedRequest b;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &a).ok());
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &b).ok());
  std::set<uint64_t> seen(a.seeds.begin(), a.seeds.end());
  seen.insert(b.seeds.begin(), b.seeds.end());
  // 16 draws of 64 bits: a collision would mean the draw is broken.
  EXPECT_EQ(seen.size(), 2u * kMaxRows);
  for (int r = 0; r < kMaxRows; ++r) EXPECT_EQ(a.specs[r].seed, a.seeds[r]);
}

TEST(RequestCodecTest, RowParamsApplyPerRow) {
  v1::SampleRequest request = testing::MakeRequest(2, kHidden, 1);
  request.add_row_params()->set_temperature(0.0f);
  request.add_row_params()->set_temperature(2.0f);
  DecodedRequest decoded;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_TRUE(decoded.specs[0].params->greedy());
  EXPECT_EQ(decoded.specs[1].params->temperature, 2.0f);
}

// allowed_token_bitmask_bytes carries the words of allowed_token_bitmask
// little-endian: both forms decode to the same bitmask, bit 31 included,
// and neither is copied out of the request.
TEST(RequestCodecTest, BitmaskBytesDecodeToTheWordsOfTheRepeatedField) {
  const int64_t words = (Config().vocab_size + 31) / 32;
  std::vector<uint32_t> mask(static_cast<size_t>(words));
  for (size_t w = 0; w < mask.size(); ++w) {
    mask[w] = 0x80000001u ^ static_cast<uint32_t>(w * 0x9e3779b9u);
  }
  v1::SampleRequest as_words = testing::MakeRequest(2, kHidden, 1);
  v1::SampleRequest as_bytes = as_words;
  for (uint32_t w : mask) {
    as_words.mutable_params()->add_allowed_token_bitmask(
        static_cast<int32_t>(w));
  }
  std::string bytes(4 * mask.size(), '\0');
  for (size_t w = 0; w < mask.size(); ++w) {
    for (int b = 0; b < 4; ++b)
      bytes[4 * w + b] = static_cast<char>(mask[w] >> (8 * b));
  }
  as_bytes.mutable_params()->set_allowed_token_bitmask_bytes(bytes);
  DecodedRequest from_words;
  DecodedRequest from_bytes;
  ASSERT_TRUE(DecodeSampleRequest(as_words, Config(), &from_words).ok());
  ASSERT_TRUE(DecodeSampleRequest(as_bytes, Config(), &from_bytes).ok());
  EXPECT_EQ(from_words.specs[0].params->allowed_bitmask, mask);
  EXPECT_EQ(from_bytes.specs[0].params->allowed_bitmask, mask);
  EXPECT_EQ(from_bytes.specs[1].params->allowed_bitmask, mask);
  // Both are read where the request holds them, not copied.
  EXPECT_EQ(static_cast<const void*>(
                from_words.specs[0].params->allowed_bitmask.data()),
            static_cast<const void*>(
                as_words.params().allowed_token_bitmask().data()));
  EXPECT_EQ(static_cast<const void*>(
                from_bytes.specs[0].params->allowed_bitmask.data()),
            static_cast<const void*>(
                as_bytes.params().allowed_token_bitmask_bytes().data()));
}

TEST(RequestCodecTest, Bf16AndFp16HiddenStatesAreAccepted) {
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    v1::SampleRequest request;
    v1::Tensor* t = request.mutable_hidden_states();
    t->set_dtype(dtype);
    t->add_shape(2);
    t->add_shape(kHidden);
    std::vector<uint16_t> words(2 * kHidden);
    for (size_t i = 0; i < words.size(); ++i) {
      words[i] = dtype == v1::DTYPE_BF16 ? FloatToBf16(0.25f * i)
                                         : FloatToHalf(0.25f * i);
    }
    t->set_data(words.data(), words.size() * 2);
    DecodedRequest decoded;
    EXPECT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  }
}

// Regression: fp32 values beyond 65504 are finite on the wire but become
// inf in an fp16 engine (and FLT_MAX in a bf16 one); that must be refused,
// not sampled.
TEST(RequestCodecTest, OverflowIntoANarrowerEngineDtypeIsRefused) {
  v1::SampleRequest request = testing::MakeRequest(2, kHidden, 1);
  const float big = 70000.0f;
  std::memcpy(&(*request.mutable_hidden_states()->mutable_data())[kHidden * 4],
              &big, 4);
  CodecConfig config = Config();
  DecodedRequest decoded;
  EXPECT_TRUE(DecodeSampleRequest(request, config, &decoded).ok());
  config.input_dtype = DType::kFp16;
  absl::Status status = DecodeSampleRequest(request, config, &decoded);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("hidden_states.data: must be finite, row 1"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("fp16"));

  // Same for a bf16 engine: FLT_MAX rounds up to inf in bf16.
  config.input_dtype = DType::kBf16;
  EXPECT_TRUE(DecodeSampleRequest(request, config, &decoded).ok());
  const float near_max = std::numeric_limits<float>::max();
  std::memcpy(&(*request.mutable_hidden_states()->mutable_data())[0], &near_max,
              4);
  status = DecodeSampleRequest(request, config, &decoded);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("hidden_states.data: must be finite, row 0"));
}

TEST(RequestCodecTest, EveryMalformedInputNamesItsField) {
  const std::vector<testing::MalformedCase> cases =
      testing::MalformedCases(kVocab, kHidden, kMaxRows);
  ASSERT_GE(cases.size(), 15u);
  std::set<std::string> names;
  for (const testing::MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case";
    DecodedRequest decoded;
    const absl::Status status =
        DecodeSampleRequest(c.request, Config(), &decoded);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), StartsWith(c.field + ": "));
    // The field path travels beside the message, for google.rpc.BadRequest.
    const std::optional<FieldViolation> violation = GetFieldViolation(status);
    ASSERT_TRUE(violation.has_value()) << status;
    EXPECT_EQ(violation->field, c.field);
    EXPECT_EQ(c.field + ": " + violation->description, status.message());
    // ... and says what was expected.
    EXPECT_TRUE(absl::StrContains(status.message(), "must") ||
                absl::StrContains(status.message(), "required"))
        << status.message();
  }
}

TEST(RequestCodecTest, MessagesCarryTheExpectedValue) {
  DecodedRequest decoded;
  v1::SampleRequest request = testing::MakeRequest(2, kHidden + 3, 1);
  absl::Status status = DecodeSampleRequest(request, Config(), &decoded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("D = 16, got 19"));
  request = testing::MakeRequest(2, kHidden, 1);
  request.mutable_params()->set_top_p(1.5f);
  status = DecodeSampleRequest(request, Config(), &decoded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("(0, 1]"));
  request = testing::MakeRequest(2, kHidden, 1);
  request.mutable_params()->add_banned_token_ids(static_cast<int32_t>(kVocab));
  status = DecodeSampleRequest(request, Config(), &decoded);
  EXPECT_THAT(std::string(status.message()), HasSubstr("[0, 1000), got 1000"));
}

TEST(RequestCodecTest, UnsupportedControlIsUnimplementedNamingTheField) {
  CodecConfig config = Config();
  config.supported_controls = {"temperature", "top_k"};
  v1::SampleRequest request = testing::MakeRequest(2, kHidden, 1);
  request.mutable_params()->set_top_k(5);
  DecodedRequest decoded;
  EXPECT_TRUE(DecodeSampleRequest(request, config, &decoded).ok());
  request.mutable_params()->set_top_p(0.9f);
  absl::Status status = DecodeSampleRequest(request, config, &decoded);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(status.message()), StartsWith("params.top_p: "));

  request = testing::MakeRequest(2, kHidden, 1);
  request.add_row_params();
  request.add_row_params()->mutable_logprobs()->set_sampled_logprob(true);
  request.mutable_row_params(0)->mutable_logprobs()->set_sampled_logprob(true);
  status = DecodeSampleRequest(request, config, &decoded);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(status.message()),
              StartsWith("row_params[0].logprobs.sampled_logprob: "));
}

TEST(RequestCodecTest, ValidationComesBeforeUnimplemented) {
  CodecConfig config = Config();
  config.supported_controls = {};
  v1::SampleRequest request = testing::MakeRequest(2, kHidden, 1);
  request.mutable_params()->set_top_p(2.0f);
  DecodedRequest decoded;
  EXPECT_EQ(DecodeSampleRequest(request, config, &decoded).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RequestCodecTest, EncodesTokensSeedsAndLogprobs) {
  v1::SampleRequest request = testing::MakeRequest(2, kHidden, 10);
  request.set_request_id("abc");
  request.mutable_params()->set_n(2);
  request.mutable_params()->mutable_logprobs()->set_sampled_logprob(true);
  request.mutable_params()->mutable_logprobs()->set_row_logsumexp(true);
  request.mutable_params()->mutable_logprobs()->set_top_logprobs(1);
  request.mutable_params()->mutable_logprobs()->set_sampled_rank(true);
  DecodedRequest decoded;
  ASSERT_TRUE(DecodeSampleRequest(request, Config(), &decoded).ok());
  EXPECT_TRUE(decoded.logprobs.rank);
  std::vector<RowResult> results(2);
  results[0].token_ids = {1, 2};
  results[0].sampled_logprobs = {-0.1f, -0.2f};
  results[0].sampled_ranks = {1, 7};
  results[0].logsumexp = 3.0f;
  results[0].top_token_ids = {1};
  results[0].top_logprobs = {-0.1f};
  results[1].token_ids = {3, 4};
  results[1].sampled_logprobs = {-0.3f, -0.4f};
  results[1].sampled_ranks = {2, 2};
  results[1].logsumexp = 4.0f;
  results[1].top_token_ids = {4};
  results[1].top_logprobs = {-0.4f};
  v1::SampleResponse response;
  ASSERT_TRUE(EncodeSampleResponse(request, decoded, results, &response).ok());
  EXPECT_EQ(response.request_id(), "abc");
  EXPECT_EQ(response.n(), 2);
  EXPECT_THAT(response.token_ids(), ::testing::ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(response.seeds(), ::testing::ElementsAre(10u, 11u));
  EXPECT_THAT(response.sampled_logprobs(),
              ::testing::ElementsAre(-0.1f, -0.2f, -0.3f, -0.4f));
  EXPECT_THAT(response.sampled_ranks(), ::testing::ElementsAre(1, 7, 2, 2));
  EXPECT_THAT(response.row_logsumexp(), ::testing::ElementsAre(3.0f, 4.0f));
  ASSERT_EQ(response.top_logprobs_size(), 2);
  EXPECT_THAT(response.top_logprobs(1).token_ids(), ::testing::ElementsAre(4));

  results[1].sampled_ranks = {2};  // an engine bug must not reach the client
  v1::SampleResponse short_ranks;
  EXPECT_EQ(
      EncodeSampleResponse(request, decoded, results, &short_ranks).code(),
      absl::StatusCode::kInternal);
  results[1].sampled_ranks = {2, 2};
  results[1].token_ids = {3};
  v1::SampleResponse bad;
  EXPECT_EQ(EncodeSampleResponse(request, decoded, results, &bad).code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace flashsampler
