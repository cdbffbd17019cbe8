// fs_controls_bench: what the sampling controls cost on the GPU, against the
// plain fused sampler and the unfused pipelines, in one run on the same data.
// The controlled path is the CUDA backend's: the fused kernel writes fp32
// logits (FusedSampleParams::logits_out), every row greedy since its token
// is not used, and the exact controlled sampler (kernels/controls/) runs
// over them. The unfused baseline is cuBLAS's GEMM with fp32 logits and the
// same exact sampler. "units_*" is the candidate path from the fused
// kernel's unit candidates instead of its logits (the CUDA engine's path for
// rows whose sets a filter closes; with a bitmask or per-token entries the
// units rank by token classes, timed apart as classes_only_* and, with the
// fused kernel, units_no_merge_*; raw logprobs from the units' tails at
// T = 1, on bitmask rows with the bitmasks in the classes, which the engine
// takes where a batch packs few bitmasks); its full-pass-rows column is
// the share of rows it could not certify, which the engine samples again
// from materialized logits. Median of --iters calls after --warmup calls, L2
// flushed before each (bench_common.h). Writes results_controls.csv into
// --out and prints one table.
//
//   fs_controls_bench --out DIR [--configs qwen,llama]
//                     [--batches 1,16,64,128,256] [--iters 50] [--warmup 10]
//                     [--stage1 greedy|sampled] [--multicast on|off]
//                     [--l2_set_aside_mb N] [--interleaved on|off]
//                     [--methods everything,topp0.9,...]
//
// --stage1 sampled scores every row's noise in the controlled path's
// stage 1 too (its tokens are not used): what running the rows greedy
// saves, measured on the whole path. --multicast off launches every fused
// kernel with each CTA loading its own W and H (FusedTuning::multicast_h,
// multicast_w). --l2_set_aside_mb sets aside N MiB of L2 for the unit
// records instead of the engine's default (FusedSampleSetAsideL2ForUnits;
// 0: none), for every method of the run, as the engine's does.
// --interleaved on also times each controlled method from the fused
// kernel (logits and units) call for call with the plain kernel
// (Timer::RunInterleaved): its "_interleaved" row's ratio is to the plain
// kernel's calls of that run, which cancels the drift of the GPU's clock
// at its power cap (B = 256), as fs_bench's interleaved column does; its
// "_over_cublas_interleaved" rows time each path from the fused kernel
// call for call with cuBLAS + the same sampler, their ratio to those calls
// (the CSV's over_fused_plain column holds it).
// --methods runs only the named controlled methods (the names after
// "units_" in the table), so that a profiler sees their kernels alone; the
// plain, logits-out and cuBLAS rows run every time, as the ratios' bases.
//
// Hidden states: "flat" rows are fs_bench's inputs (logits' std about 2.5,
// softmax entropy near ln V); "peaked" rows scale them until the mean
// softmax entropy of the first rows is about 2.5 nats, the spread of a
// language model's next-token distribution (the printed entropies say what
// each run used).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/baselines/baselines.h"
#include "kernels/baselines/bench_common.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_sampler.h"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {
namespace {

struct Options {
  std::string out_dir = ".";
  std::vector<std::string> configs = {"qwen", "llama"};
  std::vector<int> batches = {1, 16, 64, 128, 256};
  int iters = 50;
  int warmup = 10;
  bool stage1_sampled = false;  // --stage1 sampled
  bool multicast = true;     // --multicast off: FusedTuning::multicast_h and _w
  int l2_set_aside_mb = -1;  // --l2_set_aside_mb; < 0: the default
  bool interleaved = false;  // --interleaved on
  std::vector<std::string> methods;  // --methods; empty: every method
};

struct ModelConfig {
  std::string name;
  int64_t vocab;
  int hidden;
  float scale;  // as fs_bench: inputs uniform in [-scale, scale)
};

bool ParseOptions(int argc, char** argv, Options* options) {
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--out") {
      options->out_dir = value;
    } else if (flag == "--configs") {
      options->configs = SplitCommas(value);
    } else if (flag == "--batches") {
      options->batches = SplitInts(value);
    } else if (flag == "--iters") {
      options->iters = std::atoi(value.c_str());
    } else if (flag == "--warmup") {
      options->warmup = std::atoi(value.c_str());
    } else if (flag == "--stage1" &&
               (value == "greedy" || value == "sampled")) {
      options->stage1_sampled = value == "sampled";
    } else if (flag == "--multicast" && (value == "on" || value == "off")) {
      options->multicast = value == "on";
    } else if (flag == "--l2_set_aside_mb") {
      options->l2_set_aside_mb = std::atoi(value.c_str());
    } else if (flag == "--interleaved" && (value == "on" || value == "off")) {
      options->interleaved = value == "on";
    } else if (flag == "--methods") {
      options->methods = SplitCommas(value);
    } else {
      std::fprintf(stderr, "fs_controls_bench: unknown flag %s\n",
                   flag.c_str());
      return false;
    }
  }
  if (argc % 2 == 0) {
    std::fprintf(stderr, "fs_controls_bench: flag %s has no value\n",
                 argv[argc - 1]);
    return false;
  }
  if (!BatchesInRange("fs_controls_bench", options->batches, kMaxFusedBatch))
    return false;
  return options->iters > 0 && options->warmup >= 0;
}

// Softmax entropy (nats) of `logits` scaled by `factor`.
double Entropy(const std::vector<float>& logits, double factor) {
  double max = -INFINITY;
  for (float l : logits) max = std::max(max, factor * l);
  double z = 0, weighted = 0;
  for (float l : logits) {
    const double d = factor * l - max;
    const double e = std::exp(d);
    z += e;
    weighted += e * d;
  }
  return std::log(z) - weighted / z;
}

// The controls each controlled method applies to every row of its batch.
struct Controls {
  std::string name;
  bool peaked = true;  // hidden states: peaked (true) or flat rows
  float temperature = 0.8f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  bool everything = false;  // + bias, penalties, half-vocabulary bitmask,
                            // sampled logprob and top-5
  // The logprobs (the sampled one and the top 5; with `everything` always)
  // in the raw space (the API's default), whose mass at T = 1 the units'
  // tails hold, rather than the processed one.
  bool raw_logprobs = false;
  // The units rank every row by one row of token classes, as a request's
  // rows with shared controls can (UnitCandidates::token_classes_shared).
  bool shared_classes = false;
};

// The row lists of Controls::everything, shared by every row: 64 logit_bias
// entries, a 64-id penalty history (prompt and output ids, all three
// penalties) and a bitmask allowing every other token.
struct EverythingLists {
  std::vector<int32_t> bias_ids, prompt_ids, output_ids, output_counts;
  std::vector<float> bias_values;
  std::vector<uint32_t> bitmask;

  explicit EverythingLists(int64_t vocab) {
    for (int i = 0; i < 64; ++i) {
      bias_ids.push_back(static_cast<int32_t>((i * 2 * 7919) % vocab) & ~1);
      bias_values.push_back(0.5f - 0.015625f * i);
      prompt_ids.push_back(static_cast<int32_t>((i * 2 * 104729) % vocab) & ~1);
      output_ids.push_back(static_cast<int32_t>((i * 2 * 1299709) % vocab) &
                           ~1);
      output_counts.push_back(1 + i % 4);
    }
    bitmask.assign((vocab + 31) / 32, 0x55555555u);  // even ids allowed
  }
};

ControlledPlan MakePlan(const Controls& controls, const EverythingLists& lists,
                        int batch) {
  ControlledPlan plan;
  for (int b = 0; b < batch; ++b) {
    ControlledRowInput in;
    in.temperature = controls.temperature;
    in.top_k = controls.top_k;
    in.top_p = controls.top_p;
    in.min_p = controls.min_p;
    in.seed = 0x9e3779b97f4a7c15ull * (b + 1);
    in.step = 1000 + b;
    if (controls.everything) {
      in.bias_ids = lists.bias_ids.data();
      in.bias_values = lists.bias_values.data();
      in.num_bias = lists.bias_ids.size();
      in.prompt_ids = lists.prompt_ids.data();
      in.num_prompt = lists.prompt_ids.size();
      in.output_ids = lists.output_ids.data();
      in.output_counts = lists.output_counts.data();
      in.num_output = lists.output_ids.size();
      in.repetition_penalty = 1.1f;
      in.presence_penalty = 0.5f;
      in.frequency_penalty = 0.3f;
      in.allowed_bitmask = lists.bitmask.data();
      in.bitmask_words = lists.bitmask.size();
    }
    if (controls.everything || controls.raw_logprobs) {
      in.top_n = 5;
      in.logprob_flags =
          kLogprobSampled | (controls.raw_logprobs ? kLogprobRaw : 0u);
    }
    plan.AddRow(in);
  }
  return plan;
}

bool RunConfig(const ModelConfig& config, const Options& options, Timer& timer,
               cudaStream_t stream, cublasHandle_t cublas, FILE* csv) {
  const int64_t vocab = config.vocab;
  const int hidden = config.hidden;
  const int max_batch = kMaxFusedBatch;
  const size_t weight_bytes = static_cast<size_t>(vocab) * hidden * 2;
  void* weights = nullptr;
  void* flat = nullptr;
  void* peaked = nullptr;
  float* logits = nullptr;
  int32_t* tokens = nullptr;
  float* inv_temperature = nullptr;
  float* greedy_inv_temperature = nullptr;  // all 0: every row greedy
  float* unit_inv_temperature = nullptr;    // all 1: raw logprobs' tails
  uint64_t* seeds = nullptr;
  uint64_t* steps = nullptr;
  void* fused_workspace = nullptr;
  void* controlled_workspace = nullptr;
  void* plan_bytes = nullptr;
  UnitRecord* unit_records = nullptr;
  uint32_t* unit_row_maxima = nullptr;     // [2][max_batch]: bound, then top
  uint32_t* unit_token_classes = nullptr;  // [max_batch][class words]
  int32_t* out_tokens = nullptr;
  float* out_logprobs = nullptr;
  int32_t* out_top_ids = nullptr;
  float* out_top_logprobs = nullptr;
  int32_t* out_top_count = nullptr;
  int32_t* out_status = nullptr;
  int32_t* out_error_token = nullptr;
  int32_t* out_certified = nullptr;
  constexpr size_t kPlanBytes = 64u << 20;
  constexpr int kMaxTopN = 8;
  const size_t fused_workspace_bytes =
      FusedSampleWorkspaceSize(max_batch, vocab, hidden);
  const size_t controlled_workspace_bytes =
      ControlledSampleWorkspaceSize(max_batch, vocab);
  const size_t hidden_bytes = static_cast<size_t>(max_batch) * hidden * 2;
  BENCH_CHECK(cudaMalloc(&weights, weight_bytes));
  BENCH_CHECK(cudaMalloc(&flat, hidden_bytes));
  BENCH_CHECK(cudaMalloc(&peaked, hidden_bytes));
  BENCH_CHECK(cudaMalloc(&logits, sizeof(float) * max_batch * vocab));
  BENCH_CHECK(cudaMalloc(&tokens, sizeof(int32_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&inv_temperature, sizeof(float) * max_batch));
  BENCH_CHECK(cudaMalloc(&greedy_inv_temperature, sizeof(float) * max_batch));
  BENCH_CHECK(cudaMemset(greedy_inv_temperature, 0, sizeof(float) * max_batch));
  BENCH_CHECK(cudaMalloc(&unit_inv_temperature, sizeof(float) * max_batch));
  {
    const std::vector<float> ones(max_batch, 1.0f);
    BENCH_CHECK(cudaMemcpy(unit_inv_temperature, ones.data(),
                           sizeof(float) * max_batch, cudaMemcpyHostToDevice));
  }
  BENCH_CHECK(cudaMalloc(&seeds, sizeof(uint64_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&steps, sizeof(uint64_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&fused_workspace, fused_workspace_bytes));
  BENCH_CHECK(cudaMemset(fused_workspace, 0, fused_workspace_bytes));
  BENCH_CHECK(cudaMalloc(&controlled_workspace, controlled_workspace_bytes));
  BENCH_CHECK(cudaMalloc(&plan_bytes, kPlanBytes));
  const size_t batch_units =
      static_cast<size_t>(max_batch) * static_cast<size_t>(UnitsPerRow(vocab));
  const size_t unit_maxima_bytes = 2 * sizeof(uint32_t) * max_batch;
  BENCH_CHECK(cudaMalloc(&unit_records, sizeof(UnitRecord) * batch_units));
  BENCH_CHECK(cudaMalloc(&unit_row_maxima, unit_maxima_bytes));
  BENCH_CHECK(cudaMemset(unit_row_maxima, 0, unit_maxima_bytes));
  BENCH_CHECK(cudaMalloc(&unit_token_classes,
                         sizeof(uint32_t) * max_batch *
                             static_cast<size_t>(UnitClassWordsPerRow(vocab))));
  BENCH_CHECK(cudaMalloc(&out_tokens, sizeof(int32_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&out_logprobs, sizeof(float) * max_batch));
  BENCH_CHECK(cudaMalloc(&out_top_ids, sizeof(int32_t) * max_batch * kMaxTopN));
  BENCH_CHECK(
      cudaMalloc(&out_top_logprobs, sizeof(float) * max_batch * kMaxTopN));
  BENCH_CHECK(cudaMalloc(&out_top_count, sizeof(int32_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&out_status, sizeof(int32_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&out_error_token, sizeof(int32_t) * max_batch));
  BENCH_CHECK(cudaMalloc(&out_certified, sizeof(int32_t) * max_batch));
  BENCH_CHECK(LaunchFillUniform(weights, vocab * hidden, DType::kBf16, 0x1234,
                                config.scale, stream));
  BENCH_CHECK(LaunchFillUniform(flat, static_cast<int64_t>(max_batch) * hidden,
                                DType::kBf16, 0x5678, config.scale, stream));
  std::vector<float> host_inv_t(max_batch, 1.0f / 0.8f);
  std::vector<uint64_t> host_seeds(max_batch), host_steps(max_batch);
  for (int b = 0; b < max_batch; ++b) {
    host_seeds[b] = 0x9e3779b97f4a7c15ull * (b + 1);
    host_steps[b] = 1000 + b;
  }
  BENCH_CHECK(cudaMemcpy(inv_temperature, host_inv_t.data(),
                         sizeof(float) * max_batch, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(seeds, host_seeds.data(), sizeof(uint64_t) * max_batch,
                         cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(steps, host_steps.data(), sizeof(uint64_t) * max_batch,
                         cudaMemcpyHostToDevice));

  // The fused kernel over `batch` rows of `h` with 1 / T `inv_t` (0:
  // greedy); the callers add its outputs beyond the tokens.
  auto fused_params = [&](const void* h, int batch, const float* inv_t) {
    FusedSampleParams params;
    params.weights = weights;
    params.hidden = h;
    params.hidden_capacity_rows = max_batch;
    params.dtype = DType::kBf16;
    params.vocab_rows = vocab;
    params.hidden_size = hidden;
    params.batch = batch;
    params.inv_temperature = inv_t;
    params.seeds = seeds;
    params.steps = steps;
    params.token_ids = tokens;
    params.tuning.multicast_h = options.multicast;
    params.tuning.multicast_w = options.multicast;
    return params;
  };
  // logits_out: also write fp32 logits.
  auto fused = [&](const void* h, int batch, float* logits_out,
                   const float* inv_t) {
    FusedSampleParams params = fused_params(h, batch, inv_t);
    params.logits_out = logits_out;
    return LaunchFusedSample(params, fused_workspace, fused_workspace_bytes,
                             stream);
  };
  // The unit candidates instead of logits, rows greedy, each row's tail
  // mass summed at `tails` (1 / 0.8, or 0 for none), ranked by `classes`
  // where not null (the entries' logits to `logits`): what the CUDA engine
  // launches for a batch its units can serve.
  auto fused_units = [&](const void* h, int batch, const float* tails,
                         const uint32_t* classes, bool shared_classes) {
    FusedSampleParams params = fused_params(h, batch, greedy_inv_temperature);
    params.unit_candidates.records = unit_records;
    params.unit_candidates.row_bound = unit_row_maxima;
    params.unit_candidates.row_top = unit_row_maxima + max_batch;
    params.unit_candidates.tail_inv_temperature = tails;
    if (classes != nullptr) {
      params.unit_candidates.token_classes = classes;
      params.unit_candidates.token_classes_shared = shared_classes;
      params.unit_candidates.entry_logits = logits;
    }
    return LaunchFusedSample(params, fused_workspace, fused_workspace_bytes,
                             stream);
  };

  // The peaked rows: the flat rows scaled so that the first rows' mean
  // softmax entropy (T = 1) is about 2.5 nats; logits scale with h.
  constexpr int kProbeRows = 8;
  BENCH_CHECK(fused(flat, kProbeRows, logits, inv_temperature));
  // The stream is non-blocking: cudaMemcpy would not wait for it.
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> probe(static_cast<size_t>(kProbeRows) * vocab);
  BENCH_CHECK(cudaMemcpy(probe.data(), logits, sizeof(float) * probe.size(),
                         cudaMemcpyDeviceToHost));
  auto mean_entropy = [&](double factor) {
    double sum = 0;
    for (int r = 0; r < kProbeRows; ++r) {
      std::vector<float> row(probe.begin() + r * vocab,
                             probe.begin() + (r + 1) * vocab);
      sum += Entropy(row, factor);
    }
    return sum / kProbeRows;
  };
  double lo = 1.0, hi = 64.0;  // entropy falls as the factor grows
  for (int i = 0; i < 40; ++i) {
    const double mid = std::sqrt(lo * hi);
    (mean_entropy(mid) > 2.5 ? lo : hi) = mid;
  }
  const double factor = hi;
  // Logits are linear in h: the same uniform draws at factor x the scale
  // give factor x the logits (up to bf16 rounding).
  BENCH_CHECK(LaunchFillUniform(
      peaked, static_cast<int64_t>(max_batch) * hidden, DType::kBf16, 0x5678,
      static_cast<float>(config.scale * factor), stream));
  std::printf(
      "[%s] flat rows: entropy %.2f nats (T = 1); peaked rows: inputs x%.2f, "
      "entropy %.2f nats\n",
      config.name.c_str(), mean_entropy(1.0), factor, mean_entropy(factor));

  const EverythingLists lists(vocab);
  const std::vector<Controls> controlled = {
      {"topk50_topp0.9_minp0.05", true, 0.8f, 50, 0.9f, 0.05f, false},
      {"everything", true, 0.8f, 50, 0.9f, 0.05f, true},
      {"everything_raw", true, 0.8f, 50, 0.9f, 0.05f, true, true},
      {"everything_raw_shared_classes", true, 0.8f, 50, 0.9f, 0.05f, true, true,
       true},
      {"topk50_topp0.9_minp0.05_raw_logprobs", true, 0.8f, 50, 0.9f, 0.05f,
       false, true},
      {"topp0.9", true, 0.8f, 0, 0.9f, 0.0f, false},
      {"topp0.95", true, 0.8f, 0, 0.95f, 0.0f, false},
      {"topp0.9_flat", false, 0.8f, 0, 0.9f, 0.0f, false},
  };
  for (const std::string& name : options.methods) {
    if (std::none_of(controlled.begin(), controlled.end(),
                     [&](const Controls& c) { return c.name == name; })) {
      std::fprintf(stderr, "fs_controls_bench: --methods: no method %s\n",
                   name.c_str());
      return false;
    }
  }

  for (int batch : options.batches) {
    struct Result {
      std::string method;
      Stats stats;
      double fallback = -1.0;  // rows the full passes sampled, < 0: n/a
      double plain_us = 0.0;   // the ratio's reference; 0: fused_plain's
      const char* reference = "fused_plain";  // what plain_us timed
    };
    std::vector<Result> results;
    auto time = [&](const std::string& name,
                    const std::function<cudaError_t()>& launch) {
      Stats stats;
      if (!timer.Run(options.warmup, launch, &stats)) return false;
      results.push_back({name, stats});
      return true;
    };
    const std::function<cudaError_t()> plain_launch = [&] {
      return fused(peaked, batch, nullptr, inv_temperature);
    };
    // `launch` and `reference` call for call (--interleaved on): the row
    // `name` + `suffix`, its ratio to the reference's calls.
    auto time_against = [&](const std::string& name,
                            const std::function<cudaError_t()>& launch,
                            const std::function<cudaError_t()>& reference,
                            const char* reference_name, const char* suffix) {
      if (!options.interleaved) return true;
      Stats stats;
      Stats reference_stats;
      if (!timer.RunInterleaved(options.warmup, launch, reference, &stats,
                                &reference_stats)) {
        return false;
      }
      results.push_back({name + suffix, stats, -1.0, reference_stats.median_us,
                         reference_name});
      return true;
    };
    auto time_interleaved = [&](const std::string& name,
                                const std::function<cudaError_t()>& launch) {
      return time_against(name, launch, plain_launch, "fused_plain",
                          "_interleaved");
    };
    // fused_logits_out is the controlled path's stage 1 (rows greedy);
    // fused_logits_out_sampled scores every row's noise as well.
    if (!time("fused_plain", plain_launch) ||
        !time("fused_logits_out",
              [&] {
                return fused(peaked, batch, logits, greedy_inv_temperature);
              }) ||
        !time("fused_logits_out_sampled",
              [&] { return fused(peaked, batch, logits, inv_temperature); }) ||
        !time("fused_units_out",
              [&] {
                return fused_units(peaked, batch, inv_temperature, nullptr,
                                   false);
              }) ||
        // fused_units_out's records had no merge kernel to discard them
        // from L2's set-aside: let the next methods find it free, as every
        // launch of the engine's leaves it.
        cudaStreamSynchronize(stream) != cudaSuccess ||
        cudaCtxResetPersistingL2Cache() != cudaSuccess ||
        !time("cublas_only", [&] {
          return CublasLogits(cublas, weights, peaked, DType::kBf16, vocab,
                              hidden, batch, logits, DType::kBf16, stream);
        })) {
      return false;
    }
    // fused_units_out ran without the merge kernel, which resets the rows'
    // maxima for the next launch.
    BENCH_CHECK(cudaMemsetAsync(unit_row_maxima, 0, unit_maxima_bytes, stream));
    for (const Controls& controls : controlled) {
      if (!options.methods.empty() &&
          std::find(options.methods.begin(), options.methods.end(),
                    controls.name) == options.methods.end()) {
        continue;
      }
      const ControlledPlan plan = MakePlan(controls, lists, batch);
      const std::vector<unsigned char> bytes = plan.bytes();
      if (bytes.size() > kPlanBytes) {
        std::fprintf(stderr, "fs_controls_bench: plan of %zu bytes\n",
                     bytes.size());
        return false;
      }
      BENCH_CHECK(cudaMemcpy(plan_bytes, bytes.data(), bytes.size(),
                             cudaMemcpyHostToDevice));
      ControlledSampleParams params;
      plan.BindInputs(plan_bytes, vocab, &params);
      params.logits = logits;
      params.logits_row_stride = vocab;
      params.token_ids = out_tokens;
      params.sampled_logprobs = out_logprobs;
      params.top_token_ids = out_top_ids;
      params.top_logprobs = out_top_logprobs;
      params.top_count = out_top_count;
      params.status = out_status;
      params.error_token = out_error_token;
      params.certified = out_certified;
      if (params.max_samples > 1 || params.max_top_n > kMaxTopN) {
        std::fprintf(stderr, "fs_controls_bench: outputs too small\n");
        return false;
      }
      const void* h = controls.peaked ? peaked : flat;
      // Tails only where the merge kernel reads them, as the engine asks.
      ControlledUnits units;
      units.records = unit_records;
      units.row_bound = unit_row_maxima;
      units.row_top = unit_row_maxima + max_batch;
      // Raw logprobs: the mass at T = 1 (no row here also wants a top_p
      // tail: the engine takes such rows from the logits).
      units.tail_inv_temperature =
          controls.raw_logprobs ? unit_inv_temperature
          : controls::UnitTailWanted(controls.temperature, controls.top_k,
                                     controls.top_p, vocab)
              ? inv_temperature
              : greedy_inv_temperature;
      // Per-token entries: the units rank by token classes; with raw
      // logprobs on bitmask rows, classes made with the bitmasks (the
      // engine's where a batch packs at most one bitmask per 4 rows, as a
      // request's shared params do; rows each with their own take the
      // logits). Without, the classes leave the bitmask to the merge
      // kernel, as the engine's do.
      if (controls.everything) units.token_classes = unit_token_classes;
      units.bitmask_in_classes = controls.everything && controls.raw_logprobs;
      ControlledSampleParams class_params = params;
      if (!units.bitmask_in_classes) class_params.bitmask = nullptr;
      if (controls.shared_classes) class_params.rows = 1;
      auto sample = [&] {
        return LaunchControlledSample(params, controlled_workspace,
                                      controlled_workspace_bytes, stream);
      };
      // The share of rows the candidate path could not certify, as the last
      // timed call left it.
      auto record_fallback = [&] {
        std::vector<int32_t> certified(batch);
        if (cudaMemcpy(certified.data(), out_certified, sizeof(int32_t) * batch,
                       cudaMemcpyDeviceToHost) != cudaSuccess) {
          return false;
        }
        int full = 0;
        for (int32_t v : certified) full += v == 0;
        results.back().fallback = static_cast<double>(full) / batch;
        return true;
      };
      const std::function<cudaError_t()> logits_launch = [&] {
        const cudaError_t error = fused(
            h, batch, logits,
            options.stage1_sampled ? inv_temperature : greedy_inv_temperature);
        return error != cudaSuccess ? error : sample();
      };
      // The units' candidate path, its uncertified rows would take the
      // logits' path as well: the token classes' kernel (where the units
      // rank by classes), the fused kernel, the merge kernel.
      const std::function<cudaError_t()> classes_launch = [&] {
        return units.token_classes == nullptr
                   ? cudaSuccess
                   : LaunchUnitTokenClasses(class_params, unit_token_classes,
                                            stream);
      };
      const std::function<cudaError_t()> ranked_launch = [&] {
        const cudaError_t error = classes_launch();
        return error != cudaSuccess
                   ? error
                   : fused_units(h, batch, units.tail_inv_temperature,
                                 units.token_classes, controls.shared_classes);
      };
      const std::function<cudaError_t()> units_launch = [&] {
        const cudaError_t error = ranked_launch();
        return error != cudaSuccess ? error
                                    : LaunchControlledSampleFromUnits(
                                          params, units, controlled_workspace,
                                          controlled_workspace_bytes, stream);
      };
      // Where the units' path spends its time when it ranks by token
      // classes: their kernel alone, and it with the fused kernel (the
      // merge kernel is the rest of the units_ row).
      if (units.token_classes != nullptr &&
          (!time("classes_only_" + controls.name, classes_launch) ||
           !time("units_no_merge_" + controls.name, ranked_launch))) {
        return false;
      }
      const std::function<cudaError_t()> cublas_launch = [&] {
        const cudaError_t error =
            CublasLogits(cublas, weights, h, DType::kBf16, vocab, hidden, batch,
                         logits, DType::kFp32, stream);
        return error != cudaSuccess ? error : sample();
      };
      // At 256 rows the GPU's clock follows its power cap from call to
      // call: the fused paths against the cuBLAS baseline call for call too.
      if (!time("fused_" + controls.name, logits_launch) ||
          !record_fallback() ||
          !time_interleaved("fused_" + controls.name, logits_launch) ||
          !time("units_" + controls.name, units_launch) || !record_fallback() ||
          !time_interleaved("units_" + controls.name, units_launch) ||
          !time("sampler_only_" + controls.name, sample) ||
          !time("cublas_" + controls.name, cublas_launch) ||
          !record_fallback() ||
          !time_against("fused_" + controls.name, logits_launch, cublas_launch,
                        "cublas_with_sampler", "_over_cublas_interleaved") ||
          !time_against("units_" + controls.name, units_launch, cublas_launch,
                        "cublas_with_sampler", "_over_cublas_interleaved")) {
        return false;
      }
      // Every row must have sampled: a failed row would time nothing.
      std::vector<int32_t> status(batch);
      BENCH_CHECK(cudaMemcpy(status.data(), out_status, sizeof(int32_t) * batch,
                             cudaMemcpyDeviceToHost));
      for (int b = 0; b < batch; ++b) {
        if (status[b] != kControlledOk) {
          std::fprintf(stderr, "fs_controls_bench: %s row %d status %d\n",
                       controls.name.c_str(), b, status[b]);
          return false;
        }
      }
    }
    const double plain = results[0].stats.median_us;
    for (const Result& r : results) {
      const double reference = r.plain_us > 0.0 ? r.plain_us : plain;
      std::string fallback;
      if (r.fallback >= 0.0) {
        char text[32];
        std::snprintf(text, sizeof(text), "%.4f", r.fallback);
        fallback = text;
      }
      std::fprintf(csv, "%s,%lld,%d,%d,%s,%.2f,%.2f,%.2f,%.4f,%s\n",
                   config.name.c_str(), static_cast<long long>(vocab), hidden,
                   batch, r.method.c_str(), r.stats.median_us, r.stats.p10_us,
                   r.stats.p90_us, r.stats.median_us / reference,
                   fallback.c_str());
      std::printf("[%s] B=%3d %-34s %9.1f us  %6.3fx %s%s%s\n",
                  config.name.c_str(), batch, r.method.c_str(),
                  r.stats.median_us, r.stats.median_us / reference, r.reference,
                  fallback.empty() ? "" : "  full-pass rows ",
                  fallback.c_str());
    }
    std::fflush(csv);
    std::fflush(stdout);
  }
  for (void* pointer :
       {weights, flat, peaked, static_cast<void*>(logits),
        static_cast<void*>(tokens), static_cast<void*>(inv_temperature),
        static_cast<void*>(seeds), static_cast<void*>(steps), fused_workspace,
        controlled_workspace, plan_bytes, static_cast<void*>(out_tokens),
        static_cast<void*>(out_logprobs), static_cast<void*>(out_top_ids),
        static_cast<void*>(out_top_logprobs), static_cast<void*>(out_top_count),
        static_cast<void*>(out_status), static_cast<void*>(out_error_token),
        static_cast<void*>(out_certified)}) {
    BENCH_CHECK(cudaFree(pointer));
  }
  for (void* pointer :
       {static_cast<void*>(greedy_inv_temperature),
        static_cast<void*>(unit_inv_temperature),
        static_cast<void*>(unit_records), static_cast<void*>(unit_row_maxima),
        static_cast<void*>(unit_token_classes)}) {
    BENCH_CHECK(cudaFree(pointer));
  }
  return true;
}

bool Main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, &options)) return false;
  cudaDeviceProp prop;
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaGetDeviceProperties(&prop, device));
  cudaStream_t stream;
  BENCH_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "fs_controls_bench: cublasCreate failed\n");
    return false;
  }
  size_t set_aside = 0;
  const cudaError_t set = FusedSampleSetAsideL2ForUnits(
      options.l2_set_aside_mb < 0
          ? -1
          : static_cast<int64_t>(options.l2_set_aside_mb) << 20,
      &set_aside);
  if (set != cudaSuccess) {  // MIG, MPS: the engine goes on without it too
    std::printf("fs_controls_bench: no L2 set-aside: %s\n",
                cudaGetErrorString(set));
  }
  Timer timer;
  if (!timer.Init(options.iters, 2 * static_cast<size_t>(prop.l2CacheSize),
                  stream)) {
    return false;
  }
  const std::string path = options.out_dir + "/results_controls.csv";
  FILE* csv = std::fopen(path.c_str(), "w");
  if (csv == nullptr) {
    std::fprintf(stderr, "fs_controls_bench: cannot write %s\n", path.c_str());
    return false;
  }
  std::printf(
      "fs_controls_bench on %s, %d calls after %d warm-up, %.1f MiB of L2 set "
      "aside for the unit records\n",
      prop.name, options.iters, options.warmup,
      static_cast<double>(set_aside) / (1 << 20));
  std::fprintf(csv,
               "config,vocab,hidden,batch,method,median_us,p10_us,p90_us,"
               "over_fused_plain,full_pass_rows\n");
  const std::vector<ModelConfig> known = {
      {"qwen", 151936, 4096, 0.35f},
      {"llama", 128256, 8192, 0.29f},
  };
  for (const std::string& name : options.configs) {
    const auto it =
        std::find_if(known.begin(), known.end(),
                     [&](const ModelConfig& c) { return c.name == name; });
    if (it == known.end()) {
      std::fprintf(stderr, "fs_controls_bench: unknown config %s\n",
                   name.c_str());
      return false;
    }
    if (!RunConfig(*it, options, timer, stream, cublas, csv)) return false;
  }
  std::fclose(csv);
  cublasDestroy(cublas);
  return true;
}

}  // namespace
}  // namespace flashsampler

int main(int argc, char** argv) {
  return flashsampler::Main(argc, argv) ? 0 : 1;
}
