// Host dtype conversions. Bit-level, so results do not depend on the
// compiler's or the CPU's half-precision support.
#include "common/dtype_convert.h"

#include <cmath>
#include <cstring>

namespace flashsampler {

namespace {

uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

float Bf16ToFloat(uint16_t bits) {
  return FromBits(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBf16(float value) {
  const uint32_t bits = Bits(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  // Round to nearest even on the 16 bits dropped.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) {  // inf or NaN
    return FromBits(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent != 0) {  // normal
    return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) return FromBits(sign);  // signed zero
  // Subnormal half: value = mantissa * 2^-24, exact in fp32.
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  return sign ? -magnitude : magnitude;
}

uint16_t FloatToHalf(float value) {
  const uint32_t bits = Bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (abs_bits > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs_bits >= 0x477ff000u)
    return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs_bits <
      0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float magnitude = FromBits(abs_bits);
    // Round magnitude / 2^-24 to the nearest even integer (0 .. 1024).
    const float scaled = std::nearbyint(std::ldexp(magnitude, 24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(scaled));
  }
  // Normal: rebias the exponent, round to nearest even on 13 dropped bits.
  const uint32_t rebased = abs_bits - (112u << 23);
  const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + rounding) >> 13));
}

void ConvertDType(DType src_dtype, const void* src, size_t count,
                  DType dst_dtype, void* dst) {
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, count * DTypeSize(src_dtype));
    return;
  }
  auto load = [&](size_t i) -> float {
    switch (src_dtype) {
      case DType::kBf16:
        return Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
      case DType::kFp16:
        return HalfToFloat(static_cast<const uint16_t*>(src)[i]);
      case DType::kFp32:
        return static_cast<const float*>(src)[i];
    }
    return 0.0f;
  };
  switch (dst_dtype) {
    case DType::kFp32:
      for (size_t i = 0; i < count; ++i) static_cast<float*>(dst)[i] = load(i);
      return;
    case DType::kBf16:
      for (size_t i = 0; i < count; ++i) {
        static_cast<uint16_t*>(dst)[i] = FloatToBf16(load(i));
      }
      return;
    case DType::kFp16:
      for (size_t i = 0; i < count; ++i) {
        static_cast<uint16_t*>(dst)[i] = FloatToHalf(load(i));
      }
      return;
  }
}

namespace {

// A function with an AVX2 clone beside the baseline one, chosen when the
// program loads. Not under ThreadSanitizer: the clone's resolver runs
// before TSan's runtime is up, and the program crashes at start.
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FS_THREAD_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(FS_THREAD_SANITIZER)
#define FS_AVX2_CLONE
#else
#define FS_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#endif

// True when none of `count` words at `src` has every bit of `mask` set (an
// all-ones exponent: Inf or NaN); with kCopy, each word is also stored to
// `dst` from the register it was checked in, so that the bytes are read
// once and what lands in `dst` is what was checked. No early exit, so the
// compiler vectorizes it: a loop that stopped at the first bad element ran
// element by element, 19% of the daemon's CPU on 256-row bf16 requests.
// memcpy reads words at any alignment (request bytes sit in gRPC's slices
// at odd offsets). The flags gather in a Word, so that the compares stay as
// wide as the words, and an AVX2 clone runs where the CPU has one (the
// loader picks it; the build targets baseline x86-64): 2 MB of bf16 checked
// in 99 us against 197 with SSE2 and an unsigned gather, a development
// host's core, where it was a fifth of the daemon's CPU serving 256-row
// requests. Copied and checked from gRPC-sized pieces in 212-235 us
// against 297-343 for a copy of each 64 KB and a check of it in cache, and
// 323-330 for a check and then a copy (the same core; a plain copy alone
// took 190-213).
template <bool kCopy, typename Word>
FS_AVX2_CLONE bool NoExponentAllOnes(const void* src, size_t count, Word mask,
                                     void* dst) {
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  Word bad = 0;
  for (size_t i = 0; i < count; ++i) {
    Word word;
    std::memcpy(&word, in + i * sizeof(Word), sizeof(Word));
    bad |= static_cast<Word>((word & mask) == mask);
    if constexpr (kCopy) {
      std::memcpy(out + i * sizeof(Word), &word, sizeof(Word));
    }
  }
  return bad == 0;
}

// NoExponentAllOnes with `dtype`'s word and exponent mask.
template <bool kCopy>
bool FiniteElements(DType dtype, const void* src, size_t count, void* dst) {
  switch (dtype) {
    case DType::kBf16:
      return NoExponentAllOnes<kCopy, uint16_t>(src, count, 0x7f80u, dst);
    case DType::kFp16:
      return NoExponentAllOnes<kCopy, uint16_t>(src, count, 0x7c00u, dst);
    case DType::kFp32:
      return NoExponentAllOnes<kCopy, uint32_t>(src, count, 0x7f800000u, dst);
  }
  return false;
}

}  // namespace

bool CopyFinite(DType dtype, const void* src, size_t count, void* dst) {
  return FiniteElements<true>(dtype, src, count, dst);
}

bool AllFinite(DType dtype, const void* data, size_t count) {
  return FiniteElements<false>(dtype, data, count, nullptr);
}

}  // namespace flashsampler
