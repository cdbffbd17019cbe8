// LM-head weights W [V, D]: loaded from safetensors (one file or a sharded
// checkpoint with model.safetensors.index.json, memory-mapped) or generated
// deterministically ("synthetic:vocab=V,hidden=D,seed=S[,dtype=bf16]").
#ifndef FLASHSAMPLER_SERVICE_WEIGHTS_WEIGHTS_H_
#define FLASHSAMPLER_SERVICE_WEIGHTS_WEIGHTS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {

struct WeightsOptions {
  // A .safetensors file, a model.safetensors.index.json, a directory holding
  // either, or "synthetic:vocab=V,hidden=D,seed=S[,dtype=bf16|fp16|fp32]".
  std::string source = "synthetic:vocab=32000,hidden=512,seed=1";
  // Tensor to load; empty = "lm_head.weight", else "model.embed_tokens.weight"
  // (tied embeddings).
  std::string tensor_name;
  // Refuse a tensor of another dtype (empty = accept bf16, fp16 or fp32).
  // Accepts "bf16", "fp16", "fp32" and the safetensors names "BF16", "F16",
  // "F32" (case-insensitive).
  std::string expected_dtype;
};

class Weights {
 public:
  // Errors: NotFound (no such file, no such tensor), DataLoss (truncated or
  // malformed checkpoint), InvalidArgument (a tensor that cannot be an LM head:
  // rank, dtype, empty, a NaN or Inf element (named by row, column and value);
  // a source that is not a regular file, such as a FIFO, a directory where a
  // file is expected or a device, refused before it is opened; or a bad
  // synthetic spec), ResourceExhausted (no memory for synthetic weights).
  // Never throws, never aborts, never blocks on a FIFO.
  static absl::StatusOr<std::unique_ptr<Weights>> Load(
      const WeightsOptions& options);
  virtual ~Weights() = default;

  int64_t vocab_size() const { return vocab_size_; }
  int64_t hidden_size() const { return hidden_size_; }
  DType dtype() const { return dtype_; }
  // Row-major [vocab_size, hidden_size] elements of dtype(), valid for the
  // lifetime of this object (an mmap or an owned buffer). Aligned to at least
  // the element size (a checkpoint whose tensor is not is copied once).
  const void* data() const { return data_; }
  size_t size_bytes() const;
  // Where the weights came from, for ModelInfo and logs.
  const std::string& source() const { return source_; }
  // The tensor's name in the checkpoint ("" for synthetic weights).
  const std::string& tensor_name() const { return tensor_name_; }

 protected:
  Weights() = default;
  int64_t vocab_size_ = 0;
  int64_t hidden_size_ = 0;
  DType dtype_ = DType::kBf16;
  const void* data_ = nullptr;
  std::string source_;
  std::string tensor_name_;
};

// Writes a single-file safetensors checkpoint holding `tensors` (name ->
// [rows, cols] of dtype). Used by tests and tools to make checkpoints.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kBf16;
  int64_t rows = 0;
  int64_t cols = 0;
  const void* data = nullptr;
};
// The file follows the safetensors format: 8-byte little-endian header
// length, a JSON header (dtype, shape, data_offsets per tensor and an optional
// "__metadata__" map of strings) padded with spaces to 8-byte alignment, then
// the tensors back to back, widest dtype first so every tensor stays aligned.
absl::Status WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Parses a weight dtype name: "bf16" / "fp16" / "fp32" or the safetensors
// names "BF16" / "F16" / "F32", case-insensitive. InvalidArgument otherwise.
absl::StatusOr<DType> ParseWeightsDType(absl::string_view name);

// A parsed "synthetic:vocab=V,hidden=D,seed=S[,dtype=bf16|fp16|fp32]" source.
struct SyntheticSpec {
  int64_t vocab = 0;           // required, 1 .. 2^31 - 1
  int64_t hidden = 0;          // required, a multiple of 8, 8 .. 65536
  uint64_t seed = 0;           // default 0
  DType dtype = DType::kBf16;  // default bf16
};
inline constexpr absl::string_view kSyntheticPrefix = "synthetic:";
// InvalidArgument naming the offending key for a malformed spec.
absl::StatusOr<SyntheticSpec> ParseSyntheticSpec(absl::string_view source);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_WEIGHTS_WEIGHTS_H_
