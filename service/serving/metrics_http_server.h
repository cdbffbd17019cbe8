// The /metrics HTTP endpoint: a request-head parser (a pure function, the
// fuzzing surface) and a one-thread poll(2) server with per-connection
// deadlines, a connection limit and a request-size limit.
#ifndef FLASHSAMPLER_SERVICE_SERVING_METRICS_HTTP_SERVER_H_
#define FLASHSAMPLER_SERVICE_SERVING_METRICS_HTTP_SERVER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flashsampler {

// The parts of an HTTP/1.x request head the endpoint looks at.
struct HttpRequestHead {
  std::string method;   // "GET", "POST", ... (a token, case kept)
  std::string target;   // "/metrics?x=1" (origin form)
  std::string path;     // "/metrics" (target without the query)
  std::string version;  // "HTTP/1.0" or "HTTP/1.1"
};

// Parses `head`: the bytes up to (and optionally including) the blank line
// that ends a request head. Lines end in CRLF or a bare LF. Returns
// InvalidArgument for anything that is not "METHOD SP /target SP HTTP/1.x"
// followed by "Name: value" header lines, and for control characters.
// Never reads outside `head`.
absl::StatusOr<HttpRequestHead> ParseHttpRequestHead(absl::string_view head);

struct MetricsHttpOptions {
  // Bind address ("0.0.0.0" for a Kubernetes pod, "127.0.0.1", "::") and
  // port (0 = any free port).
  std::string address = "0.0.0.0";
  int port = 0;
  // Connections held at once. When full, a connection that has waited for
  // its request head longer than `stale_after` is closed to make room;
  // otherwise new connections wait in the kernel's backlog.
  int max_connections = 512;
  absl::Duration stale_after = absl::Milliseconds(250);
  // The whole request head must arrive within this time of accept(), so a
  // client dripping a byte at a time holds a slot for at most this long
  // (and never delays anyone else: the loop does not block on a client).
  absl::Duration read_timeout = absl::Seconds(2);
  // Time to write the answer; a client that does not read loses it.
  absl::Duration write_timeout = absl::Seconds(5);
  // Longest request head accepted; beyond it: 431. Prometheus sends ~250 B.
  size_t max_head_bytes = 8192;
};

// Serves GET (and HEAD) /metrics with the text `body()` returns; 404 for
// other paths, 405 for other methods, 400 for a malformed head, 408 for a
// head not complete within read_timeout, 431 for an oversized head. One
// request per connection ("Connection: close").
//
// One thread, non-blocking sockets, poll(2): no client can hold the thread.
// Out of file descriptors, accept() uses a reserved descriptor to take and
// close the waiting connection (so the loop does not spin on EMFILE), and
// pauses accepting for 100 ms when even that fails.
//
// Why not prometheus::Exposer: its civetweb workers run on fixed 100 KB
// stacks (Debian builds civetweb with USE_STACK_SIZE=102400), and glibc
// places every thread's static TLS inside its stack. OpenBLAS (60 KB of TLS),
// NCCL (12 KB) and cudart (4 KB) leave the workers about 25 KB, and the first
// scrape overflows it and crashes the daemon. This server runs on a
// default-size thread.
class MetricsHttpServer {
 public:
  using BodyFn = std::function<std::string()>;

  // Binds, listens and starts the thread.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const MetricsHttpOptions& options, BodyFn body);
  ~MetricsHttpServer();  // stops the thread, closes every socket
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

 private:
  struct Connection;
  MetricsHttpServer(const MetricsHttpOptions& options, BodyFn body,
                    int listen_fd, int wake_read_fd, int wake_write_fd,
                    int port);
  void Loop();

  const MetricsHttpOptions options_;
  const BodyFn body_;
  const int listen_fd_;
  const int wake_read_fd_;  // readable once the destructor asks to stop
  const int wake_write_fd_;
  const int port_;
  std::thread thread_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_SERVING_METRICS_HTTP_SERVER_H_
