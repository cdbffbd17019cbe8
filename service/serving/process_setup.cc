// Why each process-wide setting, with the number that settled it
// (flashsamplerd_null_engine and fs_load on one 2-core host).
#include "service/serving/process_setup.h"

#include <malloc.h>

#include "absl/synchronization/mutex.h"

namespace flashsampler {

void SetUpServingProcess() {
  // Debian's Abseil checks every Mutex acquisition against a global lock
  // graph (deadlock detection), gRPC's own locks included. Off, a one-row
  // Sample() costs the daemon about 112 us of CPU instead of 150 us. Tests
  // keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // gRPC receives a message into many small slices; freeing a 2 MB
  // request's slices left a large free top in the thread's arena, which
  // glibc (trim threshold 128 KiB, as no block was ever mmapped) gave back
  // with madvise, and the next request faulted every page in again. Fixed at
  // the values glibc's own dynamic rule reaches at most (mmap threshold 32
  // MiB, trim at twice that), each arena keeps at most 64 MiB free: a
  // 256-row bf16 request then costs 1.13 ms of daemon CPU instead of 1.55.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
}

}  // namespace flashsampler
