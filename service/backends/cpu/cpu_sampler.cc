// CPU reference sampler. One Sample() call is a series of sweeps over the
// vocabulary; each sweep recomputes logits tile by tile (fixed-shape sgemm)
// and visits them with what each row still needs (row_plan.h, tile_sweep.h):
// row statistics, a radix-select histogram or tie counts (exact top-k / top-p
// cuts the candidate buffer could not certify), the Gumbel-max sample with
// logprobs, and last, for rows that ask for them, the sampled tokens' ranks.
// Unfiltered and greedy rows need one sweep (two with ranks).
#include "service/backends/cpu/cpu_sampler.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "service/backends/cpu/row_plan.h"
#include "service/backends/cpu/row_state.h"
#include "service/backends/cpu/tile_sweep.h"

namespace flashsampler {

using cpu::Phase;
using cpu::Row;
using cpu::TaskRow;

namespace {

// W rows per sgemm. Every product has the shape [row_block, 256] x [256, D]^T
// so that OpenBLAS takes the same kernel and K blocking for every call: a
// logit's rounding then depends only on (h, W row), never on batch size,
// position, chunking or threads (docs/design.md#invariance).
constexpr int64_t kTile = cpu::kTileTokens;

}  // namespace

struct CpuSampler::Call {
  const float* hidden = nullptr;
  int rows = 0;
  float max_gumbel = 0.0f;
  std::vector<std::unique_ptr<Row>> row;
};

CpuSampler::CpuSampler(std::shared_ptr<const std::vector<float>> weights,
                       int64_t vocab, int64_t hidden,
                       const CpuSamplerOptions& options)
    : weights_(std::move(weights)),
      vocab_(vocab),
      hidden_(hidden),
      options_(options) {
  num_tiles_ = (vocab_ + kTile - 1) / kTile;
  tiles_per_chunk_ =
      std::max<int64_t>(1, (options_.chunk_rows + kTile - 1) / kTile);
  num_chunks_ = (num_tiles_ + tiles_per_chunk_ - 1) / tiles_per_chunk_;
  if (vocab_ % kTile != 0) {
    const int64_t full = vocab_ / kTile;
    const int64_t rest = vocab_ - full * kTile;
    tail_tile_.assign(kTile * hidden_, 0.0f);
    std::memcpy(tail_tile_.data(), weights_->data() + full * kTile * hidden_,
                sizeof(float) * rest * hidden_);
  }
  int threads = options_.threads;
  if (threads <= 0)
    threads = static_cast<int>(std::thread::hardware_concurrency());
  // The slot calling ParallelFor is the last of the `threads`.
  pool_ = std::make_unique<ThreadPool>(std::max(1, threads) - 1);
}

absl::StatusOr<std::unique_ptr<CpuSampler>> CpuSampler::Create(
    std::shared_ptr<const std::vector<float>> weights_fp32, int64_t vocab,
    int64_t hidden, const CpuSamplerOptions& options) {
  if (weights_fp32 == nullptr)
    return absl::InvalidArgumentError("weights are null");
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max() - kTile) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab size out of range: ", vocab));
  }
  if (hidden < 1 || hidden > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden size out of range: ", hidden));
  }
  if (static_cast<int64_t>(weights_fp32->size()) != vocab * hidden) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "weights hold %d floats, expected vocab x hidden = %d x %d",
        weights_fp32->size(), vocab, hidden));
  }
  if (options.chunk_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_rows must be >= 1, got ", options.chunk_rows));
  }
  // The pool provides the parallelism; BLAS threads inside each task would
  // only oversubscribe the cores.
  static std::once_flag blas_threads_once;
  std::call_once(blas_threads_once, [] { openblas_set_num_threads(1); });
  // The constructor allocates the zero-padded last tile (kTile x hidden
  // floats) before it starts the pool; no memory for it is a start-up error
  // with a message, not an uncaught std::bad_alloc.
  std::unique_ptr<CpuSampler> sampler;
  try {
    sampler.reset(
        new CpuSampler(std::move(weights_fp32), vocab, hidden, options));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "CpuSampler: cannot allocate the padded last tile of W: ",
        uint64_t{sizeof(float)} * kTile * static_cast<uint64_t>(hidden),
        " bytes"));
  }
  if (!sampler->RowBlockIsPositionInvariant()) sampler->row_block_ = 1;
  return sampler;
}

const float* CpuSampler::Tile(int64_t tile) const {
  if ((tile + 1) * kTile <= vocab_)
    return weights_->data() + tile * kTile * hidden_;
  return tail_tile_.data();
}

void CpuSampler::TileLogits(const float* hblock, int64_t tile,
                            float* out) const {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, row_block_,
              static_cast<int>(kTile), static_cast<int>(hidden_), 1.0f, hblock,
              static_cast<int>(hidden_), Tile(tile), static_cast<int>(hidden_),
              0.0f, out, static_cast<int>(kTile));
}

// Start-up self-check of the BLAS (OpenBLAS picks its kernel per CPU): a row
// must give the same bits at every position of the block, whatever the other
// rows hold. If not, fall back to one row per product (slower, invariant).
bool CpuSampler::RowBlockIsPositionInvariant() const {
  uint32_t state = 0x9e3779b9u;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return static_cast<float>(state >> 8) * 0x1p-23f - 1.0f;
  };
  std::vector<float> h(hidden_);
  for (float& v : h) v = next();
  std::vector<float> block(row_block_ * hidden_, 0.0f);
  std::vector<float> out(row_block_ * kTile), reference(kTile);
  std::memcpy(block.data(), h.data(), sizeof(float) * hidden_);
  TileLogits(block.data(), 0, out.data());
  std::memcpy(reference.data(), out.data(), sizeof(float) * kTile);
  for (int pos = 0; pos < row_block_; ++pos) {
    for (float& v : block) v = next() * 8.0f;
    std::memcpy(block.data() + pos * hidden_, h.data(),
                sizeof(float) * hidden_);
    TileLogits(block.data(), 0, out.data());
    if (std::memcmp(out.data() + pos * kTile, reference.data(),
                    sizeof(float) * kTile) != 0) {
      return false;
    }
  }
  return true;
}

std::vector<std::string> CpuSampler::SupportedControls() const {
  return AllSamplingControls();
}

absl::Status CpuSampler::ComputeLogits(const float* hidden, int rows,
                                       float* logits) {
  if (rows < 0 || (rows > 0 && (hidden == nullptr || logits == nullptr))) {
    return absl::InvalidArgumentError("ComputeLogits: bad rows or null buffer");
  }
  const int blocks = (rows + row_block_ - 1) / row_block_;
  pool_->ParallelFor(blocks * num_chunks_, [&](int64_t task) {
    const int block = static_cast<int>(task / num_chunks_);
    const int64_t chunk = task % num_chunks_;
    const int r0 = block * row_block_;
    const int r1 = std::min(rows, r0 + row_block_);
    std::vector<float> hblock(row_block_ * hidden_, 0.0f);
    std::memcpy(hblock.data(), hidden + r0 * hidden_,
                sizeof(float) * (r1 - r0) * hidden_);
    std::vector<float> out(row_block_ * kTile);
    const int64_t t1 = std::min(num_tiles_, (chunk + 1) * tiles_per_chunk_);
    for (int64_t t = chunk * tiles_per_chunk_; t < t1; ++t) {
      TileLogits(hblock.data(), t, out.data());
      const int64_t begin = t * kTile;
      const int64_t count = std::min(kTile, vocab_ - begin);
      for (int r = r0; r < r1; ++r) {
        std::memcpy(logits + r * vocab_ + begin, out.data() + (r - r0) * kTile,
                    sizeof(float) * count);
      }
    }
  });
  return absl::OkStatus();
}

void CpuSampler::RunTask(Call& call, int block, int64_t chunk) const {
  const int r0 = block * row_block_;
  const int r1 = std::min(call.rows, r0 + row_block_);
  std::vector<TaskRow> trs;
  trs.reserve(r1 - r0);
  std::vector<int> offset;  // row's position in the block
  for (int r = r0; r < r1; ++r) {
    Row& row = *call.row[r];
    if (row.phase == Phase::kDone) continue;
    TaskRow& tr = trs.emplace_back();
    offset.push_back(r - r0);
    tr.row = &row;
    switch (row.phase) {
      case Phase::kStats:
        tr.buffer.Reset(row.buffer.capacity());
        break;
      case Phase::kHist:
        tr.count.assign(row.select.count.size(), 0);
        tr.mass.assign(row.select.mass.size(), 0);
        tr.cursor_k.Start(row.cut_k, chunk);
        break;
      case Phase::kFinal:
        tr.fin.best.assign(row.n, cpu::BestOf{});
        tr.top_processed.Reset(row.top_n_processed);
        tr.top_raw.Reset(row.top_n_raw);
        tr.noise.clear();
        for (int j = 0; j < row.n; ++j) {
          tr.noise.emplace_back(row.seed, row.step, static_cast<uint32_t>(j));
        }
        tr.cursor_k.Start(row.cut_k, chunk);
        tr.cursor_p.Start(row.cut_p, chunk);
        break;
      case Phase::kRank:
        tr.rank_count.assign(row.rank_value.size(), 0);
        tr.cursor_k.Start(row.cut_k, chunk);
        tr.cursor_p.Start(row.cut_p, chunk);
        break;
      case Phase::kTies:
      case Phase::kDone:
        break;
    }
  }
  if (trs.empty()) return;

  std::vector<float> hblock(row_block_ * hidden_, 0.0f);
  std::memcpy(hblock.data(), call.hidden + r0 * hidden_,
              sizeof(float) * (r1 - r0) * hidden_);
  std::vector<float> out(row_block_ * kTile);
  float l[kTile];
  float x[kTile];
  const int64_t t1 = std::min(num_tiles_, (chunk + 1) * tiles_per_chunk_);
  for (int64_t t = chunk * tiles_per_chunk_; t < t1; ++t) {
    TileLogits(hblock.data(), t, out.data());
    const int64_t begin = t * kTile;
    const int count = static_cast<int>(std::min(kTile, vocab_ - begin));
    for (size_t i = 0; i < trs.size(); ++i) {
      TaskRow& tr = trs[i];
      if (tr.failed) continue;
      const Row& row = *tr.row;
      const float* z = out.data() + offset[i] * kTile;
      cpu::Transform(row, begin, count, z, l, x, tr);
      if (tr.failed) continue;
      switch (row.phase) {
        case Phase::kStats:
          cpu::VisitStats(x, begin, count, tr);
          break;
        case Phase::kHist:
          cpu::VisitHist(row, x, begin, count, tr);
          break;
        case Phase::kTies:
          cpu::VisitTies(row, x, count, tr);
          break;
        case Phase::kFinal:
          cpu::VisitFinal(row, z, l, x, begin, count, call.max_gumbel, tr);
          break;
        case Phase::kRank:
          cpu::VisitRank(row, z, x, begin, count, tr);
          break;
        case Phase::kDone:
          break;
      }
    }
  }

  for (TaskRow& tr : trs) {
    Row& row = *tr.row;
    if (tr.failed) {
      row.SetError(tr.error_token, std::move(tr.error));
      continue;
    }
    switch (row.phase) {
      case Phase::kStats: {
        absl::MutexLock lock(&row.mu);
        row.x_max = std::max(row.x_max, tr.x_max);
        row.allowed += tr.allowed;
        row.buffer.Absorb(tr.buffer);
        break;
      }
      case Phase::kHist: {
        absl::MutexLock lock(&row.mu);
        for (size_t b = 0; b < tr.count.size(); ++b)
          row.select.count[b] += tr.count[b];
        for (size_t b = 0; b < tr.mass.size(); ++b)
          row.select.mass[b] += tr.mass[b];
        break;
      }
      case Phase::kTies:
        row.tie_counts[chunk] = tr.ties;  // one task per (row, chunk): no race
        break;
      case Phase::kFinal: {
        row.finals[chunk] = std::move(tr.fin);
        absl::MutexLock lock(&row.mu);
        row.top_processed.Absorb(tr.top_processed);
        row.top_raw.Absorb(tr.top_raw);
        break;
      }
      case Phase::kRank: {
        absl::MutexLock lock(&row.mu);
        for (size_t j = 0; j < tr.rank_count.size(); ++j)
          row.rank_count[j] += tr.rank_count[j];
        break;
      }
      case Phase::kDone:
        break;
    }
  }
}

absl::Status CpuSampler::Sample(const float* hidden, int rows,
                                const RowSpec* specs,
                                std::vector<RowResult>* results) {
  if (results == nullptr) return absl::InvalidArgumentError("results is null");
  if (rows < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("rows must be >= 0, got ", rows));
  results->assign(rows, RowResult{});
  if (rows == 0) return absl::OkStatus();
  if (hidden == nullptr || specs == nullptr) {
    return absl::InvalidArgumentError("hidden states or row specs are null");
  }
  Call call;
  call.hidden = hidden;
  call.rows = rows;
  call.max_gumbel = MaxGumbelNoise();
  call.row.reserve(rows);
  for (int r = 0; r < rows; ++r) {
    call.row.push_back(std::make_unique<Row>());
    Row& row = *call.row.back();
    if (specs[r].params == nullptr) {
      row.SetError(-1, "params is null");
      row.phase = Phase::kDone;
      continue;
    }
    if (absl::Status s = ValidateSamplingParams(*specs[r].params, vocab_, "",
                                                SamplingRules::Engine());
        !s.ok()) {
      row.SetError(-1, std::string(s.message()));
      row.phase = Phase::kDone;
      continue;
    }
    cpu::PlanRow(specs[r], vocab_, options_.candidate_buffer, num_chunks_, row);
  }

  const int blocks = (rows + row_block_ - 1) / row_block_;
  std::vector<std::pair<int, int64_t>> tasks;
  while (true) {
    tasks.clear();
    for (int b = 0; b < blocks; ++b) {
      bool active = false;
      for (int r = b * row_block_; r < std::min(rows, (b + 1) * row_block_);
           ++r) {
        active = active || call.row[r]->phase != Phase::kDone;
      }
      if (!active) continue;
      for (int64_t c = 0; c < num_chunks_; ++c) tasks.emplace_back(b, c);
    }
    if (tasks.empty()) break;
    pool_->ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
      RunTask(call, tasks[i].first, tasks[i].second);
    });
    for (int r = 0; r < rows; ++r) {
      Row& row = *call.row[r];
      if (row.phase == Phase::kDone) continue;
      if (row.failed()) {
        row.phase = Phase::kDone;
        continue;
      }
      switch (row.phase) {
        case Phase::kStats:
          cpu::AfterStats(row, num_chunks_);
          break;
        case Phase::kHist:
          cpu::AfterHist(row, num_chunks_);
          break;
        case Phase::kTies:
          cpu::AfterTies(row, num_chunks_);
          break;
        case Phase::kFinal:
          cpu::FinishRow(row, (*results)[r]);
          row.phase = row.params->logprobs.rank && !row.failed() ? Phase::kRank
                                                                 : Phase::kDone;
          break;
        case Phase::kRank:
          cpu::FinishRanks(row, (*results)[r]);
          row.phase = Phase::kDone;
          break;
        case Phase::kDone:
          break;
      }
    }
  }

  int failed = 0;
  int first = -1;
  for (int r = 0; r < rows; ++r) {
    if (call.row[r]->used_radix_select) {
      (*results)[r].exact_fallback = "radix_select";
    }
    if (!call.row[r]->failed()) continue;
    (*results)[r] = RowResult{};
    (*results)[r].error = call.row[r]->error;
    if (failed++ == 0) first = r;
  }
  if (failed == 0) return absl::OkStatus();
  std::string message =
      absl::StrCat("row ", first, ": ", call.row[first]->error);
  if (failed > 1)
    absl::StrAppend(&message, " (", failed - 1, " more rows failed)");
  return absl::InvalidArgumentError(message);
}

}  // namespace flashsampler
