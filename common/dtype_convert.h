// Conversions between the wire/weight dtypes (bf16, fp16, fp32) on the host.
// bf16 and fp16 round to nearest even; NaN stays NaN; fp16 overflow gives inf.
#ifndef FLASHSAMPLER_COMMON_DTYPE_CONVERT_H_
#define FLASHSAMPLER_COMMON_DTYPE_CONVERT_H_

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace flashsampler {

float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);

// Converts `count` elements of `src` (dtype `src_dtype`) into `dst` (dtype
// `dst_dtype`); a plain copy when the dtypes match. Buffers must not overlap.
void ConvertDType(DType src_dtype, const void* src, size_t count,
                  DType dst_dtype, void* dst);

// True when every element of `data` (dtype `dtype`) is finite; `data` may
// sit at any alignment.
bool AllFinite(DType dtype, const void* data, size_t count);

// Copies `count` elements of `dtype` from `src` to `dst` (any alignment; the
// buffers must not overlap) and returns AllFinite of them: each element is
// checked as it is copied, so the bytes are read once and what lands in
// `dst` is what was checked (a writer of `src` cannot slip a NaN past it).
bool CopyFinite(DType dtype, const void* src, size_t count, void* dst);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_DTYPE_CONVERT_H_
