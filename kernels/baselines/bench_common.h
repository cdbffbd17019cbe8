// What fs_bench and fs_controls_bench share, so that both time alike: the
// timer (CUDA events around each call, L2 flushed by a memset of twice the
// L2 before every call, median and percentiles, two methods timed call for
// call alternately when their ratio matters) and their flag-list parsing.
#ifndef FLASHSAMPLER_KERNELS_BASELINES_BENCH_COMMON_H_
#define FLASHSAMPLER_KERNELS_BASELINES_BENCH_COMMON_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace flashsampler {

// "1,16,64" -> {"1", "16", "64"}; empty items are dropped.
inline std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = text.find(',', begin);
    const size_t stop = end == std::string::npos ? text.size() : end;
    if (stop > begin) parts.push_back(text.substr(begin, stop - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return parts;
}

// The integers of a comma-separated list ("1,16,64"), each as std::atoi
// reads it.
inline std::vector<int> SplitInts(const std::string& text) {
  std::vector<int> values;
  for (const std::string& part : SplitCommas(text)) {
    values.push_back(std::atoi(part.c_str()));
  }
  return values;
}

// True when every batch size is in 1..max_batch; otherwise says which one is
// not, as `tool`, on stderr.
inline bool BatchesInRange(const char* tool, const std::vector<int>& batches,
                           int max_batch) {
  for (int b : batches) {
    if (b < 1 || b > max_batch) {
      std::fprintf(stderr, "%s: batch %d outside 1..%d\n", tool, b, max_batch);
      return false;
    }
  }
  return true;
}

// In a function returning bool: prints the failed call and returns false.
#define BENCH_CHECK(expr)                                                \
  do {                                                                   \
    const cudaError_t bench_error_ = (expr);                             \
    if (bench_error_ != cudaSuccess) {                                   \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, \
                   #expr, cudaGetErrorString(bench_error_));             \
      return false;                                                      \
    }                                                                    \
  } while (false)

struct Stats {
  double median_us = 0;
  double p10_us = 0;
  double p90_us = 0;
  double min_us = 0;
};

// Times a sequence of launches with CUDA events, flushing L2 before each.
class Timer {
 public:
  static void Summarize(std::vector<double>* us, Stats* stats) {
    std::sort(us->begin(), us->end());
    const size_t n = us->size();
    stats->median_us =
        n % 2 == 1 ? (*us)[n / 2] : 0.5 * ((*us)[n / 2 - 1] + (*us)[n / 2]);
    stats->p10_us = (*us)[n / 10];
    stats->p90_us = (*us)[(n * 9) / 10 == n ? n - 1 : n * 9 / 10];
    stats->min_us = (*us)[0];
  }

  bool Init(int iters, size_t flush_bytes, cudaStream_t stream) {
    stream_ = stream;
    flush_bytes_ = flush_bytes;
    BENCH_CHECK(cudaMalloc(&flush_, flush_bytes_));
    iters_ = iters;
    // Twice as many events as calls: RunInterleaved times two methods.
    start_.resize(2 * iters);
    stop_.resize(2 * iters);
    for (int i = 0; i < 2 * iters; ++i) {
      BENCH_CHECK(cudaEventCreate(&start_[i]));
      BENCH_CHECK(cudaEventCreate(&stop_[i]));
    }
    return true;
  }

  // One call after an L2 flush, timed with CUDA events (--timeline).
  bool TimeOnce(const std::function<cudaError_t()>& launch, double* us) {
    BENCH_CHECK(cudaMemsetAsync(flush_, 0, flush_bytes_, stream_));
    BENCH_CHECK(cudaEventRecord(start_[0], stream_));
    BENCH_CHECK(launch());
    BENCH_CHECK(cudaEventRecord(stop_[0], stream_));
    BENCH_CHECK(cudaEventSynchronize(stop_[0]));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start_[0], stop_[0]));
    *us = 1000.0 * ms;
    return true;
  }

  bool Run(int warmup, const std::function<cudaError_t()>& launch,
           Stats* stats) {
    return RunAlternating(warmup, {&launch}, {stats});
  }

  // Times two launches alternately, call for call (flush, a, flush, b, ...),
  // so that both see the same drift of the GPU's clock and power state; the
  // plain Run() times one method's calls back to back, and at B >= 128 the
  // state (and cuBLAS's own time) moves by up to +-15% between methods.
  bool RunInterleaved(int warmup, const std::function<cudaError_t()>& a,
                      const std::function<cudaError_t()>& b, Stats* stats_a,
                      Stats* stats_b) {
    return RunAlternating(warmup, {&a, &b}, {stats_a, stats_b});
  }

 private:
  // Each iteration flushes L2 before every launch of `launches`, in order;
  // stats[m] gets launch m's times. Up to two launches (the events).
  bool RunAlternating(
      int warmup,
      const std::vector<const std::function<cudaError_t()>*>& launches,
      const std::vector<Stats*>& stats) {
    const int methods = static_cast<int>(launches.size());
    if (methods < 1 || methods > 2) return false;
    for (int i = 0; i < warmup; ++i) {
      for (const auto* launch : launches) {
        BENCH_CHECK(cudaMemsetAsync(flush_, i & 0xff, flush_bytes_, stream_));
        BENCH_CHECK((*launch)());
      }
    }
    for (int i = 0; i < iters_; ++i) {
      for (int m = 0; m < methods; ++m) {
        BENCH_CHECK(cudaMemsetAsync(flush_, i & 0xff, flush_bytes_, stream_));
        BENCH_CHECK(cudaEventRecord(start_[methods * i + m], stream_));
        BENCH_CHECK((*launches[m])());
        BENCH_CHECK(cudaEventRecord(stop_[methods * i + m], stream_));
      }
    }
    BENCH_CHECK(cudaStreamSynchronize(stream_));
    for (int m = 0; m < methods; ++m) {
      std::vector<double> us(iters_);
      for (int i = 0; i < iters_; ++i) {
        float ms = 0;
        BENCH_CHECK(cudaEventElapsedTime(&ms, start_[methods * i + m],
                                         stop_[methods * i + m]));
        us[i] = 1000.0 * ms;
      }
      Summarize(&us, stats[m]);
    }
    return true;
  }

  cudaStream_t stream_ = nullptr;
  void* flush_ = nullptr;
  size_t flush_bytes_ = 0;
  int iters_ = 0;
  std::vector<cudaEvent_t> start_;
  std::vector<cudaEvent_t> stop_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_BASELINES_BENCH_COMMON_H_
