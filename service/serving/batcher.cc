// Batcher implementation. The queue is FIFO and a batch takes requests from
// its head only, so a large request cannot be starved by small ones that
// would fit around it. All engine work happens outside the lock.
#include "service/serving/batcher.h"

#include <algorithm>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype_convert.h"
#include "service/serving/request_wire.h"
#include "service/serving/shared_memory.h"

namespace flashsampler {

namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// Threads that deliver answers (encode the response, finish the gRPC call:
// tens of microseconds per request). A 64-request batch delivered serially
// kept its slot idle for about a millisecond, longer than the kernel at
// B = 64 on an H100 (0.43 ms); spread over a few threads it overlaps the
// next batch instead.
int CompletionThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / 4, 2, 8);
}
// Requests per completion job: fewer would cost more in hand-offs than the
// delivery itself.
constexpr size_t kMinJobItems = 4;

// The status of one request from its rows: OK, or INVALID_ARGUMENT naming
// the request's first failed row (row indices are the request's own).
absl::Status RowErrors(const std::vector<RowResult>& rows) {
  for (size_t r = 0; r < rows.size(); ++r) {
    if (!rows[r].error.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, ": ", rows[r].error));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Batcher::Batcher(Engine* engine, const BatcherOptions& options,
                 Metrics* metrics,
                 std::function<void(const absl::Status&)> on_fatal)
    : engine_(engine),
      metrics_(metrics),
      on_fatal_(std::move(on_fatal)),
      max_batch_rows_(std::max(1, std::min(options.max_batch_rows,
                                           engine->info().max_batch_rows > 0
                                               ? engine->info().max_batch_rows
                                               : options.max_batch_rows))),
      max_queue_rows_(options.max_queue_rows),
      // A threshold the queue or one batch cannot reach would keep every
      // batch but the first waiting.
      overlap_min_rows_(static_cast<int>(std::max<int64_t>(
          0, std::min<int64_t>({options.overlap_min_rows, max_batch_rows_,
                                options.max_queue_rows})))),
      input_row_bytes_(engine->info().hidden_size *
                       DTypeSize(engine->info().input_dtype)) {}

Batcher::~Batcher() { Stop(); }

void Batcher::Start() {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kLoading) return;
    state_ = State::kAccepting;
  }
  {
    absl::MutexLock lock(&done_mu_);
    completers_stop_ = false;
  }
  for (int i = 0; i < CompletionThreads(); ++i) {
    completers_.emplace_back([this] { CompleterLoop(); });
  }
  for (int slot = 0; slot < engine_->max_slots(); ++slot) {
    workers_.emplace_back([this, slot] { WorkerLoop(slot); });
  }
}

absl::Status Batcher::Admit(const BatchItem& item) {
  if (failed_) return fatal_status_;
  switch (state_) {
    case State::kLoading:
      return absl::UnavailableError("server is loading; retry later");
    case State::kDraining:
    case State::kStopped:
      return absl::UnavailableError(
          "server is draining (shutting down); retry on another replica");
    case State::kAccepting:
      break;
  }
  if (item.rows < 1 || item.rows > max_batch_rows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states.shape[0]: B must be in [1, ",
                     max_batch_rows_, "], got ", item.rows));
  }
  if (queued_rows_ + item.rows > max_queue_rows_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", queued_rows_, " rows queued, this request adds ",
        item.rows, ", limit max_queue_rows = ", max_queue_rows_,
        "; retry with backoff"));
  }
  return absl::OkStatus();
}

void Batcher::Enqueue(std::unique_ptr<BatchItem> item) {
  queued_rows_ += item->rows;
  queue_.push_back(std::move(item));
  metrics_->SetQueueRows(queued_rows_);
  WakeWorker();
}

int64_t Batcher::HeadBatchRows(int64_t limit) const {
  int64_t rows = 0;
  for (const std::unique_ptr<BatchItem>& item : queue_) {
    if (rows + item->rows > max_batch_rows_) break;
    rows += item->rows;
    if (rows >= limit) break;
  }
  return rows;
}

void Batcher::WakeWorker() {
  if (inline_slot_ >= 0) {
    work_cv_.SignalAll();
  } else {
    work_cv_.Signal();
  }
}

absl::Status Batcher::Submit(std::unique_ptr<BatchItem> item) {
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Admit(*item); !s.ok()) return s;
  item->enqueued_ = absl::Now();
  Enqueue(std::move(item));
  return absl::OkStatus();
}

absl::Status Batcher::SubmitOrRun(std::unique_ptr<BatchItem> item,
                                  bool* left_idle) {
  constexpr int kSlot = 0;
  if (left_idle != nullptr) *left_idle = false;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = Admit(*item); !s.ok()) return s;
    item->enqueued_ = absl::Now();
    const bool idle = queue_.empty() && running_ == 0;
    if (!idle || last_execute_ns_.load(std::memory_order_relaxed) >=
                     absl::ToInt64Nanoseconds(kInlineMaxExecute)) {
      Enqueue(std::move(item));
      return absl::OkStatus();
    }
    // Every worker waits on an empty queue, so slot 0 is free; its worker
    // leaves it alone until the engine returns.
    inline_slot_ = kSlot;
    ++inline_running_;
    ++running_;
    ++executing_;
  }
  std::vector<std::unique_ptr<BatchItem>> items;
  items.push_back(std::move(item));
  std::vector<Completion> completions = RunBatch(kSlot, std::move(items));
  {
    absl::MutexLock lock(&mu_);
    inline_slot_ = -1;
    --executing_;
    if (!queue_.empty()) work_cv_.SignalAll();
  }
  for (Completion& c : completions) {
    c.item->Done(c.status, std::move(c.results), c.timing);
    c.item.reset();
  }
  absl::MutexLock lock(&mu_);
  --inline_running_;
  --running_;
  if (queue_.empty() && running_ == 0) {
    idle_cv_.SignalAll();
    if (left_idle != nullptr) *left_idle = true;
  }
  return absl::OkStatus();
}

void Batcher::StopAccepting() {
  absl::MutexLock lock(&mu_);
  if (state_ == State::kAccepting || state_ == State::kLoading) {
    state_ = State::kDraining;
  }
}

bool Batcher::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  while (!queue_.empty() || running_ > 0) {
    if (idle_cv_.WaitWithDeadline(&mu_, deadline)) {
      return queue_.empty() && running_ == 0;
    }
  }
  return true;
}

void Batcher::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&mu_);
    state_ = State::kStopped;
    work_cv_.SignalAll();
  }
  // Workers leave only once the queue is empty, and completion threads only
  // once their queue is empty after the workers are gone, so every accepted
  // item gets its Done() before Stop() returns.
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* running) { return *running == 0; }, &inline_running_));
  }
  {
    absl::MutexLock lock(&done_mu_);
    completers_stop_ = true;
    done_cv_.SignalAll();
  }
  for (std::thread& completer : completers_) completer.join();
  completers_.clear();
}

bool Batcher::failed() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

void Batcher::WorkerLoop(int slot) {
  for (;;) {
    std::vector<std::unique_ptr<BatchItem>> items;
    {
      absl::MutexLock lock(&mu_);
      // The slot is not ours while an inline batch holds it, and a batch
      // below overlap_min_rows_ waits for the one executing.
      const auto can_take = [&] {
        return !queue_.empty() && inline_slot_ != slot &&
               (executing_ == 0 ||
                HeadBatchRows(overlap_min_rows_) >= overlap_min_rows_);
      };
      while (!can_take() && !(queue_.empty() && state_ == State::kStopped)) {
        work_cv_.Wait(&mu_);
      }
      if (!can_take()) return;  // stopped and drained
      int rows = 0;
      while (!queue_.empty() &&
             rows + queue_.front()->rows <= max_batch_rows_) {
        rows += queue_.front()->rows;
        items.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      queued_rows_ -= rows;
      ++running_;
      ++executing_;
      metrics_->SetQueueRows(queued_rows_);
      // Another slot may take what is left.
      if (!queue_.empty()) WakeWorker();
    }
    std::vector<Completion> completions = RunBatch(slot, std::move(items));
    {
      absl::MutexLock lock(&mu_);
      --executing_;
      // Rows held back by overlap_min_rows_ may go now, on any free slot;
      // once stopping, a worker held back may have nothing left to wait for.
      if (!queue_.empty() || state_ == State::kStopped) work_cv_.SignalAll();
    }
    Complete(std::move(completions));
  }
}

void Batcher::Complete(std::vector<Completion> completions) {
  bool queue_empty;
  {
    absl::MutexLock lock(&mu_);
    queue_empty = queue_.empty();
  }
  // One answer and nothing waiting for this slot: delivering it here is
  // cheaper than waking a completion thread (a lone caller's latency).
  if (completions.size() <= 1 && queue_empty) {
    for (Completion& c : completions) {
      c.item->Done(c.status, std::move(c.results), c.timing);
    }
    EndBatch();
    return;
  }
  const size_t threads = static_cast<size_t>(CompletionThreads());
  const size_t per_job =
      std::max(kMinJobItems, (completions.size() + threads - 1) / threads);
  const int jobs =
      static_cast<int>((completions.size() + per_job - 1) / per_job);
  auto left = std::make_shared<std::atomic<int>>(jobs);
  absl::MutexLock lock(&done_mu_);
  for (size_t begin = 0; begin < completions.size(); begin += per_job) {
    const size_t end = std::min(completions.size(), begin + per_job);
    CompletionJob job;
    job.completions.assign(std::make_move_iterator(completions.begin() + begin),
                           std::make_move_iterator(completions.begin() + end));
    job.batch_jobs_left = left;
    done_queue_.push_back(std::move(job));
  }
  done_cv_.SignalAll();
}

void Batcher::CompleterLoop() {
  for (;;) {
    CompletionJob job;
    {
      absl::MutexLock lock(&done_mu_);
      while (done_queue_.empty() && !completers_stop_) done_cv_.Wait(&done_mu_);
      if (done_queue_.empty()) return;  // stopped and drained
      job = std::move(done_queue_.front());
      done_queue_.pop_front();
    }
    for (Completion& c : job.completions) {
      c.item->Done(c.status, std::move(c.results), c.timing);
      c.item.reset();  // the caller's buffers go before the batch ends
    }
    if (job.batch_jobs_left->fetch_sub(1) == 1) EndBatch();
  }
}

void Batcher::EndBatch() {
  absl::MutexLock lock(&mu_);
  --running_;
  if (queue_.empty() && running_ == 0) idle_cv_.SignalAll();
}

std::vector<Batcher::Completion> Batcher::RunBatch(
    int slot, std::vector<std::unique_ptr<BatchItem>> items) {
  // Deadlines and cancellation are honoured before launch: such rows are not
  // computed. The deadline is checked first because gRPC also marks an
  // expired call cancelled, and DEADLINE_EXCEEDED is the better answer.
  const absl::Time launch = absl::Now();
  std::vector<Completion> done;
  done.reserve(items.size());
  std::vector<std::unique_ptr<BatchItem>> kept;
  kept.reserve(items.size());
  for (std::unique_ptr<BatchItem>& item : items) {
    BatchTiming timing;
    timing.queue_seconds = Seconds(launch - item->enqueued_);
    if (item->deadline <= launch) {
      done.push_back({std::move(item),
                      absl::DeadlineExceededError(absl::StrCat(
                          "deadline passed after ", timing.queue_seconds,
                          " s in the queue, before the batch launched")),
                      {},
                      timing});
    } else if (item->IsCancelled()) {
      done.push_back(
          {std::move(item),
           absl::CancelledError("cancelled by the client before launch"),
           {},
           timing});
    } else {
      kept.push_back(std::move(item));
    }
  }
  if (kept.empty()) return done;
  {
    absl::Status fatal;
    {
      absl::MutexLock lock(&mu_);
      if (failed_) fatal = fatal_status_;
    }
    if (!fatal.ok()) {
      for (std::unique_ptr<BatchItem>& item : kept) {
        BatchTiming timing;
        timing.queue_seconds = Seconds(launch - item->enqueued_);
        done.push_back({std::move(item), fatal, {}, timing});
      }
      return done;
    }
  }

  // Gather the rows into the slot's input buffer in the engine's dtype.
  const EngineInfo& info = engine_->info();
  char* input = static_cast<char*>(engine_->slot_input(slot));
  std::vector<RowSpec> specs;
  int rows = 0;
  std::vector<std::unique_ptr<BatchItem>> gathered;
  gathered.reserve(kept.size());
  for (std::unique_ptr<BatchItem>& item : kept) {
    char* to = input + rows * input_row_bytes_;
    if (item->hidden != nullptr) {
      ConvertDType(item->dtype, item->hidden,
                   static_cast<size_t>(item->rows) * info.hidden_size,
                   info.input_dtype, to);
    } else {
      absl::Status copied =
          item->shared_hidden != nullptr
              ? CopyFiniteRows(info.input_dtype, item->shared_hidden,
                               item->rows, info.hidden_size, to)
              : CopyFinitePieces(info.input_dtype, *item->hidden_pieces,
                                 info.hidden_size, to);
      if (!copied.ok()) {
        BatchTiming timing;
        timing.queue_seconds = Seconds(launch - item->enqueued_);
        done.push_back({std::move(item), std::move(copied), {}, timing});
        continue;
      }
    }
    specs.insert(specs.end(), item->specs, item->specs + item->rows);
    rows += item->rows;
    metrics_->ObserveQueueWait(Seconds(launch - item->enqueued_));
    gathered.push_back(std::move(item));
  }
  kept = std::move(gathered);
  if (kept.empty()) return done;

  BatchView view;
  view.slot = slot;
  view.rows = rows;
  view.specs = specs.data();
  std::vector<RowResult> results;
  metrics_->AddBatchesInFlight(1);
  const absl::Time start = absl::Now();
  absl::Status status = engine_->Sample(view, &results);
  const absl::Time end = absl::Now();
  last_execute_ns_.store(absl::ToInt64Nanoseconds(end - start),
                         std::memory_order_relaxed);
  metrics_->AddBatchesInFlight(-1);
  if (status.ok() && static_cast<int>(results.size()) != rows) {
    status = absl::InternalError(absl::StrCat(
        "engine returned ", results.size(), " results for ", rows, " rows"));
  }
  if (status.ok()) {
    metrics_->ObserveBatch(rows, Seconds(end - start));
    for (const RowResult& row : results) {
      if (row.exact_fallback != nullptr) {
        metrics_->CountExactFallback(row.exact_fallback, 1);
      }
    }
  }
  // UNAVAILABLE from the engine means the device is gone
  // (docs/design.md#errors): stop sending it work, fail what waits, and flip
  // health, all before this batch's callers hear back, so a caller that sees
  // UNAVAILABLE also sees NOT_SERVING.
  if (absl::IsUnavailable(status)) FailAll(status);

  int offset = 0;
  for (std::unique_ptr<BatchItem>& item : kept) {
    BatchTiming timing;
    timing.queue_seconds = Seconds(start - item->enqueued_);
    timing.execute_seconds = Seconds(end - start);
    timing.batch_rows = rows;
    const int item_rows = item->rows;
    if (status.ok()) {
      std::vector<RowResult> mine(
          std::make_move_iterator(results.begin() + offset),
          std::make_move_iterator(results.begin() + offset + item_rows));
      absl::Status row_status = RowErrors(mine);
      done.push_back(
          {std::move(item), std::move(row_status), std::move(mine), timing});
    } else {
      done.push_back({std::move(item), status, {}, timing});
    }
    offset += item_rows;
  }
  return done;
}

void Batcher::FailAll(const absl::Status& status) {
  std::deque<std::unique_ptr<BatchItem>> queued;
  bool first = false;
  const absl::Status fatal = absl::UnavailableError(
      absl::StrCat("engine failed, server is not serving: ", status.message()));
  {
    absl::MutexLock lock(&mu_);
    if (!failed_) {
      failed_ = true;
      fatal_status_ = fatal;
      first = true;
    }
    queued.swap(queue_);
    queued_rows_ = 0;
    metrics_->SetQueueRows(0);
    // Workers held back from these rows (overlap_min_rows_) must see the
    // queue empty, or Stop() would wait for them forever.
    work_cv_.SignalAll();
  }
  const absl::Time now = absl::Now();
  for (std::unique_ptr<BatchItem>& item : queued) {
    BatchTiming timing;
    timing.queue_seconds = Seconds(now - item->enqueued_);
    item->Done(fatal, {}, timing);
  }
  if (first && on_fatal_) on_fatal_(fatal);
}

}  // namespace flashsampler
