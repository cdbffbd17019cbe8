// The batcher: a queue bounded in rows between the gRPC handlers and the
// engine. One worker thread per engine slot takes whatever is queued the
// moment its slot is free (up to max_batch_rows, never splitting a request),
// drops requests that expired or were cancelled while queued, launches one
// engine batch and hands each request its own rows back on a small pool of
// completion threads, so that the slot takes its next batch as soon as the
// engine returns. SubmitOrRun() skips the queue when the engine is idle and
// fast: the caller's thread runs the batch itself.
#ifndef FLASHSAMPLER_SERVICE_SERVING_BATCHER_H_
#define FLASHSAMPLER_SERVICE_SERVING_BATCHER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "service/serving/metrics.h"
#include "service/serving/server_options.h"

namespace flashsampler {

// Where a request's rows went, returned to the caller in SampleResponse.
struct BatchTiming {
  double queue_seconds = 0;    // accepted -> batch launched
  double execute_seconds = 0;  // batch launched -> results ready
  int batch_rows = 0;          // rows of the batch it rode in
};

// One request's rows waiting for a batch. The caller keeps `hidden` and
// `specs` valid until Done() has been called.
class BatchItem {
 public:
  virtual ~BatchItem() = default;

  // True when the caller went away; its rows are then not computed.
  virtual bool IsCancelled() const { return false; }
  // Called exactly once for every item accepted, on a batcher thread (a
  // slot's worker or a completion thread) or inside SubmitOrRun(): OK with
  // `rows` results, or the reason the rows were not sampled. The batcher
  // destroys the item right after.
  virtual void Done(const absl::Status& status, std::vector<RowResult> results,
                    const BatchTiming& timing) = 0;

  int rows = 0;
  DType dtype = DType::kFp32;    // dtype of `hidden`
  const void* hidden = nullptr;  // rows x D elements
  // When `hidden` is null: the rows' bytes in order, in the engine's input
  // dtype, left in the transport's buffers, copied once into the batch and
  // checked there (CopyFinitePieces); a failure fails this item alone.
  const std::vector<absl::string_view>* hidden_pieces = nullptr;
  // When `hidden` is null and this is set: the rows' bytes, in the engine's
  // input dtype, in a caller's shared-memory mapping, copied into the batch
  // and checked there (CopyFiniteRows); a failure fails this item alone.
  const char* shared_hidden = nullptr;
  const RowSpec* specs = nullptr;  // rows entries
  absl::Time deadline = absl::InfiniteFuture();

 private:
  friend class Batcher;
  absl::Time enqueued_;
};

class Batcher {
 public:
  // `engine` and `metrics` must outlive the batcher. `on_fatal` runs once, on
  // a worker thread, when the engine reports a fatal device error
  // (UNAVAILABLE): from then on every queued and later request fails with
  // UNAVAILABLE instead of reaching the engine.
  Batcher(Engine* engine, const BatcherOptions& options, Metrics* metrics,
          std::function<void(const absl::Status&)> on_fatal);
  ~Batcher();  // Stop()
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;

  // Starts one worker per engine slot; Submit() accepts from then on (before,
  // it answers UNAVAILABLE "loading").
  void Start();

  // Queues `item`. On error the item is not queued and Done() is not called:
  // UNAVAILABLE (loading, draining, device failed), RESOURCE_EXHAUSTED (the
  // queue would exceed max_queue_rows), INVALID_ARGUMENT (more rows than one
  // batch holds).
  absl::Status Submit(std::unique_ptr<BatchItem> item);

  // As Submit(), but when nothing is queued or running and the engine's last
  // batch took under kInlineMaxExecute (a GPU kernel at small B; not the CPU
  // backend at a real vocabulary), runs the item's batch on the calling
  // thread (on slot 0) and calls its Done() before returning OK: no batcher
  // thread is woken. At most one such batch runs at a time; requests that
  // arrive meanwhile queue for the workers as usual. *left_idle (if given):
  // whether the batch ran here and, once answered, left nothing queued or
  // running (no other request arrived meanwhile).
  absl::Status SubmitOrRun(std::unique_ptr<BatchItem> item,
                           bool* left_idle = nullptr);
  // The longest last batch after which SubmitOrRun() still runs inline, so a
  // caller's thread (a Sample thread) is held no longer than about this: above
  // an H100's kernel at B <= 64 (0.21-0.43 ms), far below the CPU backend at a
  // real vocabulary.
  static constexpr absl::Duration kInlineMaxExecute = absl::Milliseconds(1);

  // Later Submit() calls get UNAVAILABLE "draining"; queued work still runs.
  void StopAccepting();
  // Blocks until nothing is queued or running, or `deadline`; true if idle.
  bool WaitIdle(absl::Time deadline);
  // StopAccepting(), runs everything still queued, joins the workers.
  // Idempotent.
  void Stop();

  // Rows of the largest batch (options clamped to the engine's limit).
  int max_batch_rows() const { return max_batch_rows_; }
  // True after a fatal engine error.
  bool failed() const;

 private:
  enum class State { kLoading, kAccepting, kDraining, kStopped };

  // One item's answer, waiting for its Done() call.
  struct Completion {
    std::unique_ptr<BatchItem> item;
    absl::Status status;
    std::vector<RowResult> results;
    BatchTiming timing;
  };
  // Some completions of one batch; the last job of a batch to finish ends
  // the batch's count in running_.
  struct CompletionJob {
    std::vector<Completion> completions;
    std::shared_ptr<std::atomic<int>> batch_jobs_left;
  };

  // Why `item` cannot be accepted now (Submit()'s errors), or OK.
  absl::Status Admit(const BatchItem& item) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Enqueue(std::unique_ptr<BatchItem> item)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rows the next batch would take from the head of the queue, counted up to
  // `limit` (the walk stops there).
  int64_t HeadBatchRows(int64_t limit) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes a worker that can take queued work (all of them while a slot is
  // held by an inline batch, whose worker must not take the wake-up).
  void WakeWorker() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerLoop(int slot);
  // Launches one batch; returns every item's answer, not yet delivered.
  std::vector<Completion> RunBatch(
      int slot, std::vector<std::unique_ptr<BatchItem>> items);
  // Delivers `completions` (Done() calls), inline or on the completion
  // threads, and ends the batch's count in running_ once all are delivered.
  void Complete(std::vector<Completion> completions);
  void CompleterLoop();
  void EndBatch();
  void FailAll(const absl::Status& status);

  Engine* const engine_;
  Metrics* const metrics_;
  const std::function<void(const absl::Status&)> on_fatal_;
  const int max_batch_rows_;
  const int64_t max_queue_rows_;
  // BatcherOptions', clamped to max_batch_rows_ and max_queue_rows_.
  const int overlap_min_rows_;
  const size_t input_row_bytes_;  // D x sizeof(engine input dtype)

  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;  // queue non-empty or stopping
  absl::CondVar idle_cv_;  // queue empty and nothing running
  State state_ ABSL_GUARDED_BY(mu_) = State::kLoading;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status fatal_status_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<BatchItem>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_rows_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  // Batches inside Engine::Sample (running_ also counts delivery).
  int executing_ ABSL_GUARDED_BY(mu_) = 0;
  // The slot an inline batch holds (its worker waits), or -1.
  int inline_slot_ ABSL_GUARDED_BY(mu_) = -1;
  // Inline batches not yet fully delivered; Stop() waits for none.
  int inline_running_ ABSL_GUARDED_BY(mu_) = 0;
  // Engine time of the last batch, for SubmitOrRun(); none measured yet
  // counts as slow, so that the first batch runs on a worker.
  std::atomic<int64_t> last_execute_ns_{INT64_MAX};
  std::vector<std::thread> workers_;  // touched only by Start()/Stop()
  absl::Mutex stop_mu_;               // serializes Stop()

  // Completion threads: Done() calls run here, off the slots' workers.
  absl::Mutex done_mu_;
  absl::CondVar done_cv_;
  std::deque<CompletionJob> done_queue_ ABSL_GUARDED_BY(done_mu_);
  bool completers_stop_ ABSL_GUARDED_BY(done_mu_) = false;
  std::vector<std::thread> completers_;  // touched only by Start()/Stop()
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_BATCHER_H_
