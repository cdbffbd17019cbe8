// bf16 / fp16 / fp32 conversions: exhaustive round trips over all 2^16
// patterns, round-to-nearest-even against independent references (the
// compiler's _Float16 and a double-precision nearest search for bf16),
// subnormals, overflow, inf and NaN, and AllFinite.
#include "common/dtype_convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace flashsampler {
namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

uint16_t HalfBits(_Float16 h) {
  uint16_t b;
  std::memcpy(&b, &h, sizeof(b));
  return b;
}

_Float16 HalfFromBits(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, sizeof(h));
  return h;
}

bool IsHalfNan(uint16_t h) {
  return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
}
bool IsBf16Nan(uint16_t b) {
  return (b & 0x7f80u) == 0x7f80u && (b & 0x7fu) != 0;
}

// Nearest bf16 to a finite float, ties to even, by comparing the two
// neighbours in double; the neighbour past the largest finite bf16 stands for
// 2^128 (IEEE overflow rule), which becomes inf.
uint16_t ReferenceBf16(float x) {
  const uint32_t bits = Bits(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t lo = bits & 0x7fff0000u;
  const uint32_t hi = lo + 0x10000u;
  const double ax = std::abs(static_cast<double>(x));
  const double lo_value = static_cast<double>(FromBits(lo));
  const double hi_value = hi == 0x7f800000u ? std::ldexp(1.0, 128)
                                            : static_cast<double>(FromBits(hi));
  uint32_t pick;
  if (ax - lo_value < hi_value - ax) {
    pick = lo;
  } else if (ax - lo_value > hi_value - ax) {
    pick = hi;
  } else {
    pick = ((lo >> 16) & 1u) ? hi : lo;
  }
  return static_cast<uint16_t>((sign | pick) >> 16);
}

TEST(DtypeConvertTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(b));
    ASSERT_EQ(Bits(f), b << 16);
    const uint16_t back = FloatToBf16(f);
    if (IsBf16Nan(static_cast<uint16_t>(b))) {
      EXPECT_TRUE(IsBf16Nan(back)) << std::hex << b;
    } else {
      ASSERT_EQ(back, b) << std::hex << b;
    }
  }
}

TEST(DtypeConvertTest, FloatToBf16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)),
            0x3f80u);  // tie -> even (down)
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)),
            0x3f82u);  // tie -> even (up)
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)),
            0x3f81u);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()),
            0x7f80u);  // overflow -> inf
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80u);
  EXPECT_TRUE(IsBf16Nan(FloatToBf16(std::nanf(""))));
  EXPECT_TRUE(IsBf16Nan(
      FloatToBf16(FromBits(0x7f800001u))));  // signalling NaN stays NaN
  EXPECT_EQ(FloatToBf16(FromBits(0x00000001u)), 0x0000u);  // smallest subnormal
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000u)),
            0x0002u);  // subnormal tie -> even
  // Every 257th float pattern, both signs, against the reference.
  for (uint64_t b = 0; b < 0x100000000ull; b += 257) {
    const float f = FromBits(static_cast<uint32_t>(b));
    if (std::isnan(f)) continue;
    if (std::isinf(f)) {
      ASSERT_EQ(FloatToBf16(f), static_cast<uint16_t>(b >> 16));
      continue;
    }
    ASSERT_EQ(FloatToBf16(f), ReferenceBf16(f)) << std::hex << b;
  }
}

TEST(DtypeConvertTest, HalfRoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = HalfToFloat(bits);
    if (IsHalfNan(bits)) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(IsHalfNan(FloatToHalf(f))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(Bits(f), Bits(static_cast<float>(HalfFromBits(bits))))
        << std::hex << h;
    ASSERT_EQ(FloatToHalf(f), bits) << std::hex << h;
  }
}

TEST(DtypeConvertTest, FloatToHalfRoundsLikeTheCompiler) {
  EXPECT_EQ(HalfToFloat(0x0001u), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000u);  // tie -> even (zero)
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002u);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14) * (1.0f - std::ldexp(1.0f, -12))),
            0x0400u);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bffu);
  EXPECT_EQ(FloatToHalf(65519.99f), 0x7bffu);
  EXPECT_EQ(FloatToHalf(65520.0f),
            0x7c00u);  // tie past the largest half -> inf
  EXPECT_EQ(FloatToHalf(-1e30f), 0xfc00u);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000u);
  EXPECT_TRUE(IsHalfNan(FloatToHalf(std::nanf(""))));
  for (uint64_t b = 0; b < 0x100000000ull; b += 257) {
    const float f = FromBits(static_cast<uint32_t>(b));
    if (std::isnan(f)) {
      ASSERT_TRUE(IsHalfNan(FloatToHalf(f)));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), HalfBits(static_cast<_Float16>(f)))
        << std::hex << b;
  }
}

TEST(DtypeConvertTest, ConvertDTypeConvertsArraysBetweenEveryPair) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> src(1000);
  for (float& v : src) v = normal(rng);
  const DType kAll[] = {DType::kBf16, DType::kFp16, DType::kFp32};
  for (DType mid : kAll) {
    std::vector<uint8_t> packed(src.size() * DTypeSize(mid));
    ConvertDType(DType::kFp32, src.data(), src.size(), mid, packed.data());
    for (DType out : kAll) {
      std::vector<uint8_t> converted(src.size() * DTypeSize(out));
      ConvertDType(mid, packed.data(), src.size(), out, converted.data());
      std::vector<float> back(src.size());
      ConvertDType(out, converted.data(), src.size(), DType::kFp32,
                   back.data());
      for (size_t i = 0; i < src.size(); ++i) {
        // Expected: the value after each rounding step, done one at a time.
        float want = src[i];
        for (DType step : {mid, out}) {
          if (step == DType::kBf16) want = Bf16ToFloat(FloatToBf16(want));
          if (step == DType::kFp16) want = HalfToFloat(FloatToHalf(want));
        }
        ASSERT_EQ(Bits(back[i]), Bits(want))
            << DTypeName(mid) << " -> " << DTypeName(out) << " element " << i;
      }
    }
  }
}

TEST(DtypeConvertTest, AllFiniteFindsInfAndNanInEachDtype) {
  const float kInf = std::numeric_limits<float>::infinity();
  for (float bad : {kInf, -kInf, std::nanf("")}) {
    std::vector<float> f32 = {1.0f, -2.0f, 65504.0f, 0.0f};
    EXPECT_TRUE(AllFinite(DType::kFp32, f32.data(), f32.size()));
    f32[2] = bad;
    EXPECT_FALSE(AllFinite(DType::kFp32, f32.data(), f32.size()));
    std::vector<uint16_t> bf16 = {FloatToBf16(1.0f), FloatToBf16(3e38f), 0};
    EXPECT_TRUE(AllFinite(DType::kBf16, bf16.data(), bf16.size()));
    bf16[1] = FloatToBf16(bad);
    EXPECT_FALSE(AllFinite(DType::kBf16, bf16.data(), bf16.size()));
    std::vector<uint16_t> f16 = {FloatToHalf(1.0f), FloatToHalf(65504.0f),
                                 0x0001u};
    EXPECT_TRUE(AllFinite(DType::kFp16, f16.data(), f16.size()));
    f16[0] = FloatToHalf(bad);
    EXPECT_FALSE(AllFinite(DType::kFp16, f16.data(), f16.size()));
  }
  EXPECT_TRUE(AllFinite(DType::kFp32, nullptr, 0));
}

// Request bytes reach the check where gRPC's slices left them, at any offset.
TEST(DtypeConvertTest, AllFiniteReadsUnalignedData) {
  const float values[3] = {1.0f, std::numeric_limits<float>::infinity(), 2.0f};
  std::vector<char> bytes(1 + sizeof(values));
  std::memcpy(bytes.data() + 1, values, sizeof(values));
  EXPECT_TRUE(AllFinite(DType::kFp32, bytes.data() + 1, 1));
  EXPECT_FALSE(AllFinite(DType::kFp32, bytes.data() + 1, 3));
}

// CopyFinite copies every byte, from and to any offset, and agrees with
// AllFinite on each dtype's Inf and NaN wherever they sit (first element,
// inside the vector loop, in its remainder).
TEST(DtypeConvertTest, CopyFiniteCopiesEveryByteAndFindsInfAndNan) {
  const float kInf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    const size_t element = DTypeSize(dtype);
    for (size_t count : {size_t{1}, size_t{7}, size_t{64}, size_t{1001}}) {
      std::vector<float> values(count);
      for (size_t i = 0; i < count; ++i) values[i] = 0.5f * (i % 37) - 3.0f;
      for (size_t bad_at : {count, size_t{0}, count / 2, count - 1}) {
        for (float bad : {kInf, -kInf, std::nanf("")}) {
          std::vector<float> planted = values;
          if (bad_at < count) planted[bad_at] = bad;
          // ConvertDType writes aligned elements: converted, then moved to
          // an odd offset.
          std::vector<uint32_t> converted(count);
          ConvertDType(DType::kFp32, planted.data(), count, dtype,
                       converted.data());
          std::vector<char> src(1 + count * element);
          std::memcpy(src.data() + 1, converted.data(), count * element);
          std::vector<char> dst(3 + count * element, '\x5a');
          const bool finite =
              CopyFinite(dtype, src.data() + 1, count, dst.data() + 3);
          SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " count "
                                            << count << " bad at " << bad_at);
          EXPECT_EQ(finite, bad_at == count);
          EXPECT_EQ(finite, AllFinite(dtype, src.data() + 1, count));
          EXPECT_EQ(
              std::memcmp(dst.data() + 3, src.data() + 1, count * element), 0);
          EXPECT_EQ(dst[2], '\x5a');  // nothing written before dst
        }
      }
    }
  }
}

}  // namespace
}  // namespace flashsampler
