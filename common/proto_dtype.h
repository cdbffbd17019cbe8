// The wire dtype of an engine dtype, for everything that builds protos:
// the daemon (ModelInfo) and the client (hidden states). Header-only so
// that the client needs only the generated proto library, not the
// daemon's serving library.
#ifndef FLASHSAMPLER_COMMON_PROTO_DTYPE_H_
#define FLASHSAMPLER_COMMON_PROTO_DTYPE_H_

#include "common/dtype.h"
#include "flashsampler/v1/sampler.pb.h"

namespace flashsampler {

inline v1::DType ToProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return v1::DTYPE_BF16;
    case DType::kFp16:
      return v1::DTYPE_FP16;
    case DType::kFp32:
      return v1::DTYPE_FP32;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_PROTO_DTYPE_H_
