// The state of one row through a CpuSampler::Sample() call: its plan (from
// the controls), what each sweep over the vocabulary found, and what one
// task (row block x chunk) accumulates before merging into the row.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_STATE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_STATE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "service/backends/cpu/filters.h"
#include "service/backends/cpu/logprobs.h"
#include "service/backends/cpu/penalties.h"
#include "service/backends/cpu/sample.h"
#include "service/backends/cpu/sampling_order.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace cpu {

// What the next sweep computes for a row: row statistics (pass 1 of filtered
// rows), a radix-select histogram, tie counts of the cut value, the sample
// with its logprobs, or the sampled tokens' ranks (a sweep of its own: the
// tokens are known only after the final sweep).
enum class Phase { kStats, kHist, kTies, kFinal, kRank, kDone };
enum class Selecting { kNone, kTopK, kTopP };

struct ChunkFinal {
  std::vector<BestOf> best;  // per sample (one for greedy rows)
  Lse processed;
  Lse raw;
};

struct Row {
  const SamplingParams* params = nullptr;
  uint64_t seed = 0;
  uint64_t step = 0;
  bool greedy = false;
  float inv_t = 1.0f;  // temperature.h
  int n = 1;           // samples computed (1 for greedy rows, then copied)
  std::vector<TokenEdit> edits;
  const uint32_t* bitmask = nullptr;
  bool use_min_p = false;
  bool use_top_k = false;
  bool use_top_p = false;
  bool want_processed_lse = false;
  bool want_raw_lse = false;
  size_t top_n_processed = 0;
  size_t top_n_raw = 0;

  Phase phase = Phase::kDone;
  // The candidate buffer could not certify the cut: exact radix select ran.
  bool used_radix_select = false;

  // Pass 1 (kStats): the row max of x, the allowed count, and the best
  // tokens in the sampling order.
  float x_max = kNegInf;
  uint64_t allowed = 0;
  TopBuffer buffer;
  std::vector<Entry> sorted;  // the buffer's min_p survivors, in order
  float min_floor = kNegInf;  // min_p: keep x >= min_floor
  Cutoff cut_k;
  Cutoff cut_p;
  Selecting selecting = Selecting::kNone;
  RadixSelect select;
  Cutoff* pending_ties = nullptr;
  std::vector<int64_t> tie_counts;  // per chunk

  std::vector<ChunkFinal> finals;  // per chunk
  TopBuffer top_processed;
  TopBuffer top_raw;

  // kRank: each computed sample's value in the logprobs' space (masked raw
  // or processed logit) and the tokens counted at or above it.
  std::vector<float> rank_value;
  std::vector<int64_t> rank_count;

  absl::Mutex mu;  // guards merges from concurrent tasks
  int32_t error_token = kNoToken;
  std::string error;

  void SetError(int32_t token, std::string message) {
    absl::MutexLock lock(&mu);
    if (error.empty() || token < error_token) {
      error_token = token;
      error = std::move(message);
    }
  }
  bool failed() const { return !error.empty(); }
};

struct TaskRow {
  Row* row = nullptr;
  bool failed = false;
  int32_t error_token = kNoToken;
  std::string error;
  // kStats
  float x_max = kNegInf;
  uint64_t allowed = 0;
  TopBuffer buffer;
  // kHist
  std::vector<uint64_t> count;
  std::vector<uint128> mass;
  // kTies
  int64_t ties = 0;
  // kHist, kFinal
  CutoffCursor cursor_k;
  CutoffCursor cursor_p;
  // kFinal
  ChunkFinal fin;
  TopBuffer top_processed;
  TopBuffer top_raw;
  std::vector<NoiseWalk> noise;  // per sample
  // kRank
  std::vector<int64_t> rank_count;  // per computed sample

  void Fail(int32_t token, std::string message) {
    if (!failed || token < error_token) {
      failed = true;
      error_token = token;
      error = std::move(message);
    }
  }
};

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_STATE_H_
