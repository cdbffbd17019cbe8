// SharedMemoryRegion: shm_open + ftruncate + mmap, and shm_unlink at the end.
#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flashsampler {

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    const std::string& key, size_t byte_size, mode_t mode) {
  if (byte_size == 0) {
    return absl::InvalidArgumentError("byte_size: must be > 0");
  }
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("shm_open(\"", key, "\")"));
  }
  // shm_open's mode passes through the umask; the daemon may be another
  // user, so the mode asked for is set as given.
  if (fchmod(fd, mode) != 0 ||
      ftruncate(fd, static_cast<off_t>(byte_size)) != 0) {
    const int error = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ErrnoToStatus(
        error, absl::StrCat("sizing \"", key, "\" to ", byte_size, " bytes"));
  }
  void* data =
      mmap(nullptr, byte_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ErrnoToStatus(error, absl::StrCat("mmap of \"", key, "\""));
  }
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(key, static_cast<char*>(data), byte_size));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(data_, size_);
  shm_unlink(key_.c_str());
}

absl::Status MoveHiddenStatesToSharedMemory(SharedMemoryRegion& region,
                                            const std::string& name,
                                            uint64_t offset,
                                            v1::SampleRequest* request) {
  v1::Tensor* tensor = request->mutable_hidden_states();
  const std::string& bytes = tensor->data();
  if (offset > region.size() || bytes.size() > region.size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden states of ", bytes.size(), " bytes at offset ", offset,
        " do not fit \"", region.key(), "\" (", region.size(), " bytes)"));
  }
  std::memcpy(region.data() + offset, bytes.data(), bytes.size());
  tensor->clear_data();
  tensor->mutable_shared_memory()->set_region(name);
  tensor->mutable_shared_memory()->set_offset(offset);
  return absl::OkStatus();
}

}  // namespace flashsampler
