// Shared pieces of the service tests: a scriptable fake engine (gate, delay,
// injected errors, a record of every row it computed), a fake-engine server
// on a loopback port, request builders, the table of malformed requests, a
// grpc.health.v1 client, a minimal HTTP GET and child-process helpers.
#ifndef FLASHSAMPLER_TESTS_SERVICE_SERVING_SERVICE_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_SERVICE_SERVING_SERVICE_TEST_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flashsampler/v1/sampler.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "service/backends/engine.h"
#include "service/serving/server.h"
#include "service/serving/server_options.h"

namespace flashsampler::testing {

// State shared by a FakeEngine and the test, alive after the server (and
// with it the engine) is gone.
class FakeState {
 public:
  // While closed, Sample() blocks at the gate (counted in waiting()).
  void CloseGate();
  void OpenGate();
  // Blocks until `n` Sample() calls wait at the gate, or `timeout`.
  bool WaitForWaiting(int n, absl::Duration timeout);
  // The next Sample() call returns `status` without computing.
  void FailNext(absl::Status status);
  void SetDelay(absl::Duration delay);
  // Rows with this seed fail alone (RowResult::error), as a row whose every
  // token is masked does on a real backend.
  void FailRowsWithSeed(uint64_t seed);
  // Forgets launches and computed seeds (e.g. after warm-up).
  void Reset();

  int launches() const;
  // Rows of the Sample() calls now waiting at the gate.
  int rows_at_gate() const;
  std::vector<uint64_t> seeds_computed() const;
  std::vector<int> batch_rows() const;

 private:
  friend class FakeEngine;
  mutable absl::Mutex mu_;
  bool gate_open_ ABSL_GUARDED_BY(mu_) = true;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  int rows_at_gate_ ABSL_GUARDED_BY(mu_) = 0;
  int launches_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status fail_next_ ABSL_GUARDED_BY(mu_);
  absl::Duration delay_ ABSL_GUARDED_BY(mu_);
  std::optional<uint64_t> failing_seed_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> seeds_ ABSL_GUARDED_BY(mu_);
  std::vector<int> batch_rows_ ABSL_GUARDED_BY(mu_);
  std::set<int> busy_slots_ ABSL_GUARDED_BY(mu_);  // slots inside Sample()
};

struct FakeEngineOptions {
  int64_t vocab_size = 1000;
  int64_t hidden_size = 16;
  int max_batch_rows = 256;
  int slots = 1;
  // Controls the fake claims to implement (default: all).
  std::vector<std::string> supported_controls;
  bool all_controls = true;
};

// Token j of a row: a fixed function of the row's first hidden value, its
// seed, step and j, so tests know every row's answer without an engine.
int32_t FakeToken(float h0, uint64_t seed, uint64_t step, int j, int64_t vocab);

class FakeEngine final : public Engine {
 public:
  FakeEngine(std::shared_ptr<FakeState> state,
             const FakeEngineOptions& options);
  const EngineInfo& info() const override { return info_; }
  int max_slots() const override { return slots_; }
  void* slot_input(int slot) override { return inputs_[slot].data(); }
  absl::Status Sample(const BatchView& batch,
                      std::vector<RowResult>* results) override;

 private:
  std::shared_ptr<FakeState> state_;
  EngineInfo info_;
  int slots_;
  std::vector<std::vector<float>> inputs_;
};

// Server options for tests: loopback, any free port, no metrics endpoint,
// a one-row warm-up, a short drain.
ServerOptions TestServerOptions();

// A started server on a FakeEngine, with a client channel and stubs.
struct FakeServer {
  std::shared_ptr<FakeState> state;
  std::unique_ptr<Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Sampler::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
};
absl::StatusOr<FakeServer> StartFakeServer(
    const ServerOptions& options = TestServerOptions(),
    const FakeEngineOptions& engine = FakeEngineOptions());

// A valid fp32 request of `rows` rows: h[r][d] = first + r + d / 64, seeds
// seed0 + r (no seeds when seed0 == 0).
v1::SampleRequest MakeRequest(int rows, int64_t hidden, uint64_t seed0,
                              float first = 0.0f);
// What the fake engine answers for `request` (n samples per row).
std::vector<int32_t> ExpectedFakeTokens(const v1::SampleRequest& request,
                                        int64_t vocab);

// One malformed request and the field its error must name.
struct MalformedCase {
  std::string name;
  v1::SampleRequest request;
  std::string field;  // the message must start with "<field>: "
};
// At least 30 distinct violations of docs/api.md's rules for a model with
// V = vocab, D = hidden, max_batch_rows = max_rows, n <= 16, top <= 20.
std::vector<MalformedCase> MalformedCases(int64_t vocab, int64_t hidden,
                                          int max_rows);

// grpc.health.v1 Check; UNKNOWN on an RPC error.
grpc::health::v1::HealthCheckResponse::ServingStatus CheckHealth(
    grpc::health::v1::Health::Stub* stub, const std::string& service = "");

// A unary Sample() running on its own thread; Join() before reading.
struct AsyncSample {
  grpc::ClientContext context;
  v1::SampleResponse response;
  grpc::Status status;
  std::thread thread;
  void Join() {
    if (thread.joinable()) thread.join();
  }
  ~AsyncSample() { Join(); }
};
// Starts `request` on `stub`; a `timeout` > 0 sets the call's deadline.
std::unique_ptr<AsyncSample> SampleAsync(
    v1::Sampler::Stub* stub, const v1::SampleRequest& request,
    absl::Duration timeout = absl::ZeroDuration());

// The value of one sample line ("name{labels} value") of a Prometheus text
// exposition; NaN when absent. `series` is the text before the value.
double MetricValue(const std::string& exposition, const std::string& series);
// Polls `predicate` every 5 ms until it holds or `timeout` passes.
bool PollUntil(const std::function<bool()>& predicate, absl::Duration timeout);

// Reflection: the service names ServerReflectionInfo list_services returns,
// as the raw serialized response (tests look for names in it).
std::string ReflectionListServicesRaw(grpc::Channel* channel);

// A free TCP port on 127.0.0.1 (a SilentTcpListener's, released; fine for
// tests).
int FreeTcpPort();

// A TCP listener on 127.0.0.1 whose connections the kernel accepts and no
// one ever answers: a call to it can only run out of time.
class SilentTcpListener {
 public:
  SilentTcpListener();
  ~SilentTcpListener();
  SilentTcpListener(const SilentTcpListener&) = delete;
  SilentTcpListener& operator=(const SilentTcpListener&) = delete;

  int port() const { return port_; }  // 0 when the socket could not listen

 private:
  int fd_ = -1;
  int port_ = 0;
};
// GET http://127.0.0.1:<port><path> over a plain socket (HTTP/1.0). Returns
// the body; *status_code gets the HTTP status (0 when no answer).
std::string HttpGet(int port, const std::string& path, int* status_code);
std::string UrlEncode(const std::string& text);

// A child process with stdout+stderr going to `log_path`.
pid_t Spawn(const std::vector<std::string>& argv, const std::string& log_path);
// Waits up to `timeout` for `pid`; true with *exit_status (waitpid's) if it
// exited, false if it still runs.
bool WaitForExit(pid_t pid, absl::Duration timeout, int* exit_status);
std::string ReadFileOrEmpty(const std::string& path);
// A fresh directory under $TMPDIR (or /tmp).
std::string MakeTempDir();

}  // namespace flashsampler::testing

#endif  // FLASHSAMPLER_TESTS_SERVICE_SERVING_SERVICE_TEST_UTIL_H_
