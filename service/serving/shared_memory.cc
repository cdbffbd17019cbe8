// SharedMemoryRegistry and the SIGBUS-guarded copy. A caller owns its object
// and may shrink it (ftruncate) while the daemon has it mapped; a read past
// the object's new end raises SIGBUS, which would kill the daemon. Every read
// of a region is therefore one copy under a handler that turns that signal
// into a failed copy of that request alone.
#include "service/serving/shared_memory.h"

#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/dtype_convert.h"
#include "common/field_violation.h"

namespace flashsampler {

namespace {

// The jump buffer of the copy this thread is in, or null. Initial-exec TLS:
// reading it from the signal handler cannot allocate. Volatile: the compiler
// sees no read of it between the stores around the memcpy and would drop
// the first.
__attribute__((tls_model(
    "initial-exec"))) thread_local sigjmp_buf* volatile copy_in_progress =
    nullptr;

struct sigaction previous_sigbus;

void OnSigbus(int signal, siginfo_t* info, void* context) {
  if (sigjmp_buf* const jump = copy_in_progress) {
    copy_in_progress = nullptr;
    siglongjmp(*jump, 1);
  }
  // Not a guarded copy: whatever handled SIGBUS before handles it now.
  if ((previous_sigbus.sa_flags & SA_SIGINFO) != 0) {
    previous_sigbus.sa_sigaction(signal, info, context);
    return;
  }
  if (previous_sigbus.sa_handler == SIG_IGN) return;
  if (previous_sigbus.sa_handler != SIG_DFL) {
    previous_sigbus.sa_handler(signal);
    return;
  }
  // The default action: the signal, raised again, stays pending while this
  // handler runs and kills the process when it returns.
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(SIGBUS, &fallback, nullptr);
  raise(SIGBUS);
}

void InstallSigbusHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

// shm_open's portable names: "/" then 1-254 characters, none of them "/".
bool IsShmKey(const std::string& key) {
  return key.size() >= 2 && key.size() <= 255 && key[0] == '/' &&
         key.find('/', 1) == std::string::npos;
}

constexpr size_t kMaxNameBytes = 256;

absl::Status Shrunk(absl::string_view field) {
  return absl::FailedPreconditionError(
      absl::StrCat(field,
                   ".region: the shared-memory object is smaller than when "
                   "it was registered; register it again"));
}

// Rows copied under one guard: the guard's sigsetjmp saves the signal mask
// (a system call).
constexpr size_t kCheckedChunkBytes = 64 << 10;

// Runs `read` (which reads a mapping) and returns true, or returns false as
// soon as a read in it raises SIGBUS. `read` must leave nothing behind that
// a jump out of it would break (no locks, no allocations).
template <typename Read>
bool RunUnlessSigbus(const Read& read) {
  InstallSigbusHandler();
  sigjmp_buf jump;
  // Saving the signal mask lets the jump out of the handler unblock SIGBUS.
  if (sigsetjmp(jump, /*savemask=*/1) != 0) return false;
  copy_in_progress = &jump;
  read();
  copy_in_progress = nullptr;
  return true;
}

}  // namespace

absl::Status SharedMemoryOff(absl::string_view field) {
  return absl::FailedPreconditionError(absl::StrCat(
      field, field.empty() ? "" : ": ",
      "this daemon serves no shared memory (--max_shared_memory_regions is "
      "0): send hidden_states.data instead"));
}

bool CopyUnlessSigbus(void* dst, const void* src, size_t bytes) {
  return RunUnlessSigbus([&] { std::memcpy(dst, src, bytes); });
}

absl::Status CopyFiniteRows(DType dtype, const char* src, int rows,
                            int64_t hidden, char* dst) {
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
  const int chunk_rows =
      static_cast<int>(std::max<size_t>(1, kCheckedChunkBytes / row_bytes));
  for (int first = 0; first < rows; first += chunk_rows) {
    const int count = std::min(chunk_rows, rows - first);
    // Each element is checked in the register it is stored from
    // (CopyFinite): what lands in `dst` is what was checked, whatever the
    // caller writes into its object meanwhile.
    int bad = -1;
    if (!RunUnlessSigbus([&] {
          for (int r = first; r < first + count; ++r) {
            if (!CopyFinite(dtype, src + r * row_bytes,
                            static_cast<size_t>(hidden), dst + r * row_bytes)) {
              bad = r;
              return;
            }
          }
        })) {
      return Shrunk("hidden_states.shared_memory");
    }
    if (bad >= 0) {
      return NonFiniteRowError("hidden_states.shared_memory", bad);
    }
  }
  return absl::OkStatus();
}

struct SharedMemoryRegistry::Region {
  std::string key;
  const char* base = nullptr;
  uint64_t byte_size = 0;

  ~Region() {
    if (base != nullptr) munmap(const_cast<char*>(base), byte_size);
  }
};

SharedMemoryRegistry::SharedMemoryRegistry(int max_regions)
    : max_regions_(max_regions) {
  InstallSigbusHandler();
}

SharedMemoryRegistry::~SharedMemoryRegistry() = default;

absl::Status SharedMemoryRegistry::Register(const std::string& name,
                                            const std::string& key,
                                            uint64_t byte_size) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return FieldViolationError(
        "name", absl::StrCat("must hold 1 to ", kMaxNameBytes, " bytes, got ",
                             name.size()));
  }
  if (!IsShmKey(key)) {
    return FieldViolationError(
        "key", absl::StrCat("must be a shared-memory object name: \"/\" then "
                            "1 to 254 characters without \"/\", got \"",
                            key.substr(0, 300), "\""));
  }
  if (byte_size == 0) {
    return FieldViolationError("byte_size", "must be > 0");
  }
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = RoomFor(name); !s.ok()) return s;
  }

  const int fd = shm_open(key.c_str(), O_RDONLY, 0);
  if (fd < 0) {
    const int error = errno;
    const std::string what = absl::StrCat("key: shm_open(\"", key,
                                          "\") failed: ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(what);
    if (error == EACCES) return absl::PermissionDeniedError(what);
    return absl::FailedPreconditionError(what);
  }
  struct stat info {};
  if (fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("key: \"", key, "\" is not a shared-memory object"));
  }
  if (byte_size > static_cast<uint64_t>(info.st_size)) {
    close(fd);
    return FieldViolationError(
        "byte_size", absl::StrCat("must be <= the size of \"", key, "\" (",
                                  info.st_size, " bytes), got ", byte_size));
  }
  void* base = mmap(nullptr, byte_size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_error = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("key: mmap of ", byte_size, " bytes of \"", key,
                     "\" failed: ", std::strerror(map_error)));
  }
  auto region = std::make_shared<Region>();
  region->key = key;
  region->base = static_cast<const char*>(base);
  region->byte_size = byte_size;

  absl::MutexLock lock(&mu_);
  // Checked again: another call may have taken the name or the last place
  // while this one mapped (the mapping is released with `region`).
  if (absl::Status s = RoomFor(name); !s.ok()) return s;
  regions_.emplace(name, std::move(region));
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::RoomFor(const std::string& name) const {
  if (regions_.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(
        "name: shared-memory region \"", name, "\" is already registered"));
  }
  if (static_cast<int>(regions_.size()) >= max_regions_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared-memory regions: ", max_regions_,
        " registered, the most --max_shared_memory_regions allows"));
  }
  return absl::OkStatus();
}

absl::Status SharedMemoryRegistry::Unregister(const std::string& name) {
  std::shared_ptr<const Region> region;  // unmapped outside the lock
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("name: no shared-memory region \"",
                                            name, "\" is registered"));
  }
  region = std::move(it->second);
  regions_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<SharedBytes> SharedMemoryRegistry::Find(
    const std::string& name, uint64_t offset, size_t bytes,
    absl::string_view field) const {
  std::shared_ptr<const Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it != regions_.end()) region = it->second;
  }
  if (region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(field, ".region: no shared-memory region \"", name,
                     "\" is registered"));
  }
  if (offset > region->byte_size || bytes > region->byte_size - offset) {
    return FieldViolationError(
        absl::StrCat(field, ".offset"),
        absl::StrCat("offset + the tensor's ", bytes, " bytes must be <= \"",
                     name, "\"'s registered ", region->byte_size,
                     " bytes, got offset ", offset));
  }
  SharedBytes found;
  found.data = region->base + offset;
  found.mapping = std::move(region);
  return found;
}

absl::Status SharedMemoryRegistry::Read(const std::string& name,
                                        uint64_t offset, size_t bytes,
                                        absl::string_view field,
                                        char* out) const {
  absl::StatusOr<SharedBytes> found = Find(name, offset, bytes, field);
  if (!found.ok()) return found.status();
  if (!CopyUnlessSigbus(out, found->data, bytes)) return Shrunk(field);
  return absl::OkStatus();
}

int SharedMemoryRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(regions_.size());
}

}  // namespace flashsampler
