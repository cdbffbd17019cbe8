// Busy polling of a gRPC completion queue, for the callers that wait for
// an answer with their core kept busy (ClientOptions::busy_poll, fs_load's
// --poll_spin): the answer is then taken without the thread's wake-up.
// Header-only; needs gRPC (fs_status links it).
#ifndef FLASHSAMPLER_COMMON_COMPLETION_QUEUE_H_
#define FLASHSAMPLER_COMMON_COMPLETION_QUEUE_H_

#include "grpc/support/time.h"
#include "grpcpp/completion_queue.h"

namespace flashsampler {

// The queue's next event, polled at a zero deadline until there is one:
// GOT_EVENT, or SHUTDOWN once the queue is shut down and drained.
inline grpc::CompletionQueue::NextStatus NextWithoutSleeping(
    grpc::CompletionQueue& queue, void** tag, bool* ok) {
  grpc::CompletionQueue::NextStatus next;
  do {
    next = queue.AsyncNext(tag, ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
  } while (next == grpc::CompletionQueue::TIMEOUT);
  return next;
}

}  // namespace flashsampler

#endif  // FLASHSAMPLER_COMMON_COMPLETION_QUEUE_H_
