// flashsampler-cli: talk to a flashsamplerd from the shell.
//   flashsampler-cli info|health|sample --target=host:port [flags]
// `sample` prints one line per row ("row 0: 1234") and the seeds used.
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/hidden_states.h"
#include "common/program_flags.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "gRPC target: host:port, dns:///host:port (round robin over every "
          "address), ipv4:a:p,b:q, unix:/path");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "deadline of the call, retries included");
ABSL_FLAG(int, retries, 4,
          "attempts in total on UNAVAILABLE (exponential backoff with "
          "jitter); 1 = no retry");
ABSL_FLAG(bool, wait_for_ready, false,
          "wait for the server to come up (within --timeout) instead of "
          "failing fast");
ABSL_FLAG(std::string, lb_policy, "round_robin",
          "load balancing policy: round_robin or pick_first");
ABSL_FLAG(bool, tls, false, "use TLS (implied by --tls_ca / --tls_cert)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signed the server");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "",
          "expected name in the server certificate (default: target host)");

ABSL_FLAG(bool, json, false, "info: print ModelInfo as JSON");
ABSL_FLAG(std::string, service, "", "health: service name (\"\" = server)");

ABSL_FLAG(int64_t, rows, 1, "sample: rows B (random or raw fp32 input)");
ABSL_FLAG(std::string, seed, "",
          "sample: \"\" = the server draws seeds; S = seeds S, S+1, ... per "
          "row; a,b,c = one seed per row");
ABSL_FLAG(uint64_t, step, 0, "sample: decode step of every row");
ABSL_FLAG(float, temperature, 1.0f, "sample: temperature; 0 = greedy");
ABSL_FLAG(int, top_k, 0, "sample: top-k; 0 = off");
ABSL_FLAG(float, top_p, 1.0f, "sample: top-p in (0, 1]; 1 = off");
ABSL_FLAG(float, min_p, 0.0f, "sample: min-p in [0, 1]; 0 = off");
ABSL_FLAG(int, n, 1, "sample: samples per row");
ABSL_FLAG(bool, logprobs, false,
          "sample: also print each token's logprob and rank");
ABSL_FLAG(std::string, hidden_file, "",
          "sample: hidden states, .npy ([B, D] or [D]; float32, float16 or "
          "bf16 bits as uint16) or raw little-endian fp32 with --rows rows");
ABSL_FLAG(bool, random, false,
          "sample: random N(0,1) hidden states of the server's D (the "
          "default without --hidden_file)");
ABSL_FLAG(uint64_t, random_seed, 0, "sample: generator seed for --random");
ABSL_FLAG(std::string, dtype, "",
          "sample: wire dtype fp32, bf16 or fp16 (default: fp32 for random "
          "input, the file's dtype for --hidden_file)");
ABSL_FLAG(std::string, request_id, "", "sample: request id echoed back");

namespace flashsampler {
namespace {

constexpr char kUsage[] =
    "flashsampler-cli <command> [flags]\n"
    "  info    print the server's ModelInfo\n"
    "  health  grpc.health.v1 check, exit codes as grpc_health_probe:\n"
    "            0 SERVING, 1 invalid arguments, 2 connection failure,\n"
    "            3 RPC failure, 4 unhealthy (NOT_SERVING, SERVICE_UNKNOWN)\n"
    "  sample  sample tokens for random or file-loaded hidden states\n"
    "Common: --target=host:port --timeout=10s --retries=4 [--tls_ca=... "
    "--tls_cert=... --tls_key=...]\n"
    "Exit status of info and sample: 0 done, 1 invalid arguments or a "
    "failed call.";

// `flashsampler-cli health` exit codes, those of grpc_health_probe so that
// probes and scripts written for it read ours the same way.
enum HealthExit {
  kHealthServing = 0,
  kHealthInvalidArguments = 1,
  kHealthConnectionFailure = 2,
  kHealthRpcFailure = 3,
  kHealthUnhealthy = 4,
};

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

absl::StatusOr<std::unique_ptr<SamplerClient>> NewClient() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.retry.max_attempts = absl::GetFlag(FLAGS_retries);
  options.wait_for_ready = absl::GetFlag(FLAGS_wait_for_ready);
  options.load_balancing_policy = absl::GetFlag(FLAGS_lb_policy);
  options.use_tls = absl::GetFlag(FLAGS_tls);
  options.tls_root_certs_path = absl::GetFlag(FLAGS_tls_ca);
  options.tls_client_cert_path = absl::GetFlag(FLAGS_tls_cert);
  options.tls_client_key_path = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name_override = absl::GetFlag(FLAGS_tls_server_name);
  return SamplerClient::Create(options);
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  if (name == "fp16") return DType::kFp16;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype: expected fp32, bf16 or fp16, got \"", name, "\""));
}

// --seed: "" -> none, "S" -> S, S+1, ..., "a,b,c" -> exactly those.
absl::StatusOr<std::vector<uint64_t>> ParseSeeds(const std::string& text,
                                                 int64_t rows) {
  std::vector<uint64_t> seeds;
  if (text.empty()) return seeds;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    uint64_t seed = 0;
    if (!absl::SimpleAtoi(part, &seed)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seed: \"", part, "\" is not an unsigned integer"));
    }
    seeds.push_back(seed);
  }
  if (seeds.size() == 1) {
    for (int64_t row = 1; row < rows; ++row) seeds.push_back(seeds[0] + row);
  }
  if (seeds.size() != static_cast<size_t>(rows)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--seed: ", seeds.size(), " seeds for ", rows, " rows"));
  }
  return seeds;
}

int RunInfo(SamplerClient& client) {
  auto info = client.GetModelInfo();
  if (!info.ok()) return Fail(info.status());
  std::string text;
  if (absl::GetFlag(FLAGS_json)) {
    google::protobuf::util::JsonPrintOptions json;
    json.add_whitespace = true;
    json.preserve_proto_field_names = true;
    if (!google::protobuf::util::MessageToJsonString(*info, &text, json).ok()) {
      return Fail(absl::InternalError("cannot print ModelInfo as JSON"));
    }
  } else {
    google::protobuf::TextFormat::PrintToString(*info, &text);
  }
  std::fputs(text.c_str(), stdout);
  return 0;
}

int RunHealth(SamplerClient& client) {
  auto health = client.CheckHealth(absl::GetFlag(FLAGS_service));
  if (!health.ok()) {
    std::fprintf(stderr, "error: %s\n", health.status().ToString().c_str());
    // UNAVAILABLE: no connection could be made (refused, no route, TLS
    // handshake failed) before the deadline; anything else: the RPC itself
    // failed (deadline, UNIMPLEMENTED without a health service, ...).
    return absl::IsUnavailable(health.status()) ? kHealthConnectionFailure
                                                : kHealthRpcFailure;
  }
  std::printf("%s\n", HealthStatusName(*health));
  return *health == HealthStatus::kServing ? kHealthServing : kHealthUnhealthy;
}

int RunSample(SamplerClient& client) {
  const std::string hidden_file = absl::GetFlag(FLAGS_hidden_file);
  if (!hidden_file.empty() && absl::GetFlag(FLAGS_random)) {
    return Fail(absl::InvalidArgumentError(
        "--hidden_file and --random exclude each other"));
  }
  const std::string dtype_flag = absl::GetFlag(FLAGS_dtype);
  std::optional<DType> wire_dtype;
  if (!dtype_flag.empty()) {
    auto parsed = ParseDType(dtype_flag);
    if (!parsed.ok()) return Fail(parsed.status());
    wire_dtype = *parsed;
  }

  HiddenStates hidden;
  if (!hidden_file.empty()) {
    auto loaded = LoadHiddenStates(hidden_file, absl::GetFlag(FLAGS_rows));
    if (!loaded.ok()) return Fail(loaded.status());
    hidden = *std::move(loaded);
  } else {
    const int64_t rows = absl::GetFlag(FLAGS_rows);
    if (rows < 1)
      return Fail(absl::InvalidArgumentError("--rows: must be >= 1"));
    auto info = client.GetModelInfo();
    if (!info.ok()) return Fail(info.status());
    hidden = RandomHiddenStates(rows, info->hidden_size(),
                                absl::GetFlag(FLAGS_random_seed), DType::kFp32);
  }
  if (wire_dtype.has_value() && *wire_dtype != hidden.dtype) {
    hidden = ConvertHiddenStates(hidden, *wire_dtype);
  }

  RequestFields fields;
  fields.request_id = absl::GetFlag(FLAGS_request_id);
  auto seeds = ParseSeeds(absl::GetFlag(FLAGS_seed), hidden.rows);
  if (!seeds.ok()) return Fail(seeds.status());
  fields.seeds = *std::move(seeds);
  const uint64_t step = absl::GetFlag(FLAGS_step);
  if (step != 0) fields.steps.assign(static_cast<size_t>(hidden.rows), step);
  fields.params.set_temperature(absl::GetFlag(FLAGS_temperature));
  fields.params.set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_top_p) != 1.0f) {
    fields.params.set_top_p(absl::GetFlag(FLAGS_top_p));
  }
  fields.params.set_min_p(absl::GetFlag(FLAGS_min_p));
  if (absl::GetFlag(FLAGS_n) != 1) fields.params.set_n(absl::GetFlag(FLAGS_n));
  if (absl::GetFlag(FLAGS_logprobs)) {
    fields.params.mutable_logprobs()->set_sampled_logprob(true);
    fields.params.mutable_logprobs()->set_sampled_rank(true);
  }
  auto request = MakeSampleRequest(hidden, fields);
  if (!request.ok()) return Fail(request.status());

  auto response = client.Sample(*request);
  if (!response.ok()) return Fail(response.status());
  const int n = std::max(response->n(), 1);
  const int64_t rows = response->token_ids_size() / n;
  // "<label> <row>: v0 v1 ..." for row's n values of a [B, n] field, when
  // the response carries the field.
  auto print_row = [&](const char* label, int64_t row, const auto& field) {
    if (field.size() != response->token_ids_size()) return;
    std::printf("%s %lld: %s\n", label, static_cast<long long>(row),
                absl::StrJoin(field.begin() + row * n,
                              field.begin() + (row + 1) * n, " ")
                    .c_str());
  };
  for (int64_t row = 0; row < rows; ++row) {
    print_row("row", row, response->token_ids());
    print_row("logprobs", row, response->sampled_logprobs());
    print_row("ranks", row, response->sampled_ranks());
  }
  std::printf("seeds: %s\n", absl::StrJoin(response->seeds(), " ").c_str());
  const v1::Timing& timing = response->timing();
  std::printf("timing: queue=%.6fs execute=%.6fs batch_rows=%d\n",
              timing.queue_seconds(), timing.execute_seconds(),
              timing.batch_rows());
  return 0;
}

int Main(int argc, char** argv) {
  const ParsedCommandLine parsed = ParseProgramFlags(
      argc, argv, "flashsampler-cli", "client/cli_main.cc", kUsage);
  if (parsed.exit_code.has_value()) return *parsed.exit_code;
  const std::vector<char*>& args = parsed.args;
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return kHealthInvalidArguments;
  }
  const std::string command = args[1];
  if (command != "info" && command != "health" && command != "sample") {
    std::fprintf(stderr, "unknown command \"%s\"\n%s\n", command.c_str(),
                 kUsage);
    return kHealthInvalidArguments;
  }
  auto client = NewClient();
  // Bad TLS files, a malformed target, ...: invalid arguments (1).
  if (!client.ok()) return Fail(client.status());
  if (command == "info") return RunInfo(**client);
  if (command == "health") return RunHealth(**client);
  return RunSample(**client);
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) { return flashsampler::Main(argc, argv); }
