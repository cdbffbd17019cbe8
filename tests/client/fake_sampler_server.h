// A scripted in-process Sampler server on 127.0.0.1 for the client and load
// generator tests: it fails the first k calls with a chosen code, can stall,
// records when and on which connection each attempt arrived, and answers
// with predictable tokens.
#ifndef FLASHSAMPLER_TESTS_CLIENT_FAKE_SAMPLER_SERVER_H_
#define FLASHSAMPLER_TESTS_CLIENT_FAKE_SAMPLER_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "flashsampler/v1/sampler.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace flashsampler {

// Token of (row, sample j) in a fake response: server_id * 1000 + row * 16 + j,
// so a test can tell which server answered and that rows stay in order.
int32_t FakeToken(int server_id, int64_t row, int sample);

class FakeSamplerService final : public v1::Sampler::Service {
 public:
  explicit FakeSamplerService(int server_id) : server_id_(server_id) {}

  // The first `count` Sample calls fail with `code`.
  void FailFirst(int count, grpc::StatusCode code) {
    fail_first_ = count;
    fail_code_ = code;
  }
  // Every `every`-th Sample call (1-based) fails with `code`; 0 = never.
  void FailEvery(int every, grpc::StatusCode code) {
    fail_every_ = every;
    fail_code_ = code;
  }
  // Each Sample call waits this long (or until the client gives up).
  void set_delay(absl::Duration delay) { delay_ = delay; }
  // Answers carry one token too few (a broken server).
  void set_truncate_tokens(bool truncate) { truncate_tokens_ = truncate; }

  int calls() const { return calls_.load(); }
  std::vector<absl::Time> arrivals() const;
  // The connections (client addresses) Sample calls came on.
  std::set<std::string> peers() const;

  grpc::Status Sample(grpc::ServerContext* context,
                      const v1::SampleRequest* request,
                      v1::SampleResponse* response) override;
  // One response per request, in order, each made as Sample() makes it; a
  // request Sample() fails is answered with that failure in `error`.
  grpc::Status SampleStream(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::SampleResponse, v1::SampleRequest>* stream)
      override;
  // SampleStream calls opened so far.
  int streams() const { return streams_.load(); }
  grpc::Status GetModelInfo(grpc::ServerContext* context,
                            const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* info) override;

  static constexpr int64_t kVocab = 1000;
  static constexpr int64_t kHidden = 8;

 private:
  const int server_id_;
  std::atomic<int> calls_{0};
  std::atomic<int> streams_{0};
  std::atomic<int> fail_first_{0};
  std::atomic<int> fail_every_{0};
  std::atomic<grpc::StatusCode> fail_code_{grpc::StatusCode::UNAVAILABLE};
  absl::Duration delay_ = absl::ZeroDuration();
  std::atomic<bool> truncate_tokens_{false};
  mutable absl::Mutex mu_;
  std::vector<absl::Time> arrivals_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> peers_ ABSL_GUARDED_BY(mu_);
};

// The service plus a running server with grpc.health.v1 (SERVING).
class FakeSamplerServer {
 public:
  // Plaintext on 127.0.0.1:<free port>.
  static std::unique_ptr<FakeSamplerServer> Start(int server_id = 0);
  // TLS with the test certificates; `require_client_cert` = mutual TLS.
  static std::unique_ptr<FakeSamplerServer> StartTls(
      const std::string& testdata_dir, bool require_client_cert);
  ~FakeSamplerServer();

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  FakeSamplerService& service() { return service_; }
  grpc::Server& server() { return *server_; }

 private:
  explicit FakeSamplerServer(int server_id) : service_(server_id) {}
  static std::unique_ptr<FakeSamplerServer> StartWith(
      int server_id, std::shared_ptr<grpc::ServerCredentials> credentials);

  FakeSamplerService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_CLIENT_FAKE_SAMPLER_SERVER_H_
