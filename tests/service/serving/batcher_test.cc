// Batcher unit tests on the gated fake engine: coalescing, FIFO without
// splitting, the row bound, deadlines and cancellation before launch, drain,
// engine errors (per batch, and fatal), and batches run on the caller's
// thread by SubmitOrRun().
#include "service/serving/batcher.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/dtype_convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/serving/service_test_util.h"

namespace flashsampler {
namespace {

using ::testing::ElementsAre;
using testing::FakeEngine;
using testing::FakeEngineOptions;
using testing::FakeState;
using testing::FakeToken;
using ::testing::UnorderedElementsAre;

constexpr int64_t kHidden = 16;
constexpr int64_t kVocab = 1000;
constexpr absl::Duration kWait = absl::Seconds(10);

// What a test item's Done() saw; also owns the item's rows and specs.
struct Outcome {
  absl::Notification done;
  absl::Notification done_entered;  // Done() was called (it may block)
  absl::Status status;
  std::vector<RowResult> results;
  BatchTiming timing;
  std::vector<float> hidden;
  std::vector<uint16_t> hidden16;
  std::vector<absl::string_view> pieces;  // views of `hidden`, when set
  SamplingParams params;
  std::vector<RowSpec> specs;
  std::atomic<bool> cancelled{false};
  std::thread::id done_thread;  // where Done() ran
};

class TestItem final : public BatchItem {
 public:
  explicit TestItem(std::shared_ptr<Outcome> outcome)
      : outcome_(std::move(outcome)) {}
  bool IsCancelled() const override { return outcome_->cancelled; }
  void Done(const absl::Status& status, std::vector<RowResult> results,
            const BatchTiming& timing) override {
    outcome_->done_entered.Notify();
    if (block_done_ != nullptr) block_done_->WaitForNotification();
    outcome_->status = status;
    outcome_->results = std::move(results);
    outcome_->timing = timing;
    outcome_->done_thread = std::this_thread::get_id();
    outcome_->done.Notify();
  }
  // Done() waits for `release` (a slow response encoder) before recording.
  void BlockDoneUntil(absl::Notification* release) { block_done_ = release; }

 private:
  std::shared_ptr<Outcome> outcome_;
  absl::Notification* block_done_ = nullptr;
};

// An item of `rows` rows with seeds seed0.. and h[r][0] = first + r.
std::unique_ptr<TestItem> MakeItem(std::shared_ptr<Outcome>* outcome_out,
                                   int rows, uint64_t seed0,
                                   float first = 0.0f) {
  auto outcome = std::make_shared<Outcome>();
  outcome->hidden.assign(rows * kHidden, 0.0f);
  for (int r = 0; r < rows; ++r) outcome->hidden[r * kHidden] = first + r;
  outcome->specs.resize(rows);
  for (int r = 0; r < rows; ++r) {
    outcome->specs[r].params = &outcome->params;
    outcome->specs[r].seed = seed0 + r;
  }
  auto item = std::make_unique<TestItem>(outcome);
  item->rows = rows;
  item->dtype = DType::kFp32;
  item->hidden = outcome->hidden.data();
  item->specs = outcome->specs.data();
  *outcome_out = outcome;
  return item;
}

// MakeItem's item with its rows handed over as pieces of `piece_bytes`
// bytes (the transport's buffers), unchecked, instead of as `hidden`.
std::unique_ptr<TestItem> MakePiecesItem(std::shared_ptr<Outcome>* outcome_out,
                                         int rows, uint64_t seed0, float first,
                                         size_t piece_bytes) {
  std::unique_ptr<TestItem> item = MakeItem(outcome_out, rows, seed0, first);
  Outcome& o = **outcome_out;
  const absl::string_view bytes(reinterpret_cast<const char*>(o.hidden.data()),
                                o.hidden.size() * sizeof(float));
  for (size_t at = 0; at < bytes.size(); at += piece_bytes) {
    o.pieces.push_back(bytes.substr(at, piece_bytes));
  }
  item->hidden = nullptr;
  item->hidden_pieces = &o.pieces;
  return item;
}

// Waits for each outcome's answer (failing at the first that does not come)
// and expects every one OK. Call it as ASSERT_NO_FATAL_FAILURE(...).
void ExpectEveryAnswerOk(
    std::initializer_list<const std::shared_ptr<Outcome>*> outcomes) {
  for (const std::shared_ptr<Outcome>* o : outcomes) {
    ASSERT_TRUE((*o)->done.WaitForNotificationWithTimeout(kWait));
    EXPECT_TRUE((*o)->status.ok()) << (*o)->status;
  }
}

struct Fixture {
  explicit Fixture(FakeEngineOptions engine_options = {},
                   BatcherOptions options = {})
      : state(std::make_shared<FakeState>()),
        engine(state, engine_options),
        batcher(&engine, options, &metrics,
                [this](const absl::Status&) { ++fatal_calls; }) {}
  std::shared_ptr<FakeState> state;
  FakeEngine engine;
  Metrics metrics;
  std::atomic<int> fatal_calls{0};
  Batcher batcher;
};

FakeEngineOptions TwoSlots() {
  FakeEngineOptions engine;
  engine.slots = 2;
  return engine;
}

// overlap_min_rows 0: a free slot launches whatever is queued.
BatcherOptions AnyFreeSlotLaunches() {
  BatcherOptions options;
  options.overlap_min_rows = 0;
  return options;
}

TEST(BatcherTest, SubmitBeforeStartIsUnavailableLoading) {
  Fixture f;
  std::shared_ptr<Outcome> o;
  const absl::Status s = f.batcher.Submit(MakeItem(&o, 1, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(s.message(), "loading"));
}

TEST(BatcherTest, EachRequestGetsItsOwnRows) {
  Fixture f;
  f.batcher.Start();
  std::vector<std::shared_ptr<Outcome>> outcomes(3);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(
        f.batcher
            .Submit(MakeItem(&outcomes[i], i + 1, 100 * (i + 1), 10.0f * i))
            .ok());
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(outcomes[i]->done.WaitForNotificationWithTimeout(kWait));
    ASSERT_TRUE(outcomes[i]->status.ok()) << outcomes[i]->status;
    ASSERT_EQ(outcomes[i]->results.size(), static_cast<size_t>(i + 1));
    for (int r = 0; r <= i; ++r) {
      EXPECT_THAT(outcomes[i]->results[r].token_ids,
                  ElementsAre(FakeToken(10.0f * i + r, 100 * (i + 1) + r, 0, 0,
                                        kVocab)));
    }
  }
}

TEST(BatcherTest, CoalescesWhatQueuedWhileTheEngineWasBusy) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> first;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&first, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  std::vector<std::shared_ptr<Outcome>> rest(5);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(f.batcher.Submit(MakeItem(&rest[i], 2, 10 * (i + 1))).ok());
  }
  f.state->OpenGate();
  for (auto& o : rest) {
    ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(kWait));
    EXPECT_TRUE(o->status.ok());
    EXPECT_EQ(o->timing.batch_rows, 10);
  }
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 10));
  double sum = 0;
  uint64_t count = 0;
  f.metrics.BatchRowsSumAndCount(&sum, &count);
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(sum, 11.0);
}

TEST(BatcherTest, NeverSplitsARequestAndKeepsArrivalOrder) {
  BatcherOptions options;
  options.max_batch_rows = 4;
  Fixture f({}, options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b, c, d;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 3, 10)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&c, 2, 20)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&d, 1, 30)).ok());
  std::shared_ptr<Outcome> too_big;
  EXPECT_EQ(f.batcher.Submit(MakeItem(&too_big, 5, 40)).code(),
            absl::StatusCode::kInvalidArgument);
  f.state->OpenGate();
  for (auto* o : {&a, &b, &c, &d}) {
    ASSERT_TRUE((*o)->done.WaitForNotificationWithTimeout(kWait));
  }
  // B (3) fills the second batch; C (2) does not fit beside it, and D must
  // not jump ahead of C.
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 3, 3));
}

TEST(BatcherTest, FullQueueIsResourceExhausted) {
  BatcherOptions options;
  options.max_queue_rows = 4;
  Fixture f({}, options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> running, q1, q2, over;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&running, 2, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));  // no longer queued
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&q1, 2, 10)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&q2, 2, 20)).ok());
  const absl::Status s = f.batcher.Submit(MakeItem(&over, 1, 30));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "max_queue_rows = 4"));
  f.state->OpenGate();
  ASSERT_NO_FATAL_FAILURE(ExpectEveryAnswerOk({&running, &q1, &q2}));
}

TEST(BatcherTest, ExpiredAndCancelledRowsAreNotComputed) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> running, expired, cancelled, fine;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&running, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  auto item = MakeItem(&expired, 2, 100);
  item->deadline = absl::Now() + absl::Milliseconds(20);
  ASSERT_TRUE(f.batcher.Submit(std::move(item)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&cancelled, 2, 200)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&fine, 1, 300)).ok());
  cancelled->cancelled = true;
  absl::SleepFor(absl::Milliseconds(50));
  f.state->OpenGate();
  for (auto* o : {&running, &expired, &cancelled, &fine}) {
    ASSERT_TRUE((*o)->done.WaitForNotificationWithTimeout(kWait));
  }
  EXPECT_TRUE(running->status.ok());
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled->status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(fine->status.ok());
  EXPECT_THAT(f.state->seeds_computed(), ElementsAre(1u, 300u));
}

TEST(BatcherTest, DrainFinishesAcceptedWorkAndRefusesNewWork) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b, late;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 1, 2)).ok());
  f.batcher.StopAccepting();
  const absl::Status s = f.batcher.Submit(MakeItem(&late, 1, 3));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(s.message(), "draining"));
  EXPECT_FALSE(f.batcher.WaitIdle(absl::Now() + absl::Milliseconds(50)));
  std::thread stopper([&f] { f.batcher.Stop(); });
  absl::SleepFor(absl::Milliseconds(20));
  f.state->OpenGate();
  stopper.join();
  ASSERT_TRUE(a->done.HasBeenNotified());
  ASSERT_TRUE(b->done.HasBeenNotified());
  EXPECT_TRUE(a->status.ok());
  EXPECT_TRUE(b->status.ok());
}

TEST(BatcherTest, EngineErrorFailsOnlyThatBatch) {
  Fixture f;
  f.batcher.Start();
  f.state->FailNext(absl::InternalError("boom"));
  std::shared_ptr<Outcome> failed, next;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&failed, 1, 1)).ok());
  ASSERT_TRUE(failed->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(failed->status.code(), absl::StatusCode::kInternal);
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&next, 1, 2)).ok());
  ASSERT_TRUE(next->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(next->status.ok());
  EXPECT_FALSE(f.batcher.failed());
  EXPECT_EQ(f.fatal_calls, 0);
}

TEST(BatcherTest, ARowErrorFailsOnlyTheRequestThatOwnsIt) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> first, bad, good;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&first, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  // `bad`'s second row (seed 501) fails; `good` rides in the same batch.
  f.state->FailRowsWithSeed(501);
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&bad, 2, 500)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&good, 3, 600, 7.0f)).ok());
  f.state->OpenGate();
  ASSERT_TRUE(bad->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(good->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(bad->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad->status.message(), "row 1:"))
      << bad->status;
  ASSERT_TRUE(good->status.ok()) << good->status;
  EXPECT_EQ(good->timing.batch_rows, 5);
  for (int r = 0; r < 3; ++r) {
    EXPECT_THAT(good->results[r].token_ids,
                ElementsAre(FakeToken(7.0f + r, 600 + r, 0, 0, kVocab)));
  }
}

// Rows left in the transport's pieces are checked as they are copied into
// the batch: a request with a NaN fails alone, and the rows after it in the
// batch are the right ones.
TEST(BatcherTest, ANonFiniteRowInPiecesFailsOnlyItsRequest) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> first, before, bad, after;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&first, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakePiecesItem(&before, 2, 100, 3.0f, 24)).ok());
  std::unique_ptr<TestItem> bad_item = MakePiecesItem(&bad, 3, 200, 5.0f, 40);
  bad->hidden[2 * kHidden + 7] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_TRUE(f.batcher.Submit(std::move(bad_item)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakePiecesItem(&after, 2, 300, 9.0f, 64)).ok());
  f.state->OpenGate();
  ASSERT_NO_FATAL_FAILURE(ExpectEveryAnswerOk({&first, &before, &after}));
  ASSERT_TRUE(bad->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(bad->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad->status.message(),
            "hidden_states.data: must be finite, row 2 holds NaN or Inf");
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 4));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(before->results[r].token_ids,
                ElementsAre(FakeToken(3.0f + r, 100 + r, 0, 0, kVocab)));
    EXPECT_THAT(after->results[r].token_ids,
                ElementsAre(FakeToken(9.0f + r, 300 + r, 0, 0, kVocab)));
  }
}

TEST(BatcherTest, FatalDeviceErrorFailsEverythingWithoutHanging) {
  Fixture f;
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> running, queued, later;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&running, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&queued, 1, 2)).ok());
  f.state->FailNext(absl::UnavailableError("illegal address"));
  f.state->OpenGate();
  ASSERT_TRUE(running->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(queued->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(running->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(queued->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(f.batcher.failed());
  EXPECT_EQ(f.fatal_calls, 1);
  EXPECT_EQ(f.batcher.Submit(MakeItem(&later, 1, 3)).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(f.state->launches(), 0);
}

TEST(BatcherTest, ConvertsIntoTheEngineInputDtype) {
  Fixture f;
  f.batcher.Start();
  std::shared_ptr<Outcome> o;
  auto item = MakeItem(&o, 2, 5);
  o->hidden16.resize(2 * kHidden);
  for (int i = 0; i < 2 * kHidden; ++i) {
    o->hidden16[i] = FloatToBf16(1.5f + i);
  }
  item->dtype = DType::kBf16;
  item->hidden = o->hidden16.data();
  ASSERT_TRUE(f.batcher.Submit(std::move(item)).ok());
  ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(o->status.ok());
  EXPECT_THAT(o->results[0].token_ids,
              ElementsAre(FakeToken(1.5f, 5, 0, 0, kVocab)));
  EXPECT_THAT(o->results[1].token_ids,
              ElementsAre(FakeToken(1.5f + kHidden, 6, 0, 0, kVocab)));
}

// With overlap_min_rows 0, a free slot takes a single queued row beside the
// executing batch.
TEST(BatcherTest, OneWorkerPerSlotRunsBatchesConcurrently) {
  Fixture f(TwoSlots(), AnyFreeSlotLaunches());
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 1, 2)).ok());
  EXPECT_TRUE(f.state->WaitForWaiting(2, kWait));
  f.state->OpenGate();
  ASSERT_TRUE(a->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(b->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 1));
}

// BatcherOptions::overlap_min_rows: while a batch executes, fewer queued
// rows than that stay queued (a second slot is free), and they launch
// together once enough have come or the executing batch returns.
TEST(BatcherTest, RowsBelowOverlapMinRowsWaitForTheExecutingBatch) {
  BatcherOptions options;
  options.overlap_min_rows = 3;
  Fixture f(TwoSlots(), options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b, c, d, e;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 1, 2)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&c, 1, 3)).ok());
  // Two rows queued, the second slot free: nothing launches.
  EXPECT_FALSE(f.state->WaitForWaiting(2, absl::Milliseconds(200)));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&d, 1, 4)).ok());
  // Three rows: they launch beside the executing batch.
  ASSERT_TRUE(f.state->WaitForWaiting(2, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&e, 1, 5)).ok());
  f.state->OpenGate();
  ASSERT_NO_FATAL_FAILURE(ExpectEveryAnswerOk({&a, &b, &c, &d, &e}));
  // The last row waited for both batches and went out alone.
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 3, 1));
}

TEST(BatcherTest, RowsHeldBackByOverlapMinRowsGoWhenTheBatchReturns) {
  BatcherOptions options;
  options.overlap_min_rows = 64;
  Fixture f(TwoSlots(), options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b, c;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 2, 2)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&c, 1, 4)).ok());
  EXPECT_FALSE(f.state->WaitForWaiting(2, absl::Milliseconds(200)));
  f.state->OpenGate();
  ASSERT_NO_FATAL_FAILURE(ExpectEveryAnswerOk({&a, &b, &c}));
  EXPECT_THAT(f.state->batch_rows(), ElementsAre(1, 3));
}

// The threshold counts the rows the next batch would take: a 4-row request
// behind a 1-row one does not fit the same batch of 4, so the 1-row batch
// is not worth a launch beside the executing one.
TEST(BatcherTest, OverlapMinRowsCountsOnlyRowsThatFitTheNextBatch) {
  BatcherOptions options;
  options.max_batch_rows = 4;
  options.overlap_min_rows = 3;
  Fixture f(TwoSlots(), options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> a, b, c;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&a, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 1, 2)).ok());
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&c, 4, 3)).ok());
  EXPECT_FALSE(f.state->WaitForWaiting(2, absl::Milliseconds(200)));
  f.state->OpenGate();
  ASSERT_NO_FATAL_FAILURE(ExpectEveryAnswerOk({&a, &b, &c}));
  // Once the first batch returns, the 1-row and the 4-row batches run side
  // by side on the two slots and reach the engine in either order.
  const std::vector<int> rows = f.state->batch_rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0], 1);
  EXPECT_THAT(std::vector<int>(rows.begin() + 1, rows.end()),
              UnorderedElementsAre(1, 4));
}

// Regression: a worker held back by overlap_min_rows while Stop() waited
// for it slept on after a fatal engine error emptied the queue, and Stop()
// never returned.
TEST(BatcherTest, StopReturnsWhenAFatalErrorEmptiesHeldBackRows) {
  BatcherOptions options;
  options.overlap_min_rows = 32;
  Fixture f(TwoSlots(), options);
  f.batcher.Start();
  f.state->CloseGate();
  std::shared_ptr<Outcome> running, held;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&running, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&held, 1, 2)).ok());
  absl::Notification stopped;
  std::thread stopper([&f, &stopped] {
    f.batcher.Stop();
    stopped.Notify();
  });
  // Let Stop() mark the batcher stopped and wake the workers, which find
  // the held row still queued and wait again.
  absl::SleepFor(absl::Milliseconds(200));
  f.state->FailNext(absl::UnavailableError("illegal address"));
  f.state->OpenGate();
  const bool returned = stopped.WaitForNotificationWithTimeout(kWait);
  if (!returned) {
    // The stopper thread would hang the test's exit: fail loudly instead.
    std::fprintf(stderr, "Batcher::Stop() did not return\n");
    std::abort();
  }
  stopper.join();
  ASSERT_TRUE(running->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(held->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(running->status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(held->status.code(), absl::StatusCode::kUnavailable);
}

// Regression: a batch's answers were delivered on the slot's worker, so the
// slot sat idle until every caller of the batch had been answered.
TEST(BatcherTest, DeliveringAnswersDoesNotHoldTheSlot) {
  Fixture f;  // one slot
  f.batcher.Start();
  f.state->CloseGate();
  absl::Notification release;
  std::shared_ptr<Outcome> a, b, c;
  auto slow = MakeItem(&a, 1, 1);
  slow->BlockDoneUntil(&release);
  ASSERT_TRUE(f.batcher.Submit(std::move(slow)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&b, 1, 2)).ok());
  f.state->OpenGate();
  // b's batch launches and is answered while a's answer is still stuck.
  EXPECT_TRUE(b->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_FALSE(a->done.HasBeenNotified());
  release.Notify();
  ASSERT_TRUE(a->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(a->status.ok());
  EXPECT_TRUE(b->status.ok());
  // Idle only once every answer is delivered.
  EXPECT_TRUE(f.batcher.WaitIdle(absl::Now() + kWait));
}

// Runs one fast batch through the workers, so that the batcher has measured
// the engine (SubmitOrRun() runs nothing inline before).
void MeasureTheEngine(Fixture& f) {
  std::shared_ptr<Outcome> o;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&o, 1, 999)).ok());
  ASSERT_TRUE(o->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(f.batcher.WaitIdle(absl::Now() + kWait));
}

TEST(BatcherTest, SubmitOrRunRunsTheBatchOnTheCallerWhenTheEngineIsIdle) {
  Fixture f;
  f.batcher.Start();
  // Nothing measured yet: the first batch goes to a worker.
  std::shared_ptr<Outcome> first, second;
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&first, 1, 1)).ok());
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_NE(first->done_thread, std::this_thread::get_id());
  ASSERT_TRUE(f.batcher.WaitIdle(absl::Now() + kWait));
  // Measured fast and idle: answered before SubmitOrRun() returns, here.
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&second, 2, 20, 4.0f)).ok());
  ASSERT_TRUE(second->done.HasBeenNotified());
  EXPECT_EQ(second->done_thread, std::this_thread::get_id());
  ASSERT_TRUE(second->status.ok());
  ASSERT_EQ(second->results.size(), 2u);
  EXPECT_THAT(second->results[1].token_ids,
              ElementsAre(FakeToken(5.0f, 21, 0, 0, kVocab)));
  EXPECT_EQ(second->timing.batch_rows, 2);
  EXPECT_TRUE(f.batcher.WaitIdle(absl::Now()));
}

TEST(BatcherTest, SubmitOrRunQueuesBehindARunningBatch) {
  Fixture f;  // one slot
  f.batcher.Start();
  MeasureTheEngine(f);
  f.state->Reset();
  f.state->CloseGate();
  std::shared_ptr<Outcome> running, queued;
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&running, 1, 1)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&queued, 1, 2)).ok());
  EXPECT_FALSE(queued->done.HasBeenNotified());
  f.state->OpenGate();
  ASSERT_TRUE(queued->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(running->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(queued->status.ok());
  EXPECT_NE(queued->done_thread, std::this_thread::get_id());
  EXPECT_THAT(f.state->seeds_computed(), ElementsAre(1u, 2u));
}

TEST(BatcherTest, SubmitOrRunQueuesAfterASlowBatch) {
  Fixture f;
  f.batcher.Start();
  MeasureTheEngine(f);
  f.state->SetDelay(2 * Batcher::kInlineMaxExecute);
  std::shared_ptr<Outcome> slow, after_slow, after_fast;
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&slow, 1, 1)).ok());
  EXPECT_TRUE(slow->done.HasBeenNotified());  // the last batch was fast
  f.state->SetDelay(absl::ZeroDuration());
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&after_slow, 1, 2)).ok());
  ASSERT_TRUE(after_slow->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_NE(after_slow->done_thread, std::this_thread::get_id());
  ASSERT_TRUE(f.batcher.WaitIdle(absl::Now() + kWait));
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&after_fast, 1, 3)).ok());
  EXPECT_TRUE(after_fast->done.HasBeenNotified());
}

// left_idle: true for an inline batch that was alone from its launch to its
// answer; false for one queued for a worker, and for an inline batch beside
// which another request arrived (here still in the engine when the inline
// batch's answer is done).
TEST(BatcherTest, SubmitOrRunSaysWhetherItLeftTheEngineIdle) {
  Fixture f(TwoSlots(), AnyFreeSlotLaunches());
  f.batcher.Start();
  std::shared_ptr<Outcome> unmeasured, alone, beside, other;
  bool left_idle = true;
  ASSERT_TRUE(
      f.batcher.SubmitOrRun(MakeItem(&unmeasured, 1, 1), &left_idle).ok());
  EXPECT_FALSE(left_idle);  // nothing measured yet: a worker ran it
  ASSERT_TRUE(unmeasured->done.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(f.batcher.WaitIdle(absl::Now() + kWait));

  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&alone, 1, 2), &left_idle).ok());
  ASSERT_TRUE(alone->done.HasBeenNotified());
  EXPECT_TRUE(left_idle);

  // The inline batch's answer waits for `release`; meanwhile another request
  // arrives and its batch stops at the closed gate on slot 1.
  absl::Notification release;
  auto item = MakeItem(&beside, 1, 3);
  item->BlockDoneUntil(&release);
  bool beside_left_idle = true;
  std::thread caller([&f, &item, &beside_left_idle] {
    ASSERT_TRUE(f.batcher.SubmitOrRun(std::move(item), &beside_left_idle).ok());
  });
  ASSERT_TRUE(beside->done_entered.WaitForNotificationWithTimeout(kWait));
  f.state->CloseGate();
  ASSERT_TRUE(f.batcher.Submit(MakeItem(&other, 1, 4)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  release.Notify();
  caller.join();
  ASSERT_TRUE(beside->done.HasBeenNotified());
  EXPECT_TRUE(beside->status.ok());
  EXPECT_FALSE(beside_left_idle);
  f.state->OpenGate();
  ASSERT_TRUE(other->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(other->status.ok());
}

// While an inline batch holds slot 0 its worker leaves the slot alone (one
// slot: queued work waits), the batcher is not idle, draining refuses new
// work, and Stop() waits for the inline batch.
TEST(BatcherTest, InlineBatchHoldsItsSlotAndCountsAsRunning) {
  Fixture f;  // one slot
  f.batcher.Start();
  MeasureTheEngine(f);
  f.state->Reset();
  f.state->CloseGate();
  std::shared_ptr<Outcome> inline_item, queued, refused;
  auto item = MakeItem(&inline_item, 1, 1);
  std::thread caller([&f, &item] {
    ASSERT_TRUE(f.batcher.SubmitOrRun(std::move(item)).ok());
  });
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&queued, 2, 10)).ok());
  EXPECT_FALSE(f.state->WaitForWaiting(2, absl::Milliseconds(50)));
  EXPECT_FALSE(f.batcher.WaitIdle(absl::Now() + absl::Milliseconds(50)));
  f.batcher.StopAccepting();
  EXPECT_EQ(f.batcher.SubmitOrRun(MakeItem(&refused, 1, 20)).code(),
            absl::StatusCode::kUnavailable);
  std::thread stopper([&f] { f.batcher.Stop(); });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(inline_item->done.HasBeenNotified());
  f.state->OpenGate();
  caller.join();
  stopper.join();
  ASSERT_TRUE(inline_item->done.HasBeenNotified());
  EXPECT_TRUE(inline_item->status.ok());
  ASSERT_TRUE(queued->done.HasBeenNotified());
  EXPECT_TRUE(queued->status.ok()) << queued->status;
  EXPECT_THAT(f.state->seeds_computed(), ElementsAre(1u, 10u, 11u));
}

// With two slots (and overlap_min_rows 0), work queued behind an inline
// batch runs at once on the other slot.
TEST(BatcherTest, InlineBatchLeavesTheOtherSlotToTheQueue) {
  Fixture f(TwoSlots(), AnyFreeSlotLaunches());
  f.batcher.Start();
  MeasureTheEngine(f);
  f.state->Reset();
  f.state->CloseGate();
  std::shared_ptr<Outcome> inline_item, queued;
  auto item = MakeItem(&inline_item, 1, 1);
  std::thread caller([&f, &item] {
    ASSERT_TRUE(f.batcher.SubmitOrRun(std::move(item)).ok());
  });
  ASSERT_TRUE(f.state->WaitForWaiting(1, kWait));
  ASSERT_TRUE(f.batcher.SubmitOrRun(MakeItem(&queued, 2, 10)).ok());
  ASSERT_TRUE(f.state->WaitForWaiting(2, kWait));
  EXPECT_EQ(f.state->rows_at_gate(), 3);
  f.state->OpenGate();
  caller.join();
  ASSERT_TRUE(queued->done.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(inline_item->status.ok());
  EXPECT_TRUE(queued->status.ok()) << queued->status;
}

}  // namespace
}  // namespace flashsampler
