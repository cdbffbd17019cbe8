// fs_engine_bench: what one batch costs in the CUDA engine (Engine::Sample on
// one slot: packing the controls, the copies, every kernel, the wait and
// the results), for each mix of sampling controls against the plain batch,
// in one run on the same weights and hidden states. It is the service's
// "execute" without gRPC, the batcher or a second slot: the host's share of
// a controlled batch is this time less the kernels' (fs_controls_bench).
//
// Methods, temperature 0.8 on every row and hidden states as peaked as a
// language model's (--hidden_scale, softmax entropy about 2.4 nats on qwen's
// synthetic weights at 2.5):
//   plain          temperature alone
//   filters        top_k 50, top_p 0.9, min_p 0.05
//   everything     filters, 64 logit_bias entries, 64 prompt and 64 output
//                  ids with all three penalties, a bitmask allowing the even
//                  ids (fs_load's --logit_bias=64 --penalized_ids=64
//                  --allow_even_ids)
//   everything_raw everything and the sampled token's and the top 5's raw
//                  logprobs (fs_load's --logprobs=5)
// each with the batch's rows sharing one params ("_params": one request's
// rows) or each row its own copy ("_rows": row_params, or single-row
// requests). Each iteration runs every method once, in turn, so that all
// see the same clocks; the median and mean of --iters calls after --warmup.
// Writes results_engine.csv into --out and prints one table.
//
//   fs_engine_bench --out DIR [--configs qwen,llama]
//                   [--batches 1,16,64,128,256] [--iters 50] [--warmup 10]
//                   [--methods everything_rows,...] [--hidden_scale 2.5]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/hidden_states.h"
#include "service/backends/cuda/cuda_engine.h"
#include "service/backends/engine.h"
#include "service/backends/sampling_params.h"
#include "service/weights/weights.h"

ABSL_FLAG(std::string, out, ".", "directory for results_engine.csv");
ABSL_FLAG(std::string, configs, "qwen,llama",
          "qwen (V = 151936, D = 4096), "
          "llama (V = 128256, D = 8192), comma-separated");
ABSL_FLAG(std::string, batches, "1,16,64,128,256",
          "batch rows, comma-separated");
ABSL_FLAG(int, iters, 50, "timed calls of each method");
ABSL_FLAG(int, warmup, 10, "untimed calls of each method first");
ABSL_FLAG(std::string, methods, "",
          "methods to time besides plain, comma-separated (empty: all)");
ABSL_FLAG(float, hidden_scale, 2.5f,
          "standard deviation of the hidden states' elements");

namespace flashsampler {
namespace {

struct ModelConfig {
  std::string name;
  int64_t vocab;
  int64_t hidden;
};

// fs_load's ids: spread over the vocabulary by large primes, even, so that
// the bitmask of the even ids allows them.
int32_t SpreadId(int i, int64_t prime, int64_t vocab) {
  return static_cast<int32_t>((2 * i * prime) % vocab) & ~1;
}

SamplingParams MakeParams(const std::string& controls, int64_t vocab) {
  SamplingParams p;
  p.temperature = 0.8f;
  if (controls == "plain") return p;
  p.top_k = 50;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  if (controls == "filters") return p;
  for (int i = 0; i < 64; ++i) {
    p.logit_bias.push_back(
        {SpreadId(i, 7919, vocab), 0.5f - 0.015625f * static_cast<float>(i)});
    p.prompt_token_ids.push_back(SpreadId(i, 104729, vocab));
    p.output_token_counts.push_back({SpreadId(i, 1299709, vocab), 1 + i % 4});
  }
  p.repetition_penalty = 1.1f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.3f;
  p.allowed_bitmask.assign(static_cast<size_t>((vocab + 31) / 32), 0x55555555u);
  if (controls == "everything_raw") {
    p.logprobs.sampled = true;
    p.logprobs.top_n = 5;
    p.logprobs.raw = true;
  }
  return p;
}

struct Method {
  std::string name;
  std::string controls;
  bool own_params;  // each row its own copy
};

struct Timing {
  std::vector<double> us;
  int64_t fallback_rows = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

double Mean(const std::vector<double>& v) {
  double sum = 0.0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
}

std::vector<int> ParseInts(const std::string& list) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int value = 0;
    if (absl::SimpleAtoi(item, &value)) out.push_back(value);
  }
  return out;
}

int Run() {
  const std::vector<ModelConfig> known = {{"qwen", 151936, 4096},
                                          {"llama", 128256, 8192}};
  const std::vector<Method> all_methods = {
      {"plain", "plain", false},
      {"filters", "filters", false},
      {"everything_params", "everything", false},
      {"everything_rows", "everything", true},
      {"everything_raw_params", "everything_raw", false},
      {"everything_raw_rows", "everything_raw", true},
  };
  // plain first: every ratio is to it.
  const std::vector<std::string> wanted =
      absl::StrSplit(absl::GetFlag(FLAGS_methods), ',', absl::SkipEmpty());
  std::vector<Method> methods;
  for (const Method& method : all_methods) {
    if (method.name == "plain" || wanted.empty() ||
        std::find(wanted.begin(), wanted.end(), method.name) != wanted.end()) {
      methods.push_back(method);
    }
  }
  if (methods.size() !=
      (wanted.empty() ? all_methods.size() : wanted.size() + 1)) {
    std::fprintf(stderr, "fs_engine_bench: --methods: one of %s\n",
                 "filters, everything_params, everything_rows, "
                 "everything_raw_params, everything_raw_rows");
    return 1;
  }
  const std::vector<int> batches = ParseInts(absl::GetFlag(FLAGS_batches));
  const int iters = absl::GetFlag(FLAGS_iters);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const std::string csv_path =
      absl::StrCat(absl::GetFlag(FLAGS_out), "/results_engine.csv");
  FILE* csv = std::fopen(csv_path.c_str(), "w");
  if (csv == nullptr) {
    std::fprintf(stderr, "fs_engine_bench: cannot write %s\n",
                 csv_path.c_str());
    return 1;
  }
  std::fprintf(csv,
               "config,batch,method,median_us,mean_us,ratio_to_plain,"
               "fallback_rows\n");
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_configs), ',', absl::SkipEmpty())) {
    auto config =
        std::find_if(known.begin(), known.end(),
                     [&](const ModelConfig& c) { return c.name == name; });
    if (config == known.end()) {
      std::fprintf(stderr, "fs_engine_bench: unknown config %s\n",
                   std::string(name).c_str());
      return 1;
    }
    WeightsOptions weights_options;
    weights_options.source =
        absl::StrCat("synthetic:vocab=", config->vocab,
                     ",hidden=", config->hidden, ",seed=1,dtype=bf16");
    auto weights = Weights::Load(weights_options);
    if (!weights.ok()) {
      std::fprintf(stderr, "fs_engine_bench: %s\n",
                   weights.status().ToString().c_str());
      return 1;
    }
    const int max_rows = *std::max_element(batches.begin(), batches.end());
    CudaEngineOptions engine_options;
    engine_options.max_batch_rows = max_rows;
    engine_options.slots = 1;
    auto engine = CreateCudaEngine(
        std::shared_ptr<const Weights>(std::move(weights).value()),
        engine_options);
    if (!engine.ok()) {
      std::fprintf(stderr, "fs_engine_bench: %s\n",
                   engine.status().ToString().c_str());
      return 1;
    }
    const EngineInfo& info = (*engine)->info();
    const HiddenStates hidden =
        RandomHiddenStates(max_rows, info.hidden_size, /*seed=*/7,
                           info.input_dtype, absl::GetFlag(FLAGS_hidden_scale));
    std::memcpy((*engine)->slot_input(0), hidden.data.data(),
                hidden.data.size());
    std::printf("== %s (V = %lld, D = %lld): %s\n", config->name.c_str(),
                static_cast<long long>(info.vocab_size),
                static_cast<long long>(info.hidden_size),
                info.controls_path.c_str());
    std::printf("%6s %-24s %10s %10s %8s %10s\n", "B", "method", "median us",
                "mean us", "x plain", "fallbacks");
    for (int rows : batches) {
      // Each method's params: one for every row, or a copy per row.
      std::vector<std::vector<SamplingParams>> params(methods.size());
      std::vector<std::vector<RowSpec>> specs(methods.size());
      for (size_t m = 0; m < methods.size(); ++m) {
        const SamplingParams p =
            MakeParams(methods[m].controls, info.vocab_size);
        params[m].assign(methods[m].own_params ? rows : 1, p);
        for (int r = 0; r < rows; ++r) {
          specs[m].push_back(
              {&params[m][methods[m].own_params ? r : 0],
               /*seed=*/0x9e3779b97f4a7c15ull * static_cast<uint64_t>(r + 1),
               /*step=*/0});
        }
      }
      std::vector<Timing> timings(methods.size());
      std::vector<RowResult> results;
      for (int it = 0; it < warmup + iters; ++it) {
        for (size_t m = 0; m < methods.size(); ++m) {
          for (RowSpec& spec : specs[m]) spec.step = static_cast<uint64_t>(it);
          const BatchView batch{0, rows, specs[m].data()};
          const auto start = std::chrono::steady_clock::now();
          const absl::Status status = (*engine)->Sample(batch, &results);
          const auto end = std::chrono::steady_clock::now();
          if (!status.ok()) {
            std::fprintf(stderr, "fs_engine_bench: %s B=%d: %s\n",
                         methods[m].name.c_str(), rows,
                         status.ToString().c_str());
            return 1;
          }
          for (const RowResult& result : results) {
            if (!result.error.empty()) {
              std::fprintf(stderr, "fs_engine_bench: %s B=%d: row error %s\n",
                           methods[m].name.c_str(), rows, result.error.c_str());
              return 1;
            }
            if (it >= warmup && result.exact_fallback != nullptr) {
              ++timings[m].fallback_rows;
            }
          }
          if (it >= warmup) {
            timings[m].us.push_back(
                std::chrono::duration<double, std::micro>(end - start).count());
          }
        }
      }
      const double plain = Median(timings[0].us);
      for (size_t m = 0; m < methods.size(); ++m) {
        const double median = Median(timings[m].us);
        const double mean = Mean(timings[m].us);
        std::printf("%6d %-24s %10.1f %10.1f %8.2f %10lld\n", rows,
                    methods[m].name.c_str(), median, mean, median / plain,
                    static_cast<long long>(timings[m].fallback_rows));
        std::fprintf(csv, "%s,%d,%s,%.1f,%.1f,%.3f,%lld\n",
                     config->name.c_str(), rows, methods[m].name.c_str(),
                     median, mean, median / plain,
                     static_cast<long long>(timings[m].fallback_rows));
      }
    }
  }
  std::fclose(csv);
  return 0;
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return flashsampler::Run();
}
