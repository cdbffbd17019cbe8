// A small fixed pool of worker threads: ParallelFor runs one function over an
// index range, on the calling thread and on the pool's free workers, and
// returns when every call has returned. Several callers (the CPU backend's
// engine slots, the gRPC handlers parsing requests) may share one pool at
// the same time.
#ifndef FLASHSAMPLER_COMMON_THREAD_POOL_H_
#define FLASHSAMPLER_COMMON_THREAD_POOL_H_

#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace flashsampler {

class ThreadPool {
 public:
  // Starts `num_threads` workers (0: every call runs on its caller alone).
  explicit ThreadPool(int num_threads);
  // Joins the workers (no ParallelFor may be running).
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(threads_.size()); }

  // Calls fn(i) once for every i in [0, n) and returns when all calls have
  // returned. Indices are handed out one at a time, so uneven work balances
  // itself; the calling thread takes them too, so a call never waits for a
  // worker busy with another caller's work, which only helps less. `fn`
  // must be safe to call from several threads at once and must not call
  // ParallelFor on the same pool.
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn);

 private:
  struct Job;

  // Takes indices of `job` until none is left; returns how many it ran.
  static int64_t RunIndices(Job* job);
  void WorkerLoop();

  absl::Mutex mu_;
  // One entry per worker a call asked for; an entry no worker took is
  // withdrawn when its call has run every index.
  std::deque<Job*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// pool->ParallelFor(n, fn), or fn(0) .. fn(n - 1) on the calling thread
// where `pool` is null: work its caller judged too small to wake workers for.
void ParallelForOrInline(ThreadPool* pool, int64_t n,
                         absl::FunctionRef<void(int64_t)> fn);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_THREAD_POOL_H_
