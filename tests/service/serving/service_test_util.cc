// Implementation of the service test helpers (see the header).
#include "tests/service/serving/service_test_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"

extern char** environ;

namespace flashsampler::testing {

void FakeState::CloseGate() {
  absl::MutexLock lock(&mu_);
  gate_open_ = false;
}

void FakeState::OpenGate() {
  absl::MutexLock lock(&mu_);
  gate_open_ = true;
}

bool FakeState::WaitForWaiting(int n, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]()
                    ABSL_SHARED_LOCKS_REQUIRED(mu_) { return waiting_ >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

void FakeState::FailNext(absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_next_ = std::move(status);
}

void FakeState::FailRowsWithSeed(uint64_t seed) {
  absl::MutexLock lock(&mu_);
  failing_seed_ = seed;
}

void FakeState::SetDelay(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  delay_ = delay;
}

void FakeState::Reset() {
  absl::MutexLock lock(&mu_);
  launches_ = 0;
  seeds_.clear();
  batch_rows_.clear();
}

int FakeState::rows_at_gate() const {
  absl::MutexLock lock(&mu_);
  return rows_at_gate_;
}

int FakeState::launches() const {
  absl::MutexLock lock(&mu_);
  return launches_;
}

std::vector<uint64_t> FakeState::seeds_computed() const {
  absl::MutexLock lock(&mu_);
  return seeds_;
}

std::vector<int> FakeState::batch_rows() const {
  absl::MutexLock lock(&mu_);
  return batch_rows_;
}

int32_t FakeToken(float h0, uint64_t seed, uint64_t step, int j,
                  int64_t vocab) {
  const uint64_t mixed = seed * 31u + step * 7u +
                         static_cast<uint64_t>(j) * 13u +
                         static_cast<uint64_t>(std::llround(h0 * 1000.0f));
  return static_cast<int32_t>(mixed % static_cast<uint64_t>(vocab));
}

FakeEngine::FakeEngine(std::shared_ptr<FakeState> state,
                       const FakeEngineOptions& options)
    : state_(std::move(state)), slots_(options.slots) {
  info_.backend = "fake";
  info_.vocab_size = options.vocab_size;
  info_.hidden_size = options.hidden_size;
  info_.weight_dtype = DType::kFp32;
  info_.input_dtype = DType::kFp32;
  info_.max_batch_rows = options.max_batch_rows;
  info_.shards.push_back({0, -1, 0, options.vocab_size});
  info_.supported_controls =
      options.all_controls ? AllSamplingControls() : options.supported_controls;
  inputs_.resize(slots_);
  for (auto& input : inputs_) {
    input.resize(static_cast<size_t>(options.max_batch_rows) *
                 options.hidden_size);
  }
}

absl::Status FakeEngine::Sample(const BatchView& batch,
                                std::vector<RowResult>* results) {
  absl::Duration delay;
  std::optional<uint64_t> failing_seed;
  {
    absl::MutexLock lock(&state_->mu_);
    // A slot's input buffer belongs to one batch at a time.
    if (!state_->busy_slots_.insert(batch.slot).second) {
      return absl::InternalError(
          absl::StrCat("slot ", batch.slot, " used by two batches at once"));
    }
  }
  absl::Cleanup free_slot = [this, slot = batch.slot] {
    absl::MutexLock lock(&state_->mu_);
    state_->busy_slots_.erase(slot);
  };
  {
    absl::MutexLock lock(&state_->mu_);
    ++state_->waiting_;
    state_->rows_at_gate_ += batch.rows;
    state_->mu_.Await(absl::Condition(&state_->gate_open_));
    --state_->waiting_;
    state_->rows_at_gate_ -= batch.rows;
    delay = state_->delay_;
    failing_seed = state_->failing_seed_;
    if (!state_->fail_next_.ok()) {
      absl::Status status = std::move(state_->fail_next_);
      state_->fail_next_ = absl::OkStatus();
      return status;
    }
    ++state_->launches_;
    state_->batch_rows_.push_back(batch.rows);
    for (int r = 0; r < batch.rows; ++r) {
      state_->seeds_.push_back(batch.specs[r].seed);
    }
  }
  if (delay > absl::ZeroDuration()) absl::SleepFor(delay);
  const float* input = inputs_[batch.slot].data();
  results->assign(batch.rows, RowResult());
  for (int r = 0; r < batch.rows; ++r) {
    const RowSpec& spec = batch.specs[r];
    const SamplingParams& params = *spec.params;
    RowResult& out = (*results)[r];
    if (failing_seed == spec.seed) {
      out.error = "every token is masked";
      continue;
    }
    const float h0 = input[r * info_.hidden_size];
    for (int j = 0; j < params.n; ++j) {
      out.token_ids.push_back(
          FakeToken(h0, spec.seed, spec.step, j, info_.vocab_size));
      if (params.logprobs.sampled) out.sampled_logprobs.push_back(-1.0f);
      if (params.logprobs.rank) out.sampled_ranks.push_back(1 + j);
    }
    out.logsumexp = 0.5f;
    for (int t = 0; t < params.logprobs.top_n; ++t) {
      out.top_token_ids.push_back(t);
      out.top_logprobs.push_back(-1.0f - t);
    }
  }
  return absl::OkStatus();
}

ServerOptions TestServerOptions() {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_port = 0;
  options.metrics_address = "127.0.0.1";
  options.warmup_rows = 1;
  options.drain_timeout = absl::Seconds(10);
  return options;
}

absl::StatusOr<FakeServer> StartFakeServer(const ServerOptions& options,
                                           const FakeEngineOptions& engine) {
  FakeServer fake;
  fake.state = std::make_shared<FakeState>();
  auto server = Server::CreateWithEngine(
      options, std::make_unique<FakeEngine>(fake.state, engine), nullptr,
      "fake");
  if (!server.ok()) return server.status();
  fake.server = *std::move(server);
  if (absl::Status s = fake.server->Start(); !s.ok()) return s;
  fake.state->Reset();  // forget the warm-up batch
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  fake.channel =
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", fake.server->port()),
                                grpc::InsecureChannelCredentials(), args);
  fake.stub = v1::Sampler::NewStub(fake.channel);
  fake.health = grpc::health::v1::Health::NewStub(fake.channel);
  return fake;
}

v1::SampleRequest MakeRequest(int rows, int64_t hidden, uint64_t seed0,
                              float first) {
  v1::SampleRequest request;
  v1::Tensor* tensor = request.mutable_hidden_states();
  tensor->set_dtype(v1::DTYPE_FP32);
  tensor->add_shape(rows);
  tensor->add_shape(hidden);
  std::vector<float> values(static_cast<size_t>(rows) * hidden);
  for (int r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < hidden; ++d) {
      values[r * hidden + d] = first + r + d / 64.0f;
    }
  }
  tensor->set_data(values.data(), values.size() * sizeof(float));
  if (seed0 != 0) {
    for (int r = 0; r < rows; ++r) request.add_seeds(seed0 + r);
  }
  return request;
}

std::vector<int32_t> ExpectedFakeTokens(const v1::SampleRequest& request,
                                        int64_t vocab) {
  const int rows = static_cast<int>(request.hidden_states().shape(0));
  const int64_t hidden = request.hidden_states().shape(1);
  const auto* values =
      reinterpret_cast<const float*>(request.hidden_states().data().data());
  std::vector<int32_t> tokens;
  for (int r = 0; r < rows; ++r) {
    const v1::SamplingParams& p = request.row_params_size() != 0
                                      ? request.row_params(r)
                                      : request.params();
    const int n = p.has_n() ? p.n() : 1;
    const uint64_t step = request.steps_size() != 0 ? request.steps(r) : 0;
    for (int j = 0; j < n; ++j) {
      tokens.push_back(
          FakeToken(values[r * hidden], request.seeds(r), step, j, vocab));
    }
  }
  return tokens;
}

std::vector<MalformedCase> MalformedCases(int64_t vocab, int64_t hidden,
                                          int max_rows) {
  std::vector<MalformedCase> cases;
  const v1::SampleRequest base = MakeRequest(2, hidden, 1);
  auto add = [&](std::string name, std::string field,
                 const std::function<void(v1::SampleRequest*)>& mutate) {
    MalformedCase c{std::move(name), base, std::move(field)};
    mutate(&c.request);
    cases.push_back(std::move(c));
  };
  auto set_value = [hidden](v1::SampleRequest* r, int row, float value) {
    std::string* data = r->mutable_hidden_states()->mutable_data();
    std::memcpy(&(*data)[(row * hidden + 1) * sizeof(float)], &value,
                sizeof(float));
  };
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();

  add("missing_hidden_states", "hidden_states",
      [](v1::SampleRequest* r) { r->clear_hidden_states(); });
  add("unspecified_dtype", "hidden_states.dtype", [](v1::SampleRequest* r) {
    r->mutable_hidden_states()->set_dtype(v1::DTYPE_UNSPECIFIED);
  });
  add("unknown_dtype", "hidden_states.dtype", [](v1::SampleRequest* r) {
    r->mutable_hidden_states()->set_dtype(static_cast<v1::DType>(9));
  });
  add("shape_rank_1", "hidden_states.shape", [](v1::SampleRequest* r) {
    r->mutable_hidden_states()->clear_shape();
    r->mutable_hidden_states()->add_shape(2);
  });
  add("shape_rank_3", "hidden_states.shape",
      [](v1::SampleRequest* r) { r->mutable_hidden_states()->add_shape(1); });
  add("wrong_hidden_size", "hidden_states.shape[1]",
      [hidden](v1::SampleRequest* r) {
        r->mutable_hidden_states()->set_shape(1, hidden + 1);
      });
  add("empty_batch", "hidden_states.shape[0]", [](v1::SampleRequest* r) {
    r->mutable_hidden_states()->set_shape(0, 0);
    r->mutable_hidden_states()->clear_data();
    r->clear_seeds();
  });
  add("too_many_rows", "hidden_states.shape[0]",
      [hidden, max_rows](v1::SampleRequest* r) {
        *r = MakeRequest(max_rows + 1, hidden, 0);
      });
  add("byte_length_short", "hidden_states.data", [](v1::SampleRequest* r) {
    r->mutable_hidden_states()->mutable_data()->resize(
        r->hidden_states().data().size() - 4);
  });
  add("byte_length_for_other_dtype", "hidden_states.data",
      [](v1::SampleRequest* r) {
        r->mutable_hidden_states()->set_dtype(v1::DTYPE_BF16);
      });
  add("nan_hidden_state", "hidden_states.data",
      [&](v1::SampleRequest* r) { set_value(r, 1, nan); });
  add("inf_hidden_state", "hidden_states.data",
      [&](v1::SampleRequest* r) { set_value(r, 0, -inf); });
  add("temperature_negative", "params.temperature", [](v1::SampleRequest* r) {
    r->mutable_params()->set_temperature(-0.5f);
  });
  add("temperature_nan", "params.temperature", [nan](v1::SampleRequest* r) {
    r->mutable_params()->set_temperature(nan);
  });
  add("top_k_negative", "params.top_k",
      [](v1::SampleRequest* r) { r->mutable_params()->set_top_k(-2); });
  add("top_p_zero", "params.top_p",
      [](v1::SampleRequest* r) { r->mutable_params()->set_top_p(0.0f); });
  add("top_p_above_one", "params.top_p",
      [](v1::SampleRequest* r) { r->mutable_params()->set_top_p(1.5f); });
  add("min_p_above_one", "params.min_p",
      [](v1::SampleRequest* r) { r->mutable_params()->set_min_p(1.01f); });
  add("repetition_penalty_zero", "params.repetition_penalty",
      [](v1::SampleRequest* r) {
        r->mutable_params()->set_repetition_penalty(0.0f);
      });
  add("presence_penalty_inf", "params.presence_penalty",
      [inf](v1::SampleRequest* r) {
        r->mutable_params()->set_presence_penalty(inf);
      });
  add("frequency_penalty_nan", "params.frequency_penalty",
      [nan](v1::SampleRequest* r) {
        r->mutable_params()->set_frequency_penalty(nan);
      });
  add("logit_bias_token_ge_vocab", "params.logit_bias[0].token_id",
      [vocab](v1::SampleRequest* r) {
        v1::TokenBias* b = r->mutable_params()->add_logit_bias();
        b->set_token_id(static_cast<int32_t>(vocab));
        b->set_bias(1.0f);
      });
  add("logit_bias_not_finite", "params.logit_bias[1].bias",
      [inf](v1::SampleRequest* r) {
        r->mutable_params()->add_logit_bias()->set_token_id(1);
        v1::TokenBias* b = r->mutable_params()->add_logit_bias();
        b->set_token_id(2);
        b->set_bias(inf);
      });
  add("banned_token_negative", "params.banned_token_ids[0]",
      [](v1::SampleRequest* r) {
        r->mutable_params()->add_banned_token_ids(-3);
      });
  add("prompt_token_ge_vocab", "params.prompt_token_ids[1]",
      [vocab](v1::SampleRequest* r) {
        r->mutable_params()->add_prompt_token_ids(0);
        r->mutable_params()->add_prompt_token_ids(
            static_cast<int32_t>(vocab + 5));
      });
  add("output_count_token_ge_vocab", "params.output_token_counts[0].token_id",
      [vocab](v1::SampleRequest* r) {
        v1::TokenCount* c = r->mutable_params()->add_output_token_counts();
        c->set_token_id(static_cast<int32_t>(vocab));
        c->set_count(1);
      });
  add("output_count_zero", "params.output_token_counts[0].count",
      [](v1::SampleRequest* r) {
        v1::TokenCount* c = r->mutable_params()->add_output_token_counts();
        c->set_token_id(3);
        c->set_count(0);
      });
  add("bitmask_wrong_size", "params.allowed_token_bitmask",
      [vocab](v1::SampleRequest* r) {
        for (int64_t w = 0; w < (vocab + 31) / 32 + 1; ++w) {
          r->mutable_params()->add_allowed_token_bitmask(-1);
        }
      });
  add("bitmask_allows_nothing", "params.allowed_token_bitmask",
      [vocab](v1::SampleRequest* r) {
        for (int64_t w = 0; w < (vocab + 31) / 32; ++w) {
          r->mutable_params()->add_allowed_token_bitmask(0);
        }
      });
  const std::string words_as_bytes(static_cast<size_t>(4 * ((vocab + 31) / 32)),
                                   '\xff');
  add("bitmask_bytes_wrong_size", "params.allowed_token_bitmask_bytes",
      [words_as_bytes](v1::SampleRequest* r) {
        r->mutable_params()->set_allowed_token_bitmask_bytes(words_as_bytes +
                                                             "\xff");
      });
  add("bitmask_bytes_allows_nothing", "params.allowed_token_bitmask_bytes",
      [words_as_bytes](v1::SampleRequest* r) {
        r->mutable_params()->set_allowed_token_bitmask_bytes(
            std::string(words_as_bytes.size(), '\0'));
      });
  add("bitmask_in_both_fields", "params.allowed_token_bitmask_bytes",
      [vocab, words_as_bytes](v1::SampleRequest* r) {
        for (int64_t w = 0; w < (vocab + 31) / 32; ++w) {
          r->mutable_params()->add_allowed_token_bitmask(-1);
        }
        r->mutable_params()->set_allowed_token_bitmask_bytes(words_as_bytes);
      });
  add("row_bitmask_bytes_short", "row_params[1].allowed_token_bitmask_bytes",
      [words_as_bytes](v1::SampleRequest* r) {
        r->add_row_params();
        r->add_row_params()->set_allowed_token_bitmask_bytes(
            words_as_bytes.substr(1));
      });
  add("n_zero", "params.n",
      [](v1::SampleRequest* r) { r->mutable_params()->set_n(0); });
  add("n_too_large", "params.n",
      [](v1::SampleRequest* r) { r->mutable_params()->set_n(17); });
  add("n_differs_across_rows", "row_params[1].n", [](v1::SampleRequest* r) {
    r->add_row_params()->set_n(2);
    r->add_row_params()->set_n(3);
  });
  add("row_params_wrong_length", "row_params",
      [](v1::SampleRequest* r) { r->add_row_params(); });
  add("row_params_bad_temperature", "row_params[1].temperature",
      [](v1::SampleRequest* r) {
        r->add_row_params();
        r->add_row_params()->set_temperature(-1.0f);
      });
  add("seeds_wrong_length", "seeds",
      [](v1::SampleRequest* r) { r->add_seeds(99); });
  add("steps_wrong_length", "steps",
      [](v1::SampleRequest* r) { r->add_steps(1); });
  add("top_logprobs_negative", "params.logprobs.top_logprobs",
      [](v1::SampleRequest* r) {
        r->mutable_params()->mutable_logprobs()->set_top_logprobs(-1);
      });
  add("top_logprobs_too_large", "params.logprobs.top_logprobs",
      [](v1::SampleRequest* r) {
        r->mutable_params()->mutable_logprobs()->set_top_logprobs(21);
      });
  add("logprob_space_unknown", "params.logprobs.space",
      [](v1::SampleRequest* r) {
        r->mutable_params()->mutable_logprobs()->set_space(
            static_cast<v1::LogprobOptions::Space>(7));
      });
  return cases;
}

grpc::health::v1::HealthCheckResponse::ServingStatus CheckHealth(
    grpc::health::v1::Health::Stub* stub, const std::string& service) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  if (!stub->Check(&context, request, &response).ok()) {
    return grpc::health::v1::HealthCheckResponse::UNKNOWN;
  }
  return response.status();
}

std::unique_ptr<AsyncSample> SampleAsync(v1::Sampler::Stub* stub,
                                         const v1::SampleRequest& request,
                                         absl::Duration timeout) {
  auto call = std::make_unique<AsyncSample>();
  if (timeout > absl::ZeroDuration()) {
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  AsyncSample* raw = call.get();
  call->thread = std::thread([stub, request, raw] {
    raw->status = stub->Sample(&raw->context, request, &raw->response);
  });
  return call;
}

double MetricValue(const std::string& exposition, const std::string& series) {
  const std::string prefix = series + " ";
  size_t pos = 0;
  while (pos < exposition.size()) {
    size_t end = exposition.find('\n', pos);
    if (end == std::string::npos) end = exposition.size();
    if (exposition.compare(pos, prefix.size(), prefix) == 0) {
      return std::strtod(exposition.c_str() + pos + prefix.size(), nullptr);
    }
    pos = end + 1;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

bool PollUntil(const std::function<bool()>& predicate, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!predicate()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

std::string ReflectionListServicesRaw(grpc::Channel* channel) {
  // ServerReflectionRequest{list_services: "*"} hand-encoded (field 7,
  // length-delimited): linking a second copy of the reflection protos next
  // to libgrpc++_reflection's would clash in the descriptor pool.
  static const grpc::internal::RpcMethod kMethod(
      "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
      grpc::internal::RpcMethod::BIDI_STREAMING);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
      stream(grpc::internal::ClientReaderWriterFactory<
             grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel, kMethod,
                                                         &context));
  const std::string request("\x3a\x01*", 3);
  grpc::Slice slice(request);
  grpc::ByteBuffer out(&slice, 1);
  if (!stream->Write(out)) return "";
  stream->WritesDone();
  grpc::ByteBuffer in;
  std::string raw;
  while (stream->Read(&in)) {
    std::vector<grpc::Slice> slices;
    if (!in.Dump(&slices).ok()) break;
    for (const grpc::Slice& s : slices) {
      raw.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  stream->Finish();
  return raw;
}

int FreeTcpPort() { return SilentTcpListener().port(); }

SilentTcpListener::SilentTcpListener() {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  if (fd_ < 0) return;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      listen(fd_, 16) == 0 &&
      getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port_ = ntohs(addr.sin_port);
  }
}

SilentTcpListener::~SilentTcpListener() {
  if (fd_ >= 0) close(fd_);
}

std::string HttpGet(int port, const std::string& path, int* status_code) {
  *status_code = 0;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1:", port,
                   "\r\nConnection: close\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, 0);
    if (n <= 0) {
      close(fd);
      return "";
    }
    sent += n;
  }
  std::string reply;
  char buffer[4096];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    reply.append(buffer, n);
  }
  close(fd);
  // "HTTP/1.x 200 OK\r\n...\r\n\r\nbody"
  const size_t space = reply.find(' ');
  if (reply.compare(0, 5, "HTTP/") != 0 || space == std::string::npos) {
    return "";
  }
  *status_code = std::atoi(reply.c_str() + space + 1);
  const size_t body = reply.find("\r\n\r\n");
  return body == std::string::npos ? "" : reply.substr(body + 4);
}

std::string UrlEncode(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "%", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log_path) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ) !=
      0) {
    pid = -1;
  }
  posix_spawn_file_actions_destroy(&actions);
  return pid;
}

bool WaitForExit(pid_t pid, absl::Duration timeout, int* exit_status) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const pid_t done = waitpid(pid, exit_status, WNOHANG);
    if (done == pid) return true;
    if (done < 0) return false;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string MakeTempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(base != nullptr ? base : "/tmp", "/fs_service_test.XXXXXX");
  if (mkdtemp(pattern.data()) == nullptr) return "";
  return pattern;
}

}  // namespace flashsampler::testing
