// Helpers shared by the tensor-parallel tests: bf16 encoding of test inputs
// and the chi-squared test (tests/common/chi_squared.h). Pure host code,
// checked by tp_layout_test.
#ifndef FLASHSAMPLER_TESTS_TP_TP_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_TP_TP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "tests/common/chi_squared.h"

namespace flashsampler {
namespace tp_test {

// Round-to-nearest-even fp32 -> bf16 bits (inputs here are finite).
inline uint16_t FloatToBf16Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

using stats::ChiSquaredPValue;
using stats::ChiSquaredResult;
using stats::ChiSquaredTest;

}  // namespace tp_test
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_TP_TP_TEST_UTIL_H_
