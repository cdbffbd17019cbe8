// The /metrics endpoint's HTTP/1.x parser and poll(2) loop. Every socket is
// non-blocking and every connection has a deadline, so the loop's only
// blocking call is poll() itself.
#include "service/serving/metrics_http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace flashsampler {

namespace {

// After the answer, the rest of what a client sent (say, the remainder of a
// 1 MB request line) is read and dropped for up to this long or this many
// bytes before the close, so the client sees the answer instead of a reset.
constexpr absl::Duration kLingerTime = absl::Seconds(1);
constexpr size_t kMaxLingerBytes = size_t{4} << 20;
// accept() failing for want of memory or descriptors: retry after this long
// instead of spinning.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);

bool IsTokenChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
         std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

bool IsToken(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), IsTokenChar);
}

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed request: ", what));
}

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Offset just past the blank line ending the head in `data`, or npos.
size_t HeadEnd(absl::string_view data) {
  const size_t lf_lf = data.find("\n\n");
  const size_t lf_crlf = data.find("\n\r\n");
  const size_t a = lf_lf == absl::string_view::npos ? lf_lf : lf_lf + 2;
  const size_t b = lf_crlf == absl::string_view::npos ? lf_crlf : lf_crlf + 3;
  if (data.size() >= 2 && data.substr(0, 2) == "\r\n") return 2;
  if (!data.empty() && data[0] == '\n') return 1;
  return std::min(a, b);
}

std::string Response(absl::string_view status, absl::string_view body,
                     bool with_body = true,
                     absl::string_view type = "text/plain; charset=utf-8",
                     absl::string_view extra_headers = "") {
  return absl::StrCat("HTTP/1.1 ", status, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\n",
                      extra_headers, "Connection: close\r\n\r\n",
                      with_body ? body : "");
}

}  // namespace

absl::StatusOr<HttpRequestHead> ParseHttpRequestHead(absl::string_view head) {
  std::vector<absl::string_view> lines = absl::StrSplit(head, '\n');
  // A head that ends in its line break splits into a last empty piece.
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  for (absl::string_view& line : lines) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  }
  if (lines.empty() || lines[0].empty()) return Malformed("no request line");

  const absl::string_view request_line = lines[0];
  for (const char c : request_line) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) {
      return Malformed("control or non-ASCII byte in the request line");
    }
  }
  const std::vector<absl::string_view> parts =
      absl::StrSplit(request_line, ' ');
  if (parts.size() != 3) {
    return Malformed("request line is not METHOD SP TARGET SP VERSION");
  }
  HttpRequestHead parsed;
  if (!IsToken(parts[0])) return Malformed("method is not a token");
  if (parts[1].empty() || parts[1][0] != '/') {
    return Malformed("target is not an absolute path");
  }
  if (parts[2] != "HTTP/1.1" && parts[2] != "HTTP/1.0") {
    return Malformed("version is not HTTP/1.0 or HTTP/1.1");
  }
  parsed.method = std::string(parts[0]);
  parsed.target = std::string(parts[1]);
  parsed.path = std::string(parts[1].substr(0, parts[1].find('?')));
  parsed.version = std::string(parts[2]);

  size_t i = 1;
  for (; i < lines.size() && !lines[i].empty(); ++i) {
    const absl::string_view line = lines[i];
    const size_t colon = line.find(':');
    if (colon == absl::string_view::npos || !IsToken(line.substr(0, colon))) {
      return Malformed("header line is not NAME: value");
    }
    for (const char c : line.substr(colon + 1)) {
      const unsigned char u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\t') || u == 0x7f) {
        return Malformed("control byte in a header value");
      }
    }
  }
  // Only the blank line that ends the head may follow the headers.
  if (i + 1 < lines.size()) return Malformed("bytes after the end of the head");
  return parsed;
}

struct MetricsHttpServer::Connection {
  enum class Phase { kReading, kWriting, kLingering };
  int fd = -1;
  Phase phase = Phase::kReading;
  std::string in;
  std::string out;
  size_t sent = 0;
  size_t lingered = 0;
  absl::Time accepted;
  absl::Time deadline;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsHttpOptions& options, BodyFn body) {
  if (options.max_connections < 1 || options.max_head_bytes < 16) {
    return absl::InvalidArgumentError(
        "metrics: max_connections >= 1 and max_head_bytes >= 16 needed");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(options.port);
  if (getaddrinfo(options.address.empty() ? nullptr : options.address.c_str(),
                  service.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics_address: cannot resolve \"", options.address, "\""));
  }
  const int fd = socket(found->ai_family,
                        found->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    freeaddrinfo(found);
    return Errno("metrics: socket");
  }
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const bool bound = bind(fd, found->ai_addr, found->ai_addrlen) == 0;
  freeaddrinfo(found);
  // SOMAXCONN (4096 on current kernels): a burst of scrapes waits in the
  // kernel instead of being refused while the loop works through it.
  if (!bound || listen(fd, SOMAXCONN) != 0) {
    absl::Status status = Errno(absl::StrCat(
        "metrics_port: cannot listen on ", options.address, ":", options.port));
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
    absl::Status status = Errno("metrics: pipe");
    close(fd);
    return status;
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer(
      options, std::move(body), fd, wake[0], wake[1], bound_port));
  server->thread_ = std::thread([raw = server.get()] { raw->Loop(); });
  return server;
}

MetricsHttpServer::MetricsHttpServer(const MetricsHttpOptions& options,
                                     BodyFn body, int listen_fd,
                                     int wake_read_fd, int wake_write_fd,
                                     int port)
    : options_(options),
      body_(std::move(body)),
      listen_fd_(listen_fd),
      wake_read_fd_(wake_read_fd),
      wake_write_fd_(wake_write_fd),
      port_(port) {}

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
  using Phase = Connection::Phase;
  std::vector<Connection> connections;
  // Held so that, out of descriptors, one can be freed to accept and close
  // the connection at the head of the backlog (else poll() reports it
  // readable forever and the loop spins).
  int reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  absl::Time accept_paused_until = absl::InfinitePast();

  auto close_connection = [](Connection& c) {
    close(c.fd);
    c.fd = -1;
  };
  auto answer = [&](Connection& c, std::string response, absl::Time now) {
    c.out = std::move(response);
    c.sent = 0;
    c.phase = Phase::kWriting;
    c.deadline = now + options_.write_timeout;
  };
  auto respond_to_head = [&](absl::string_view head) {
    absl::StatusOr<HttpRequestHead> parsed = ParseHttpRequestHead(head);
    if (!parsed.ok()) {
      return Response("400 Bad Request",
                      absl::StrCat(parsed.status().message(), "\n"));
    }
    const bool is_head = parsed->method == "HEAD";
    if (parsed->method != "GET" && !is_head) {
      return Response("405 Method Not Allowed", "only GET is served\n", true,
                      "text/plain; charset=utf-8", "Allow: GET, HEAD\r\n");
    }
    if (parsed->path != "/metrics") {
      return Response("404 Not Found", "metrics are at /metrics\n", !is_head);
    }
    return Response("200 OK", body_(), !is_head,
                    "text/plain; version=0.0.4; charset=utf-8");
  };
  // Moves `c` forward as far as its socket allows without blocking.
  auto progress = [&](Connection& c, absl::Time now) {
    char buffer[4096];
    if (c.phase == Phase::kReading) {
      for (;;) {
        const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
        if (n == 0) return close_connection(c);  // gone before asking
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          return close_connection(c);
        }
        c.in.append(buffer, n);
        const size_t end = HeadEnd(c.in);
        if (end != absl::string_view::npos && end <= options_.max_head_bytes) {
          answer(c, respond_to_head(absl::string_view(c.in).substr(0, end)),
                 now);
          break;
        }
        if (c.in.size() > options_.max_head_bytes) {
          answer(c,
                 Response("431 Request Header Fields Too Large",
                          absl::StrCat("request head over ",
                                       options_.max_head_bytes, " bytes\n")),
                 now);
          break;
        }
      }
    }
    if (c.phase == Phase::kWriting) {
      while (c.sent < c.out.size()) {
        // MSG_NOSIGNAL: a scraper that hung up must not SIGPIPE the daemon.
        const ssize_t n = send(c.fd, c.out.data() + c.sent,
                               c.out.size() - c.sent, MSG_NOSIGNAL);
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return;
          return close_connection(c);
        }
        c.sent += n;
      }
      shutdown(c.fd, SHUT_WR);
      c.phase = Phase::kLingering;
      c.deadline = now + kLingerTime;
      c.in.clear();
      c.in.shrink_to_fit();
      c.out.clear();
      c.out.shrink_to_fit();
    }
    if (c.phase == Phase::kLingering) {
      for (;;) {
        const ssize_t n = recv(c.fd, buffer, sizeof(buffer), 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0) return close_connection(c);  // the client closed
        c.lingered += n;
        if (c.lingered > kMaxLingerBytes) return close_connection(c);
      }
    }
  };
  auto is_stale = [&](const Connection& c, absl::Time now) {
    return c.phase == Phase::kReading &&
           now - c.accepted >= options_.stale_after;
  };
  auto accept_all = [&](absl::Time now) {
    for (;;) {
      const bool full =
          static_cast<int>(connections.size()) >= options_.max_connections;
      auto oldest_stale = connections.end();
      if (full) {
        for (auto it = connections.begin(); it != connections.end(); ++it) {
          if (is_stale(*it, now) && (oldest_stale == connections.end() ||
                                     it->accepted < oldest_stale->accepted)) {
            oldest_stale = it;
          }
        }
        if (oldest_stale == connections.end()) return;  // wait in the backlog
      }
      const int fd =
          accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        if (full) {
          close(oldest_stale->fd);
          connections.erase(oldest_stale);
        }
        Connection c;
        c.fd = fd;
        c.accepted = now;
        c.deadline = now + options_.read_timeout;
        connections.push_back(std::move(c));
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if ((errno == EMFILE || errno == ENFILE) && reserve_fd >= 0) {
        close(reserve_fd);
        const int dropped = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (dropped >= 0) close(dropped);
        reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (dropped >= 0 && reserve_fd >= 0) continue;
      }
      // Out of memory or descriptors with no reserve left, or another error
      // (EPERM from a firewall, ENOBUFS): try again shortly.
      accept_paused_until = now + kAcceptPause;
      return;
    }
  };

  std::vector<pollfd> fds;
  for (;;) {
    absl::Time now = absl::Now();
    const bool full =
        static_cast<int>(connections.size()) >= options_.max_connections;
    bool any_stale = false;
    absl::Time wake_at = absl::InfiniteFuture();
    for (const Connection& c : connections) {
      wake_at = std::min(wake_at, c.deadline);
      if (full && c.phase == Phase::kReading) {
        any_stale = any_stale || is_stale(c, now);
        wake_at = std::min(wake_at, c.accepted + options_.stale_after);
      }
    }
    const bool accepting = now >= accept_paused_until && (!full || any_stale);
    if (now < accept_paused_until) {
      wake_at = std::min(wake_at, accept_paused_until);
    }
    fds.clear();
    fds.push_back({wake_read_fd_, POLLIN, 0});
    // A negative descriptor is skipped by poll().
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (const Connection& c : connections) {
      fds.push_back(
          {c.fd,
           static_cast<short>(c.phase == Phase::kWriting ? POLLOUT : POLLIN),
           0});
    }
    int timeout_ms = -1;
    if (wake_at != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(
          std::clamp<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(
                                  wake_at - now, absl::Milliseconds(1))),
                              0, 60000));
    }
    if (poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      // ENOMEM (EFAULT and EINVAL cannot happen here): back off, retry.
      absl::SleepFor(kAcceptPause);
      continue;
    }
    if (fds[0].revents != 0) break;
    now = absl::Now();
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      if (fds[i + 2].revents != 0) progress(c, now);
      if (c.fd < 0 || now < c.deadline) continue;
      if (c.phase == Phase::kReading) {
        // Too slow to ask: say so (best effort) and close.
        const std::string timeout =
            Response("408 Request Timeout", "request head too slow\n");
        send(c.fd, timeout.data(), timeout.size(), MSG_NOSIGNAL);
      }
      close_connection(c);
    }
    connections.erase(
        std::remove_if(connections.begin(), connections.end(),
                       [](const Connection& c) { return c.fd < 0; }),
        connections.end());
    if ((fds[1].revents & POLLIN) != 0) accept_all(now);
  }
  for (Connection& c : connections) close(c.fd);
  if (reserve_fd >= 0) close(reserve_fd);
}

}  // namespace flashsampler
