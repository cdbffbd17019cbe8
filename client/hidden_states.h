// Hidden-state batches for the CLI and the load generator: loaded from .npy
// or raw fp32 files, or drawn at random, and turned into a SampleRequest.
#ifndef FLASHSAMPLER_CLIENT_HIDDEN_STATES_H_
#define FLASHSAMPLER_CLIENT_HIDDEN_STATES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/dtype.h"
#include "flashsampler/v1/sampler.pb.h"

namespace flashsampler {

// Row-major [rows, dim] elements of `dtype`, little-endian bytes.
struct HiddenStates {
  DType dtype = DType::kFp32;
  int64_t rows = 0;
  int64_t dim = 0;
  std::string data;
};

// Reads a .npy file (version 1-3, C order, 1-D [D] or 2-D [B, D], dtype
// '<f4' = fp32, '<f2' = fp16 or '<u2' = bf16 bit patterns, the way numpy
// holds bfloat16 without extensions). Any other file is raw little-endian
// fp32 with `raw_rows` rows; its size must be a multiple of raw_rows x 4.
absl::StatusOr<HiddenStates> LoadHiddenStates(const std::string& path,
                                              int64_t raw_rows);

// rows x dim values drawn from N(0, scale^2) by a generator seeded with
// `seed` (the same seed gives the same values), stored as `dtype`.
HiddenStates RandomHiddenStates(int64_t rows, int64_t dim, uint64_t seed,
                                DType dtype, float scale = 1.0f);

// Converts to `dtype` (round to nearest even); a copy when it matches.
HiddenStates ConvertHiddenStates(const HiddenStates& hidden, DType dtype);

absl::StatusOr<v1::SampleRequest> MakeSampleRequest(
    const HiddenStates& hidden, const RequestFields& fields);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_CLIENT_HIDDEN_STATES_H_
