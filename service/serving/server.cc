// Server: backend selection, warm-up, gRPC and metrics wiring, and the
// drain sequence documented in server.h.
#include "service/serving/server.h"

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype_convert.h"
#include "common/proto_dtype.h"
#include "common/status_macros.h"
#include "common/status_util.h"
#include "flashsampler/version.h"
#include "grpc/support/log.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "service/backends/cpu/cpu_engine.h"
#include "service/serving/request_codec.h"
#ifdef FS_HAVE_CUDA_BACKEND
#include "service/backends/cuda/cuda_engine.h"
#endif

namespace flashsampler {

namespace {

constexpr char kServiceName[] = "flashsampler.v1.Sampler";
// Bounds --max_shared_memory_regions: each region is a mapping and a map
// entry, and a caller needs one or a few.
constexpr int kMaxSharedMemoryRegions = 65536;
// ServerOptions::sample_threads' bound: far above any host's cores.
constexpr int kMaxSampleThreads = 256;
// ServerOptions::sample_poll_spin's bound: a spin is for the gap between a
// caller's answer and its next call, not for an idle daemon.
constexpr absl::Duration kMaxSamplePollSpin = absl::Milliseconds(10);

// A TLS file's contents, or an error naming the flag, the path and what is
// wrong (missing, a directory, unreadable, empty).
absl::StatusOr<std::string> ReadTlsFile(const std::string& flag,
                                        const std::string& path) {
  std::error_code error;
  const std::filesystem::file_status status =
      std::filesystem::status(path, error);
  if (!std::filesystem::exists(status)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" does not exist"));
  }
  if (std::filesystem::is_directory(status)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" is a directory, not a PEM file"));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  if (in) contents << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read \"", path, "\""));
  }
  if (contents.str().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" is empty"));
  }
  return contents.str();
}

// OpenSSL's queued errors as one line (and the queue emptied).
std::string OpenSslErrors() {
  std::string text;
  for (unsigned long e = ERR_get_error(); e != 0; e = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(e, buffer, sizeof(buffer));
    absl::StrAppend(&text, text.empty() ? "" : "; ", buffer);
  }
  return text.empty() ? "no details" : text;
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;

BioPtr MemoryBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate in a PEM bundle; an error when there is none or one of
// them does not parse.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(const std::string& flag,
                                                       const std::string& path,
                                                       const std::string& pem) {
  ERR_clear_error();
  BioPtr bio = MemoryBio(pem);
  std::vector<X509Ptr> certs;
  for (;;) {
    X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (cert == nullptr) break;
    certs.push_back(std::move(cert));
  }
  const unsigned long last = ERR_peek_last_error();
  const bool clean_end = ERR_GET_LIB(last) == ERR_LIB_PEM &&
                         ERR_GET_REASON(last) == PEM_R_NO_START_LINE;
  if (certs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path,
                     "\" holds no PEM certificate (-----BEGIN CERTIFICATE-----"
                     " block): ",
                     OpenSslErrors()));
  }
  if (last != 0 && !clean_end) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": certificate ", certs.size() + 1, " in \"", path,
                     "\" does not parse: ", OpenSslErrors()));
  }
  ERR_clear_error();
  return certs;
}

// Refuses to prompt for a passphrase: an encrypted key fails to load.
int NoPassphrase(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) {
  return -1;
}

// Parses the certificate chain, the key and the client CA bundle the way the
// TLS handshake will, so that a bad file is reported by name at start-up
// (gRPC only says that it could not listen).
absl::Status CheckTlsFiles(const TlsOptions& tls, const std::string& cert_pem,
                           const std::string& key_pem,
                           const std::string& client_ca_pem) {
  FS_ASSIGN_OR_RETURN(std::vector<X509Ptr> chain,
                      ParseCertificates("tls_cert", tls.cert_path, cert_pem));
  if (absl::StrContains(key_pem, "ENCRYPTED")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_key: \"", tls.key_path,
        "\" is encrypted with a passphrase, which the daemon cannot ask for; "
        "store it decrypted (openssl pkey -in KEY -out KEY.plain) with file "
        "permissions guarding it"));
  }
  ERR_clear_error();
  BioPtr bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("tls_key: \"", tls.key_path,
                     "\" holds no PEM private key: ", OpenSslErrors()));
  }
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_key: \"", tls.key_path,
        "\" does not match the certificate in tls_cert \"", tls.cert_path,
        "\" (the first certificate must be the one the key signs for)"));
  }
  if (!tls.client_ca_path.empty()) {
    FS_ASSIGN_OR_RETURN(
        std::vector<X509Ptr> cas,
        ParseCertificates("tls_client_ca", tls.client_ca_path, client_ca_pem));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(
    const TlsOptions& tls) {
  if (tls.cert_path.empty() && tls.key_path.empty()) {
    if (!tls.client_ca_path.empty()) {
      return absl::InvalidArgumentError(
          "tls_client_ca: mutual TLS needs tls_cert and tls_key as well");
    }
    return grpc::InsecureServerCredentials();
  }
  if (tls.cert_path.empty() || tls.key_path.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert and tls_key: TLS needs both (PEM files), got one");
  }
  grpc::SslServerCredentialsOptions ssl(
      tls.client_ca_path.empty()
          ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
          : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  FS_ASSIGN_OR_RETURN(std::string cert, ReadTlsFile("tls_cert", tls.cert_path));
  FS_ASSIGN_OR_RETURN(std::string key, ReadTlsFile("tls_key", tls.key_path));
  if (!tls.client_ca_path.empty()) {
    FS_ASSIGN_OR_RETURN(ssl.pem_root_certs,
                        ReadTlsFile("tls_client_ca", tls.client_ca_path));
  }
  FS_RETURN_IF_ERROR(CheckTlsFiles(tls, cert, key, ssl.pem_root_certs));
  ssl.pem_key_cert_pairs.push_back({std::move(key), std::move(cert)});
  return grpc::SslServerCredentials(ssl);
}

std::atomic<bool> g_listener_failed{false};

// gRPC's log, forwarded to stderr in gRPC's own format, with the one line
// that says the listener closed for good (see Server::ListenerHealth).
void WatchGrpcLog(gpr_log_func_args* args) {
  if (args->severity == GPR_LOG_SEVERITY_ERROR &&
      absl::StrContains(args->message, "Failed accept4")) {
    g_listener_failed.store(true);
  }
  std::fprintf(stderr, "%s %s:%d] %s\n",
               gpr_log_severity_string(args->severity), args->file, args->line,
               args->message);
}

int ToMillis(absl::Duration d) {
  return static_cast<int>(
      std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
}

// SHA-256 of W's bytes, lowercase hex, for ModelInfo and the startup log.
// One pass over weights that are read anyway: OpenSSL hashes 1.8 GB/s on an
// x86 core with the SHA extensions (`openssl speed -evp sha256`), 0.7 s for
// a 151936 x 4096 bf16 head.
std::string WeightsSha256(const Weights& weights) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(static_cast<const unsigned char*>(weights.data()),
         weights.size_bytes(), digest);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * SHA256_DIGEST_LENGTH);
  for (unsigned char byte : digest) {
    hex.push_back(kHex[byte >> 4]);
    hex.push_back(kHex[byte & 0xf]);
  }
  return hex;
}

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(
    const ServerOptions& options, std::shared_ptr<const Weights> weights) {
  std::string backend = options.backend;
  if (backend == "auto") {
#ifdef FS_HAVE_CUDA_BACKEND
    backend = CudaDeviceCount() > 0 ? "cuda" : "cpu";
#else
    backend = "cpu";
#endif
  }
  if (backend == "cpu") {
    CpuEngineOptions cpu;
    cpu.sampler.threads = options.cpu_threads;
    cpu.sampler.chunk_rows = options.cpu_chunk_rows;
    cpu.max_batch_rows = options.batcher.max_batch_rows;
    cpu.slots = options.cpu_slots;
    FS_ASSIGN_OR_RETURN(auto engine, CpuEngine::Create(*weights, cpu));
    return std::unique_ptr<Engine>(std::move(engine));
  }
  if (backend == "cuda") {
#ifdef FS_HAVE_CUDA_BACKEND
    const int visible = CudaDeviceCount();
    if (visible == 0) {
      return absl::UnavailableError(
          "backend: \"cuda\" asked for, but no CUDA device is visible");
    }
    const int tp = options.tp == 0 ? visible : options.tp;
    if (tp < 1 || tp > visible) {
      return absl::InvalidArgumentError(
          absl::StrCat("tp: must be in [1, ", visible, "] (visible GPUs), got ",
                       options.tp));
    }
    CudaEngineOptions cuda;
    for (int d = 0; d < tp; ++d) cuda.devices.push_back(d);
    cuda.max_batch_rows = options.batcher.max_batch_rows;
    cuda.slots = options.cuda_slots;
    cuda.replay_graphs = options.cuda_graphs;
    if (options.tp_transport == "auto") {
      cuda.tp_transport = CudaTpTransport::kAuto;
    } else if (options.tp_transport == "nccl") {
      cuda.tp_transport = CudaTpTransport::kNcclDevice;
    } else if (options.tp_transport == "peer") {
      cuda.tp_transport = CudaTpTransport::kCudaPeer;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("tp_transport: must be auto, nccl or peer, got \"",
                       options.tp_transport, "\""));
    }
    FS_ASSIGN_OR_RETURN(auto engine,
                        CreateCudaEngine(std::move(weights), cuda));
    return std::unique_ptr<Engine>(std::move(engine));
#else
    return absl::InvalidArgumentError(
        "backend: \"cuda\" asked for, but this build has no CUDA backend");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "backend: must be auto, cpu or cuda, got \"", options.backend, "\""));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Create(
    const ServerOptions& options) {
  if (options.weights.source.empty()) {
    return absl::InvalidArgumentError(
        "weights: none given. Serve a checkpoint "
        "(--weights=/models/lm_head.safetensors, an index.json or a "
        "directory) or ask for synthetic weights by name, e.g. "
        "--weights=synthetic:vocab=32000,hidden=512,seed=1");
  }
  Prepared prepared;
  prepared.metrics = std::make_unique<Metrics>();
  prepared.metrics->SetLoadProgress(0.0);
  if (options.metrics_port != 0) {
    FS_ASSIGN_OR_RETURN(prepared.metrics_http,
                        ServeMetrics(options, prepared.metrics.get()));
  }
  FS_ASSIGN_OR_RETURN(std::unique_ptr<Weights> loaded,
                      Weights::Load(options.weights));
  std::shared_ptr<const Weights> weights(std::move(loaded));
  prepared.weights_tensor = weights->tensor_name();
  prepared.weights_sha256 = WeightsSha256(*weights);
  prepared.metrics->SetLoadProgress(0.5);
  FS_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                      CreateEngine(options, weights));
  prepared.metrics->SetLoadProgress(0.75);
  const std::string source = weights->source();
  return CreateImpl(options, std::move(engine), std::move(weights), source,
                    std::move(prepared));
}

absl::StatusOr<std::unique_ptr<Server>> Server::CreateWithEngine(
    const ServerOptions& options, std::unique_ptr<Engine> engine,
    std::shared_ptr<const Weights> weights, std::string weights_source) {
  Prepared prepared;
  prepared.metrics = std::make_unique<Metrics>();
  if (weights != nullptr) {
    prepared.weights_tensor = weights->tensor_name();
    prepared.weights_sha256 = WeightsSha256(*weights);
  }
  return CreateImpl(options, std::move(engine), std::move(weights),
                    std::move(weights_source), std::move(prepared));
}

absl::StatusOr<std::unique_ptr<Server>> Server::CreateImpl(
    const ServerOptions& options, std::unique_ptr<Engine> engine,
    std::shared_ptr<const Weights> weights, std::string weights_source,
    Prepared prepared) {
  if (engine == nullptr) return absl::InvalidArgumentError("engine: null");
  if (engine->max_slots() < 1) {
    return absl::InvalidArgumentError("engine: max_slots() must be >= 1");
  }
  if (options.batcher.max_batch_rows < 1 ||
      options.batcher.max_queue_rows < 1) {
    return absl::InvalidArgumentError(
        "max_batch_rows and max_queue_rows: must be >= 1");
  }
  if (options.batcher.overlap_min_rows < 0) {
    return absl::InvalidArgumentError("overlap_min_rows: must be >= 0");
  }
  if (options.max_shared_memory_regions < 0 ||
      options.max_shared_memory_regions > kMaxSharedMemoryRegions) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_shared_memory_regions: must be in [0, ", kMaxSharedMemoryRegions,
        "], got ", options.max_shared_memory_regions));
  }
  if (options.sample_threads < 1 ||
      options.sample_threads > kMaxSampleThreads) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample_threads: must be in [1, ", kMaxSampleThreads,
                     "], got ", options.sample_threads));
  }
  if (options.sample_poll_spin < absl::ZeroDuration() ||
      options.sample_poll_spin > kMaxSamplePollSpin) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample_poll_spin: must be in [0, ",
                     absl::FormatDuration(kMaxSamplePollSpin), "], got ",
                     absl::FormatDuration(options.sample_poll_spin)));
  }
  if (options.unix_socket.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unix_socket: the path must be shorter than ",
                     sizeof(sockaddr_un::sun_path), " bytes, got ",
                     options.unix_socket.size()));
  }
  return std::unique_ptr<Server>(
      new Server(options, std::move(weights), std::move(engine),
                 std::move(weights_source), std::move(prepared)));
}

Server::Server(const ServerOptions& options,
               std::shared_ptr<const Weights> weights,
               std::unique_ptr<Engine> engine, std::string weights_source,
               Prepared prepared)
    : options_(options),
      weights_source_(std::move(weights_source)),
      info_(engine->info()),
      metrics_(std::move(prepared.metrics)),
      metrics_http_(std::move(prepared.metrics_http)),
      weights_(std::move(weights)),
      engine_(std::move(engine)) {
  const EngineInfo& info = info_;
  if (metrics_http_ != nullptr) metrics_port_ = metrics_http_->port();
  batcher_ = std::make_unique<Batcher>(
      engine_.get(), options_.batcher, metrics_.get(),
      [this](const absl::Status& status) { OnFatal(status); });

  CodecConfig codec;
  codec.vocab_size = info.vocab_size;
  codec.hidden_size = info.hidden_size;
  codec.max_batch_rows = batcher_->max_batch_rows();
  codec.input_dtype = info.input_dtype;
  codec.limits = options_.limits;
  codec.backend = info.backend;
  codec.supported_controls = info.supported_controls;
  codec.rows_checked_when_copied = true;  // the batcher's CopyFinitePieces
  if (options_.max_shared_memory_regions > 0) {
    shared_memory_ = std::make_unique<SharedMemoryRegistry>(
        options_.max_shared_memory_regions);
    codec.shared_memory = shared_memory_.get();
  }

  v1::ModelInfo& model = model_;
  model.set_vocab_size(info.vocab_size);
  model.set_hidden_size(info.hidden_size);
  model.set_weight_dtype(ToProtoDType(info.weight_dtype));
  model.set_backend(info.backend);
  model.set_tp_degree(static_cast<int>(info.shards.size()));
  for (const ShardInfo& shard : info.shards) {
    v1::ShardRange* range = model.add_shards();
    range->set_rank(shard.rank);
    range->set_device(shard.device);
    range->set_vocab_begin(shard.vocab_begin);
    range->set_vocab_end(shard.vocab_end);
  }
  model.set_max_batch_rows(batcher_->max_batch_rows());
  model.set_version(kVersion);
  model.set_git_revision(kGitRevision);
  model.set_weights_source(weights_source_);
  model.set_weights_tensor(prepared.weights_tensor);
  model.set_weights_sha256(prepared.weights_sha256);
  model.set_max_shared_memory_regions(options_.max_shared_memory_regions);
  for (const std::string& control : info.supported_controls) {
    model.add_supported_features(control);
  }
  service_ = std::make_unique<SamplerService>(
      batcher_.get(), metrics_.get(), std::move(codec), model_,
      options_.max_stream_in_flight, options_.parse_threads,
      options_.sample_threads, options_.sample_poll_spin, shared_memory_.get());

  metrics_->SetWeightsInfo(info.vocab_size, info.hidden_size,
                           DTypeName(info.weight_dtype),
                           static_cast<int>(info.shards.size()), info.backend);
  for (const ShardInfo& shard : info.shards) {
    if (shard.device < 0) continue;  // CPU backend: no device memory
    metrics_->SetDeviceMemoryBytes(shard.device,
                                   static_cast<double>(shard.device_bytes));
  }

  // The largest legal request: B = max rows of fp32 hidden states, plus per
  // row an allowed-token bitmask (ceil(V/32) int32 words, up to 10 bytes each
  // as varints, 4 as allowed_token_bitmask_bytes) and a little framing; plus 4
  // MiB for token lists (bias, banned, prompt, counts), which have no fixed
  // bound.
  const int64_t rows = batcher_->max_batch_rows();
  const int64_t per_row =
      info.hidden_size * 4 + ((info.vocab_size + 31) / 32) * 10 + 256;
  max_receive_bytes_ = static_cast<int>(
      std::min<int64_t>(rows * per_row + (4 << 20), INT32_MAX));
}

Server::~Server() { Stop(); }

absl::Status Server::ListenerHealth() {
  if (!g_listener_failed.load()) return absl::OkStatus();
  return absl::UnavailableError(
      "gRPC stopped accepting connections (accept4 failed, most likely out of "
      "file descriptors: raise the container's nofile limit)");
}

bool Server::serving() const {
  absl::MutexLock lock(&health_mu_);
  return serving_;
}

absl::Status Server::WarmUp() {
  // One batch per slot so every slot's buffers and (on GPUs) kernels are
  // touched before the first request; zero hidden states with the default
  // controls are always valid.
  const EngineInfo& info = engine_->info();
  const int rows =
      std::max(1, std::min(options_.warmup_rows, batcher_->max_batch_rows()));
  const SamplingParams params;
  std::vector<RowSpec> specs(rows);
  for (int r = 0; r < rows; ++r) {
    specs[r].params = &params;
    specs[r].seed = static_cast<uint64_t>(r);
  }
  std::vector<float> zeros(static_cast<size_t>(rows) * info.hidden_size, 0.0f);
  for (int slot = 0; slot < engine_->max_slots(); ++slot) {
    ConvertDType(DType::kFp32, zeros.data(), zeros.size(), info.input_dtype,
                 engine_->slot_input(slot));
    BatchView view;
    view.slot = slot;
    view.rows = rows;
    view.specs = specs.data();
    std::vector<RowResult> results;
    absl::Status status = engine_->Sample(view, &results);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("warm-up batch on slot ", slot,
                                       " failed: ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Server::ServeMetrics(
    const ServerOptions& options, Metrics* metrics) {
  MetricsHttpOptions http;
  http.address = options.metrics_address;
  http.port = options.metrics_port;
  return MetricsHttpServer::Start(
      http, [metrics] { return metrics->TextExposition(); });
}

absl::Status Server::StartMetrics() {
  if (options_.metrics_port == 0 || metrics_http_ != nullptr) {
    return absl::OkStatus();
  }
  FS_ASSIGN_OR_RETURN(metrics_http_, ServeMetrics(options_, metrics_.get()));
  metrics_port_ = metrics_http_->port();
  return absl::OkStatus();
}

namespace {

// True when a process accepts connections on the Unix socket at `path`.
// gRPC removes a socket file it finds at the path before binding, which
// would silently take the path over from a daemon still serving on it. The
// probe does not block: a listener whose backlog is full (EAGAIN) is alive.
// Two daemons started at the same instant can both pass it; the second
// bind then wins the path.
bool UnixSocketInUse(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  path.copy(address.sun_path, sizeof(address.sun_path) - 1);
  const bool alive = connect(fd, reinterpret_cast<const sockaddr*>(&address),
                             sizeof(address)) == 0 ||
                     errno == EAGAIN || errno == EINPROGRESS;
  close(fd);
  return alive;
}

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Server>> Server::StartGrpc() {
  static std::once_flag once;
  std::call_once(once, [] {
    gpr_set_log_function(WatchGrpcLog);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  });
  FS_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                      MakeCredentials(options_.tls));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options_.listen_address, credentials, &port_);
  int unix_bound = 0;  // gRPC reports 1 for a bound Unix socket
  if (!options_.unix_socket.empty()) {
    if (UnixSocketInUse(options_.unix_socket)) {
      return absl::UnavailableError(
          absl::StrCat("unix_socket: ", options_.unix_socket,
                       " is in use by another process"));
    }
    builder.AddListeningPort(absl::StrCat("unix:", options_.unix_socket),
                             credentials, &unix_bound);
  }
  builder.RegisterService(service_.get());
  service_->AddCompletionQueues(&builder);
  builder.SetMaxReceiveMessageSize(max_receive_bytes_);
  // Without this, Linux gRPC sets SO_REUSEPORT and a second daemon on the
  // same port would silently share it instead of failing.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  const KeepaliveOptions& keepalive = options_.keepalive;
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             ToMillis(keepalive.time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             ToMillis(keepalive.timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             keepalive.permit_without_calls ? 1 : 0);
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
      ToMillis(keepalive.min_client_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // gRPC binds the ports in the order added and fails the whole build at
  // the first that does not bind, leaving the later ones at 0.
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  const bool unix_failed = !options_.unix_socket.empty() && unix_bound == 0;
  if (server != nullptr && port_ != 0 && !unix_failed) {
    service_->StartSampleThreads();
    return server;
  }
  if (server != nullptr) server->Shutdown();
  service_->StopSampleThreads();
  if (port_ != 0 && unix_failed) {
    port_ = 0;  // nothing listens
    return absl::UnavailableError(absl::StrCat(
        "unix_socket: cannot listen on ", options_.unix_socket,
        " (no such directory, not writable, or a file that is not a socket)"));
  }
  return absl::UnavailableError(
      absl::StrCat("listen_address: cannot listen on ", options_.listen_address,
                   " (in use, or not a valid address)"));
}

absl::Status Server::Start() {
  {
    absl::MutexLock lock(&health_mu_);
    if (started_ || stopped_) {
      return absl::FailedPreconditionError("Server::Start: called twice");
    }
    started_ = true;
  }
  FS_RETURN_IF_ERROR(WarmUp());
  metrics_->SetLoadProgress(1.0);
  batcher_->Start();
  if (absl::Status s = StartMetrics(); !s.ok()) {
    batcher_->Stop();
    return s;
  }
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartGrpc();
  if (!server.ok()) {
    batcher_->Stop();
    metrics_http_.reset();
    return server.status();
  }
  absl::MutexLock lock(&health_mu_);
  grpc_server_ = *std::move(server);
  SetServing(!fatal_);
  return absl::OkStatus();
}

void Server::SetServing(bool serving) {
  serving_ = serving;
  metrics_->SetServingState(serving    ? ServingState::kServing
                            : stopped_ ? ServingState::kDraining
                                       : ServingState::kNotServing);
  if (grpc_server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health =
      grpc_server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

void Server::OnFatal(const absl::Status& /*status*/) {
  // The batcher already fails every call with UNAVAILABLE; health tells the
  // orchestrator to restart or route around this replica.
  absl::MutexLock lock(&health_mu_);
  fatal_ = true;
  SetServing(false);
}

void Server::Stop() {
  absl::MutexLock stop_lock(&stop_mu_);
  {
    absl::MutexLock lock(&health_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  const absl::Time deadline = absl::Now() + options_.drain_timeout;
  // Refuse new work before health says NOT_SERVING, so that a caller who
  // sees NOT_SERVING is refused too; in the other order a call could slip
  // in between and wait behind the drain.
  batcher_->StopAccepting();  // 1
  service_->BeginDrain();
  {
    absl::MutexLock lock(&health_mu_);
    SetServing(false);  // 2
  }
  batcher_->WaitIdle(deadline);  // 3
  grpc::Server* server;
  {
    absl::MutexLock lock(&health_mu_);
    server = grpc_server_.get();
  }
  // Not under health_mu_: Shutdown waits for calls that batcher threads
  // finish, and a batcher thread may need health_mu_ (OnFatal).
  if (server != nullptr) server->Shutdown(absl::ToChronoTime(deadline));  // 4
  batcher_->Stop();                                                       // 5
  // Only now: a batcher thread may answer a unary call until Stop() joins it,
  // and an answer needs its completion queue.
  if (service_ != nullptr) service_->StopSampleThreads();
  metrics_http_.reset();  // 6
  {
    absl::MutexLock lock(&health_mu_);
    grpc_server_.reset();
  }
  service_.reset();
  batcher_.reset();
  engine_.reset();
  weights_.reset();
}

}  // namespace flashsampler
