// The caller's side of passing hidden states by reference: a POSIX
// shared-memory object this process creates and maps read-write, and the
// request rewrite that moves a request's hidden states into it. Register the
// object with SamplerClient::RegisterSharedMemory before sending such a
// request; flashsamplerd must run on the same host with
// --max_shared_memory_regions > 0.
#ifndef FLASHSAMPLER_CLIENT_SHARED_MEMORY_H_
#define FLASHSAMPLER_CLIENT_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flashsampler/v1/sampler.pb.h"

namespace flashsampler {

class SharedMemoryRegion {
 public:
  // Creates the object shm_open(`key`) names (it must not exist yet) with
  // `mode` permissions and `byte_size` zero bytes, mapped read-write. The
  // daemon's user must be able to read it: 0600 when both run as one user.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(
      const std::string& key, size_t byte_size, mode_t mode = 0600);

  // Unmaps and unlinks the object (the daemon's mapping stays valid until
  // it unregisters the region).
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& key() const { return key_; }
  char* data() { return data_; }
  size_t size() const { return size_; }

 private:
  SharedMemoryRegion(std::string key, char* data, size_t size)
      : key_(std::move(key)), data_(data), size_(size) {}

  const std::string key_;
  char* const data_;
  const size_t size_;
};

// Copies request->hidden_states().data() to `region` at `offset`, clears it
// and sets hidden_states.shared_memory to {`name`, `offset`}: the request
// then names bytes the daemon reads from the region registered as `name`.
// InvalidArgument when the bytes do not fit the region at `offset`.
absl::Status MoveHiddenStatesToSharedMemory(SharedMemoryRegion& region,
                                            const std::string& name,
                                            uint64_t offset,
                                            v1::SampleRequest* request);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_CLIENT_SHARED_MEMORY_H_
