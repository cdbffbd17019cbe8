// The one element-type enum of the project: weights, hidden states and
// materialized logits are bf16, fp16 or fp32. Header-only and free of any
// library, so that the kernels, the service and the clients share it (the
// kernels compute on bf16 and fp16 and refuse fp32 operands).
#ifndef FLASHSAMPLER_COMMON_DTYPE_H_
#define FLASHSAMPLER_COMMON_DTYPE_H_

#include <cstddef>

namespace flashsampler {

enum class DType { kBf16, kFp16, kFp32 };

// Bytes per element.
constexpr size_t DTypeSize(DType dtype) {
  return dtype == DType::kFp32 ? 4 : 2;
}

// "bf16", "fp16" or "fp32": the names flags, files and messages use.
constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
    case DType::kFp32:
      return "fp32";
  }
  return "unknown";
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_DTYPE_H_
