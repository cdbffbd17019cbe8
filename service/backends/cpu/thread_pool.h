// A small fixed pool of worker threads for the CPU backend: ParallelFor runs
// one function over an index range and blocks until every call has returned.
// Several callers (engine slots) may share one pool at the same time.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_THREAD_POOL_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_THREAD_POOL_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace flashsampler {

class ThreadPool {
 public:
  // Starts `num_threads` workers (at least one).
  explicit ThreadPool(int num_threads);
  // Finishes the queued work, then joins the workers.
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(threads_.size()); }

  // Calls fn(i) for every i in [0, n), spread over the workers (indices are
  // handed out one at a time, so uneven work balances itself), and returns
  // when all calls have returned. Thread-safe; must not be called from inside
  // `fn` (a worker waiting on its own pool could deadlock it).
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_THREAD_POOL_H_
