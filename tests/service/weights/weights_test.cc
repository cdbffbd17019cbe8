// Tests of the weights loader: safetensors round trips (single file, sharded
// index, directory, tied embeddings), every malformed-checkpoint case giving a
// clear status and no crash, and the synthetic generator against a slow
// reference.
#include "service/weights/weights.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype_convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/noise/philox.h"
#include "nlohmann/json.hpp"

namespace flashsampler {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// A fresh directory per test under the test's temp dir, removed with
// everything in it when the test ends.
class TestDir {
 public:
  explicit TestDir(const std::string& suffix = "") {
    const testing::TestInfo* info =
        testing::UnitTest::GetInstance()->current_test_info();
    std::string name =
        absl::StrCat(info->test_suite_name(), "_", info->name(), suffix);
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    path_ =
        absl::StrCat(testing::TempDir(), "/fs_weights_", getpid(), "_", name);
    std::filesystem::create_directories(path_);
  }
  ~TestDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TestDir(const TestDir&) = delete;
  TestDir& operator=(const TestDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Raw element bits of a [rows, cols] tensor: varied patterns (signs,
// subnormals, the largest exponents) so a byte-exact round trip is really
// checked. The loader refuses NaN and Inf, so a pattern with every exponent
// bit set gets its lowest exponent bit cleared.
std::vector<uint8_t> PatternBytes(DType dtype, int64_t rows, int64_t cols,
                                  uint32_t salt) {
  const size_t count = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> bytes(count * DTypeSize(dtype));
  for (size_t i = 0; i < count; ++i) {
    uint32_t bits = static_cast<uint32_t>(i) * 2654435761u + salt;
    if (dtype == DType::kFp32) {
      if ((bits & 0x7f800000u) == 0x7f800000u) bits ^= 0x00800000u;
      std::memcpy(&bytes[4 * i], &bits, 4);
    } else {
      const uint16_t exponent = dtype == DType::kBf16 ? 0x7f80u : 0x7c00u;
      const uint16_t lowest = dtype == DType::kBf16 ? 0x0080u : 0x0400u;
      uint16_t half = static_cast<uint16_t>(bits >> 13);
      if ((half & exponent) == exponent) half ^= lowest;
      std::memcpy(&bytes[2 * i], &half, 2);
    }
  }
  return bytes;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A safetensors file with a hand-written header (for the malformed cases).
// `declared_length` overrides the length field when >= 0.
void WriteRawSafetensors(const std::string& path, const std::string& header,
                         size_t data_bytes, int64_t declared_length = -1) {
  const uint64_t length = declared_length >= 0
                              ? static_cast<uint64_t>(declared_length)
                              : static_cast<uint64_t>(header.size());
  std::string contents(8, '\0');
  for (int i = 0; i < 8; ++i) {
    contents[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  }
  contents += header;
  contents.append(data_bytes, '\x11');
  WriteFile(path, contents);
}

absl::StatusOr<std::unique_ptr<Weights>> LoadFrom(
    const std::string& source, const std::string& tensor = "",
    const std::string& expected_dtype = "") {
  WeightsOptions options;
  options.source = source;
  options.tensor_name = tensor;
  options.expected_dtype = expected_dtype;
  return Weights::Load(options);
}

// Asserts that the weights hold exactly `bytes` as a [rows, cols] tensor.
void ExpectTensor(const Weights& weights, DType dtype, int64_t rows,
                  int64_t cols, const std::vector<uint8_t>& bytes) {
  ASSERT_EQ(weights.vocab_size(), rows);
  ASSERT_EQ(weights.hidden_size(), cols);
  ASSERT_EQ(weights.dtype(), dtype);
  ASSERT_EQ(weights.size_bytes(), bytes.size());
  ASSERT_NE(weights.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(weights.data()) % DTypeSize(dtype), 0u);
  const size_t element = DTypeSize(dtype);
  const auto* got = static_cast<const uint8_t*>(weights.data());
  for (size_t i = 0; i < bytes.size() / element; ++i) {
    ASSERT_EQ(std::memcmp(got + i * element, &bytes[i * element], element), 0)
        << "element " << i << " (row " << i / cols << ", col " << i % cols
        << ")";
  }
}

TEST(WeightsRoundTripTest, EveryDtypeReadsBackBitForBit) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    SCOPED_TRACE(DTypeName(dtype));
    const int64_t rows = 37, cols = 24;
    const std::vector<uint8_t> head = PatternBytes(dtype, rows, cols, 1);
    const std::vector<uint8_t> norm = PatternBytes(DType::kFp32, 1, cols, 2);
    const std::vector<uint8_t> embed = PatternBytes(dtype, rows, cols, 3);
    const std::string path =
        absl::StrCat(dir, "/model_", DTypeName(dtype), ".safetensors");
    ASSERT_TRUE(
        WriteSafetensors(
            path,
            {{"model.norm.weight", DType::kFp32, 1, cols, norm.data()},
             {"model.embed_tokens.weight", dtype, rows, cols, embed.data()},
             {"lm_head.weight", dtype, rows, cols, head.data()}})
            .ok());
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
    ASSERT_TRUE(weights.ok()) << weights.status();
    ExpectTensor(**weights, dtype, rows, cols, head);
    EXPECT_EQ((*weights)->tensor_name(), "lm_head.weight");
    EXPECT_EQ((*weights)->source(), path);

    // Any tensor by name, and the expected dtype when it matches.
    weights = LoadFrom(path, "model.norm.weight", "fp32");
    ASSERT_TRUE(weights.ok()) << weights.status();
    ExpectTensor(**weights, DType::kFp32, 1, cols, norm);
    weights = LoadFrom(path, "model.embed_tokens.weight", DTypeName(dtype));
    ASSERT_TRUE(weights.ok()) << weights.status();
    ExpectTensor(**weights, dtype, rows, cols, embed);
  }
}

TEST(WeightsRoundTripTest, FileLayoutFollowsTheFormat) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/layout.safetensors";
  // An odd-sized bf16 tensor listed before an fp32 one: the writer must still
  // place the fp32 tensor at a multiple of 4.
  const std::vector<uint8_t> odd = PatternBytes(DType::kBf16, 3, 5, 4);
  const std::vector<uint8_t> wide = PatternBytes(DType::kFp32, 7, 3, 5);
  ASSERT_TRUE(WriteSafetensors(path,
                               {{"odd", DType::kBf16, 3, 5, odd.data()},
                                {"wide", DType::kFp32, 7, 3, wide.data()}},
                               {{"format", "pt"}, {"note", "test"}})
                  .ok());
  const std::string contents = ReadFile(path);
  ASSERT_GE(contents.size(), 8u);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) {
    length = (length << 8) | static_cast<uint8_t>(contents[i]);
  }
  EXPECT_EQ((8 + length) % 8, 0u);
  ASSERT_EQ(contents.size(), 8 + length + odd.size() + wide.size());
  const Json header = Json::parse(contents.substr(8, length), nullptr, false);
  ASSERT_FALSE(header.is_discarded());
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["__metadata__"]["note"], "test");
  EXPECT_EQ(header["wide"]["dtype"], "F32");
  EXPECT_EQ(header["wide"]["shape"], Json({7, 3}));
  EXPECT_EQ(header["wide"]["data_offsets"], Json({0, 84}));
  EXPECT_EQ(header["odd"]["dtype"], "BF16");
  EXPECT_EQ(header["odd"]["data_offsets"], Json({84, 114}));

  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path, "wide");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kFp32, 7, 3, wide);
  weights = LoadFrom(path, "odd");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 3, 5, odd);
}

TEST(WeightsRoundTripTest, MisalignedTensorIsCopiedToAlignedMemory) {
  // Other writers may leave an fp32 tensor at an odd offset; the loader must
  // still hand out element-aligned data.
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/misaligned.safetensors";
  const std::vector<uint8_t> wide = PatternBytes(DType::kFp32, 2, 3, 6);
  const std::string header =
      R"({"pad":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("lm_head.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[1,25]}})";
  std::string padded = header;
  padded.append((8 - padded.size() % 8) % 8, ' ');
  std::string contents(8, '\0');
  for (int i = 0; i < 8; ++i) {
    contents[i] = static_cast<char>((padded.size() >> (8 * i)) & 0xff);
  }
  contents += padded;
  contents.push_back('\x7f');
  contents.append(reinterpret_cast<const char*>(wide.data()), wide.size());
  WriteFile(path, contents);
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kFp32, 2, 3, wide);
}

TEST(WeightsRoundTripTest, TiedEmbeddingsAreTheFallback) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/tied.safetensors";
  const std::vector<uint8_t> embed = PatternBytes(DType::kBf16, 11, 16, 7);
  const std::vector<uint8_t> norm = PatternBytes(DType::kBf16, 1, 16, 8);
  ASSERT_TRUE(
      WriteSafetensors(
          path,
          {{"model.embed_tokens.weight", DType::kBf16, 11, 16, embed.data()},
           {"model.norm.weight", DType::kBf16, 1, 16, norm.data()}})
          .ok());
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 11, 16, embed);
  EXPECT_EQ((*weights)->tensor_name(), "model.embed_tokens.weight");
}

// Two shards and an index, as Hugging Face writes them.
struct ShardedCheckpoint {
  std::string dir;
  std::string index;
  std::vector<uint8_t> head, embed, layer;
};

ShardedCheckpoint WriteSharded(const std::string& dir, bool with_head) {
  ShardedCheckpoint checkpoint;
  checkpoint.dir = dir;
  checkpoint.index = dir + "/model.safetensors.index.json";
  checkpoint.embed = PatternBytes(DType::kBf16, 50, 32, 9);
  checkpoint.layer = PatternBytes(DType::kBf16, 32, 32, 10);
  checkpoint.head = PatternBytes(DType::kBf16, 50, 32, 11);
  EXPECT_TRUE(WriteSafetensors(dir + "/model-00001-of-00002.safetensors",
                               {{"model.embed_tokens.weight", DType::kBf16, 50,
                                 32, checkpoint.embed.data()},
                                {"model.layers.0.mlp.weight", DType::kBf16, 32,
                                 32, checkpoint.layer.data()}})
                  .ok());
  std::vector<TensorToWrite> second = {
      {"model.norm.weight", DType::kBf16, 1, 32, checkpoint.layer.data()}};
  if (with_head) {
    second.push_back(
        {"lm_head.weight", DType::kBf16, 50, 32, checkpoint.head.data()});
  }
  EXPECT_TRUE(
      WriteSafetensors(dir + "/model-00002-of-00002.safetensors", second).ok());
  Json index = {
      {"metadata", {{"total_size", 12345}}},
      {"weight_map",
       {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
        {"model.layers.0.mlp.weight", "model-00001-of-00002.safetensors"},
        {"model.norm.weight", "model-00002-of-00002.safetensors"}}}};
  if (with_head) {
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors";
  }
  WriteFile(checkpoint.index, index.dump(2));
  return checkpoint;
}

TEST(WeightsShardedTest, IndexRoundTrip) {
  const TestDir test_dir;
  const ShardedCheckpoint checkpoint = WriteSharded(test_dir.path(), true);
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(checkpoint.index);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 50, 32, checkpoint.head);
  EXPECT_EQ((*weights)->tensor_name(), "lm_head.weight");
  EXPECT_EQ((*weights)->source(), checkpoint.index);

  // The directory finds the index by itself.
  weights = LoadFrom(checkpoint.dir);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 50, 32, checkpoint.head);

  // A tensor in the other shard, by name.
  weights = LoadFrom(checkpoint.dir, "model.layers.0.mlp.weight");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 32, 32, checkpoint.layer);
}

TEST(WeightsShardedTest, TiedEmbeddingFallbackThroughIndex) {
  const TestDir test_dir;
  const ShardedCheckpoint checkpoint = WriteSharded(test_dir.path(), false);
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(checkpoint.dir);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kBf16, 50, 32, checkpoint.embed);
  EXPECT_EQ((*weights)->tensor_name(), "model.embed_tokens.weight");
}

TEST(WeightsDirectoryTest, FindsTheSingleFile) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::vector<uint8_t> head = PatternBytes(DType::kFp16, 9, 8, 12);
  ASSERT_TRUE(
      WriteSafetensors(dir + "/model.safetensors",
                       {{"lm_head.weight", DType::kFp16, 9, 8, head.data()}})
          .ok());
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(dir);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kFp16, 9, 8, head);

  // Any one *.safetensors file name works too; two are ambiguous.
  const TestDir other_dir("_other");
  const std::string& other = other_dir.path();
  ASSERT_TRUE(
      WriteSafetensors(other + "/consolidated.safetensors",
                       {{"lm_head.weight", DType::kFp16, 9, 8, head.data()}})
          .ok());
  weights = LoadFrom(other);
  ASSERT_TRUE(weights.ok()) << weights.status();
  ExpectTensor(**weights, DType::kFp16, 9, 8, head);
  ASSERT_TRUE(
      WriteSafetensors(other + "/second.safetensors",
                       {{"lm_head.weight", DType::kFp16, 9, 8, head.data()}})
          .ok());
  weights = LoadFrom(other);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(), HasSubstr("several"));
}

// One malformed checkpoint: its header (written raw) and what Load must say.
struct BadHeaderCase {
  std::string name;
  std::string header;
  size_t data_bytes;
  std::string tensor;  // tensor requested ("" = default choice)
  std::string expected_dtype;
  absl::StatusCode code;
  std::string message;  // substring of the error message
};

std::string Entry(const std::string& name, const std::string& dtype,
                  const std::string& shape, const std::string& offsets) {
  return absl::StrCat("\"", name, "\":{\"dtype\":\"", dtype,
                      "\",\"shape\":", shape, ",\"data_offsets\":", offsets,
                      "}");
}

TEST(WeightsErrorTest, MalformedHeadersGiveClearErrors) {
  const std::string kHead = "lm_head.weight";
  const auto head = [&](const std::string& dtype, const std::string& shape,
                        const std::string& offsets) {
    return absl::StrCat("{", Entry(kHead, dtype, shape, offsets), "}");
  };
  const std::vector<BadHeaderCase> cases = {
      {"NotJson", "{\"lm_head.weight\": [", 0, "", "",
       absl::StatusCode::kDataLoss, "not valid JSON"},
      {"NotAnObject", "[1, 2, 3]", 0, "", "", absl::StatusCode::kDataLoss,
       "not a JSON object"},
      {"EntryNotAnObject", "{\"lm_head.weight\": 5}", 0, "", "",
       absl::StatusCode::kDataLoss, "'lm_head.weight' is not a JSON object"},
      {"NoDtype", R"({"lm_head.weight":{"shape":[2,8],"data_offsets":[0,32]}})",
       32, "", "", absl::StatusCode::kDataLoss, "no string \"dtype\""},
      {"NoShape",
       R"({"lm_head.weight":{"dtype":"BF16","data_offsets":[0,32]}})", 32, "",
       "", absl::StatusCode::kDataLoss, "no \"shape\" array"},
      {"NoOffsets", R"({"lm_head.weight":{"dtype":"BF16","shape":[2,8]}})", 32,
       "", "", absl::StatusCode::kDataLoss, "data_offsets"},
      {"ThreeOffsets", head("BF16", "[2,8]", "[0,16,32]"), 32, "", "",
       absl::StatusCode::kDataLoss, "data_offsets"},
      {"FloatOffset", head("BF16", "[2,8]", "[0,32.5]"), 32, "", "",
       absl::StatusCode::kDataLoss, "not an integer"},
      {"NegativeOffset", head("BF16", "[2,8]", "[-32,0]"), 32, "", "",
       absl::StatusCode::kDataLoss, "negative"},
      {"NegativeShape", head("BF16", "[-2,8]", "[0,32]"), 32, "", "",
       absl::StatusCode::kDataLoss, "negative"},
      {"EndBeforeBegin", head("BF16", "[2,8]", "[32,0]"), 32, "", "",
       absl::StatusCode::kDataLoss, "end before begin"},
      {"OffsetsPastEnd", head("BF16", "[2,8]", "[0,32]"), 20, "", "",
       absl::StatusCode::kDataLoss, "truncated"},
      {"OtherTensorPastEnd",
       absl::StrCat("{", Entry(kHead, "BF16", "[2,8]", "[0,32]"), ",",
                    Entry("model.norm.weight", "BF16", "[8]", "[32,48]"), "}"),
       40, "", "", absl::StatusCode::kDataLoss, "truncated"},
      {"Overlap",
       absl::StrCat("{", Entry(kHead, "BF16", "[2,8]", "[0,32]"), ",",
                    Entry("model.norm.weight", "BF16", "[8]", "[16,32]"), "}"),
       32, "", "", absl::StatusCode::kDataLoss, "overlap"},
      {"SizeMismatch", head("BF16", "[2,8]", "[0,30]"), 32, "", "",
       absl::StatusCode::kDataLoss, "needs 32 bytes"},
      {"SizeMismatchDtype", head("F32", "[2,8]", "[0,32]"), 64, "", "",
       absl::StatusCode::kDataLoss, "needs 64 bytes"},
      {"RankOne", head("BF16", "[16]", "[0,32]"), 32, "", "",
       absl::StatusCode::kInvalidArgument, "rank 1"},
      {"RankThree", head("BF16", "[2,2,4]", "[0,32]"), 32, "", "",
       absl::StatusCode::kInvalidArgument, "rank 3"},
      {"ZeroVocab", head("BF16", "[0,8]", "[0,0]"), 0, "", "",
       absl::StatusCode::kInvalidArgument, "empty"},
      {"ZeroHidden", head("BF16", "[8,0]", "[0,0]"), 0, "", "",
       absl::StatusCode::kInvalidArgument, "empty"},
      {"HugeVocab", head("BF16", "[4294967296,1]", "[0,32]"), 32, "", "",
       absl::StatusCode::kInvalidArgument, "below 2^31"},
      {"UnsupportedDtype", head("I64", "[2,2]", "[0,32]"), 32, "", "",
       absl::StatusCode::kInvalidArgument, "unsupported dtype 'I64'"},
      {"Fp8Unsupported", head("F8_E4M3", "[4,8]", "[0,32]"), 32, "", "",
       absl::StatusCode::kInvalidArgument, "unsupported dtype 'F8_E4M3'"},
      {"DtypeMismatch", head("BF16", "[2,8]", "[0,32]"), 32, "", "fp16",
       absl::StatusCode::kInvalidArgument, "dtype BF16 but F16"},
      {"DtypeMismatchFp32", head("F16", "[2,8]", "[0,32]"), 32, "", "F32",
       absl::StatusCode::kInvalidArgument, "dtype F16 but F32"},
      {"BadExpectedDtype", head("BF16", "[2,8]", "[0,32]"), 32, "", "int8",
       absl::StatusCode::kInvalidArgument, "'int8' is not one of"},
      {"MissingRequestedTensor", head("BF16", "[2,8]", "[0,32]"), 32,
       "output.weight", "", absl::StatusCode::kNotFound,
       "tensor 'output.weight' not found"},
      {"MissingDefaultTensors",
       absl::StrCat("{", Entry("model.norm.weight", "BF16", "[8]", "[0,16]"),
                    "}"),
       16, "", "", absl::StatusCode::kNotFound,
       "neither 'lm_head.weight' nor 'model.embed_tokens.weight'"},
      {"EmptyHeader", "{}", 0, "", "", absl::StatusCode::kNotFound,
       "tensors there: (none)"},
  };
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  for (const BadHeaderCase& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = absl::StrCat(dir, "/", c.name, ".safetensors");
    WriteRawSafetensors(path, c.header, c.data_bytes);
    absl::StatusOr<std::unique_ptr<Weights>> weights =
        LoadFrom(path, c.tensor, c.expected_dtype);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), c.code) << weights.status();
    EXPECT_THAT(weights.status().message(), HasSubstr(c.message));
    if (c.expected_dtype != "int8") {  // that one is about the option
      EXPECT_THAT(weights.status().message(), HasSubstr(path));
    }
  }
}

TEST(WeightsErrorTest, NulPaddedHeaderIsAccepted) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/nul.safetensors";
  std::string header = absl::StrCat(
      "{", Entry("lm_head.weight", "BF16", "[2,8]", "[0,32]"), "}");
  header.append(5, '\0');
  WriteRawSafetensors(path, header, 32);
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ((*weights)->vocab_size(), 2);
}

TEST(WeightsErrorTest, MissingTensorListsWhatExistsAbbreviated) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/many.safetensors";
  const std::vector<uint8_t> bytes = PatternBytes(DType::kBf16, 1, 8, 13);
  std::vector<TensorToWrite> tensors;
  std::vector<std::string> names;
  for (int i = 0; i < 20; ++i) names.push_back(absl::StrCat("layer.", 10 + i));
  for (const std::string& name : names) {
    tensors.push_back({name, DType::kBf16, 1, 8, bytes.data()});
  }
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr("layer.10, layer.11"), HasSubstr("layer.17"),
                    HasSubstr("and 12 more"), HasSubstr("20 in all")));
  EXPECT_THAT(weights.status().message(),
              ::testing::Not(HasSubstr("layer.29")));
}

TEST(WeightsErrorTest, FileLevelErrors) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  struct Case {
    std::string name;
    std::string contents;
    absl::StatusCode code;
    std::string message;
  };
  std::string past_end(8, '\0');
  past_end[0] = static_cast<char>(200);  // 200-byte header, 2 bytes present
  past_end += "{}";
  std::string huge_length(8, '\xff');  // 2^64 - 1
  huge_length += "{}";
  const std::vector<Case> cases = {
      {"Empty", "", absl::StatusCode::kDataLoss, "truncated: 0 bytes"},
      {"FiveBytes", "abcde", absl::StatusCode::kDataLoss, "truncated: 5 bytes"},
      {"HeaderPastEof", past_end, absl::StatusCode::kDataLoss,
       "header length 200 runs past the end of the 10-byte file"},
      {"HugeHeaderLength", huge_length, absl::StatusCode::kDataLoss,
       "runs past the end"},
      {"TextFile", "this is not a safetensors file at all",
       absl::StatusCode::kDataLoss, "runs past the end"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = absl::StrCat(dir, "/", c.name, ".safetensors");
    WriteFile(path, c.contents);
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), c.code) << weights.status();
    EXPECT_THAT(weights.status().message(),
                AllOf(HasSubstr(c.message), HasSubstr(path)));
  }

  absl::StatusOr<std::unique_ptr<Weights>> weights =
      LoadFrom(dir + "/absent.safetensors");
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(weights.status().message(), AllOf(HasSubstr("absent.safetensors"),
                                                HasSubstr("does not exist")));

  const std::string empty_dir = dir + "/empty";
  mkdir(empty_dir.c_str(), 0755);
  weights = LoadFrom(empty_dir);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(weights.status().message(), HasSubstr("no model.safetensors"));

  weights = LoadFrom("/dev/null");
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(), HasSubstr("not a regular file"));

  weights = LoadFrom("");
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(), HasSubstr("source is empty"));
}

TEST(WeightsErrorTest, TruncatedAtEveryLengthFailsCleanly) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/full.safetensors";
  const std::vector<uint8_t> head = PatternBytes(DType::kBf16, 4, 8, 14);
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"lm_head.weight", DType::kBf16, 4, 8, head.data()}})
                  .ok());
  const std::string full = ReadFile(path);
  const std::string cut = dir + "/cut.safetensors";
  for (size_t length = 0; length < full.size(); ++length) {
    SCOPED_TRACE(length);
    WriteFile(cut, full.substr(0, length));
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(cut);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), absl::StatusCode::kDataLoss)
        << weights.status();
    EXPECT_THAT(weights.status().message(), HasSubstr(cut));
  }
  ASSERT_TRUE(LoadFrom(path).ok());
}

TEST(WeightsErrorTest, CorruptedBytesNeverCrash) {
  // Random single-byte corruptions of a valid file: every outcome is either a
  // load whose tensor lies inside the file or a non-OK status.
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string path = dir + "/good.safetensors";
  const std::vector<uint8_t> head = PatternBytes(DType::kFp16, 4, 8, 15);
  const std::vector<uint8_t> norm = PatternBytes(DType::kFp16, 1, 8, 16);
  ASSERT_TRUE(WriteSafetensors(
                  path, {{"lm_head.weight", DType::kFp16, 4, 8, head.data()},
                         {"norm", DType::kFp16, 1, 8, norm.data()}})
                  .ok());
  const std::string full = ReadFile(path);
  std::mt19937 rng(1234);
  const std::string bad = dir + "/bad.safetensors";
  int failures = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string corrupted = full;
    const size_t at = rng() % (full.size() - head.size() - norm.size());
    corrupted[at] = static_cast<char>(rng());
    WriteFile(bad, corrupted);
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(bad);
    if (!weights.ok()) {
      ++failures;
      EXPECT_NE(weights.status().code(), absl::StatusCode::kUnknown);
      continue;
    }
    const auto* begin = static_cast<const uint8_t*>((*weights)->data());
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < (*weights)->size_bytes(); ++i) sink ^= begin[i];
  }
  EXPECT_GT(failures, 0);
}

TEST(WeightsErrorTest, IndexErrors) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const ShardedCheckpoint checkpoint = WriteSharded(dir, true);
  struct Case {
    std::string name;
    std::string index;
    std::string tensor;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"NotJson", "{\"weight_map\": ", "", absl::StatusCode::kDataLoss,
       "malformed index"},
      {"NoWeightMap", R"({"metadata": {}})", "", absl::StatusCode::kDataLoss,
       "no \"weight_map\""},
      {"FileNotString", R"({"weight_map": {"lm_head.weight": 3}})", "",
       absl::StatusCode::kDataLoss, "not a file name string"},
      {"MissingShard",
       R"({"weight_map": {"lm_head.weight": "model-00009.safetensors"}})", "",
       absl::StatusCode::kNotFound, "model-00009.safetensors"},
      {"ShardLacksTensor",
       R"({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})",
       "", absl::StatusCode::kDataLoss, "does not hold it"},
      {"ShardOutsideFolder",
       R"({"weight_map": {"lm_head.weight": "../model-00002-of-00002.safetensors"}})",
       "", absl::StatusCode::kDataLoss, "relative to the index's folder"},
      {"AbsoluteShard", R"({"weight_map": {"lm_head.weight": "/etc/passwd"}})",
       "", absl::StatusCode::kDataLoss, "relative to the index's folder"},
      {"TensorNotInIndex",
       R"({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})",
       "output.weight", absl::StatusCode::kNotFound,
       "tensor 'output.weight' not found"},
      {"NoDefaultTensorInIndex",
       R"({"weight_map": {"norm": "model-00002-of-00002.safetensors"}})", "",
       absl::StatusCode::kNotFound, "neither 'lm_head.weight'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = absl::StrCat(dir, "/", c.name, ".index.json");
    WriteFile(path, c.index);
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path, c.tensor);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), c.code) << weights.status();
    EXPECT_THAT(weights.status().message(), HasSubstr(c.message));
  }
}

TEST(WriteSafetensorsTest, RefusesBadInput) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::vector<uint8_t> bytes = PatternBytes(DType::kBf16, 2, 2, 17);
  const std::string path = dir + "/out.safetensors";
  struct Case {
    std::string name;
    std::vector<TensorToWrite> tensors;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"EmptyName", {{"", DType::kBf16, 2, 2, bytes.data()}}, "invalid"},
      {"MetadataName",
       {{"__metadata__", DType::kBf16, 2, 2, bytes.data()}},
       "invalid"},
      {"Duplicate",
       {{"a", DType::kBf16, 2, 2, bytes.data()},
        {"a", DType::kBf16, 2, 2, bytes.data()}},
       "given twice"},
      {"Negative", {{"a", DType::kBf16, -2, 2, bytes.data()}}, "extents"},
      {"NoData", {{"a", DType::kBf16, 2, 2, nullptr}}, "no data"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status status = WriteSafetensors(path, c.tensors);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
  const absl::Status status =
      WriteSafetensors(dir + "/no/such/dir/x.safetensors",
                       {{"a", DType::kBf16, 2, 2, bytes.data()}});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_THAT(status.message(), HasSubstr("no/such/dir"));
}

// The slow, obviously correct synthetic reference: element e of the tensor.
float ReferenceSynthetic(uint64_t seed, int64_t hidden, uint64_t e) {
  const uint64_t pair = e / 2;
  const Philox4x32 bits = Philox4x32_10(
      Philox4x32{{static_cast<uint32_t>(pair),
                  static_cast<uint32_t>(pair >> 32), 0u, 0x57e16475u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint32_t a = bits.v[2 * (e % 2)];
  const uint32_t b = bits.v[2 * (e % 2) + 1];
  int64_t sum = 0;
  for (uint32_t word : {a, b}) sum += (word & 0xffff) + (word >> 16);
  const double std_of_twice_sum =
      4.0 * std::sqrt((65536.0 * 65536.0 - 1.0) / 12.0);
  const float scale = static_cast<float>(
      2.5 / std::sqrt(static_cast<double>(hidden)) / std_of_twice_sum);
  return static_cast<float>(2 * sum - 4 * 65535) * scale;
}

uint64_t Fnv1a(const void* data, size_t size) {
  uint64_t hash = 1469598103934665603ull;
  for (size_t i = 0; i < size; ++i) {
    hash = (hash ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
  }
  return hash;
}

TEST(SyntheticWeightsTest, DefaultSourceIsSynthetic) {
  absl::StatusOr<std::unique_ptr<Weights>> weights =
      Weights::Load(WeightsOptions{});
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ((*weights)->vocab_size(), 32000);
  EXPECT_EQ((*weights)->hidden_size(), 512);
  EXPECT_EQ((*weights)->dtype(), DType::kBf16);
  EXPECT_EQ((*weights)->size_bytes(), 32000u * 512u * 2u);
  EXPECT_EQ((*weights)->source(), WeightsOptions{}.source);
  EXPECT_EQ((*weights)->tensor_name(), "");
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*weights)->data()) % 64, 0u);
}

TEST(SyntheticWeightsTest, MatchesTheReferenceEverywhere) {
  // Big enough for several generator threads: thread boundaries, the first
  // and the last elements must all match the element-wise reference.
  const int64_t vocab = 8203, hidden = 1024;
  absl::StatusOr<std::unique_ptr<Weights>> weights =
      LoadFrom(absl::StrCat("synthetic:vocab=", vocab, ",hidden=", hidden,
                            ",seed=18446744073709551557,dtype=fp32"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  const auto* values = static_cast<const float*>((*weights)->data());
  const uint64_t count = static_cast<uint64_t>(vocab * hidden);
  for (uint64_t e = 0; e < count;
       e += (e < 4096 || e > count - 4096) ? 1 : 997) {
    ASSERT_EQ(values[e], ReferenceSynthetic(18446744073709551557ull, hidden, e))
        << "element " << e;
  }
  for (uint64_t t = 1; t < 17; ++t) {  // every possible split point
    const uint64_t pair = count / 2 * t / 16;
    for (uint64_t e = 2 * pair - 2; e < 2 * pair + 2 && e < count; ++e) {
      ASSERT_EQ(values[e],
                ReferenceSynthetic(18446744073709551557ull, hidden, e))
          << "element " << e;
    }
  }
}

TEST(SyntheticWeightsTest, DeterministicAndSeedSensitive) {
  const auto load = [](const std::string& spec) {
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(spec);
    EXPECT_TRUE(weights.ok()) << weights.status();
    return weights.ok() ? std::move(*weights) : nullptr;
  };
  auto a = load("synthetic:vocab=300,hidden=64,seed=7");
  auto b = load("synthetic:vocab=300,hidden=64,seed=7");
  auto c = load("synthetic:vocab=300,hidden=64,seed=8");
  auto prefix = load("synthetic:seed=7,hidden=64,vocab=100");
  ASSERT_TRUE(a && b && c && prefix);
  EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size_bytes()), 0);
  EXPECT_NE(std::memcmp(a->data(), c->data(), a->size_bytes()), 0);
  // Rows depend only on their index: a smaller vocabulary is a prefix.
  EXPECT_EQ(std::memcmp(a->data(), prefix->data(), prefix->size_bytes()), 0);

  // The same values in every dtype, rounded from the fp32 ones.
  auto fp32 = load("synthetic:vocab=300,hidden=64,seed=7,dtype=fp32");
  auto fp16 = load("synthetic:vocab=300,hidden=64,seed=7,dtype=FP16");
  ASSERT_TRUE(fp32 && fp16);
  EXPECT_EQ(a->dtype(), DType::kBf16);
  EXPECT_EQ(fp16->dtype(), DType::kFp16);
  const auto* f = static_cast<const float*>(fp32->data());
  const auto* bf = static_cast<const uint16_t*>(a->data());
  const auto* h = static_cast<const uint16_t*>(fp16->data());
  for (size_t i = 0; i < 300 * 64; ++i) {
    ASSERT_EQ(bf[i], FloatToBf16(f[i])) << i;
    ASSERT_EQ(h[i], FloatToHalf(f[i])) << i;
  }

  // Golden hash: the generator must not drift between machines or versions
  // (the GPU machines regenerate the same weights the CPU reference uses).
  EXPECT_EQ(Fnv1a(a->data(), a->size_bytes()), 2593254845351051749ull)
      << "hash of synthetic:vocab=300,hidden=64,seed=7";
}

TEST(SyntheticWeightsTest, LooksLikeAnLmHead) {
  // std 2.5 / sqrt(D) per weight, so logits of a standard-normal hidden state
  // have std 2.5; mean zero; bounded tails (Irwin-Hall of 4: |z| <= 3.47).
  const int64_t vocab = 2000, hidden = 256;
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(absl::StrCat(
      "synthetic:vocab=", vocab, ",hidden=", hidden, ",seed=3,dtype=fp32"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  const auto* w = static_cast<const float*>((*weights)->data());
  const double target = 2.5 / std::sqrt(static_cast<double>(hidden));
  double sum = 0, sum_sq = 0, max_abs = 0;
  const size_t count = static_cast<size_t>(vocab * hidden);
  for (size_t i = 0; i < count; ++i) {
    sum += w[i];
    sum_sq += static_cast<double>(w[i]) * w[i];
    max_abs = std::max(max_abs, std::abs(static_cast<double>(w[i])));
  }
  const double mean = sum / static_cast<double>(count);
  const double std =
      std::sqrt(sum_sq / static_cast<double>(count) - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.01 * target);
  EXPECT_NEAR(std, target, 0.01 * target);
  EXPECT_LE(max_abs, 3.47 * target);
  EXPECT_GE(max_abs, 2.5 * target);

  // Logits of a fixed standard-normal-ish hidden state (from the same
  // reference generator, seed 99) spread a few units.
  std::vector<float> h(hidden);
  for (int64_t d = 0; d < hidden; ++d) {
    h[d] = ReferenceSynthetic(99, hidden, d) / static_cast<float>(target);
  }
  double logit_sum_sq = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    double logit = 0;
    for (int64_t d = 0; d < hidden; ++d) logit += h[d] * w[v * hidden + d];
    logit_sum_sq += logit * logit;
  }
  const double logit_std = std::sqrt(logit_sum_sq / vocab);
  EXPECT_GT(logit_std, 1.5);
  EXPECT_LT(logit_std, 4.0);
}

TEST(SyntheticWeightsTest, BadSpecsNameTheKey) {
  struct Case {
    std::string spec;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"synthetic:", "missing key 'vocab'"},
      {"synthetic:hidden=64,seed=1", "missing key 'vocab'"},
      {"synthetic:vocab=10,seed=1", "missing key 'hidden'"},
      {"synthetic:vocab=0,hidden=64", "vocab=0"},
      {"synthetic:vocab=-5,hidden=64", "vocab=-5"},
      {"synthetic:vocab=2147483648,hidden=64", "vocab=2147483648"},
      {"synthetic:vocab=abc,hidden=64", "vocab='abc'"},
      {"synthetic:vocab=,hidden=64", "vocab=''"},
      {"synthetic:vocab=10,hidden=12", "hidden=12"},
      {"synthetic:vocab=10,hidden=0", "hidden=0"},
      {"synthetic:vocab=10,hidden=4", "hidden=4"},
      {"synthetic:vocab=10,hidden=-64", "hidden=-64"},
      {"synthetic:vocab=10,hidden=131072", "hidden=131072"},
      {"synthetic:vocab=10,hidden=1.5", "hidden='1.5'"},
      {"synthetic:vocab=10,hidden=64,seed=-1", "seed='-1'"},
      {"synthetic:vocab=10,hidden=64,seed=18446744073709551616", "seed="},
      {"synthetic:vocab=10,hidden=64,dtype=int8", "dtype='int8'"},
      {"synthetic:vocab=10,hidden=64,foo=1", "unknown key 'foo'"},
      {"synthetic:vocab=10,hidden=64,vocab=11", "key 'vocab' given twice"},
      {"synthetic:vocab=10,,hidden=64", "empty item"},
      {"synthetic:vocab=10,hidden", "'hidden' is not of the form key=value"},
      {"synthetic:vocab=2147483647,hidden=65536", "64 GiB"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(c.spec);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(weights.status().message(),
                AllOf(HasSubstr(c.message), HasSubstr(c.spec)));
    EXPECT_FALSE(ParseSyntheticSpec(c.spec).ok());
  }

  absl::StatusOr<std::unique_ptr<Weights>> weights =
      LoadFrom("synthetic:vocab=10,hidden=64", "", "fp16");
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(), HasSubstr("bf16 but fp16"));

  weights = LoadFrom("synthetic:vocab=10,hidden=64", "lm_head.weight");
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(), HasSubstr("tensor name"));
}

TEST(SyntheticWeightsTest, ParsesDefaultsAndSpaces) {
  absl::StatusOr<SyntheticSpec> spec =
      ParseSyntheticSpec("synthetic: vocab = 5 , hidden=16");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->vocab, 5);
  EXPECT_EQ(spec->hidden, 16);
  EXPECT_EQ(spec->seed, 0u);
  EXPECT_EQ(spec->dtype, DType::kBf16);
  spec = ParseSyntheticSpec(
      "synthetic:vocab=151936,hidden=4096,seed=18446744073709551615,dtype=f32");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->seed, 18446744073709551615ull);
  EXPECT_EQ(spec->dtype, DType::kFp32);
  EXPECT_FALSE(ParseSyntheticSpec("vocab=5,hidden=16").ok());
}

TEST(ParseWeightsDTypeTest, AcceptsBothNamings) {
  EXPECT_EQ(*ParseWeightsDType("bf16"), DType::kBf16);
  EXPECT_EQ(*ParseWeightsDType("BF16"), DType::kBf16);
  EXPECT_EQ(*ParseWeightsDType("F16"), DType::kFp16);
  EXPECT_EQ(*ParseWeightsDType("fp16"), DType::kFp16);
  EXPECT_EQ(*ParseWeightsDType("F32"), DType::kFp32);
  EXPECT_EQ(*ParseWeightsDType("float32"), DType::kFp32);
  EXPECT_EQ(ParseWeightsDType("F64").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Defect 6: a checkpoint holding NaN or Inf loaded fine, and then every
// Sample failed with INVALID_ARGUMENT blaming the caller's hidden state. The
// loader must refuse it, naming the tensor, the first bad (row, column) and
// the value, in every dtype.
TEST(NonFiniteWeightsRegressionTest, NanOrInfWeightsRefusedAtLoad) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const int64_t rows = 9, cols = 16;
  struct Case {
    DType dtype;
    float value;
    int64_t row, col;
    std::string shown;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<Case> cases = {
      {DType::kBf16, std::nanf(""), 5, 3, "nan"},
      {DType::kBf16, -inf, 0, 0, "-inf"},
      {DType::kFp16, inf, 8, 15, "inf"},
      {DType::kFp16, std::nanf(""), 2, 7, "nan"},
      {DType::kFp32, std::nanf(""), 4, 9, "nan"},
      {DType::kFp32, -inf, 7, 1, "-inf"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(DTypeName(c.dtype), " ", c.shown));
    std::vector<uint8_t> head = PatternBytes(c.dtype, rows, cols, 21);
    const size_t at = static_cast<size_t>(c.row * cols + c.col);
    // A second bad element later on: the message names the first one.
    const size_t later = static_cast<size_t>(rows * cols - 1);
    for (size_t index : {later, at}) {  // `at` last: it may be `later`
      if (c.dtype == DType::kFp32) {
        std::memcpy(&head[4 * index], &c.value, 4);
      } else {
        const uint16_t bits = c.dtype == DType::kBf16 ? FloatToBf16(c.value)
                                                      : FloatToHalf(c.value);
        std::memcpy(&head[2 * index], &bits, 2);
      }
    }
    const std::string path =
        absl::StrCat(dir, "/bad_", DTypeName(c.dtype), ".safetensors");
    ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", c.dtype, rows, cols,
                                         head.data()}})
                    .ok());
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
    ASSERT_FALSE(weights.ok());
    EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        weights.status().message(),
        AllOf(HasSubstr("tensor 'lm_head.weight'"), HasSubstr(path),
              HasSubstr(absl::StrCat("row ", c.row, ", column ", c.col,
                                     " (element ", at, "): ", c.shown, ";"))));
  }

  // The largest finite values of each dtype load.
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    SCOPED_TRACE(DTypeName(dtype));
    std::vector<uint8_t> head(static_cast<size_t>(rows * cols) *
                              DTypeSize(dtype));
    for (size_t i = 0; i < static_cast<size_t>(rows * cols); ++i) {
      const bool negative = i % 2 == 1;
      if (dtype == DType::kFp32) {
        const uint32_t bits = negative ? 0xff7fffffu : 0x7f7fffffu;
        std::memcpy(&head[4 * i], &bits, 4);
      } else {
        const uint16_t max = dtype == DType::kBf16 ? 0x7f7fu : 0x7bffu;
        const uint16_t bits =
            static_cast<uint16_t>(max | (negative ? 0x8000u : 0u));
        std::memcpy(&head[2 * i], &bits, 2);
      }
    }
    const std::string path =
        absl::StrCat(dir, "/max_", DTypeName(dtype), ".safetensors");
    ASSERT_TRUE(WriteSafetensors(
                    path, {{"lm_head.weight", dtype, rows, cols, head.data()}})
                    .ok());
    absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
    ASSERT_TRUE(weights.ok()) << weights.status();
    ExpectTensor(**weights, dtype, rows, cols, head);
  }
}

// A tensor large enough to be scanned by several threads: the first bad
// element wins whichever thread finds it, and the loaded tensor is intact.
TEST(NonFiniteWeightsRegressionTest, MultiThreadedScanFindsTheFirstBadElement) {
  const TestDir test_dir;
  const std::string path = test_dir.path() + "/large.safetensors";
  const int64_t rows = 20000, cols = 4096;  // 164 MB of fp16: 2+ scan threads
  std::vector<uint8_t> head(static_cast<size_t>(rows * cols) * 2, 0);
  ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", DType::kFp16, rows,
                                       cols, head.data()}})
                  .ok());
  ASSERT_TRUE(LoadFrom(path).ok());
  const uint16_t inf = 0x7c00u;
  const int64_t late_row = rows - 3, early_row = rows / 3 + 1;
  std::memcpy(&head[static_cast<size_t>(late_row * cols + 11) * 2], &inf, 2);
  std::memcpy(&head[static_cast<size_t>(early_row * cols + 5) * 2], &inf, 2);
  ASSERT_TRUE(WriteSafetensors(path, {{"lm_head.weight", DType::kFp16, rows,
                                       cols, head.data()}})
                  .ok());
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadFrom(path);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              HasSubstr(absl::StrCat("row ", early_row, ", column 5")));
}

// Runs LoadFrom(source) on its own thread. If it has not returned within
// `seconds`, opens `fifo` (when given) for writing to release an open() that
// waits for a writer, and reports the hang as a test failure.
absl::StatusOr<std::unique_ptr<Weights>> LoadWithin(const std::string& source,
                                                    const std::string& fifo,
                                                    int seconds) {
  auto done = std::make_shared<
      std::promise<absl::StatusOr<std::unique_ptr<Weights>>>>();
  std::future<absl::StatusOr<std::unique_ptr<Weights>>> result =
      done->get_future();
  std::thread loader([source, done] { done->set_value(LoadFrom(source)); });
  if (result.wait_for(std::chrono::seconds(seconds)) !=
      std::future_status::ready) {
    ADD_FAILURE() << "loading " << source << " did not return within "
                  << seconds << " s";
    if (!fifo.empty()) {
      const int writer = open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      result.wait_for(std::chrono::seconds(seconds));
      if (writer >= 0) close(writer);
    }
  }
  if (result.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    loader.detach();  // still stuck: leave it rather than hang the suite
    return absl::DeadlineExceededError("load hung");
  }
  loader.join();
  return result.get();
}

// Defect 8: --weights naming a FIFO hung forever in open(); so did an index
// or a shard that is one. Every non-regular file is refused before open()
// with a message saying what it is.
TEST(NonRegularWeightsRegressionTest, FifoWeightsRefusedWithoutHanging) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  const std::string fifo = dir + "/pipe.safetensors";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << strerror(errno);
  absl::StatusOr<std::unique_ptr<Weights>> weights = LoadWithin(fifo, fifo, 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument)
      << weights.status();
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr(fifo), HasSubstr("FIFO"),
                    HasSubstr("not a regular file")));

  // An index that is a FIFO.
  const std::string fifo_index = dir + "/model.safetensors.index.json";
  ASSERT_EQ(mkfifo(fifo_index.c_str(), 0600), 0) << strerror(errno);
  weights = LoadWithin(fifo_index, fifo_index, 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr(fifo_index), HasSubstr("FIFO")));
  // The same index found by naming its directory.
  weights = LoadWithin(dir, fifo_index, 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr(fifo_index), HasSubstr("FIFO")));

  // A shard that is a FIFO, reached through a regular index.
  const std::string sharded = dir + "/sharded";
  ASSERT_EQ(mkdir(sharded.c_str(), 0755), 0);
  const std::string fifo_shard = sharded + "/model-00001.safetensors";
  ASSERT_EQ(mkfifo(fifo_shard.c_str(), 0600), 0) << strerror(errno);
  WriteFile(sharded + "/model.safetensors.index.json",
            R"({"weight_map": {"lm_head.weight": "model-00001.safetensors"}})");
  weights = LoadWithin(sharded, fifo_shard, 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr(fifo_shard), HasSubstr("FIFO")));
}

TEST(NonRegularWeightsRegressionTest, DevicesDirectoriesAndSocketsRefused) {
  const TestDir test_dir;
  const std::string& dir = test_dir.path();
  // A character device that never ends.
  absl::StatusOr<std::unique_ptr<Weights>> weights =
      LoadWithin("/dev/zero", "", 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr("/dev/zero"), HasSubstr("character device")));

  // A directory where the index names a shard file.
  const std::string sharded = dir + "/sharded";
  ASSERT_EQ(mkdir(sharded.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((sharded + "/shard.safetensors").c_str(), 0755), 0);
  const std::string index = sharded + "/model.safetensors.index.json";
  WriteFile(index,
            R"({"weight_map": {"lm_head.weight": "shard.safetensors"}})");
  weights = LoadWithin(index, "", 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr("shard.safetensors"), HasSubstr("directory")));

  // A directory named model.safetensors inside the weights directory.
  const std::string nested = dir + "/nested";
  ASSERT_EQ(mkdir(nested.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((nested + "/model.safetensors").c_str(), 0755), 0);
  weights = LoadWithin(nested, "", 10);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("directory")));

  // A listening Unix socket.
  const std::string socket_path = dir + "/sock.safetensors";
  const int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof(address.sun_path));
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  ASSERT_EQ(
      bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0)
      << strerror(errno);
  ASSERT_EQ(listen(listener, 1), 0);
  weights = LoadWithin(socket_path, "", 10);
  close(listener);
  ASSERT_FALSE(weights.ok());
  EXPECT_THAT(weights.status().message(),
              AllOf(HasSubstr(socket_path), HasSubstr("socket")));
}

}  // namespace
}  // namespace flashsampler
