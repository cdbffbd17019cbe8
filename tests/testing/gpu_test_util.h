// Helpers shared by the GPU tests: a loud skip without a GPU, RAII device
// arrays, and the host reference for one row (exact logits in, the same
// Philox noise and tie-break as every backend).
#ifndef FLASHSAMPLER_TESTS_TESTING_GPU_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_TESTING_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"
#include "service/backends/cuda/cuda_engine.h"

// Skips the current test, loudly, when no CUDA device is usable.
#define FS_SKIP_WITHOUT_GPUS(min_count)                                    \
  do {                                                                     \
    const int fs_gpus_ = ::flashsampler::CudaDeviceCount();                \
    if (fs_gpus_ < (min_count)) {                                          \
      const char* fs_name_ =                                               \
          ::testing::UnitTest::GetInstance()->current_test_info()->name(); \
      std::fprintf(stderr,                                                 \
                   "NO GPU: skipping %s (needs %d CUDA device(s), %d "     \
                   "visible)\n",                                           \
                   fs_name_, (min_count), fs_gpus_);                       \
      GTEST_SKIP() << "NO GPU: skipping " << fs_name_ << " (needs "        \
                   << (min_count) << " CUDA device(s), " << fs_gpus_       \
                   << " visible)";                                         \
    }                                                                      \
  } while (false)

#define FS_SKIP_WITHOUT_GPU() FS_SKIP_WITHOUT_GPUS(1)

#define FS_ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

namespace flashsampler {
namespace testing_gpu {

// A device array of T, freed on destruction.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t count) : count_(count) {
    if (cudaMalloc(reinterpret_cast<void**>(&data_),
                   sizeof(T) * (count == 0 ? 1 : count)) != cudaSuccess) {
      data_ = nullptr;
    }
  }
  ~DeviceArray() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  size_t count() const { return count_; }
  bool ok() const { return data_ != nullptr; }

  cudaError_t Upload(const std::vector<T>& host) {
    return cudaMemcpy(data_, host.data(), sizeof(T) * host.size(),
                      cudaMemcpyHostToDevice);
  }
  cudaError_t Download(std::vector<T>* host, size_t count) const {
    host->resize(count);
    return cudaMemcpy(host->data(), data_, sizeof(T) * count,
                      cudaMemcpyDeviceToHost);
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// The reference sample of one row: argmax over the row's logits (global ids
// vocab_offset + i) of the perturbed score, greedy when inv_temperature is 0.
inline Candidate ReferenceSample(const float* logits, int64_t vocab,
                                 int64_t vocab_offset, float inv_temperature,
                                 uint64_t seed, uint64_t step,
                                 uint32_t sample) {
  Candidate best{-__builtin_inff(), kNoToken};
  for (int64_t i = 0; i < vocab; ++i) {
    const int32_t id = static_cast<int32_t>(vocab_offset + i);
    const float score =
        inv_temperature == 0.0f
            ? logits[i]
            : GumbelScore(
                  logits[i], inv_temperature,
                  GumbelNoise(seed, step, sample, static_cast<uint32_t>(id)));
    if (CandidateBetter(score, id, best.score, best.token_id)) {
      best = Candidate{score, id};
    }
  }
  return best;
}

// What FusedSampleSetAsideL2ForUnits(-1, ...) sets aside on device 0: 2/5
// of its L2, at most what it allows for persisting accesses (0 where the
// attributes cannot be read).
inline size_t DefaultUnitL2SetAside() {
  int l2 = 0;
  int most = 0;
  if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize, 0) !=
          cudaSuccess) {
    return 0;
  }
  return std::min(static_cast<size_t>(l2) / 5 * 2, static_cast<size_t>(most));
}

// The tensor-core paths this device runs, and the block_n values of each.
struct PathConfig {
  FusedKernel kernel;
  int block_n;
};

inline std::vector<FusedKernel> AvailablePaths() {
  std::vector<FusedKernel> paths = {FusedKernel::kMmaSync};
  if (FusedSampleResolveKernel(FusedKernel::kAuto) == FusedKernel::kWgmma) {
    paths.push_back(FusedKernel::kWgmma);
  }
  return paths;
}

// Every kernel configuration of a path: tile widths, and on the wgmma path
// both pipeline stage depths in K, named explicitly (the default depth
// depends on the tile and the batch; results must be the same bits).
struct KernelConfig {
  int block_n;
  int stage_k;  // 0 = default (the mma.sync path has no stages to choose)
};

inline std::vector<KernelConfig> ConfigsOf(FusedKernel kernel) {
  std::vector<KernelConfig> configs;
  for (int block_n : {16, 64, 80, 96, 112, 128}) {
    if (kernel == FusedKernel::kWgmma) {
      configs.push_back({block_n, 64});
      configs.push_back({block_n, 128});
    } else if (block_n == 16 || block_n == 64 || block_n == 128) {
      configs.push_back({block_n, 0});
    }
  }
  return configs;
}

inline const char* PathName(FusedKernel kernel) {
  return kernel == FusedKernel::kWgmma ? "wgmma" : "mma";
}

}  // namespace testing_gpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_TESTING_GPU_TEST_UTIL_H_
