// Hidden states passed by reference: POSIX shared-memory objects that callers
// on the daemon's host create, fill and register, so that a request names an
// offset in one (Tensor.shared_memory) instead of carrying the bytes through
// gRPC and the socket. The daemon maps each registered object read-only and
// copies a request's bytes out once, at decode, so that what is validated is
// what the engine gets, whatever the caller writes afterwards.
#ifndef FLASHSAMPLER_SERVICE_SERVING_SHARED_MEMORY_H_
#define FLASHSAMPLER_SERVICE_SERVING_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"

namespace flashsampler {

// Copies `bytes` bytes from `src` to `dst`; false, with nothing else done,
// when reading `src` raised SIGBUS (a mapped file shrunk under the mapping).
// Installs the process's SIGBUS handler on first use; a SIGBUS outside such a
// copy goes to the handler that was there before (the default: the process
// dies).
bool CopyUnlessSigbus(void* dst, const void* src, size_t bytes);

// FAILED_PRECONDITION for a daemon started without shared memory
// (--max_shared_memory_regions 0), prefixed "<field>: " unless `field` is
// empty (the Register/Unregister RPCs).
absl::Status SharedMemoryOff(absl::string_view field);

// Copies `rows` rows of `hidden` elements of `dtype` from a caller's mapping
// to `dst` and checks that every copied element is finite (each element in
// the register it is stored from, so bytes the caller rewrites meanwhile
// cannot slip past it).
// INVALID_ARGUMENT "hidden_states.shared_memory: must be finite, row r ...",
// or FAILED_PRECONDITION when the mapping's object shrank.
absl::Status CopyFiniteRows(DType dtype, const char* src, int rows,
                            int64_t hidden, char* dst);

// Bytes of a registered region, and what keeps them mapped.
struct SharedBytes {
  std::shared_ptr<const void> mapping;  // held while `data` is read
  const char* data = nullptr;
};

// The registered regions, by the caller's name for each. Thread-safe.
class SharedMemoryRegistry {
 public:
  // At most `max_regions` (>= 1) regions registered at once.
  explicit SharedMemoryRegistry(int max_regions);
  ~SharedMemoryRegistry();
  SharedMemoryRegistry(const SharedMemoryRegistry&) = delete;
  SharedMemoryRegistry& operator=(const SharedMemoryRegistry&) = delete;

  // Maps the first `byte_size` bytes of the object shm_open(`key`) opens
  // read-only. INVALID_ARGUMENT naming the field for an empty or overlong
  // name, a key that is not "/" and 1-254 characters without "/", a zero
  // byte_size or one beyond the object's size; NOT_FOUND when no such object
  // exists; PERMISSION_DENIED when the daemon may not read it;
  // ALREADY_EXISTS when `name` is taken; RESOURCE_EXHAUSTED at max_regions.
  absl::Status Register(const std::string& name, const std::string& key,
                        uint64_t byte_size);

  // Forgets `name`; NOT_FOUND when it is not registered. A request already
  // copying from the region finishes first (the mapping outlives it).
  absl::Status Unregister(const std::string& name);

  // The `bytes` bytes at `offset` of region `name`, mapped for as long as
  // the result's `mapping` lives (Unregister does not unmap them). `field`
  // names the reference in errors: NOT_FOUND for an unknown name,
  // INVALID_ARGUMENT when offset + bytes passes the registered size.
  absl::StatusOr<SharedBytes> Find(const std::string& name, uint64_t offset,
                                   size_t bytes, absl::string_view field) const;

  // Find, then a copy of the bytes to `out`: FAILED_PRECONDITION when the
  // object has shrunk below its registered size since.
  absl::Status Read(const std::string& name, uint64_t offset, size_t bytes,
                    absl::string_view field, char* out) const;

  int size() const;

 private:
  struct Region;

  // OK when `name` is free and a region fits; ALREADY_EXISTS or
  // RESOURCE_EXHAUSTED otherwise.
  absl::Status RoomFor(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int max_regions_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const Region>> regions_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_SHARED_MEMORY_H_
