// ThreadPool::ParallelFor: every index runs exactly once, with or without
// workers and from several callers at once, and a caller whose pool's
// workers are all busy with another call still finishes on its own thread;
// ParallelForOrInline without a pool stays on the caller.
#include "common/thread_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace flashsampler {
namespace {

TEST(ThreadPoolTest, EveryIndexRunsOnceFromSeveralCallers) {
  for (int workers : {0, 1, 3}) {
    ThreadPool pool(workers);
    constexpr int kCallers = 4;
    std::vector<std::vector<std::atomic<int>>> runs;
    for (int c = 0; c < kCallers; ++c) runs.emplace_back(1000);
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c) {
      callers.emplace_back([&pool, &runs, c, workers] {
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}}) {
          for (auto& count : runs[c]) count = 0;
          pool.ParallelFor(n, [&](int64_t i) { ++runs[c][i]; });
          for (int64_t i = 0; i < 1000; ++i) {
            ASSERT_EQ(runs[c][i].load(), i < n ? 1 : 0)
                << "workers " << workers << " n " << n << " index " << i;
          }
        }
      });
    }
    for (std::thread& caller : callers) caller.join();
  }
}

TEST(ThreadPoolTest, ACallFinishesWhileEveryWorkerIsBusy) {
  ThreadPool pool(2);
  absl::Notification second_done;
  std::atomic<int> blocked{0};
  // The first call holds both workers (and its own thread) until the second
  // call, made after they are all blocked, has run all its indices.
  std::thread first([&] {
    pool.ParallelFor(3, [&](int64_t) {
      ++blocked;
      second_done.WaitForNotification();
    });
  });
  while (blocked.load() < 3) std::this_thread::yield();
  std::atomic<int> ran{0};
  pool.ParallelFor(50, [&](int64_t) { ++ran; });
  EXPECT_EQ(ran.load(), 50);
  second_done.Notify();
  first.join();
}

// Without a pool every call runs on the calling thread, in order.
TEST(ThreadPoolTest, ParallelForOrInlineWithoutAPoolRunsOnTheCaller) {
  std::vector<int64_t> order;
  const std::thread::id caller = std::this_thread::get_id();
  bool elsewhere = false;
  ParallelForOrInline(nullptr, 5, [&](int64_t i) {
    order.push_back(i);
    elsewhere = elsewhere || std::this_thread::get_id() != caller;
  });
  EXPECT_EQ(order, std::vector<int64_t>({0, 1, 2, 3, 4}));
  EXPECT_FALSE(elsewhere);
  ThreadPool pool(2);
  std::atomic<int> ran{0};
  ParallelForOrInline(&pool, 40, [&](int64_t) { ++ran; });
  EXPECT_EQ(ran.load(), 40);
}

}  // namespace
}  // namespace flashsampler
