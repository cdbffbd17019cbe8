// Fuzz target: the metrics endpoint's request-head parser
// (ParseHttpRequestHead). It never crashes; an accepted head has a token
// method, an origin-form target starting with '/', the path that target
// names and an HTTP/1.0 or HTTP/1.1 version; a refused one is
// INVALID_ARGUMENT with a reason; and the answer the endpoint gives maps to
// one of the statuses metrics_http_server.h documents.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "service/serving/metrics_http_server.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

// MetricsHttpOptions::max_head_bytes's default.
const size_t kMaxHeadBytes = flashsampler::MetricsHttpOptions{}.max_head_bytes;

bool IsTokenChar(char c) {
  const unsigned char u = static_cast<unsigned char>(c);
  if (u <= 0x20 || u >= 0x7f) return false;
  return absl::string_view("()<>@,;:\\\"/[]?={}").find(c) ==
         absl::string_view::npos;
}

// The status the endpoint answers a complete head with, by the contract in
// metrics_http_server.h: 431 over the size limit, 400 malformed, 405 for a
// method other than GET and HEAD, 404 for a path other than /metrics, 200.
int StatusFor(size_t head_bytes,
              const absl::StatusOr<flashsampler::HttpRequestHead>& parsed) {
  if (head_bytes > kMaxHeadBytes) return 431;
  if (!parsed.ok()) return 400;
  if (parsed->method != "GET" && parsed->method != "HEAD") return 405;
  if (parsed->path != "/metrics") return 404;
  return 200;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using flashsampler::HttpRequestHead;
  const absl::string_view head(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<HttpRequestHead> parsed =
      flashsampler::ParseHttpRequestHead(head);
  if (!parsed.ok()) {
    FUZZ_CHECK(absl::IsInvalidArgument(parsed.status()), "status %s",
               parsed.status().ToString().c_str());
    FUZZ_CHECK(!parsed.status().message().empty(), "refusal without reason");
  } else {
    FUZZ_CHECK(!parsed->method.empty(), "accepted head without a method");
    for (const char c : parsed->method) {
      FUZZ_CHECK(IsTokenChar(c), "method byte 0x%02x is not a token byte",
                 static_cast<unsigned char>(c));
    }
    FUZZ_CHECK(!parsed->path.empty() && parsed->path[0] == '/',
               "path '%s' does not start with '/'", parsed->path.c_str());
    FUZZ_CHECK(absl::StartsWith(parsed->target, parsed->path),
               "path '%s' is not a prefix of target '%s'", parsed->path.c_str(),
               parsed->target.c_str());
    FUZZ_CHECK(parsed->path.find('?') == std::string::npos,
               "path '%s' keeps the query", parsed->path.c_str());
    FUZZ_CHECK(parsed->target.size() == parsed->path.size() ||
                   parsed->target[parsed->path.size()] == '?',
               "target '%s' goes on past path '%s' without a query",
               parsed->target.c_str(), parsed->path.c_str());
    for (const char c : parsed->target) {
      const unsigned char u = static_cast<unsigned char>(c);
      FUZZ_CHECK(u > 0x20 && u < 0x7f, "target byte 0x%02x", u);
    }
    FUZZ_CHECK(parsed->version == "HTTP/1.0" || parsed->version == "HTTP/1.1",
               "version '%s'", parsed->version.c_str());
    // The request line is the input's first line: the method opens it.
    FUZZ_CHECK(absl::StartsWith(head, parsed->method + " " + parsed->target +
                                          " " + parsed->version),
               "fields are not the input's request line");
  }
  // Parsing is a pure function of the bytes.
  const absl::StatusOr<HttpRequestHead> again =
      flashsampler::ParseHttpRequestHead(head);
  FUZZ_CHECK(again.ok() == parsed.ok(), "second parse disagrees");
  if (parsed.ok()) {
    FUZZ_CHECK(again->method == parsed->method &&
                   again->target == parsed->target &&
                   again->version == parsed->version,
               "second parse disagrees");
  }
  const int status = StatusFor(size, parsed);
  FUZZ_CHECK(status == 200 || status == 400 || status == 404 || status == 405 ||
                 status == 431,
             "status %d is not documented", status);
  return 0;
}
