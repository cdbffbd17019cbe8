// Helpers of the CUDA engine's GPU tests: bf16 weights written as a
// safetensors checkpoint and loaded through the real loader, small-integer
// weights (every logit an exact integer on every backend) and a one-GPU
// engine over them, and hidden states staged into an engine's slot.
#ifndef FLASHSAMPLER_TESTS_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/dtype_convert.h"
#include "gtest/gtest.h"
#include "service/backends/cuda/cuda_engine.h"
#include "service/backends/engine.h"
#include "service/weights/weights.h"

namespace flashsampler {
namespace testing_cuda {

// A bf16 W of values `draw` gives (rounded to bf16) written as a
// safetensors checkpoint and loaded back through the real loader; `values`
// receives W in fp32.
inline std::shared_ptr<const Weights> Bf16Weights(
    int64_t vocab, int hidden, const std::string& tag,
    const std::function<float()>& draw, std::vector<float>* values) {
  values->resize(vocab * hidden);
  std::vector<uint16_t> bits(values->size());
  for (size_t i = 0; i < values->size(); ++i) {
    bits[i] = FloatToBf16(draw());
    (*values)[i] = Bf16ToFloat(bits[i]);
  }
  const std::string path = ::testing::TempDir() + "/cuda_engine_w_" + tag +
                           "_" + std::to_string(vocab) + ".safetensors";
  TensorToWrite tensor;
  tensor.name = "lm_head.weight";
  tensor.dtype = DType::kBf16;
  tensor.rows = vocab;
  tensor.cols = hidden;
  tensor.data = bits.data();
  EXPECT_TRUE(WriteSafetensors(path, {tensor}).ok());
  WeightsOptions options;
  options.source = path;
  auto weights = Weights::Load(options);
  EXPECT_TRUE(weights.ok()) << weights.status();
  if (!weights.ok()) return nullptr;
  return std::shared_ptr<const Weights>(std::move(*weights));
}

// Small-integer bf16 W (-3 .. 3): with small-integer hidden states every
// logit is an exact integer on both backends.
inline std::shared_ptr<const Weights> SmallIntegerWeights(
    int64_t vocab, int hidden, uint64_t seed, std::vector<float>* values) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(-3, 3);
  return Bf16Weights(
      vocab, hidden, "int" + std::to_string(seed),
      [&] { return static_cast<float>(pick(rng)); }, values);
}

// An engine on device 0 over small-integer W (SmallIntegerWeights).
inline absl::StatusOr<std::unique_ptr<Engine>> OneGpuEngine(
    int64_t vocab, int hidden, uint64_t seed, int max_batch_rows,
    std::vector<float>* values) {
  auto weights = SmallIntegerWeights(vocab, hidden, seed, values);
  if (weights == nullptr) {
    return absl::InternalError("small-integer weights did not load");
  }
  CudaEngineOptions options;
  options.devices = {0};
  options.max_batch_rows = max_batch_rows;
  return CreateCudaEngine(weights, options);
}

// Copies fp32 hidden states (small integers: exact in bf16) into a slot.
inline void StageHidden(Engine& engine, int slot,
                        const std::vector<float>& hidden) {
  uint16_t* input = static_cast<uint16_t*>(engine.slot_input(slot));
  for (size_t i = 0; i < hidden.size(); ++i) {
    input[i] = FloatToBf16(hidden[i]);
  }
}

}  // namespace testing_cuda
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_SERVICE_BACKENDS_CUDA_CUDA_ENGINE_TEST_UTIL_H_
