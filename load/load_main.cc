// fs_load: load generator for flashsamplerd.
//   fs_load --target=host:port --mode=closed --concurrency=16 --duration=30s
//   fs_load --target=host:port --mode=open --rate=500 --rows=4 --csv=run.csv
//   fs_load --target=host:port --mode=closed --concurrency=16 --stream
//   fs_load --target=localhost:50051 --rows=256 --shared_memory
// Prints latency percentiles, throughput and error counts by gRPC code;
// --csv writes one line per call (load/plot_latency.py plots it) and
// --summary_csv appends one line per run (for sweeps).
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/hidden_states.h"
#include "client/shared_memory.h"
#include "common/program_flags.h"
#include "load/load_runner.h"
#include "load/load_stats.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "gRPC target (dns:///name:port spreads over every address)");
ABSL_FLAG(std::string, mode, "closed",
          "closed: --concurrency callers back to back; open: Poisson "
          "arrivals at --rate per second");
ABSL_FLAG(int, concurrency, 8, "closed loop: concurrent callers");
ABSL_FLAG(int, channels, 1,
          "connections to spread the callers over (one HTTP/2 connection "
          "carries about 17k small calls/s: use several to measure a fast "
          "server)");
ABSL_FLAG(int, connections, 1,
          "ClientOptions::connections of each client: calls through "
          "SamplerClient::Sample (--retries above 1), streams and the open "
          "loop take its connections in turn");
ABSL_FLAG(bool, poll_spin, false,
          "closed loop, unary: wait for each answer polling without sleeping "
          "(a caller that busy-polls; its wake-up leaves the latency); with "
          "--retries above 1 through the client's ClientOptions::busy_poll");
ABSL_FLAG(bool, stream, false,
          "closed loop: each caller keeps one SampleStream open and sends "
          "its requests on it (no per-call retries)");
ABSL_FLAG(double, rate, 100.0, "open loop: mean requests per second");
ABSL_FLAG(int, max_outstanding, 10000,
          "open loop: most calls in flight; later arrivals count as dropped");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10), "measured window");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(1),
          "load before the measured window, not recorded");
ABSL_FLAG(int, rows, 1, "rows (hidden states) per request");
ABSL_FLAG(std::string, hidden_file, "",
          "hidden states (.npy or raw fp32 with --rows rows); default random");
ABSL_FLAG(std::string, dtype, "bf16", "wire dtype: fp32, bf16 or fp16");
ABSL_FLAG(float, hidden_scale, 1.0f,
          "std of the random hidden states; on synthetic weights 1 gives "
          "flat rows (softmax entropy about 8.8 nats at V = 151936) and 2.5 "
          "about 2.4, the spread of a language model's next-token "
          "distribution");
ABSL_FLAG(bool, shared_memory, false,
          "send the hidden states by reference: written once to a "
          "shared-memory region registered with the daemon, which must run "
          "on this host with --max_shared_memory_regions >= 1");
ABSL_FLAG(float, temperature, 1.0f, "sampling temperature; 0 = greedy");
ABSL_FLAG(int, n, 1, "samples per row");
ABSL_FLAG(int, top_k, 0, "top_k of every row; 0 = off");
ABSL_FLAG(float, top_p, 1.0f, "top_p of every row; 1 = off");
ABSL_FLAG(float, min_p, 0.0f, "min_p of every row; 0 = off");
ABSL_FLAG(int, logprobs, 0,
          "raw logprobs of every row: the sampled token's and the top N "
          "(N <= 20); 0 = none");
ABSL_FLAG(bool, allow_even_ids, false,
          "an allowed-token bitmask on every row allowing the even ids, half "
          "of the vocabulary (19 KB a row at V = 151936)");
ABSL_FLAG(std::string, bitmask_field, "bytes",
          "the wire field of --allow_even_ids: bytes "
          "(allowed_token_bitmask_bytes) or words (allowed_token_bitmask, "
          "varints)");
ABSL_FLAG(int, logit_bias, 0,
          "logit_bias entries on every row: N even ids spread over the "
          "vocabulary, biases from +0.5 down in steps of 1/64");
ABSL_FLAG(int, penalized_ids, 0,
          "a penalty history on every row: N prompt ids and N generated ids "
          "(counts 1 to 4), all even, with repetition 1.1, presence 0.5 and "
          "frequency 0.3 penalties");
ABSL_FLAG(bool, row_params, false,
          "send the controls once per row (row_params), as a batch of "
          "sequences with their own grammars does, instead of once for "
          "every row (params); with --allow_even_ids the daemon then packs "
          "and copies a bitmask per row");
ABSL_FLAG(uint64_t, seed, 1,
          "seed of the random hidden states and of the arrival process");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "deadline per call");
ABSL_FLAG(int, retries, 1,
          "attempts per call in closed loop (1 = none, so that every "
          "UNAVAILABLE is counted); the open loop never retries");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signed the server");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mutual TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "", "expected server name");
ABSL_FLAG(std::string, csv, "", "write one line per call here");
ABSL_FLAG(std::string, summary_csv, "", "append one line per run here");
ABSL_FLAG(std::string, label, "", "label of this run in --summary_csv");

namespace flashsampler {
namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "fs_load: %s\n", status.ToString().c_str());
  return 1;
}

int Main(int argc, char** argv) {
  // gRPC's locks are Abseil Mutexes; checking each acquisition against the
  // global lock graph would add the check's cost to every measured call.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Each call serializes its request anew (2 MB at 256 bf16 rows): keep
  // freed buffers in the allocator, as the daemon does
  // (service/serving/process_setup.cc), so the load generator does not
  // fault them in again on every call.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 64 << 20);
  const ParsedCommandLine parsed = ParseProgramFlags(
      argc, argv, "fs_load", "load/load_main.cc",
      "fs_load --target=host:port [--mode=closed --concurrency=N [--stream] | "
      "--mode=open --rate=R] [--duration=10s --rows=B --csv=out.csv]");
  if (parsed.exit_code.has_value()) return *parsed.exit_code;

  LoadOptions load;
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "closed") {
    load.mode = LoadOptions::Mode::kClosed;
  } else if (mode == "open") {
    load.mode = LoadOptions::Mode::kOpen;
  } else {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--mode: closed or open, got \"", mode, "\"")));
  }
  load.concurrency = absl::GetFlag(FLAGS_concurrency);
  load.stream = absl::GetFlag(FLAGS_stream);
  load.poll_spin = absl::GetFlag(FLAGS_poll_spin);
  load.rate = absl::GetFlag(FLAGS_rate);
  load.max_outstanding = absl::GetFlag(FLAGS_max_outstanding);
  load.duration = absl::GetFlag(FLAGS_duration);
  load.warmup = absl::GetFlag(FLAGS_warmup);
  load.seed = absl::GetFlag(FLAGS_seed);

  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.retry.max_attempts = absl::GetFlag(FLAGS_retries);
  options.tls_root_certs_path = absl::GetFlag(FLAGS_tls_ca);
  options.tls_client_cert_path = absl::GetFlag(FLAGS_tls_cert);
  options.tls_client_key_path = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name_override = absl::GetFlag(FLAGS_tls_server_name);
  // Closed-loop callers with retries call SamplerClient::Sample, which then
  // waits the same way.
  options.busy_poll = absl::GetFlag(FLAGS_poll_spin);
  options.connections = absl::GetFlag(FLAGS_connections);
  auto client = SamplerClient::Create(options);
  if (!client.ok()) return Fail(client.status());
  const int channels = absl::GetFlag(FLAGS_channels);
  if (channels < 1) {
    return Fail(absl::InvalidArgumentError("--channels: must be >= 1"));
  }
  std::vector<std::unique_ptr<SamplerClient>> more_clients;
  std::vector<SamplerClient*> clients = {client->get()};
  for (int c = 1; c < channels; ++c) {
    auto another = SamplerClient::Create(options);
    if (!another.ok()) return Fail(another.status());
    clients.push_back(another->get());
    more_clients.push_back(*std::move(another));
  }

  DType dtype = DType::kBf16;
  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  if (dtype_name == "fp32") {
    dtype = DType::kFp32;
  } else if (dtype_name == "fp16") {
    dtype = DType::kFp16;
  } else if (dtype_name != "bf16") {
    return Fail(absl::InvalidArgumentError("--dtype: fp32, bf16 or fp16"));
  }
  const std::string hidden_file = absl::GetFlag(FLAGS_hidden_file);
  // The daemon's shape, where random hidden states or the controls' ids
  // need it.
  absl::StatusOr<v1::ModelInfo> info;
  if (hidden_file.empty() || absl::GetFlag(FLAGS_allow_even_ids) ||
      absl::GetFlag(FLAGS_logit_bias) > 0 ||
      absl::GetFlag(FLAGS_penalized_ids) > 0) {
    info = (*client)->GetModelInfo();
    if (!info.ok()) return Fail(info.status());
  }
  HiddenStates hidden;
  if (!hidden_file.empty()) {
    auto loaded = LoadHiddenStates(hidden_file, absl::GetFlag(FLAGS_rows));
    if (!loaded.ok()) return Fail(loaded.status());
    hidden = ConvertHiddenStates(*loaded, dtype);
  } else {
    hidden = RandomHiddenStates(absl::GetFlag(FLAGS_rows), info->hidden_size(),
                                absl::GetFlag(FLAGS_seed), dtype,
                                absl::GetFlag(FLAGS_hidden_scale));
  }
  RequestFields fields;  // no seeds: the server draws fresh ones per call
  fields.params.set_temperature(absl::GetFlag(FLAGS_temperature));
  if (absl::GetFlag(FLAGS_n) != 1) fields.params.set_n(absl::GetFlag(FLAGS_n));
  fields.params.set_top_k(absl::GetFlag(FLAGS_top_k));
  if (absl::GetFlag(FLAGS_top_p) != 1.0f)
    fields.params.set_top_p(absl::GetFlag(FLAGS_top_p));
  fields.params.set_min_p(absl::GetFlag(FLAGS_min_p));
  if (const int top = absl::GetFlag(FLAGS_logprobs); top > 0) {
    fields.params.mutable_logprobs()->set_sampled_logprob(true);
    fields.params.mutable_logprobs()->set_top_logprobs(top);
  }
  // Ids spread over the vocabulary by large primes, kept even so that
  // --allow_even_ids allows them.
  auto spread_id = [&info](int i, int64_t prime) {
    return static_cast<int32_t>((2 * i * prime) % info->vocab_size()) & ~1;
  };
  for (int i = 0; i < absl::GetFlag(FLAGS_logit_bias); ++i) {
    v1::TokenBias* bias = fields.params.add_logit_bias();
    bias->set_token_id(spread_id(i, 7919));
    bias->set_bias(0.5f - 0.015625f * static_cast<float>(i));
  }
  if (const int ids = absl::GetFlag(FLAGS_penalized_ids); ids > 0) {
    fields.params.set_repetition_penalty(1.1f);
    fields.params.set_presence_penalty(0.5f);
    fields.params.set_frequency_penalty(0.3f);
    for (int i = 0; i < ids; ++i) {
      fields.params.add_prompt_token_ids(spread_id(i, 104729));
      v1::TokenCount* count = fields.params.add_output_token_counts();
      count->set_token_id(spread_id(i, 1299709));
      count->set_count(1 + i % 4);
    }
  }
  if (absl::GetFlag(FLAGS_allow_even_ids)) {
    // Bit (t & 31) of word t >> 5 allows token t.
    const int words = static_cast<int>((info->vocab_size() + 31) / 32);
    const std::string& field = absl::GetFlag(FLAGS_bitmask_field);
    if (field == "bytes") {
      fields.params.set_allowed_token_bitmask_bytes(
          std::string(4 * static_cast<size_t>(words), '\x55'));
    } else if (field == "words") {
      fields.params.mutable_allowed_token_bitmask()->Resize(
          words, static_cast<int32_t>(0x55555555u));
    } else {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--bitmask_field: bytes or words, got \"", field, "\"")));
    }
  }
  auto request = MakeSampleRequest(hidden, fields);
  if (!request.ok()) return Fail(request.status());
  if (absl::GetFlag(FLAGS_row_params)) {
    for (int64_t r = 0; r < request->hidden_states().shape(0); ++r) {
      *request->add_row_params() = request->params();
    }
    request->clear_params();
  }

  std::unique_ptr<SharedMemoryRegion> region;
  const std::string region_name = absl::StrCat("fs_load_", getpid());
  if (absl::GetFlag(FLAGS_shared_memory)) {
    auto created = SharedMemoryRegion::Create(
        absl::StrCat("/", region_name), request->hidden_states().data().size());
    if (!created.ok()) return Fail(created.status());
    region = *std::move(created);
    if (auto s =
            MoveHiddenStatesToSharedMemory(*region, region_name, 0, &*request);
        !s.ok()) {
      return Fail(s);
    }
    if (auto s = (*client)->RegisterSharedMemory(region_name, region->key(),
                                                 region->size());
        !s.ok()) {
      return Fail(s);
    }
  }
  auto result = RunLoad(
      clients, std::make_shared<const v1::SampleRequest>(*std::move(request)),
      load);
  if (region != nullptr) {
    if (auto s = (*client)->UnregisterSharedMemory(region_name); !s.ok()) {
      std::fprintf(stderr, "fs_load: %s\n", s.ToString().c_str());
    }
  }
  if (!result.ok()) return Fail(result.status());
  const LoadSummary summary =
      Summarize(result->records, result->duration_s, result->dropped);
  std::printf("target        %s\nmode          %s", options.target.c_str(),
              mode.c_str());
  if (load.mode == LoadOptions::Mode::kClosed) {
    std::printf(" (%d callers%s)", load.concurrency,
                load.stream ? ", one SampleStream each" : "");
  } else {
    std::printf(" (%.1f req/s offered)", load.rate);
  }
  std::printf(", %lld rows per request%s\n%s",
              static_cast<long long>(hidden.rows),
              region != nullptr ? " (hidden states in shared memory)" : "",
              FormatSummary(summary).c_str());

  if (const std::string csv = absl::GetFlag(FLAGS_csv); !csv.empty()) {
    if (auto s = WriteRecordsCsv(csv, result->records); !s.ok()) return Fail(s);
  }
  if (const std::string csv = absl::GetFlag(FLAGS_summary_csv); !csv.empty()) {
    RunLabel run;
    run.label = absl::GetFlag(FLAGS_label);
    run.mode = mode;
    run.concurrency = load.concurrency;
    run.rate = load.mode == LoadOptions::Mode::kOpen ? load.rate : 0.0;
    run.rows = static_cast<int>(hidden.rows);
    if (auto s = AppendSummaryCsv(csv, run, summary); !s.ok()) return Fail(s);
  }
  // Exit status says whether every call succeeded, for scripts and CI.
  return summary.errors == 0 && summary.dropped == 0 && summary.ok > 0 ? 0 : 3;
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) { return flashsampler::Main(argc, argv); }
