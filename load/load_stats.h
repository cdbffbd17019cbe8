// Load-test bookkeeping: one record per call, latency percentiles, error
// counts by gRPC code, and the CSV files plot_latency.py reads.
#ifndef FLASHSAMPLER_LOAD_LOAD_STATS_H_
#define FLASHSAMPLER_LOAD_LOAD_STATS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace flashsampler {

struct CallRecord {
  // Seconds from the start of the measured window to the call's intended
  // start: its scheduled arrival in open loop (so that a slow server cannot
  // hide its queueing by delaying our sends: no coordinated omission), the
  // actual send in closed loop.
  double start_s = 0.0;
  // Intended start -> answer, seconds.
  double latency_s = 0.0;
  absl::StatusCode code = absl::StatusCode::kOk;
  int rows = 0;
};

struct LoadSummary {
  double duration_s = 0.0;  // measured window
  int64_t requests = 0;     // calls that ended (any code)
  int64_t ok = 0;
  int64_t errors = 0;
  // Open loop: arrivals not sent because max_outstanding calls were already
  // in flight (the client, not the server, was the bottleneck).
  int64_t dropped = 0;
  double throughput_rps = 0.0;  // OK calls per second
  double rows_per_s = 0.0;      // rows of OK calls per second
  // Latency of OK calls, seconds (nearest-rank percentiles; 0 without any).
  double mean_s = 0.0;
  double p50_s = 0.0;
  double p90_s = 0.0;
  double p99_s = 0.0;
  double p999_s = 0.0;
  double max_s = 0.0;
  std::map<std::string, int64_t> codes;  // "OK", "UNAVAILABLE", ... -> count
};

// Nearest-rank percentile (q in [0, 1]) of ascending `sorted`: the smallest
// value with at least q of the values at or below it. 0 when empty.
double Percentile(const std::vector<double>& sorted, double q);

LoadSummary Summarize(const std::vector<CallRecord>& records, double duration_s,
                      int64_t dropped);

// Human-readable block for stdout.
std::string FormatSummary(const LoadSummary& summary);

// One line per call: start_s,latency_s,code,rows (header first).
absl::Status WriteRecordsCsv(const std::string& path,
                             const std::vector<CallRecord>& records);

// Appends one line (and the header when the file is new or empty): the run's
// label and settings, then the summary. One file collects a sweep.
struct RunLabel {
  std::string label;
  std::string mode;  // "closed" or "open"
  int concurrency = 0;
  double rate = 0.0;
  int rows = 0;
};
absl::Status AppendSummaryCsv(const std::string& path, const RunLabel& run,
                              const LoadSummary& summary);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_LOAD_LOAD_STATS_H_
