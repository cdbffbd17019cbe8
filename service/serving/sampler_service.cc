// The Sampler service's calls and reactors. Unary Sample is a
// UnarySampleCall on a completion queue that a Sample thread polls, answered
// by a batcher thread or, when the engine is idle, by that thread itself;
// SampleStream has its own reactor
// that keeps accepted requests in arrival order and writes each answer once
// it and every earlier one are ready (one outstanding write at a time).
#include "service/serving/sampler_service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_util.h"
#include "google/protobuf/arena.h"
#include "grpc/support/time.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "service/serving/request_wire.h"

namespace flashsampler {

namespace {

constexpr absl::Duration kDrainGrace = absl::Milliseconds(50);

absl::Time DeadlineOf(const grpc::ServerContextBase* context) {
  const std::chrono::system_clock::time_point deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

double SecondsSince(absl::Time start) {
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// Counts a unary call answered in its handler and finishes it there.
grpc::ServerUnaryReactor* FinishInHandler(grpc::CallbackServerContext* context,
                                          Metrics* metrics, const char* rpc,
                                          absl::Time start,
                                          const absl::Status& status) {
  metrics->ObserveRequest(rpc, status.code(), SecondsSince(start));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

void SetTiming(const BatchTiming& timing, v1::SampleResponse* response) {
  v1::Timing* out = response->mutable_timing();
  out->set_queue_seconds(timing.queue_seconds);
  out->set_execute_seconds(timing.execute_seconds);
  out->set_batch_rows(timing.batch_rows);
}

constexpr char kNotARequest[] =
    "request is not a valid flashsampler.v1.SampleRequest";

// Parses a request's bytes. The ByteBuffer copy shares the slices.
bool ParseRequest(const grpc::ByteBuffer& bytes, v1::SampleRequest* request) {
  grpc::ByteBuffer shared(bytes);
  grpc::ProtoBufferReader reader(&shared);
  return reader.status().ok() && request->ParseFromZeroCopyStream(&reader);
}

// Arena blocks of a request: grown from 4 KB up to 256 KB, so that a
// request of a few MB takes a few dozen of them.
google::protobuf::ArenaOptions RequestArenaOptions() {
  google::protobuf::ArenaOptions options;
  options.start_block_size = 4 << 10;
  options.max_block_size = 256 << 10;
  return options;
}

// A request read with its hidden states left in gRPC's slices
// (request_wire.h); requests the splitter does not follow are parsed whole.
// The message lives on its own arena: its nested messages (a SamplingParams
// a row, a TokenBias a bias entry, a TokenCount a generated id) are carved
// from a few blocks instead of one heap allocation and free each. 256-row
// requests whose rows carry a bitmask, 64 bias entries and 64 prompt and
// generated ids took 6.9 ms a request against 10.6 to decode and refuse (a
// development host, the null engine; malloc and free had been a third of
// the daemon's time).
struct WireRequest {
  google::protobuf::Arena arena{RequestArenaOptions()};
  v1::SampleRequest& request =
      *google::protobuf::Arena::CreateMessage<v1::SampleRequest>(&arena);
  std::vector<grpc::Slice> slices;  // holds the bytes `parts` points into
  SplitRequest parts;
  bool split = false;  // `parts.data` holds hidden_states.data
};

// Reads a request's bytes into `wire`; false when they are not a valid
// SampleRequest.
bool ParseWireRequest(const grpc::ByteBuffer& bytes, ThreadPool* pool,
                      WireRequest* wire) {
  wire->split = false;
  if (bytes.Dump(&wire->slices).ok()) {
    std::vector<absl::string_view> pieces;
    pieces.reserve(wire->slices.size());
    for (const grpc::Slice& slice : wire->slices) {
      pieces.emplace_back(reinterpret_cast<const char*>(slice.begin()),
                          slice.size());
    }
    if (SplitHiddenStates(pieces, &wire->parts) == SplitResult::kSplit) {
      wire->split = true;
      return ParseSplitRequest(wire->parts,
                               RowsWorthAPool(wire->parts) ? pool : nullptr,
                               &wire->request);
    }
  }
  wire->slices.clear();
  wire->parts = SplitRequest();
  return ParseRequest(bytes, &wire->request);
}

absl::Status DecodeWireRequest(const WireRequest& wire,
                               const CodecConfig& codec, ThreadPool* pool,
                               DecodedRequest* decoded) {
  if (!wire.split) return DecodeSampleRequest(wire.request, codec, decoded);
  return DecodeSampleRequest(wire.request, wire.parts.data, codec, decoded,
                             RowsWorthAPool(wire.parts) ? pool : nullptr);
}

// Serializes a response; INTERNAL if it cannot be (it always can: the
// fields are plain numbers and strings).
absl::Status SerializeResponse(const v1::SampleResponse& response,
                               grpc::ByteBuffer* bytes) {
  bool own_buffer = false;
  const grpc::Status s =
      grpc::SerializationTraits<v1::SampleResponse>::Serialize(response, bytes,
                                                               &own_buffer);
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cannot serialize the response: ", s.error_message()));
}

// Fills the batch-facing fields of `item` from a decoded request.
void Describe(const DecodedRequest& decoded, absl::Time deadline,
              BatchItem* item) {
  item->rows = decoded.rows;
  item->dtype = decoded.dtype;
  item->hidden = decoded.hidden;
  item->hidden_pieces = &decoded.hidden_pieces;
  item->shared_hidden = decoded.shared.data;
  item->specs = decoded.specs.data();
  item->deadline = deadline;
}

}  // namespace

// One unary Sample() call on a completion queue, from the moment it is
// asked for until gRPC has returned every event of it; it deletes itself
// after the last. Events: kArrived (the call came, or, not ok, the server
// shut down before one did), then kDone (gRPC finished with the call, after
// the answer or on cancellation) and kAnswered (the answer went out or
// failed), in either order.
class UnarySampleCall {
 public:
  enum class Event { kArrived, kDone, kAnswered };
  // What the completion queue hands back: the call and which event it is.
  struct Tag {
    UnarySampleCall* call;
    Event event;
  };

  grpc::ServerContext* context() { return &context_; }
  grpc::ByteBuffer* request() { return &request_; }
  grpc::ByteBuffer* response() { return &response_; }
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer>* responder() {
    return &responder_;
  }
  void* tag(Event event) {
    switch (event) {
      case Event::kArrived:
        return &arrived_;
      case Event::kDone:
        return &done_;
      case Event::kAnswered:
        return &answered_;
    }
    return nullptr;
  }
  absl::Time start() const { return start_; }
  absl::Time deadline() const { return DeadlineOf(&context_); }
  // Valid from any thread: set when kDone reports a cancelled call.
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }

  // Sends the answer: `response()` when `status` is OK. Exactly once per
  // call that arrived.
  void Answer(const absl::Status& status) {
    if (status.ok()) {
      responder_.Finish(response_, grpc::Status::OK, &answered_);
    } else {
      responder_.FinishWithError(ToGrpcStatus(status), &answered_);
    }
  }

  // The queue's thread, for each event of this call. Returns true when the
  // call arrived (the caller then handles it).
  bool OnEvent(Event event, bool ok) {
    switch (event) {
      case Event::kArrived:
        if (!ok) {  // no call came; no other event will
          delete this;
          return false;
        }
        start_ = absl::Now();
        return true;
      case Event::kDone:
        // IsCancelled() is valid on the async API only once this event has
        // been delivered.
        cancelled_.store(context_.IsCancelled(), std::memory_order_release);
        break;
      case Event::kAnswered:
        break;
    }
    if (events_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
    return false;
  }

 private:
  grpc::ServerContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  grpc::ServerAsyncResponseWriter<grpc::ByteBuffer> responder_{&context_};
  Tag arrived_{this, Event::kArrived};
  Tag done_{this, Event::kDone};
  Tag answered_{this, Event::kAnswered};
  absl::Time start_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> events_left_{2};  // kDone and kAnswered
};

namespace {

// One unary Sample() in the batcher: the parsed and decoded request and the
// response message. The call it answers outlives it.
class QueuedSample final : public BatchItem {
 public:
  QueuedSample(UnarySampleCall* call, Metrics* metrics)
      : call_(call), metrics_(metrics) {}

  WireRequest* wire() { return &wire_; }
  DecodedRequest* decoded() { return &decoded_; }

  bool IsCancelled() const override { return call_->cancelled(); }

  void Done(const absl::Status& status, std::vector<RowResult> results,
            const BatchTiming& timing) override {
    const absl::Time answered = absl::Now();
    absl::Status s = status;
    if (s.ok()) {
      s = EncodeSampleResponse(wire_.request, decoded_, results, &response_);
    }
    if (s.ok()) {
      SetTiming(timing, &response_);
      s = SerializeResponse(response_, call_->response());
    }
    metrics_->ObserveEncode(SecondsSince(answered));
    metrics_->ObserveRequest(kRpcSample, s.code(),
                             SecondsSince(call_->start()));
    call_->Answer(s);
  }

 private:
  UnarySampleCall* const call_;
  Metrics* const metrics_;
  WireRequest wire_;
  v1::SampleResponse response_;
  DecodedRequest decoded_;
};

}  // namespace

class SampleStreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  SampleStreamReactor(SamplerService* service,
                      grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    // Registered before taking mu_, so that no lock of the service is ever
    // taken while a stream's lock is held.
    const bool accepting = service_->RegisterStream(this);
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      if (!accepting) draining_ = true;
      Decide(&actions);
    }
    Act(actions);
  }

  // See SamplerService::BeginDrain().
  void Drain() {
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      draining_ = true;
      Decide(&actions);
    }
    Act(actions);
  }

  void OnReadDone(bool ok) override {
    std::unique_ptr<Entry> entry;
    int frame = 0;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {
        reads_done_ = true;
      } else if (!finished_) {
        entry = std::move(read_entry_);
        entry->start = absl::Now();
        frame = frames_read_++;
      }
    }
    // reading_ stays set until the entry is queued in entries_: otherwise a
    // batcher thread's Decide() could start the next read, and that message
    // could be queued ahead of this one.
    if (entry != nullptr) {
      if (ParseWireRequest(entry->request_bytes, &service_->parse_pool_,
                           &entry->wire)) {
        entry->request_bytes.Clear();
        Accept(std::move(entry));
      } else {
        // Nothing after an unparsable message can be trusted to line up
        // with the caller's requests: stop reading, answer what came
        // before, end the stream with the error.
        service_->metrics_->ObserveRequest(kRpcSampleStream,
                                           absl::StatusCode::kInvalidArgument,
                                           SecondsSince(entry->start));
        absl::MutexLock lock(&mu_);
        bad_frame_ = grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("frame ", frame, ": ", kNotARequest,
                         "; the stream ends here, every request before it "
                         "was answered"));
      }
    }
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      Decide(&actions);
    }
    Act(actions);
  }

  void OnWriteDone(bool ok) override {
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      entries_.pop_front();
      if (!ok) write_failed_ = true;
      Decide(&actions);
    }
    Act(actions);
  }

  void OnCancel() override {
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      Decide(&actions);
    }
    Act(actions);
  }

  // The service deletes the reactor (possibly later, see BeginDrain()).
  void OnDone() override { service_->StreamDone(this); }

 private:
  // One request of the stream, from its read to its written answer.
  struct Entry {
    grpc::ByteBuffer request_bytes;  // as read, until parsed
    // Parsed as a Sample() request is: hidden states left in the slices,
    // large row_params on the parse pool.
    WireRequest wire;
    v1::SampleResponse response;
    grpc::ByteBuffer response_bytes;  // what is written
    DecodedRequest decoded;
    absl::Time start;
    bool ready = false;  // response holds the answer
  };

  class Item final : public BatchItem {
   public:
    Item(SampleStreamReactor* stream, Entry* entry)
        : stream_(stream), entry_(entry) {}
    bool IsCancelled() const override {
      return stream_->context_->IsCancelled();
    }
    void Done(const absl::Status& status, std::vector<RowResult> results,
              const BatchTiming& timing) override {
      stream_->OnResult(entry_, status, results, timing);
    }

   private:
    SampleStreamReactor* const stream_;
    Entry* const entry_;
  };

  // gRPC operations decided under mu_ and started after releasing it:
  // reactions may run inline on the starting thread.
  struct Actions {
    grpc::ByteBuffer* read = nullptr;
    const grpc::ByteBuffer* write = nullptr;
    bool finish = false;
    grpc::Status status;
  };

  void Decide(Actions* actions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    const bool broken = cancelled_ || write_failed_;
    if (broken) {
      // Nobody will read these answers; drop the ready ones, wait for the
      // rest to come back from the batcher (they reference this reactor).
      while (!writing_ && !entries_.empty() && entries_.front()->ready) {
        entries_.pop_front();
      }
    } else if (!writing_ && !entries_.empty() && entries_.front()->ready) {
      writing_ = true;
      actions->write = &entries_.front()->response_bytes;
    }
    if (!writing_ && in_batcher_ == 0) {
      if (broken) {
        Finish(actions,
               grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
        return;
      }
      if (entries_.empty() && !bad_frame_.ok()) {
        Finish(actions, bad_frame_);
        return;
      }
      if (entries_.empty() && reads_done_) {
        Finish(actions, grpc::Status::OK);
        return;
      }
      if (entries_.empty() && draining_) {
        Finish(actions,
               grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "server is draining (shutting down); reconnect "
                            "to another replica"));
        return;
      }
    }
    if (!reading_ && !reads_done_ && !draining_ && !broken && bad_frame_.ok() &&
        static_cast<int>(entries_.size()) < service_->max_stream_in_flight_) {
      reading_ = true;
      read_entry_ = std::make_unique<Entry>();
      actions->read = &read_entry_->request_bytes;
    }
  }

  void Finish(Actions* actions, grpc::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    actions->finish = true;
    actions->status = std::move(status);
  }

  void Act(const Actions& actions) {
    if (actions.write != nullptr) StartWrite(actions.write);
    if (actions.read != nullptr) StartRead(actions.read);
    if (actions.finish) ServerBidiReactor::Finish(actions.status);
  }

  // Validates and queues one request; a failure becomes its error response.
  void Accept(std::unique_ptr<Entry> entry) {
    Entry* e = entry.get();
    absl::Status status = DecodeWireRequest(
        e->wire, service_->codec_, &service_->parse_pool_, &e->decoded);
    if (status.ok()) {
      service_->metrics_->ObserveDecode(SecondsSince(e->start));
      auto item = std::make_unique<Item>(this, e);
      Describe(e->decoded, DeadlineOf(context_), item.get());
      {
        absl::MutexLock lock(&mu_);
        entries_.push_back(std::move(entry));
        ++in_batcher_;
      }
      status = service_->batcher_->Submit(std::move(item));
      if (status.ok()) return;
      absl::MutexLock lock(&mu_);
      --in_batcher_;
      SetError(e, status);
      return;
    }
    absl::MutexLock lock(&mu_);
    entries_.push_back(std::move(entry));
    SetError(e, status);
  }

  void SetError(Entry* e, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    e->response.Clear();
    e->response.set_request_id(e->wire.request.request_id());
    e->response.mutable_error()->set_code(static_cast<int>(status.code()));
    e->response.mutable_error()->set_message(std::string(status.message()));
    // An error response of a code and a message always serializes.
    SerializeResponse(e->response, &e->response_bytes).IgnoreError();
    e->ready = true;
    service_->metrics_->ObserveRequest(kRpcSampleStream, status.code(),
                                       SecondsSince(e->start));
  }

  void OnResult(Entry* e, const absl::Status& status,
                const std::vector<RowResult>& results,
                const BatchTiming& timing) {
    // The entry is ours alone until it is marked ready.
    const absl::Time answered = absl::Now();
    absl::Status s = status;
    if (s.ok()) {
      s = EncodeSampleResponse(e->wire.request, e->decoded, results,
                               &e->response);
    }
    if (s.ok()) {
      SetTiming(timing, &e->response);
      s = SerializeResponse(e->response, &e->response_bytes);
    }
    service_->metrics_->ObserveEncode(SecondsSince(answered));
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      --in_batcher_;
      if (s.ok()) {
        e->ready = true;
        service_->metrics_->ObserveRequest(kRpcSampleStream, s.code(),
                                           SecondsSince(e->start));
      } else {
        SetError(e, s);
      }
      Decide(&actions);
    }
    Act(actions);
  }

  SamplerService* const service_;
  grpc::CallbackServerContext* const context_;

  absl::Mutex mu_;
  std::unique_ptr<Entry> read_entry_ ABSL_GUARDED_BY(mu_);  // outstanding read
  // Accepted requests in arrival order; the front is the next to answer.
  std::deque<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  int in_batcher_ ABSL_GUARDED_BY(mu_) = 0;  // entries awaiting Done()
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;  // client half-closed
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int frames_read_ ABSL_GUARDED_BY(mu_) = 0;  // messages read so far
  // Set when a message did not parse: the stream's final status.
  grpc::Status bad_frame_ ABSL_GUARDED_BY(mu_);
};

SamplerService::SamplerService(Batcher* batcher, Metrics* metrics,
                               CodecConfig codec, v1::ModelInfo model_info,
                               int max_stream_in_flight, int parse_threads,
                               int sample_threads,
                               absl::Duration sample_poll_spin,
                               SharedMemoryRegistry* shared_memory)
    : batcher_(batcher),
      metrics_(metrics),
      codec_(std::move(codec)),
      model_info_(std::move(model_info)),
      max_stream_in_flight_(std::max(1, max_stream_in_flight)),
      sample_threads_(sample_threads),
      sample_poll_spin_(sample_poll_spin),
      shared_memory_(shared_memory),
      parse_pool_(parse_threads) {}

SamplerService::~SamplerService() {
  StopSampleThreads();
  // Server::Stop destroys the service after gRPC's shutdown has ended every
  // stream. Taking mu_ orders this thread after the last StreamDone (gRPC
  // makes that hand-off in code ThreadSanitizer cannot see).
  absl::MutexLock lock(&mu_);
}

void SamplerService::AddCompletionQueues(grpc::ServerBuilder* builder) {
  for (int i = 0; i < sample_threads_; ++i) {
    auto queue = std::make_unique<SampleQueue>();
    queue->cq = builder->AddCompletionQueue();
    sample_queues_.push_back(std::move(queue));
  }
}

void SamplerService::StartSampleThreads() {
  for (const std::unique_ptr<SampleQueue>& queue : sample_queues_) {
    ListenForSample(queue.get());
    queue->thread =
        std::thread([this, q = queue.get()] { PollSampleQueue(q); });
  }
}

void SamplerService::StopSampleThreads() {
  if (sample_threads_stopped_) return;
  sample_threads_stopped_ = true;
  for (const std::unique_ptr<SampleQueue>& queue : sample_queues_) {
    {
      absl::MutexLock lock(&queue->mu);
      queue->shut_down = true;
    }
    queue->cq->Shutdown();
  }
  for (const std::unique_ptr<SampleQueue>& queue : sample_queues_) {
    if (queue->thread.joinable()) {
      queue->thread.join();
    } else {
      PollSampleQueue(queue.get());  // never started: drains it here
    }
  }
}

void SamplerService::ListenForSample(SampleQueue* queue) {
  absl::MutexLock lock(&queue->mu);
  if (queue->shut_down) return;
  auto* call = new UnarySampleCall();
  using Event = UnarySampleCall::Event;
  call->context()->AsyncNotifyWhenDone(call->tag(Event::kDone));
  RequestSample(call->context(), call->request(), call->responder(),
                queue->cq.get(), queue->cq.get(), call->tag(Event::kArrived));
}

void SamplerService::PollSampleQueue(SampleQueue* queue) {
  void* tag = nullptr;
  bool ok = false;
  // Until when this thread polls without sleeping (it holds
  // sample_queue_spinning_ until then); infinite past: it sleeps in Next().
  absl::Time spin_until = absl::InfinitePast();
  while (true) {
    grpc::CompletionQueue::NextStatus next;
    if (spin_until != absl::InfinitePast()) {
      next = queue->cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
      if (next == grpc::CompletionQueue::TIMEOUT) {
        if (absl::Now() < spin_until) continue;
        spin_until = absl::InfinitePast();
        sample_queue_spinning_.store(false, std::memory_order_release);
        continue;
      }
    } else {
      next = queue->cq->Next(&tag, &ok) ? grpc::CompletionQueue::GOT_EVENT
                                        : grpc::CompletionQueue::SHUTDOWN;
    }
    if (next == grpc::CompletionQueue::SHUTDOWN) break;
    auto* event = static_cast<UnarySampleCall::Tag*>(tag);
    UnarySampleCall* call = event->call;
    if (call->OnEvent(event->event, ok)) {
      // One call asked for at a time, and the next only once this one is in
      // the batcher or answered: gRPC gives a connection's calls to one
      // queue first and to the others only when it has none asked for, so
      // that a thread that runs a batch itself would otherwise hold the
      // calls that arrive meanwhile. Four callers of 64 rows on one
      // connection: 1,404 requests/s with 16 calls asked for ahead against
      // 2,132 on gRPC's callback API (H100); one at a time, as many as
      // there.
      const bool left_idle = HandleSample(call);
      ListenForSample(queue);
      // A batch run here that no other request arrived beside: the caller,
      // likely the only one, sends its next call about a round trip later.
      // Polled without sleeping, it is taken without a wake-up. Under load
      // another request nearly always arrives beside the batch: no spin.
      if (left_idle && sample_poll_spin_ > absl::ZeroDuration()) {
        const bool holding = spin_until != absl::InfinitePast();
        if (holding ||
            !sample_queue_spinning_.exchange(true, std::memory_order_acquire)) {
          spin_until = absl::Now() + sample_poll_spin_;
        }
      }
    }
  }
  if (spin_until != absl::InfinitePast()) {
    sample_queue_spinning_.store(false, std::memory_order_release);
  }
}

bool SamplerService::HandleSample(UnarySampleCall* call) {
  auto item = std::make_unique<QueuedSample>(call, metrics_);
  absl::Status status;
  if (!ParseWireRequest(*call->request(), &parse_pool_, item->wire())) {
    status = absl::InvalidArgumentError(kNotARequest);
  } else {
    status =
        DecodeWireRequest(*item->wire(), codec_, &parse_pool_, item->decoded());
  }
  if (status.ok()) {
    metrics_->ObserveDecode(SecondsSince(call->start()));
    Describe(*item->decoded(), call->deadline(), item.get());
    // An idle engine runs the batch right here, and Done() answers the call
    // before this returns; else a batcher thread answers it.
    bool left_idle = false;
    status = batcher_->SubmitOrRun(std::move(item), &left_idle);
    if (status.ok()) return left_idle;
  }
  metrics_->ObserveRequest(kRpcSample, status.code(),
                           SecondsSince(call->start()));
  call->Answer(status);
  return false;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>*
SamplerService::SampleStream(grpc::CallbackServerContext* context) {
  return new SampleStreamReactor(this, context);
}

grpc::ServerUnaryReactor* SamplerService::GetModelInfo(
    grpc::CallbackServerContext* context,
    const v1::GetModelInfoRequest* /*request*/, v1::ModelInfo* response) {
  const absl::Time start = absl::Now();
  *response = model_info_;
  return FinishInHandler(context, metrics_, kRpcGetModelInfo, start,
                         absl::OkStatus());
}

grpc::ServerUnaryReactor* SamplerService::RegisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::RegisterSharedMemoryRequest* request,
    v1::RegisterSharedMemoryResponse* /*response*/) {
  const absl::Time start = absl::Now();
  const absl::Status status =
      shared_memory_ == nullptr
          ? SharedMemoryOff("")
          : shared_memory_->Register(request->name(), request->key(),
                                     request->byte_size());
  return FinishInHandler(context, metrics_, kRpcRegisterSharedMemory, start,
                         status);
}

grpc::ServerUnaryReactor* SamplerService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context,
    const v1::UnregisterSharedMemoryRequest* request,
    v1::UnregisterSharedMemoryResponse* /*response*/) {
  const absl::Time start = absl::Now();
  const absl::Status status = shared_memory_ == nullptr
                                  ? SharedMemoryOff("")
                                  : shared_memory_->Unregister(request->name());
  return FinishInHandler(context, metrics_, kRpcUnregisterSharedMemory, start,
                         status);
}

void SamplerService::BeginDrain() {
  // Calls the client sent before the drain may still be inside gRPC, not yet
  // handed to a handler; when the gRPC server shuts down, its core cancels
  // them (CANCELLED, no message) instead of letting them run. The grace lets
  // them reach Sample(), where the batcher answers them UNAVAILABLE: under
  // 32 callers on 2 cores such calls took up to about 3 ms to arrive.
  absl::SleepFor(kDrainGrace);
  std::vector<SampleStreamReactor*> streams;
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    ++walkers_;
    streams.assign(streams_.begin(), streams_.end());
  }
  // Drain() is called without mu_ (it may finish the stream, and gRPC may
  // run OnDone inline); a stream that finishes meanwhile is kept alive in
  // done_streams_ until no walk is in progress.
  for (SampleStreamReactor* stream : streams) stream->Drain();
  std::vector<SampleStreamReactor*> done;
  {
    absl::MutexLock lock(&mu_);
    if (--walkers_ == 0) done.swap(done_streams_);
  }
  for (SampleStreamReactor* stream : done) delete stream;
}

bool SamplerService::RegisterStream(SampleStreamReactor* stream) {
  absl::MutexLock lock(&mu_);
  streams_.insert(stream);
  return !draining_;
}

void SamplerService::StreamDone(SampleStreamReactor* stream) {
  {
    absl::MutexLock lock(&mu_);
    streams_.erase(stream);
    if (walkers_ > 0) {
      done_streams_.push_back(stream);
      return;
    }
  }
  delete stream;
}

}  // namespace flashsampler
