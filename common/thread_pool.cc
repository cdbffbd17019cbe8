// ThreadPool: a call's job is an index counter on the caller's stack that
// the caller and any free worker draw from. The caller returns once every
// index has run and no worker still holds the job.
#include "common/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace flashsampler {

struct ThreadPool::Job {
  Job(int64_t n, absl::FunctionRef<void(int64_t)> fn) : n(n), fn(fn) {}

  const int64_t n;
  const absl::FunctionRef<void(int64_t)> fn;
  std::atomic<int64_t> next{0};
  absl::Mutex mu;
  int64_t finished ABSL_GUARDED_BY(mu) = 0;  // indices that have run
  int holders ABSL_GUARDED_BY(mu) = 0;       // workers inside RunIndices
};

ThreadPool::ThreadPool(int num_threads) {
  const int n = std::max(0, num_threads);
  threads_.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

int64_t ThreadPool::RunIndices(Job* job) {
  int64_t ran = 0;
  for (int64_t i = job->next.fetch_add(1); i < job->n;
       i = job->next.fetch_add(1)) {
    job->fn(i);
    ++ran;
  }
  return ran;
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  Job job(n, fn);
  const int64_t asked = std::min<int64_t>(num_threads(), n - 1);
  {
    absl::MutexLock lock(&mu_);
    for (int64_t w = 0; w < asked; ++w) queue_.push_back(&job);
  }
  const int64_t ran = RunIndices(&job);
  {
    // No index is left: an entry no worker has taken would find none.
    absl::MutexLock lock(&mu_);
    queue_.erase(std::remove(queue_.begin(), queue_.end(), &job), queue_.end());
  }
  absl::MutexLock lock(&job.mu);
  job.finished += ran;
  job.mu.Await(absl::Condition(
      +[](Job* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) {
        return j->finished == j->n && j->holders == 0;
      },
      &job));
}

void ParallelForOrInline(ThreadPool* pool, int64_t n,
                         absl::FunctionRef<void(int64_t)> fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n, fn);
    return;
  }
  for (int64_t i = 0; i < n; ++i) fn(i);
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    Job* job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ThreadPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->mu_) {
            return pool->stopping_ || !pool->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping
      job = queue_.front();
      queue_.pop_front();
      // Held before mu_ is released: the caller withdraws its entries under
      // mu_, then waits for the job's holders.
      absl::MutexLock job_lock(&job->mu);
      ++job->holders;
    }
    const int64_t ran = RunIndices(job);
    absl::MutexLock job_lock(&job->mu);
    job->finished += ran;
    --job->holders;
  }
}

}  // namespace flashsampler
