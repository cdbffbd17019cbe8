// Metric families of flashsamplerd and the /metrics HTTP endpoint. Buckets
// fit the numbers: a Sample() takes 0.1-2 ms on a GPU and 1 ms-1 s on the CPU
// backend, so latency buckets span 50 us to 10 s; batch sizes are powers of
// two up to the default max_batch_rows (256).
#include "service/serving/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/text_serializer.h"

#ifndef FS_VERSION
#define FS_VERSION "unknown"
#endif

namespace flashsampler {

namespace {

const prometheus::Histogram::BucketBoundaries& LatencyBuckets() {
  static const auto* const kBuckets =
      new prometheus::Histogram::BucketBoundaries{
          0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,    0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0};
  return *kBuckets;
}

prometheus::Histogram::BucketBoundaries RowBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double rows = 1; rows <= 256; rows *= 2) buckets.push_back(rows);
  return buckets;
}

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  request_duration_ =
      &prometheus::BuildHistogram()
           .Name("flashsampler_request_duration_seconds")
           .Help(
               "Time from receiving a request to its answer, by RPC and "
               "gRPC status code (SampleStream: per message)")
           .Register(*registry_);
  requests_ = &prometheus::BuildCounter()
                   .Name("flashsampler_requests_total")
                   .Help("Requests answered, by RPC and gRPC status code")
                   .Register(*registry_);
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("flashsampler_queue_wait_seconds")
                     .Help(
                         "Time a request waited in the batcher queue "
                         "before its batch launched")
                     .Register(*registry_)
                     .Add({}, LatencyBuckets());
  batch_execute_ = &prometheus::BuildHistogram()
                        .Name("flashsampler_batch_execute_seconds")
                        .Help(
                            "Engine time of one batch (copy in, sample, "
                            "copy out), all ranks")
                        .Register(*registry_)
                        .Add({}, LatencyBuckets());
  batch_rows_ = &prometheus::BuildHistogram()
                     .Name("flashsampler_batch_rows")
                     .Help(
                         "Rows per engine launch (rows of many requests "
                         "coalesce into one batch)")
                     .Register(*registry_)
                     .Add({}, RowBuckets());
  rows_sampled_ = &prometheus::BuildCounter()
                       .Name("flashsampler_rows_sampled_total")
                       .Help("Hidden-state rows sampled")
                       .Register(*registry_)
                       .Add({});
  queue_rows_ = &prometheus::BuildGauge()
                     .Name("flashsampler_queue_rows")
                     .Help("Rows accepted and waiting for a batch")
                     .Register(*registry_)
                     .Add({});
  batches_in_flight_ = &prometheus::BuildGauge()
                            .Name("flashsampler_batches_in_flight")
                            .Help("Batches running on the engine")
                            .Register(*registry_)
                            .Add({});
  device_memory_ = &prometheus::BuildGauge()
                        .Name("flashsampler_device_memory_bytes")
                        .Help(
                            "Device memory held for the LM-head weights "
                            "shard, by CUDA device (no series on CPU)")
                        .Register(*registry_);
  weights_info_ = &prometheus::BuildGauge()
                       .Name("flashsampler_weights_info")
                       .Help("Loaded weights and backend (value is always 1)")
                       .Register(*registry_);
  prometheus::BuildGauge()
      .Name("flashsampler_build_info")
      .Help("Build of flashsamplerd (value is always 1)")
      .Register(*registry_)
      .Add({{"version", FS_VERSION}})
      .Set(1);
  exact_fallback_ = &prometheus::BuildCounter()
                         .Name("flashsampler_exact_fallback_total")
                         .Help(
                             "Rows whose fast path could not certify "
                             "exactness and ran the exact path, by reason")
                         .Register(*registry_);
}

void Metrics::ObserveRequest(absl::string_view rpc, absl::StatusCode code,
                             double seconds) {
  const prometheus::Labels labels = {{"rpc", std::string(rpc)},
                                     {"code", absl::StatusCodeToString(code)}};
  // Family::Add returns the existing child when the labels exist already.
  request_duration_->Add(labels, LatencyBuckets()).Observe(seconds);
  requests_->Add(labels).Increment();
}

void Metrics::ObserveQueueWait(double seconds) {
  queue_wait_->Observe(seconds);
}

void Metrics::ObserveBatch(int rows, double seconds) {
  batch_execute_->Observe(seconds);
  batch_rows_->Observe(rows);
  rows_sampled_->Increment(rows);
}

void Metrics::SetQueueRows(int64_t rows) {
  queue_rows_->Set(static_cast<double>(rows));
}

void Metrics::AddBatchesInFlight(int delta) {
  batches_in_flight_->Increment(delta);
}

void Metrics::SetDeviceMemoryBytes(int device, double bytes) {
  device_memory_->Add({{"device", std::to_string(device)}}).Set(bytes);
}

void Metrics::SetWeightsInfo(int64_t vocab, int64_t hidden,
                             absl::string_view dtype, int tp,
                             absl::string_view backend) {
  weights_info_
      ->Add({{"vocab", std::to_string(vocab)},
             {"hidden", std::to_string(hidden)},
             {"dtype", std::string(dtype)},
             {"tp", std::to_string(tp)},
             {"backend", std::string(backend)}})
      .Set(1);
}

void Metrics::CountExactFallback(absl::string_view reason, double rows) {
  exact_fallback_->Add({{"reason", std::string(reason)}}).Increment(rows);
}

std::string Metrics::TextExposition() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

void Metrics::BatchRowsSumAndCount(double* sum, uint64_t* count) const {
  const prometheus::ClientMetric metric = batch_rows_->Collect();
  *sum = metric.histogram.sample_sum;
  *count = metric.histogram.sample_count;
}

namespace {

// A scrape that sends nothing useful for this long is dropped, so one stuck
// client cannot hold the (single) metrics thread.
constexpr int kClientTimeoutMs = 5000;
// Longest request head read; a GET line and a few headers fit easily.
constexpr size_t kMaxRequestBytes = 16 * 1024;

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Reads the request head (up to the blank line); false on timeout, close,
// error or an oversized head.
bool ReadRequestHead(int fd, std::string* head) {
  char buffer[2048];
  while (head->find("\r\n\r\n") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, kClientTimeoutMs) <= 0) return false;
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) return false;
    head->append(buffer, n);
    if (head->size() > kMaxRequestBytes) return false;
  }
  return true;
}

void WriteAll(int fd, const std::string& data) {
  size_t sent = 0;
  while (sent < data.size()) {
    pollfd p{fd, POLLOUT, 0};
    if (poll(&p, 1, kClientTimeoutMs) <= 0) return;
    // MSG_NOSIGNAL: a scraper that hung up must not SIGPIPE the daemon.
    const ssize_t n =
        send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += n;
  }
}

std::string Response(absl::string_view status, absl::string_view type,
                     absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(),
                      "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, int port,
    std::shared_ptr<prometheus::Registry> registry) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(address.empty() ? nullptr : address.c_str(), service.c_str(),
                  &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_address: cannot resolve \"", address, "\""));
  }
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return Errno("metrics: socket");
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = bind(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  if (!bound || listen(fd, 16) != 0) {
    absl::Status status = Errno(
        absl::StrCat("metrics_port: cannot listen on ", address, ":", port));
    close(fd);
    return status;
  }
  sockaddr_storage local{};
  socklen_t local_len = sizeof(local);
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len);
  const int bound_port =
      local.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<sockaddr_in6*>(&local)->sin6_port)
          : ntohs(reinterpret_cast<sockaddr_in*>(&local)->sin_port);
  int wake[2];
  if (pipe2(wake, O_CLOEXEC) != 0) {
    close(fd);
    return Errno("metrics: pipe");
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(
      fd, wake[0], wake[1], bound_port, std::move(registry)));
  server->thread_ = std::thread([raw = server.get()] { raw->Loop(); });
  return server;
}

MetricsHttpServer::MetricsHttpServer(
    int listen_fd, int wake_read_fd, int wake_write_fd, int port,
    std::shared_ptr<prometheus::Registry> registry)
    : listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port),
      registry_(std::move(registry)) {}

MetricsHttpServer::~MetricsHttpServer() {
  const char byte = 0;
  while (write(wake_write_fd_, &byte, 1) < 0 && errno == EINTR) {
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  close(wake_read_fd_);
  close(wake_write_fd_);
}

void MetricsHttpServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    Serve(client);
    close(client);
  }
}

void MetricsHttpServer::Serve(int fd) {
  std::string head;
  if (!ReadRequestHead(fd, &head)) return;
  const size_t line_end = head.find("\r\n");
  const std::string line = head.substr(0, line_end);
  // "GET /metrics HTTP/1.1", query strings allowed.
  const bool is_get = absl::StartsWith(line, "GET ");
  const size_t path_end = line.find(' ', 4);
  std::string path = line.substr(
      4, path_end == std::string::npos ? std::string::npos : path_end - 4);
  path = path.substr(0, path.find('?'));
  if (!is_get) {
    WriteAll(fd, Response("405 Method Not Allowed", "text/plain",
                          "only GET is served\n"));
    return;
  }
  if (path != "/metrics") {
    WriteAll(fd, Response("404 Not Found", "text/plain",
                          "metrics are at /metrics\n"));
    return;
  }
  std::ostringstream body;
  prometheus::TextSerializer().Serialize(body, registry_->Collect());
  WriteAll(fd, Response("200 OK", "text/plain; version=0.0.4; charset=utf-8",
                        body.str()));
}

}  // namespace flashsampler
