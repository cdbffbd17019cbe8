// Tests of tools/sanitizers/tsan_absl_shim.cc in the FS_SANITIZE=thread
// build: threads that share data through absl::Mutex, CondVar, Await,
// ReaderLock and Notification run without a ThreadSanitizer report (any
// report fails the test: exit code 66, or abort with halt_on_error), and an
// unguarded race is still reported.

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace {

#define FS_STRINGIFY_INNER(x) #x
#define FS_STRINGIFY(x) FS_STRINGIFY_INNER(x)

constexpr int kIterations = 2000;

TEST(TsanAbslShimTest, MutexLockResolvesToTheShim) {
  // The executable's own reference and libgpr's PLT go through the same
  // global lookup: the first definition of Mutex::Lock must be the shim's.
  const std::string ns = FS_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name =
      "_ZN4absl" + std::to_string(ns.size()) + ns + "5Mutex4LockEv";
  void* fn = dlsym(RTLD_DEFAULT, name.c_str());
  ASSERT_NE(fn, nullptr) << dlerror();
  Dl_info info{};
  ASSERT_NE(dladdr(fn, &info), 0);
  EXPECT_NE(std::string(info.dli_fname).find("libfs_tsan_absl"),
            std::string::npos)
      << "absl::Mutex::Lock resolves to " << info.dli_fname;
}

TEST(TsanAbslShimTest, CounterGuardedByMutexIsNotARace) {
  absl::Mutex mu;
  int counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIterations; ++i) {
        absl::MutexLock lock(&mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 2 * kIterations);
}

TEST(TsanAbslShimTest, ReaderLockSeesWriterUnderMutex) {
  absl::Mutex mu;
  std::vector<int> values;  // grows under the writer lock
  size_t seen = 0;
  std::thread writer([&] {
    for (int i = 0; i < kIterations; ++i) {
      absl::MutexLock lock(&mu);
      values.push_back(i);
    }
  });
  std::thread reader([&] {
    for (int i = 0; i < kIterations; ++i) {
      absl::ReaderMutexLock lock(&mu);
      if (!values.empty()) seen = values.back() + 1;
    }
  });
  writer.join();
  reader.join();
  EXPECT_LE(seen, static_cast<size_t>(kIterations));
}

TEST(TsanAbslShimTest, TryLockGuardsData) {
  absl::Mutex mu;
  int counter = 0;
  auto work = [&] {
    for (int i = 0; i < kIterations; ++i) {
      while (!mu.TryLock()) {
      }
      ++counter;
      mu.Unlock();
    }
  };
  std::thread a(work);
  std::thread b(work);
  a.join();
  b.join();
  EXPECT_EQ(counter, 2 * kIterations);
}

TEST(TsanAbslShimTest, CondVarHandsDataToWaiter) {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;
  std::string payload;  // written by the producer, read by the consumer
  std::thread producer([&] {
    absl::MutexLock lock(&mu);
    payload = "from the producer";
    ready = true;
    cv.Signal();
  });
  {
    absl::MutexLock lock(&mu);
    while (!ready) cv.Wait(&mu);
    EXPECT_EQ(payload, "from the producer");
  }
  producer.join();
}

TEST(TsanAbslShimTest, AwaitAndLockWhenHandDataToWaiter) {
  absl::Mutex mu;
  int stage = 0;
  std::vector<int> log;
  std::thread other([&] {
    mu.LockWhen(absl::Condition(
        +[](int* s) { return *s == 1; }, &stage));
    log.push_back(2);
    stage = 2;
    mu.Unlock();
  });
  {
    absl::MutexLock lock(&mu);
    log.push_back(1);
    stage = 1;
    mu.Await(absl::Condition(
        +[](int* s) { return *s == 2; }, &stage));
    log.push_back(3);
  }
  other.join();
  EXPECT_EQ(log, (std::vector<int>{1, 2, 3}));
}

TEST(TsanAbslShimTest, NotificationPublishesData) {
  for (int round = 0; round < 50; ++round) {
    absl::Notification done;
    absl::Notification polled;
    int plain = 0;         // read after WaitForNotification
    int polled_value = 0;  // read after HasBeenNotified (the inline fast path)
    std::thread notifier([&] {
      plain = round + 1;
      polled_value = round + 2;
      done.Notify();
      polled.Notify();
    });
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    EXPECT_EQ(plain, round + 1);
    while (!polled.HasBeenNotified()) std::this_thread::yield();
    EXPECT_EQ(polled_value, round + 2);
    notifier.join();
  }
}

// Run only as the child of UnguardedRaceIsStillReported.
TEST(TsanAbslShimTest, DISABLED_UnguardedRace) {
  absl::Mutex unused;  // an annotated mutex that does not guard `racy`
  volatile int racy = 0;
  std::thread a([&] { racy = racy + 1; });
  std::thread b([&] {
    absl::MutexLock lock(&unused);
    racy = racy + 1;
  });
  a.join();
  b.join();
}

TEST(TsanAbslShimTest, UnguardedRaceIsStillReported) {
  char self[PATH_MAX] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  // halt_on_error makes the first report end the child; no suppressions.
  const std::string command =
      std::string("TSAN_OPTIONS=halt_on_error=1:exitcode=66 '") + self +
      "' --gtest_also_run_disabled_tests"
      " --gtest_filter=TsanAbslShimTest.DISABLED_UnguardedRace 2>&1";
  FILE* child = popen(command.c_str(), "r");
  ASSERT_NE(child, nullptr);
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), child)) > 0) {
    output.append(buffer, n);
  }
  const int status = pclose(child);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 66) << output;
  EXPECT_NE(output.find("WARNING: ThreadSanitizer: data race"),
            std::string::npos)
      << output;
}

}  // namespace
