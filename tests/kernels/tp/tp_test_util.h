// Helpers shared by the tensor-parallel tests: bf16 encoding of test inputs
// (common/dtype_convert.h) and the chi-squared test
// (tests/testing/chi_squared.h). Pure host code, checked by tp_layout_test.
#ifndef FLASHSAMPLER_TESTS_KERNELS_TP_TP_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_KERNELS_TP_TP_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/dtype_convert.h"
#include "tests/testing/chi_squared.h"

namespace flashsampler {
namespace tp_test {

// bf16 encoding of test inputs: the project's conversions.
using ::flashsampler::Bf16ToFloat;
using ::flashsampler::FloatToBf16;

using stats::ChiSquaredPValue;
using stats::ChiSquaredResult;
using stats::ChiSquaredTest;

}  // namespace tp_test
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_KERNELS_TP_TP_TEST_UTIL_H_
