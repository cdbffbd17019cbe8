// CpuEngine start-up under a memory limit: a buffer that cannot be allocated
// (the fp32 copy of W, a slot's input buffer) is a ResourceExhausted status
// naming it and its size, never an uncaught std::bad_alloc.
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "service/backends/cpu/cpu_engine.h"
#include "service/weights/weights.h"

// AddressSanitizer and ThreadSanitizer reserve terabytes of address space
// for their shadow memory: RLIMIT_AS cannot be lowered under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FS_UNDER_SHADOW_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define FS_UNDER_SHADOW_SANITIZER 1
#endif
#endif

namespace flashsampler {
namespace {

// bf16 weights of the given shape, all zero (the test is about memory, not
// tokens).
class ZeroWeights final : public Weights {
 public:
  ZeroWeights(int64_t vocab, int64_t hidden)
      : buffer_(static_cast<size_t>(vocab * hidden), 0) {
    vocab_size_ = vocab;
    hidden_size_ = hidden;
    dtype_ = DType::kBf16;
    data_ = buffer_.data();
    source_ = "test:zeros";
  }

 private:
  std::vector<uint16_t> buffer_;
};

// Virtual memory of this process now, in bytes (VmSize), or 0.
uint64_t VirtualBytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmSize:") {
      uint64_t kib = 0;
      status >> kib;
      return kib * 1024;
    }
    std::getline(status, key);
  }
  return 0;
}

// Caps this process's address space at what it uses now plus `headroom`.
bool LimitAddressSpace(uint64_t headroom) {
  const uint64_t now = VirtualBytes();
  if (now == 0) return false;
  rlimit limit{};
  limit.rlim_cur = now + headroom;
  limit.rlim_max = now + headroom;
  return setrlimit(RLIMIT_AS, &limit) == 0;
}

// Runs in the death-test child: creates the engine under a limit of
// `headroom` bytes over what the process uses now, prints the status on
// stderr and exits 0 if it is ResourceExhausted, 1 if it is another error,
// 2 if the engine was created. A crash fails the test.
[[noreturn]] void CreateUnderLimit(const Weights& weights,
                                   const CpuEngineOptions& options,
                                   uint64_t headroom) {
  if (!LimitAddressSpace(headroom)) {
    std::fprintf(stderr, "setrlimit failed\n");
    _exit(3);
  }
  const auto engine = CpuEngine::Create(weights, options);
  if (engine.ok()) {
    std::fprintf(stderr, "engine created under the limit\n");
    _exit(2);
  }
  std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
  _exit(absl::IsResourceExhausted(engine.status()) ? 0 : 1);
}

class CpuEngineOomTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef FS_UNDER_SHADOW_SANITIZER
    GTEST_SKIP() << "a sanitizer's shadow memory does not fit RLIMIT_AS";
#endif
    GTEST_FLAG_SET(death_test_style, "threadsafe");
  }
};

// Defect: out of memory aborts. With no memory for the fp32 copy of W the
// engine threw std::bad_alloc out of Create and the daemon died on SIGABRT
// with no word of what it could not allocate.
TEST_F(CpuEngineOomTest, OutOfMemoryAborts) {
  // bf16 W of 64 MiB; its fp32 copy (128 MiB) exceeds the 64 MiB headroom.
  const ZeroWeights weights(16384, 2048);
  CpuEngineOptions options;
  options.sampler.threads = 1;
  options.max_batch_rows = 8;
  EXPECT_EXIT(CreateUnderLimit(weights, options, uint64_t{64} << 20),
              ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED: CpuEngine: cannot allocate the fp32 copy "
              "of W \\[16384, 2048\\]: 134217728 bytes");
}

// Same defect, slot buffers: each slot's fp32 input buffer is allocated at
// start-up too.
TEST_F(CpuEngineOomTest, OutOfMemoryAbortsOnSlotBuffers) {
  const ZeroWeights weights(1000, 1024);
  CpuEngineOptions options;
  options.sampler.threads = 1;
  options.max_batch_rows = 1 << 20;  // 4 GiB per slot at hidden 1024
  options.slots = 2;
  // 1 GiB of headroom: the 4 MB fp32 copy of W must fit beside whatever
  // else the process maps meanwhile. OpenBLAS starts its threads at load,
  // and a thread's first malloc maps 128 MiB for its arena (strace, 2-core
  // host); where that came after the limit, 64 MiB of headroom left no
  // room for the copy of W, and the test failed on the wrong allocation.
  EXPECT_EXIT(CreateUnderLimit(weights, options, uint64_t{1} << 30),
              ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED: CpuEngine: cannot allocate the input "
              "buffer of slot 0 \\[1048576, 1024\\]: 4294967296 bytes");
}

// The limit is what fails, not the engine: the same shapes create fine
// without it.
TEST_F(CpuEngineOomTest, SameShapesCreateWithoutALimit) {
  const ZeroWeights weights(16384, 2048);
  CpuEngineOptions options;
  options.sampler.threads = 1;
  options.max_batch_rows = 8;
  const auto engine = CpuEngine::Create(weights, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->info().vocab_size, 16384);
}

}  // namespace
}  // namespace flashsampler
