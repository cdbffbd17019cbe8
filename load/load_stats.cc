// Percentiles, summaries and CSV output of the load generator.
#include "load/load_stats.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flashsampler {

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  const double rank = std::ceil(std::clamp(q, 0.0, 1.0) * sorted.size());
  const size_t index =
      rank < 1.0 ? 0
                 : std::min(sorted.size() - 1, static_cast<size_t>(rank) - 1);
  return sorted[index];
}

LoadSummary Summarize(const std::vector<CallRecord>& records, double duration_s,
                      int64_t dropped) {
  LoadSummary summary;
  summary.duration_s = duration_s;
  summary.dropped = dropped;
  std::vector<double> latencies;
  int64_t ok_rows = 0;
  for (const CallRecord& record : records) {
    ++summary.requests;
    ++summary.codes[absl::StatusCodeToString(record.code)];
    if (record.code == absl::StatusCode::kOk) {
      ++summary.ok;
      ok_rows += record.rows;
      latencies.push_back(record.latency_s);
    } else {
      ++summary.errors;
    }
  }
  if (duration_s > 0.0) {
    summary.throughput_rps = static_cast<double>(summary.ok) / duration_s;
    summary.rows_per_s = static_cast<double>(ok_rows) / duration_s;
  }
  if (!latencies.empty()) {
    std::sort(latencies.begin(), latencies.end());
    summary.mean_s = std::accumulate(latencies.begin(), latencies.end(), 0.0) /
                     static_cast<double>(latencies.size());
    summary.p50_s = Percentile(latencies, 0.50);
    summary.p90_s = Percentile(latencies, 0.90);
    summary.p99_s = Percentile(latencies, 0.99);
    summary.p999_s = Percentile(latencies, 0.999);
    summary.max_s = latencies.back();
  }
  return summary;
}

std::string FormatSummary(const LoadSummary& s) {
  std::string out = absl::StrFormat(
      "duration      %.3f s\n"
      "requests      %d (ok %d, errors %d, dropped %d)\n"
      "throughput    %.1f req/s, %.1f rows/s\n"
      "latency (ok)  mean %.3f ms  p50 %.3f ms  p90 %.3f ms  p99 %.3f ms  "
      "p99.9 %.3f ms  max %.3f ms\n"
      "codes        ",
      s.duration_s, s.requests, s.ok, s.errors, s.dropped, s.throughput_rps,
      s.rows_per_s, s.mean_s * 1e3, s.p50_s * 1e3, s.p90_s * 1e3, s.p99_s * 1e3,
      s.p999_s * 1e3, s.max_s * 1e3);
  for (const auto& [code, count] : s.codes) {
    absl::StrAppend(&out, " ", code, "=", count);
  }
  absl::StrAppend(&out, "\n");
  return out;
}

absl::Status WriteRecordsCsv(const std::string& path,
                             const std::vector<CallRecord>& records) {
  std::ofstream out(path);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot write ", path));
  out << "start_s,latency_s,code,rows\n";
  for (const CallRecord& r : records) {
    out << absl::StrFormat("%.6f,%.9f,%s,%d\n", r.start_s, r.latency_s,
                           absl::StatusCodeToString(r.code), r.rows);
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

absl::Status AppendSummaryCsv(const std::string& path, const RunLabel& run,
                              const LoadSummary& s) {
  bool need_header = true;
  {
    std::ifstream existing(path);
    need_header =
        !existing || existing.peek() == std::ifstream::traits_type::eof();
  }
  std::ofstream out(path, std::ios::app);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot write ", path));
  if (need_header) {
    out << "label,mode,concurrency,rate,rows,duration_s,requests,ok,errors,"
           "dropped,throughput_rps,rows_per_s,mean_ms,p50_ms,p90_ms,p99_ms,"
           "p999_ms,max_ms\n";
  }
  out << absl::StrFormat(
      "%s,%s,%d,%.3f,%d,%.3f,%d,%d,%d,%d,%.3f,%.3f,%.6f,%.6f,%.6f,%.6f,%.6f,"
      "%.6f\n",
      run.label, run.mode, run.concurrency, run.rate, run.rows, s.duration_s,
      s.requests, s.ok, s.errors, s.dropped, s.throughput_rps, s.rows_per_s,
      s.mean_s * 1e3, s.p50_s * 1e3, s.p90_s * 1e3, s.p99_s * 1e3,
      s.p999_s * 1e3, s.max_s * 1e3);
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("error writing ", path));
  return absl::OkStatus();
}

}  // namespace flashsampler
