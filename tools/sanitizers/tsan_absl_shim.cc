// ThreadSanitizer annotations for a prebuilt (uninstrumented) Abseil: defines
// absl::Mutex, absl::CondVar and absl::Notification's out-of-line members,
// forwards each to the shared library's own definition and tells TSan what
// it did, so the TSan build sees the happens-before that these objects give.
//
// Debian's libabsl_synchronization is not built with -fsanitize=thread: its
// futex-based Lock/Unlock are invisible to TSan, so every access guarded by
// an absl::Mutex (ours and gRPC's gpr_mu / grpc_core::Mutex, which wrap it)
// looks unsynchronized. This library is linked first into every binary of
// the FS_SANITIZE=thread build (tools/sanitizers/CMakeLists.txt), so its
// definitions come before the library's in the global symbol lookup: calls
// from our code, and from libgpr / libgrpc / libabsl through their PLT,
// reach them. The real function is found with dlsym(RTLD_NEXT, mangled name).
// The annotations are the ones Abseil itself emits when built with TSan
// (absl/base/internal/tsan_mutex_interface.h): __tsan_mutex_pre/post_lock and
// pre/post_unlock around each call, which also make TSan ignore the memory
// accesses inside the call (Abseil evaluates a waiter's Condition in the
// thread that unlocks).
//
// Calls inside libabsl_synchronization that bypass these entry points
// (CondVar::Wait and Mutex::Await release and retake the mutex through
// UnlockSlow / LockSlowLoop) are annotated at the outer call: an unlock
// before, a lock after. Await and CondVar::Wait* are annotated as writer-mode
// holds: a wait with the mutex held in reader mode would be reported as an
// unlock of a read-locked mutex (no code in this repository does that).

#include <dlfcn.h>
#include <link.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

#define FS_STRINGIFY_INNER(x) #x
#define FS_STRINGIFY(x) FS_STRINGIFY_INNER(x)

// The Itanium-mangled name of absl::<nested...><rest>: `nested` is e.g.
// "5Mutex4Lock" and `rest` the parameter types ("Ev"). Abseil's inline
// namespace (ABSL_OPTION_INLINE_NAMESPACE_NAME, "debian3" in Debian's
// 20220623 build) is part of every name.
std::string Mangled(bool is_const, const char* nested, const char* rest) {
  std::string name = is_const ? "_ZNK4absl" : "_ZN4absl";
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const char* ns = FS_STRINGIFY(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  name += std::to_string(std::strlen(ns)) + ns;
#endif
  return name + nested + rest;
}

// Resolves the library's definition once per entry point. A missing symbol
// means the shim and the library disagree; continuing would deadlock or
// lose every lock, so it stops the process with the name.
void* Real(std::atomic<void*>& slot, bool is_const, const char* nested,
           const char* rest) {
  void* fn = slot.load(std::memory_order_acquire);
  if (fn != nullptr) return fn;
  const std::string name = Mangled(is_const, nested, rest);
  fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "fs_tsan_absl: %s not found after the shim: %s\n",
                 name.c_str(), dlerror());
    std::abort();
  }
  slot.store(fn, std::memory_order_release);
  return fn;
}

// Declares the slot and calls the real function with the given signature.
#define FS_REAL(is_const, nested, rest, Signature)                          \
  ([]() {                                                                   \
    static std::atomic<void*> slot{nullptr};                                \
    return reinterpret_cast<Signature>(Real(slot, is_const, nested, rest)); \
  }())

// Abseil's own entry points call each other (LockWhenWithTimeout calls
// LockWhenWithDeadline, Notification's waits call LockWhen*): only the
// outermost call on a thread is annotated, the nested ones only forward.
thread_local int nesting = 0;

bool Nested() { return nesting > 0; }

template <typename Fn, typename... Args>
auto Forward(Fn fn, Args... args) {
  struct Depth {
    Depth() { ++nesting; }
    ~Depth() { --nesting; }
  } depth;
  return fn(args...);
}

constexpr unsigned kWrite = 0;
constexpr unsigned kRead = __tsan_mutex_read_lock;

// The sync object for a Notification's notified_yet_: HasBeenNotified() is
// inline (an instrumented acquire load of that atomic), so Notify releases
// into that address and the waits acquire from it.
struct NotificationLayout {
  absl::Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(absl::Notification),
              "absl::Notification's layout changed");

void* NotifiedAddress(const absl::Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n)) +
         offsetof(NotificationLayout, notified_yet);
}

// Runs `after` when the scope ends, after the return value is computed.
template <typename F>
class After {
 public:
  explicit After(F f) : f_(f) {}
  ~After() { f_(); }

 private:
  F f_;
};

// Whether `pc` lies in the main program, where all of this project's
// (instrumented) code is linked; gRPC and Abseil are shared libraries.
bool InMainProgram(const void* pc) {
  static const std::vector<std::pair<uintptr_t, uintptr_t>>* const ranges = [] {
    auto* r = new std::vector<std::pair<uintptr_t, uintptr_t>>();
    // The first object dl_iterate_phdr visits is the main program.
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) {
          auto* v =
              static_cast<std::vector<std::pair<uintptr_t, uintptr_t>>*>(out);
          for (int i = 0; i < info->dlpi_phnum; ++i) {
            const ElfW(Phdr)& ph = info->dlpi_phdr[i];
            if (ph.p_type != PT_LOAD) continue;
            const uintptr_t begin = info->dlpi_addr + ph.p_vaddr;
            v->emplace_back(begin, begin + ph.p_memsz);
          }
          return 1;
        },
        r);
    return r;
  }();
  const auto addr = reinterpret_cast<uintptr_t>(pc);
  for (const auto& [begin, end] : *ranges) {
    if (addr >= begin && addr < end) return true;
  }
  return false;
}

// A call that returns with `mu` held (flags kWrite or kRead).
template <typename Fn, typename... Args>
auto LockCall(absl::Mutex* mu, unsigned flags, Fn real, Args... args) {
  if (Nested()) return real(args...);
  __tsan_mutex_pre_lock(mu, flags);
  After post([=] { __tsan_mutex_post_lock(mu, flags, 0); });
  return Forward(real, args...);
}

// A call that releases `mu`.
template <typename Fn, typename... Args>
auto UnlockCall(absl::Mutex* mu, unsigned flags, Fn real, Args... args) {
  if (Nested()) return real(args...);
  __tsan_mutex_pre_unlock(mu, flags);
  After post([=] { __tsan_mutex_post_unlock(mu, flags); });
  return Forward(real, args...);
}

// A call that releases `mu`, waits, and retakes it (Await, CondVar::Wait).
template <typename Fn, typename... Args>
auto WaitCall(absl::Mutex* mu, Fn real, Args... args) {
  if (Nested()) return real(args...);
  __tsan_mutex_pre_unlock(mu, kWrite);
  __tsan_mutex_post_unlock(mu, kWrite);
  __tsan_mutex_pre_lock(mu, kWrite);
  After post([=] { __tsan_mutex_post_lock(mu, kWrite, 0); });
  return Forward(real, args...);
}

// A try-lock: the post annotation says whether it took the mutex.
template <typename Fn>
bool TryLockCall(absl::Mutex* mu, unsigned flags, unsigned failed_flags,
                 Fn real) {
  if (Nested()) return real(mu);
  __tsan_mutex_pre_lock(mu, flags);
  const bool ok = Forward(real, mu);
  __tsan_mutex_post_lock(mu, ok ? flags : failed_flags, 0);
  return ok;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

using Cond = const Condition&;

// TSan treats a mutex's destruction as a write to it, racing with every
// earlier lock not ordered before it. gRPC and Abseil::Status free their
// objects after a reference count (uninstrumented atomics) drops to zero, so
// that order is invisible and each destruction of their mutexes would be
// reported: only mutexes destroyed by this project's code are annotated.
// The others keep their TSan state until their memory is freed.
Mutex::~Mutex() {
  const auto real = FS_REAL(false, "5Mutex", "D2Ev", void (*)(Mutex*));
  if (!Nested() && InMainProgram(__builtin_return_address(0))) {
    __tsan_mutex_destroy(this, 0);
  }
  real(this);
}

void Mutex::Lock() {
  LockCall(this, kWrite, FS_REAL(false, "5Mutex4Lock", "Ev", void (*)(Mutex*)),
           this);
}

void Mutex::ReaderLock() {
  LockCall(this, kRead,
           FS_REAL(false, "5Mutex10ReaderLock", "Ev", void (*)(Mutex*)), this);
}

bool Mutex::TryLock() {
  return TryLockCall(this, __tsan_mutex_try_lock, __tsan_mutex_try_lock_failed,
                     FS_REAL(false, "5Mutex7TryLock", "Ev", bool (*)(Mutex*)));
}

bool Mutex::ReaderTryLock() {
  return TryLockCall(
      this, __tsan_mutex_try_read_lock, __tsan_mutex_try_read_lock_failed,
      FS_REAL(false, "5Mutex13ReaderTryLock", "Ev", bool (*)(Mutex*)));
}

void Mutex::Unlock() {
  UnlockCall(this, kWrite,
             FS_REAL(false, "5Mutex6Unlock", "Ev", void (*)(Mutex*)), this);
}

void Mutex::ReaderUnlock() {
  UnlockCall(this, kRead,
             FS_REAL(false, "5Mutex12ReaderUnlock", "Ev", void (*)(Mutex*)),
             this);
}

// LockWhen*: every variant returns with the mutex held, timed out or not.
void Mutex::LockWhen(Cond cond) {
  LockCall(this, kWrite,
           FS_REAL(false, "5Mutex8LockWhen", "ERKNS0_9ConditionE",
                   void (*)(Mutex*, const Condition*)),
           this, &cond);
}

bool Mutex::LockWhenWithTimeout(Cond cond, Duration timeout) {
  return LockCall(this, kWrite,
                  FS_REAL(false, "5Mutex19LockWhenWithTimeout",
                          "ERKNS0_9ConditionENS0_8DurationE",
                          bool (*)(Mutex*, const Condition*, Duration)),
                  this, &cond, timeout);
}

bool Mutex::LockWhenWithDeadline(Cond cond, Time deadline) {
  return LockCall(this, kWrite,
                  FS_REAL(false, "5Mutex20LockWhenWithDeadline",
                          "ERKNS0_9ConditionENS0_4TimeE",
                          bool (*)(Mutex*, const Condition*, Time)),
                  this, &cond, deadline);
}

void Mutex::ReaderLockWhen(Cond cond) {
  LockCall(this, kRead,
           FS_REAL(false, "5Mutex14ReaderLockWhen", "ERKNS0_9ConditionE",
                   void (*)(Mutex*, const Condition*)),
           this, &cond);
}

bool Mutex::ReaderLockWhenWithTimeout(Cond cond, Duration timeout) {
  return LockCall(this, kRead,
                  FS_REAL(false, "5Mutex25ReaderLockWhenWithTimeout",
                          "ERKNS0_9ConditionENS0_8DurationE",
                          bool (*)(Mutex*, const Condition*, Duration)),
                  this, &cond, timeout);
}

bool Mutex::ReaderLockWhenWithDeadline(Cond cond, Time deadline) {
  return LockCall(this, kRead,
                  FS_REAL(false, "5Mutex26ReaderLockWhenWithDeadline",
                          "ERKNS0_9ConditionENS0_4TimeE",
                          bool (*)(Mutex*, const Condition*, Time)),
                  this, &cond, deadline);
}

void Mutex::Await(Cond cond) {
  WaitCall(this,
           FS_REAL(false, "5Mutex5Await", "ERKNS0_9ConditionE",
                   void (*)(Mutex*, const Condition*)),
           this, &cond);
}

bool Mutex::AwaitWithTimeout(Cond cond, Duration timeout) {
  return WaitCall(this,
                  FS_REAL(false, "5Mutex16AwaitWithTimeout",
                          "ERKNS0_9ConditionENS0_8DurationE",
                          bool (*)(Mutex*, const Condition*, Duration)),
                  this, &cond, timeout);
}

bool Mutex::AwaitWithDeadline(Cond cond, Time deadline) {
  return WaitCall(this,
                  FS_REAL(false, "5Mutex17AwaitWithDeadline",
                          "ERKNS0_9ConditionENS0_4TimeE",
                          bool (*)(Mutex*, const Condition*, Time)),
                  this, &cond, deadline);
}

void CondVar::Wait(Mutex* mu) {
  WaitCall(mu,
           FS_REAL(false, "7CondVar4Wait", "EPNS0_5MutexE",
                   void (*)(CondVar*, Mutex*)),
           this, mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  return WaitCall(
      mu,
      FS_REAL(false, "7CondVar15WaitWithTimeout", "EPNS0_5MutexENS0_8DurationE",
              bool (*)(CondVar*, Mutex*, Duration)),
      this, mu, timeout);
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  return WaitCall(
      mu,
      FS_REAL(false, "7CondVar16WaitWithDeadline", "EPNS0_5MutexENS0_4TimeE",
              bool (*)(CondVar*, Mutex*, Time)),
      this, mu, deadline);
}

// Notification's waits return through an acquire load of notified_yet_ when
// Notify has already run (no mutex taken), in uninstrumented code: the
// happens-before is carried by the release/acquire pair below.
void Notification::Notify() {
  __tsan_release(NotifiedAddress(this));
  FS_REAL(false, "12Notification6Notify", "Ev", void (*)(Notification*))(this);
}

void Notification::WaitForNotification() const {
  FS_REAL(true, "12Notification19WaitForNotification", "Ev",
          void (*)(const Notification*))
  (this);
  __tsan_acquire(NotifiedAddress(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  const bool notified = FS_REAL(
      true, "12Notification30WaitForNotificationWithTimeout", "ENS0_8DurationE",
      bool (*)(const Notification*, Duration))(this, timeout);
  if (notified) __tsan_acquire(NotifiedAddress(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  const bool notified = FS_REAL(
      true, "12Notification31WaitForNotificationWithDeadline", "ENS0_4TimeE",
      bool (*)(const Notification*, Time))(this, deadline);
  if (notified) __tsan_acquire(NotifiedAddress(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
