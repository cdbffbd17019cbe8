// Host glue of the CUDA engine's controlled path: row checks with the CPU
// sampler's messages, SamplingParams -> ControlledRowInput, the token
// classes' inputs, the packed-byte bound and chunking, and the per-row error
// texts.
#include "service/backends/cuda/controlled_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_types.h"

namespace flashsampler {
namespace {

// One merged entry of the packed lists: id (4) + flags (1) + bias (4) +
// count (4).
constexpr size_t kBytesPerListEntry = 13;

size_t ListEntries(const SamplingParams& p) {
  size_t entries = p.logit_bias.size() + p.banned_token_ids.size() +
                   p.output_token_counts.size();
  // The packer reads prompt ids only for a repetition penalty.
  if (p.repetition_penalty != 1.0f) entries += p.prompt_token_ids.size();
  return entries;
}

// The row's units sum its top_p tail (controls::UnitTailWanted).
bool TopPTailWanted(const SamplingParams& p, int64_t vocab) {
  return controls::UnitTailWanted(p.greedy() ? 0.0f : p.temperature, p.top_k,
                                  p.top_p, vocab);
}

}  // namespace

bool NeedsControlledSampler(const SamplingParams& p) {
  return p.has_token_transforms() || p.top_k > 0 || p.top_p < 1.0f ||
         p.min_p > 0.0f || p.logprobs.any();
}

bool HasTokenEntries(const SamplingParams& p) { return ListEntries(p) > 0; }

bool NeedsBitmaskInClasses(const SamplingParams& p, int64_t vocab) {
  return !p.allowed_bitmask.empty() &&
         ((p.logprobs.any() && p.logprobs.raw) || TopPTailWanted(p, vocab));
}

bool ServedFromUnitCandidates(const SamplingParams& p, int64_t vocab) {
  if (p.logprobs.any()) {
    if (p.logprobs.raw) {
      // One tail a unit: a top_p tail at 1 / T over the members, or the raw
      // mass at T = 1 over every allowed token.
      if (TopPTailWanted(p, vocab)) return false;
      if (p.greedy()) return true;
    } else if (p.greedy()) {
      return false;
    }
  } else if (p.greedy() || !p.has_token_transforms()) {
    return true;
  }
  return (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
}

absl::Status ValidateCudaRow(const SamplingParams& p, int64_t vocab) {
  // The ranges (and messages) every engine shares, top_k = -1 included.
  if (absl::Status s =
          ValidateSamplingParams(p, vocab, "", SamplingRules::Engine());
      !s.ok()) {
    return s;
  }
  if (p.n > kCudaMaxSamples) {
    return absl::InvalidArgumentError(absl::StrCat(
        "n must be <= ", kCudaMaxSamples, " on the CUDA backend, got ", p.n));
  }
  if (p.logprobs.top_n > kCudaMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs.top_logprobs must be <= ", kCudaMaxTopLogprobs,
                     " on the CUDA backend, got ", p.logprobs.top_n));
  }
  const size_t limit = kControlledPlanBudgetBytes - kControlledPlanLayoutSlack;
  const size_t bound = ControlledRowBytesBound(p);
  if (NeedsControlledSampler(p) && bound > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logit_bias (", p.logit_bias.size(), "), banned_token_ids (",
        p.banned_token_ids.size(), "), prompt_token_ids (",
        p.prompt_token_ids.size(), "), output_token_counts (",
        p.output_token_counts.size(), ") and allowed_token_bitmask pack to ",
        bound, " bytes; the CUDA backend packs at most ", limit,
        " bytes of them per row"));
  }
  return absl::OkStatus();
}

ControlledRowInput ControlledInputFrom(const RowSpec& spec,
                                       ControlledRowLists* lists) {
  const SamplingParams& p = *spec.params;
  lists->bias_ids.clear();
  lists->bias_values.clear();
  lists->output_ids.clear();
  lists->output_counts.clear();
  ControlledRowInput in;
  // The kernel's greedy rule is temperature 0; SamplingParams::greedy() is
  // the one definition (it also covers temperatures below 1e-5).
  in.temperature = p.greedy() ? 0.0f : p.temperature;
  in.top_k = p.top_k;
  in.top_p = p.top_p;
  in.min_p = p.min_p;
  in.repetition_penalty = p.repetition_penalty;
  in.presence_penalty = p.presence_penalty;
  in.frequency_penalty = p.frequency_penalty;
  for (const TokenBias& b : p.logit_bias) {
    lists->bias_ids.push_back(b.token_id);
    lists->bias_values.push_back(b.bias);
  }
  in.bias_ids = lists->bias_ids.data();
  in.bias_values = lists->bias_values.data();
  in.num_bias = lists->bias_ids.size();
  in.banned_ids = p.banned_token_ids.data();
  in.num_banned = p.banned_token_ids.size();
  in.prompt_ids = p.prompt_token_ids.data();
  in.num_prompt = p.prompt_token_ids.size();
  for (const TokenCount& tc : p.output_token_counts) {
    lists->output_ids.push_back(tc.token_id);
    lists->output_counts.push_back(tc.count);
  }
  in.output_ids = lists->output_ids.data();
  in.output_counts = lists->output_counts.data();
  in.num_output = lists->output_ids.size();
  in.allowed_bitmask =
      p.allowed_bitmask.empty() ? nullptr : p.allowed_bitmask.data();
  in.bitmask_words = p.allowed_bitmask.size();
  in.n = p.n;
  in.top_n = p.logprobs.top_n;
  in.logprob_flags = (p.logprobs.sampled ? kLogprobSampled : 0u) |
                     (p.logprobs.rank ? kLogprobRank : 0u) |
                     (p.logprobs.logsumexp ? kLogprobLogsumexp : 0u) |
                     (p.logprobs.raw ? kLogprobRaw : 0u);
  in.seed = spec.seed;
  in.step = spec.step;
  return in;
}

void PackControlledRows(const RowSpec* specs, const std::vector<char>& valid,
                        int first, int end, const SamplingParams& ride_along,
                        ControlledPackScratch* scratch, ControlledPlan* plan,
                        ThreadPool* pool, bool device_merge) {
  // Each row an input or a repeat. An input points into its lists' element
  // buffers, which stay put when `scratch->lists` grows (the lists are
  // moved, not copied); the rows point at the inputs, which do not move
  // (reserved for every row).
  scratch->inputs.clear();
  scratch->inputs.reserve(static_cast<size_t>(end - first));
  scratch->rows.clear();
  size_t entries = 0;
  const SamplingParams* previous = nullptr;
  for (int i = first; i < end; ++i) {
    RowSpec spec = specs[i];
    if (!valid[i]) spec.params = &ride_along;
    ControlledPlan::RowToAdd row;
    if (previous != nullptr && spec.params == previous) {
      row.seed = spec.seed;
      row.step = spec.step;
    } else {
      if (scratch->inputs.size() == scratch->lists.size()) {
        scratch->lists.emplace_back();
      }
      ControlledRowLists* lists = &scratch->lists[scratch->inputs.size()];
      scratch->inputs.push_back(ControlledInputFrom(spec, lists));
      row.in = &scratch->inputs.back();
      entries += ListEntries(*spec.params);
    }
    previous = spec.params;
    scratch->rows.push_back(row);
  }
  ThreadPool* merge_pool = entries >= kParallelPackEntries ? pool : nullptr;
  const size_t pending_max_keys =
      device_merge && entries >= kDeviceMergeEntries ? kPendingMaxKeys : 0;
  plan->AddRows(
      scratch->rows,
      [merge_pool](int64_t n, absl::FunctionRef<void(int64_t)> fn) {
        ParallelForOrInline(merge_pool, n, fn);
      },
      pending_max_keys);
}

size_t CountPackedBitmasks(const RowSpec* specs, const std::vector<char>& valid,
                           int first, int end,
                           const SamplingParams& ride_along) {
  // PackControlledRows' rule: a row packs its params unless they are the
  // row before's.
  size_t count = 0;
  const SamplingParams* previous = nullptr;
  for (int i = first; i < end; ++i) {
    const SamplingParams* params = valid[i] ? specs[i].params : &ride_along;
    if (params != previous && !params->allowed_bitmask.empty()) ++count;
    previous = params;
  }
  return count;
}

namespace {

// The entry ids of a row, in TokenClassInputs' order: MergeEntries' keys.
template <typename Fn>
void ForEachEntryId(const SamplingParams& p, Fn&& fn) {
  for (const TokenBias& b : p.logit_bias) fn(b.token_id);
  for (int32_t id : p.banned_token_ids) fn(id);
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : p.prompt_token_ids) fn(id);
  }
  for (const TokenCount& tc : p.output_token_counts) {
    if (tc.count > 0) fn(tc.token_id);
  }
}

size_t AlignTo256(size_t v) { return (v + 255) / 256 * 256; }

}  // namespace

void TokenClassInputs::Build(const RowSpec* specs,
                             const std::vector<char>& valid, int rows,
                             const SamplingParams& ride_along,
                             bool with_bitmask, bool shared) {
  rows_.clear();
  packed_.clear();
  ids_ = 0;
  bitmask_words_ = 0;
  const int count = shared ? std::min(rows, 1) : rows;
  const SamplingParams* previous = nullptr;
  for (int i = 0; i < count; ++i) {
    const SamplingParams* p = valid[i] ? specs[i].params : &ride_along;
    if (p == previous) {
      rows_.push_back(rows_.back());
      continue;
    }
    previous = p;
    ControlledRow row;
    row.special_begin = static_cast<int64_t>(ids_);
    ForEachEntryId(*p, [this](int32_t) { ++ids_; });
    row.special_end = static_cast<int64_t>(ids_);
    if (with_bitmask && !p->allowed_bitmask.empty()) {
      row.bitmask_offset = static_cast<int64_t>(bitmask_words_);
      bitmask_words_ += p->allowed_bitmask.size();
    }
    rows_.push_back(row);
    packed_.push_back(p);
  }
}

TokenClassInputs::Layout TokenClassInputs::MakeLayout() const {
  Layout l;
  l.rows = 0;
  l.ids = AlignTo256(sizeof(ControlledRow) * rows_.size());
  l.bitmask = AlignTo256(l.ids + sizeof(int32_t) * ids_);
  l.total = std::max<size_t>(
      AlignTo256(l.bitmask + sizeof(uint32_t) * bitmask_words_), 256);
  return l;
}

void TokenClassInputs::WriteBytes(void* out) const {
  const Layout layout = MakeLayout();
  auto* base = static_cast<unsigned char*>(out);
  std::memcpy(base + layout.rows, rows_.data(),
              sizeof(ControlledRow) * rows_.size());
  auto* ids = reinterpret_cast<int32_t*>(base + layout.ids);
  auto* words = reinterpret_cast<uint32_t*>(base + layout.bitmask);
  for (const SamplingParams* p : packed_) {
    ForEachEntryId(*p, [&ids](int32_t id) { *ids++ = id; });
    if (bitmask_words_ > 0 && !p->allowed_bitmask.empty()) {
      std::memcpy(words, p->allowed_bitmask.data(),
                  sizeof(uint32_t) * p->allowed_bitmask.size());
      words += p->allowed_bitmask.size();
    }
  }
}

void TokenClassInputs::BindInputs(const void* device_bytes, int64_t vocab,
                                  ControlledSampleParams* params) const {
  const Layout layout = MakeLayout();
  const auto* base = static_cast<const unsigned char*>(device_bytes);
  params->rows = static_cast<int>(rows_.size());
  params->vocab = vocab;
  params->row_controls =
      reinterpret_cast<const ControlledRow*>(base + layout.rows);
  params->special_ids = reinterpret_cast<const int32_t*>(base + layout.ids);
  params->bitmask =
      bitmask_words_ == 0
          ? nullptr
          : reinterpret_cast<const uint32_t*>(base + layout.bitmask);
}

size_t ControlledRowBytesBound(const SamplingParams& p) {
  // A row of kPendingMaxKeys keys or fewer (its list entries, as
  // ControlledPlan counts them) may be left to the device's merge: its
  // entries are packed as they come as well.
  const size_t entries = ListEntries(p);
  const size_t pending =
      entries <= static_cast<size_t>(kPendingMaxKeys)
          ? sizeof(PendingMergeRow) + sizeof(PendingListEntry) * entries
          : 0;
  return sizeof(ControlledRow) + kBytesPerListEntry * entries + pending +
         sizeof(uint32_t) * p.allowed_bitmask.size();
}

std::vector<std::pair<int, int>> SplitRowsByBudget(
    const std::vector<size_t>& row_bounds, size_t budget) {
  const size_t limit = budget > kControlledPlanLayoutSlack
                           ? budget - kControlledPlanLayoutSlack
                           : 0;
  std::vector<std::pair<int, int>> chunks;
  const int rows = static_cast<int>(row_bounds.size());
  int first = 0;
  size_t used = 0;
  for (int r = 0; r < rows; ++r) {
    if (r > first && used + row_bounds[r] > limit) {
      chunks.emplace_back(first, r);
      first = r;
      used = 0;
    }
    used += row_bounds[r];
  }
  if (rows > first) chunks.emplace_back(first, rows);
  return chunks;
}

std::string ControlledRowError(int32_t status, int32_t error_token,
                               float raw_logit, float processed_logit) {
  if (status == kControlledNonFinite) {
    return absl::StrFormat(
        "logit of token %d is not finite (raw %g, processed %g)", error_token,
        raw_logit, processed_logit);
  }
  return ControlledStatusMessage(status);
}

}  // namespace flashsampler
