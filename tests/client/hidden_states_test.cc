// Hidden-state files and random batches: .npy headers as numpy writes them
// (versions 1 and 2, 1-D and 2-D, three dtypes), raw fp32, and the errors.
#include "client/hidden_states.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "common/dtype_convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/fs_hidden_" + name;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

// A .npy file the way numpy.save lays it out: the header padded with spaces
// and a newline so that the data starts at a multiple of 64 bytes.
std::string Npy(const std::string& descr, const std::string& shape,
                const std::string& data, int version = 1) {
  std::string dict = "{'descr': '" + descr +
                     "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t prefix = version == 1 ? 10 : 12;
  while ((prefix + dict.size() + 1) % 64 != 0) dict.push_back(' ');
  dict.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(static_cast<char>(version));
  out.push_back(0);
  const size_t n = dict.size();
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>((n >> 8) & 0xff));
  if (version != 1) out.append(2, '\0');
  return out + dict + data;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     values.size() * sizeof(T));
}

TEST(LoadHiddenStatesTest, Npy2dFloat32) {
  const std::vector<float> values = {1, 2, 3, 4, 5, 6};
  const std::string path = TempPath("f4.npy");
  WriteFile(path, Npy("<f4", "(2, 3)", Bytes(values)));
  auto hidden = LoadHiddenStates(path, 99);  // raw_rows is ignored for .npy
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  EXPECT_EQ(hidden->dtype, DType::kFp32);
  EXPECT_EQ(hidden->rows, 2);
  EXPECT_EQ(hidden->dim, 3);
  EXPECT_EQ(hidden->data, Bytes(values));

  auto request = MakeSampleRequest(*hidden, {});
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->hidden_states().data(), Bytes(values));
}

TEST(LoadHiddenStatesTest, Npy1dFloat16AndVersion2) {
  const std::vector<uint16_t> values = {0x3c00, 0x4000, 0xc000, 0x0000};
  const std::string path = TempPath("f2.npy");
  WriteFile(path, Npy("<f2", "(4,)", Bytes(values), /*version=*/2));
  auto hidden = LoadHiddenStates(path, 1);
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  EXPECT_EQ(hidden->dtype, DType::kFp16);
  EXPECT_EQ(hidden->rows, 1);
  EXPECT_EQ(hidden->dim, 4);
  auto request = MakeSampleRequest(*hidden, {});
  ASSERT_TRUE(request.ok());
  EXPECT_EQ(request->hidden_states().dtype(), v1::DTYPE_FP16);
}

TEST(LoadHiddenStatesTest, NpyUint16IsBf16) {
  const std::vector<uint16_t> values = {0x3f80, 0x4000};
  const std::string path = TempPath("u2.npy");
  WriteFile(path, Npy("<u2", "(1, 2)", Bytes(values)));
  auto hidden = LoadHiddenStates(path, 1);
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  EXPECT_EQ(hidden->dtype, DType::kBf16);
  HiddenStates fp32 = ConvertHiddenStates(*hidden, DType::kFp32);
  float out[2];
  std::memcpy(out, fp32.data.data(), sizeof(out));
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 2.0f);
}

TEST(LoadHiddenStatesTest, NpyErrorsNameTheProblem) {
  const std::string path = TempPath("bad.npy");
  WriteFile(path, Npy("<f8", "(1, 2)", std::string(16, '\0')));
  EXPECT_THAT(LoadHiddenStates(path, 1).status().message(), HasSubstr("<f8"));
  WriteFile(path, Npy("<f4", "(2, 3)", std::string(20, '\0')));
  EXPECT_THAT(LoadHiddenStates(path, 1).status().message(),
              HasSubstr("expected 24 data bytes"));
  WriteFile(path, Npy("<f4", "(2, 3, 4)", std::string(96, '\0')));
  EXPECT_THAT(LoadHiddenStates(path, 1).status().message(),
              HasSubstr("[B, D]"));
  EXPECT_EQ(LoadHiddenStates(TempPath("missing.npy"), 1).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(LoadHiddenStatesTest, RawFp32UsesRows) {
  const std::vector<float> values(12, 0.25f);
  const std::string path = TempPath("raw.f32");
  WriteFile(path, Bytes(values));
  auto hidden = LoadHiddenStates(path, 3);
  ASSERT_TRUE(hidden.ok()) << hidden.status();
  EXPECT_EQ(hidden->rows, 3);
  EXPECT_EQ(hidden->dim, 4);
  EXPECT_EQ(LoadHiddenStates(path, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RandomHiddenStatesTest, DeterministicPerSeedAndFinite) {
  HiddenStates a = RandomHiddenStates(3, 16, 42, DType::kFp32);
  HiddenStates b = RandomHiddenStates(3, 16, 42, DType::kFp32);
  HiddenStates c = RandomHiddenStates(3, 16, 43, DType::kFp32);
  EXPECT_EQ(a.data, b.data);
  EXPECT_NE(a.data, c.data);
  ASSERT_EQ(a.data.size(), 3u * 16u * 4u);
  EXPECT_TRUE(AllFinite(DType::kFp32, a.data.data(), 48));
  HiddenStates bf16 = RandomHiddenStates(3, 16, 42, DType::kBf16);
  EXPECT_EQ(bf16.data.size(), 3u * 16u * 2u);
  EXPECT_EQ(bf16.data, ConvertHiddenStates(a, DType::kBf16).data);
  // Mean near 0 and variance near 1 over many values.
  HiddenStates big = RandomHiddenStates(1, 20000, 7, DType::kFp32);
  std::vector<float> v(20000);
  std::memcpy(v.data(), big.data.data(), big.data.size());
  double sum = 0, sum_sq = 0;
  for (float x : v) {
    sum += x;
    sum_sq += static_cast<double>(x) * x;
  }
  EXPECT_NEAR(sum / v.size(), 0.0, 0.05);
  EXPECT_NEAR(sum_sq / v.size(), 1.0, 0.05);
}

}  // namespace
}  // namespace flashsampler
