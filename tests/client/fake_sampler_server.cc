// Scripted Sampler server for the client tests (see the header).
#include "tests/client/fake_sampler_server.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "grpcpp/health_check_service_interface.h"

namespace flashsampler {
namespace {

std::string ReadTestFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace

int32_t FakeToken(int server_id, int64_t row, int sample) {
  return static_cast<int32_t>(server_id * 1000 + row * 16 + sample);
}

std::vector<absl::Time> FakeSamplerService::arrivals() const {
  absl::MutexLock lock(&mu_);
  return arrivals_;
}

std::set<std::string> FakeSamplerService::peers() const {
  absl::MutexLock lock(&mu_);
  return peers_;
}

grpc::Status FakeSamplerService::Sample(grpc::ServerContext* context,
                                        const v1::SampleRequest* request,
                                        v1::SampleResponse* response) {
  {
    absl::MutexLock lock(&mu_);
    arrivals_.push_back(absl::Now());
    peers_.insert(context->peer());
  }
  const int call = ++calls_;
  const int every = fail_every_.load();
  if (call <= fail_first_.load() || (every > 0 && call % every == 0)) {
    return grpc::Status(fail_code_.load(),
                        "scripted failure " + std::to_string(call));
  }
  // Stall in small steps so that a client giving up frees the handler (and
  // server shutdown) right away.
  const absl::Time until = absl::Now() + delay_;
  while (absl::Now() < until) {
    if (context->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client gave up");
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  const auto& shape = request->hidden_states().shape();
  if (shape.size() != 2 || shape[1] != kHidden) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "hidden_states.shape: expected [B, 8]");
  }
  const int64_t rows = shape[0];
  const int n = request->params().has_n() ? request->params().n() : 1;
  response->set_request_id(request->request_id());
  response->set_n(n);
  for (int64_t row = 0; row < rows; ++row) {
    for (int j = 0; j < n; ++j) {
      response->add_token_ids(FakeToken(server_id_, row, j));
    }
    response->add_seeds(request->seeds().empty()
                            ? static_cast<uint64_t>(7000 + row)
                            : request->seeds(static_cast<int>(row)));
  }
  if (truncate_tokens_ && response->token_ids_size() > 0) {
    response->mutable_token_ids()->RemoveLast();
  }
  response->mutable_timing()->set_batch_rows(static_cast<int32_t>(rows));
  return grpc::Status::OK;
}

grpc::Status FakeSamplerService::SampleStream(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::SampleResponse, v1::SampleRequest>* stream) {
  ++streams_;
  v1::SampleRequest request;
  while (stream->Read(&request)) {
    v1::SampleResponse response;
    const grpc::Status status = Sample(context, &request, &response);
    if (!status.ok()) {
      response.Clear();
      response.set_request_id(request.request_id());
      response.mutable_error()->set_code(status.error_code());
      response.mutable_error()->set_message(status.error_message());
    }
    if (!stream->Write(response)) break;
  }
  return grpc::Status::OK;
}

grpc::Status FakeSamplerService::GetModelInfo(
    grpc::ServerContext* /*context*/,
    const v1::GetModelInfoRequest* /*request*/, v1::ModelInfo* info) {
  info->set_vocab_size(kVocab);
  info->set_hidden_size(kHidden);
  info->set_weight_dtype(v1::DTYPE_BF16);
  info->set_backend("fake");
  info->set_tp_degree(1);
  info->set_max_batch_rows(64);
  info->set_version("fake-" + std::to_string(server_id_));
  return grpc::Status::OK;
}

std::unique_ptr<FakeSamplerServer> FakeSamplerServer::Start(int server_id) {
  return StartWith(server_id, grpc::InsecureServerCredentials());
}

std::unique_ptr<FakeSamplerServer> FakeSamplerServer::StartTls(
    const std::string& testdata_dir, bool require_client_cert) {
  grpc::SslServerCredentialsOptions ssl(
      require_client_cert
          ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
          : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  ssl.pem_key_cert_pairs.push_back(
      {ReadTestFile(testdata_dir + "/server.key"),
       ReadTestFile(testdata_dir + "/server.pem")});
  if (require_client_cert) {
    ssl.pem_root_certs = ReadTestFile(testdata_dir + "/ca.pem");
  }
  return StartWith(0, grpc::SslServerCredentials(ssl));
}

std::unique_ptr<FakeSamplerServer> FakeSamplerServer::StartWith(
    int server_id, std::shared_ptr<grpc::ServerCredentials> credentials) {
  grpc::EnableDefaultHealthCheckService(true);
  std::unique_ptr<FakeSamplerServer> fake(new FakeSamplerServer(server_id));
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &fake->port_);
  builder.RegisterService(&fake->service_);
  fake->server_ = builder.BuildAndStart();
  if (fake->server_ == nullptr || fake->port_ == 0) return nullptr;
  fake->server_->GetHealthCheckService()->SetServingStatus(true);
  return fake;
}

FakeSamplerServer::~FakeSamplerServer() {
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::seconds(1));
  }
}

}  // namespace flashsampler
