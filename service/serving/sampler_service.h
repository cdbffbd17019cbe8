// flashsampler.v1.Sampler. Unary Sample is served on gRPC's async API, by
// sample_threads threads that each poll their own completion queue; the
// other methods on gRPC's callback API. Handlers validate the request (a
// large row_params with the parse pool's help), hand it to the batcher and
// return; batcher threads finish the calls, except that unary Sample runs its
// batch on the polling thread when the engine is idle and fast
// (Batcher::SubmitOrRun: at most one such batch, of under about a
// millisecond, holds a polling thread at a time). SampleStream answers one
// response per request, in order, with at most max_stream_in_flight requests
// of a stream in flight. Sample and SampleStream take raw bytes and parse
// them here: gRPC's typed handlers answer an unparsable unary request
// UNIMPLEMENTED with no message and end a stream OK at an unparsable message,
// dropping it unanswered.
#ifndef FLASHSAMPLER_SERVICE_SERVING_SAMPLER_SERVICE_H_
#define FLASHSAMPLER_SERVICE_SERVING_SAMPLER_SERVICE_H_

#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/thread_pool.h"
#include "flashsampler/v1/sampler.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_builder.h"
#include "service/serving/batcher.h"
#include "service/serving/metrics.h"
#include "service/serving/request_codec.h"
#include "service/serving/shared_memory.h"

namespace flashsampler {

class SampleStreamReactor;
class UnarySampleCall;

// Sample as a raw (ByteBuffer) async method, SampleStream as a raw callback
// method, the others typed callback methods.
using SamplerServiceBase = v1::Sampler::WithRawMethod_Sample<
    v1::Sampler::WithRawCallbackMethod_SampleStream<
        v1::Sampler::WithCallbackMethod_GetModelInfo<
            v1::Sampler::WithCallbackMethod_RegisterSharedMemory<
                v1::Sampler::WithCallbackMethod_UnregisterSharedMemory<
                    v1::Sampler::Service>>>>>;

class SamplerService final : public SamplerServiceBase {
 public:
  // `batcher`, `metrics` and `shared_memory` (null: the daemon serves no
  // shared memory) must outlive the service. `model_info` is what
  // GetModelInfo returns.
  // `parse_threads` help handlers parse large row_params (Sample and
  // SampleStream; ServerOptions::parse_threads). `sample_threads` poll the
  // completion queues of unary Sample (ServerOptions::sample_threads), one of
  // them at a time polling without sleeping for `sample_poll_spin` after it
  // ran a batch itself and left the engine idle
  // (ServerOptions::sample_poll_spin).
  SamplerService(Batcher* batcher, Metrics* metrics, CodecConfig codec,
                 v1::ModelInfo model_info, int max_stream_in_flight,
                 int parse_threads, int sample_threads,
                 absl::Duration sample_poll_spin,
                 SharedMemoryRegistry* shared_memory = nullptr);
  ~SamplerService() override;  // StopSampleThreads()

  // Unary Sample's lifecycle around the gRPC server's:
  //   AddCompletionQueues(&builder) before builder.BuildAndStart();
  //   StartSampleThreads() once the server has started;
  //   StopSampleThreads() once the server has shut down and the batcher has
  //   stopped (no call can be answered any more); it drains the queues and
  //   joins the threads. Also right after a failed BuildAndStart().
  // A request that does not parse is INVALID_ARGUMENT "request is not a
  // valid flashsampler.v1.SampleRequest", counted like any other answer.
  void AddCompletionQueues(grpc::ServerBuilder* builder);
  void StartSampleThreads();
  void StopSampleThreads();
  // A message that does not parse ends the stream with INVALID_ARGUMENT
  // naming it ("frame N", 0-based) once every earlier request is answered.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* SampleStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context,
      const v1::RegisterSharedMemoryRequest* request,
      v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context,
      const v1::UnregisterSharedMemoryRequest* request,
      v1::UnregisterSharedMemoryResponse* response) override;

  // Drain: waits a short grace so that calls already sent reach their
  // handlers (and the batcher's UNAVAILABLE) before gRPC shuts down; then
  // open streams stop reading, answer what they accepted and end with
  // UNAVAILABLE; streams opened later end at once. Unary calls are refused by
  // the batcher (Batcher::StopAccepting), not here.
  void BeginDrain();

 private:
  friend class SampleStreamReactor;

  // One completion queue of unary Sample and the thread that polls it.
  struct SampleQueue {
    std::unique_ptr<grpc::ServerCompletionQueue> cq;
    std::thread thread;
    // Held while asking the queue for a call, so that no call is asked for
    // on a queue that has been shut down (gRPC aborts on that).
    absl::Mutex mu;
    bool shut_down ABSL_GUARDED_BY(mu) = false;
  };

  // Asks `queue` for the next unary Sample call (no-op once shut down).
  void ListenForSample(SampleQueue* queue);
  // A call that arrived: decodes it and hands it to the batcher, or answers
  // it at once. True when its batch ran on this thread and no other request
  // arrived meanwhile (Batcher::SubmitOrRun's left_idle).
  bool HandleSample(UnarySampleCall* call);
  // The polling thread: one queue's events until it is shut down and empty.
  void PollSampleQueue(SampleQueue* queue);

  // Streams register while open so BeginDrain() can reach them; returns
  // false when draining has begun (the stream must end at once).
  bool RegisterStream(SampleStreamReactor* stream);
  // From the stream's OnDone: unregisters and deletes it (deferred while
  // BeginDrain() walks the streams).
  void StreamDone(SampleStreamReactor* stream);

  Batcher* const batcher_;
  Metrics* const metrics_;
  const CodecConfig codec_;
  const v1::ModelInfo model_info_;
  const int max_stream_in_flight_;
  const int sample_threads_;
  const absl::Duration sample_poll_spin_;
  // Set while a Sample thread polls without sleeping: at most one does.
  std::atomic<bool> sample_queue_spinning_{false};
  SharedMemoryRegistry* const shared_memory_;
  ThreadPool parse_pool_;
  std::vector<std::unique_ptr<SampleQueue>> sample_queues_;
  bool sample_threads_stopped_ = false;

  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  std::set<SampleStreamReactor*> streams_ ABSL_GUARDED_BY(mu_);
  int walkers_ ABSL_GUARDED_BY(mu_) = 0;  // BeginDrain() calls in progress
  std::vector<SampleStreamReactor*> done_streams_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_SAMPLER_SERVICE_H_
