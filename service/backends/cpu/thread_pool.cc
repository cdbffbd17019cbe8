// Fixed worker pool on absl::Mutex: a FIFO of closures; ParallelFor enqueues
// one claim-loop closure per worker and waits for all of them to finish.
#include "service/backends/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

namespace flashsampler {

ThreadPool::ThreadPool(int num_threads) {
  const int n = std::max(1, num_threads);
  threads_.reserve(n);
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::function<void()> work;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mu_) {
            return pool->stopping_ || !pool->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping, and nothing left to run
      work = std::move(queue_.front());
      queue_.pop_front();
    }
    work();
  }
}

void ThreadPool::ParallelFor(int64_t n,
                             const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  // Shared by the claim loops; a shared_ptr because a worker may still hold it
  // for a moment after the caller has seen `running` reach zero.
  struct Job {
    std::atomic<int64_t> next{0};
    absl::Mutex mu;
    int running ABSL_GUARDED_BY(mu) = 0;
  };
  auto job = std::make_shared<Job>();
  const int workers = static_cast<int>(
      std::min<int64_t>(n, static_cast<int64_t>(threads_.size())));
  {
    absl::MutexLock lock(&job->mu);
    job->running = workers;
  }
  {
    absl::MutexLock lock(&mu_);
    for (int w = 0; w < workers; ++w) {
      // `fn` outlives every call: the caller returns only after running == 0.
      queue_.push_back([job, n, &fn] {
        for (int64_t i = job->next.fetch_add(1); i < n;
             i = job->next.fetch_add(1)) {
          fn(i);
        }
        absl::MutexLock job_lock(&job->mu);
        --job->running;
      });
    }
  }
  absl::MutexLock lock(&job->mu);
  job->mu.Await(absl::Condition(
      +[](Job* j)
           ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) { return j->running == 0; },
      job.get()));
}

}  // namespace flashsampler
