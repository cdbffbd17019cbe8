// The plain data of the controlled sampler's interface: per-row controls,
// status codes and launch arguments. Free of CUDA headers, so the host packer
// (controlled_plan.h) and host tests build without the CUDA toolkit.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_TYPES_H_
#define FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_TYPES_H_

#include <cstddef>
#include <cstdint>

namespace flashsampler {

// ControlledRow::logprob_flags bits.
constexpr uint32_t kLogprobSampled = 1u;    // logprob of each sampled token
constexpr uint32_t kLogprobLogsumexp = 2u;  // the row's logsumexp
// Raw logits after the masks alone (bitmask, banned ids; vLLM's
// raw_logprobs) instead of the processed distribution.
constexpr uint32_t kLogprobRaw = 4u;
// The rank of each sampled token: 1 + the other tokens whose value in the
// logprobs' space (raw, or processed over the survivors) is >= its own.
constexpr uint32_t kLogprobRank = 8u;

// The controls of one row (an array of these lives on the device). Values
// are assumed range-checked as the CPU's ValidateRow does (temperature >= 0,
// top_p in (0, 1], min_p in [0, 1], penalties finite, ids < V).
struct ControlledRow {
  // 0 = greedy (argmax of l; filters ignored; logprobs at T = 1). Callers
  // pass 0 for every row SamplingParams::greedy() calls greedy (T < 1e-5):
  // that is the one definition of the rule.
  float temperature = 1.0f;
  // <= 0 or >= V = off; else keeps every min_p survivor whose x is >= the
  // k-th largest x among them (ties at that value all stay).
  int32_t top_k = 0;
  float top_p = 1.0f;  // 1 = off
  float min_p = 0.0f;  // 0 = off
  // std::log((double)min_p) computed on the host (read only when min_p > 0):
  // CUDA's double log is within 1 ulp, glibc's is what the CPU floor uses.
  double log_min_p = 0.0;
  float repetition_penalty = 1.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  uint64_t seed = 0;  // Philox key (kernels/noise/philox.h)
  uint64_t step = 0;  // decode step (noise counter)
  int32_t n = 1;      // samples, 1 .. ControlledSampleParams::max_samples
  // Most likely tokens to list, 0 .. ; min(top_n, V) must be <=
  // ControlledSampleParams::max_top_n.
  int32_t top_n = 0;
  uint32_t logprob_flags = 0;  // kLogprob* bits
  // This row's merged per-token entries: [special_begin, special_end) of the
  // ControlledSampleParams::special_* arrays, ids strictly ascending.
  int64_t special_begin = 0;
  int64_t special_end = 0;
  // Word offset of this row's allowed-token bitmask (ceil(V / 32) words, bit
  // id % 32 of word id / 32 set = allowed) in ControlledSampleParams::bitmask;
  // -1 = every token allowed.
  int64_t bitmask_offset = -1;
};

// Per-row outcome codes (ControlledSampleParams::status).
enum ControlledStatus : int32_t {
  kControlledOk = 0,
  // Every token is masked (banned ids, allowed bitmask or -inf bias).
  kControlledAllMasked = 1,
  // A raw logit is not finite, or a processed one is NaN or +inf;
  // error_token holds the lowest such id.
  kControlledNonFinite = 2,
  // n or top_n exceed the output capacity, or an output this row asks for is
  // null.
  kControlledBadControls = 3,
};

// The CPU sampler's RowResult::error text for a status (kControlledNonFinite
// adds values the caller formats: "logit of token %d is not finite (raw %g,
// processed %g)").
inline const char* ControlledStatusMessage(int32_t status) {
  switch (status) {
    case kControlledOk:
      return "";
    case kControlledAllMasked:
      return "every token is masked (banned ids, allowed bitmask or -inf bias)";
    case kControlledNonFinite:
      return "logit is not finite";
    case kControlledBadControls:
      return "n or top_logprobs exceed the controlled sampler's outputs";
  }
  return "unknown controlled sampler status";
}

// Rows whose per-token entries the GPU merges from their lists
// (LaunchMergePendingEntries) instead of the host: 256 rows each with 64
// bias entries and 128 penalized ids took 0.36-0.5 ms to merge on the CUDA
// engine's pack pool (an H100 host), next to the 0.57 ms fused kernel they
// run beside.
// The list ids and a row's key count are bounded so that a key, id << 13 |
// place, is one 32-bit word and a row's keys sort in 32 KB of shared memory.
constexpr int kPendingMaxKeys = 8192;
constexpr int64_t kPendingMaxVocab = int64_t{1} << 19;
// PendingListEntry::id_kind's kind, in MergeEntries' order of the lists.
constexpr uint32_t kPendingKindShift = 30;
constexpr uint32_t kPendingBias = 0;    // value: the bias's float bits
constexpr uint32_t kPendingBanned = 1;  // value: 0
constexpr uint32_t kPendingPrompt = 2;  // value: 0 (penalized rows alone)
constexpr uint32_t kPendingOutput = 3;  // value: its count (> 0)

// One list entry of a pending row, in list order: bias entries, banned ids,
// prompt ids (where the repetition penalty is not 1), output ids with a
// positive count.
struct PendingListEntry {
  uint32_t id_kind = 0;  // id | kind << kPendingKindShift
  uint32_t value = 0;
};

// One pending merge: a row's list entries, and the rows that share its
// entries (the row and the rows repeating it, ControlledPlan::RepeatLastRow).
// Its entries go to [special_begin, special_begin + key_count) of the
// ControlledSampleParams::special_* arrays (its row's special_begin), and
// each of its rows' special_end is set past the last one.
struct PendingMergeRow {
  int32_t first_row = 0;
  int32_t rows = 1;
  int32_t key_count = 0;  // 1 .. kPendingMaxKeys
  int32_t pad = 0;
  int64_t key_begin = 0;  // in PendingMerges::entries
};

// Arguments of LaunchMergePendingEntries. Every pointer is device memory:
// the packed controls' own arrays (ControlledPlan::BindPendingMerges).
struct PendingMerges {
  int count = 0;     // PendingMergeRow records, one CTA each
  int max_keys = 0;  // the largest key_count among them
  const PendingMergeRow* merges = nullptr;
  const PendingListEntry* entries = nullptr;
  ControlledRow* row_controls = nullptr;
  int32_t* special_ids = nullptr;
  uint8_t* special_flags = nullptr;
  float* special_bias = nullptr;
  int32_t* special_count = nullptr;
};

// Arguments of one launch. Every pointer is device memory.
struct ControlledSampleParams {
  int rows = 0;       // one CTA each
  int64_t vocab = 0;  // V, 1 .. 2^31 - 1
  // [rows, logits_row_stride] fp32 raw logits (e.g. written by the fused
  // kernel through FusedSampleParams::logits_out); read only.
  const float* logits = nullptr;
  int64_t logits_row_stride = 0;                // >= vocab
  const ControlledRow* row_controls = nullptr;  // [rows]

  // Merged per-token entries (ControlledPlan builds them): one per distinct
  // (row, id) among that row's logit_bias, banned, prompt and output ids.
  const int32_t* special_ids = nullptr;    // token id
  const uint8_t* special_flags = nullptr;  // controls::kSpecial* bits
  // Sum of the id's logit_bias entries, added in list order in fp32.
  const float* special_bias = nullptr;
  // Sum of the id's positive output counts (frequency / presence penalties).
  const int32_t* special_count = nullptr;
  // Allowed-token bitmask words, addressed by ControlledRow::bitmask_offset;
  // may be null when no row has a bitmask.
  const uint32_t* bitmask = nullptr;

  // Output capacities (row strides of the [rows, ...] outputs).
  int max_samples = 1;  // >= 1
  int max_top_n = 0;    // >= 0

  // Outputs. Rows that fail get status != 0, token ids -1 and top_count 0.
  int32_t* token_ids = nullptr;       // [rows, max_samples]
  float* sampled_logprobs = nullptr;  // [rows, max_samples]; may be null
  int32_t* sampled_ranks = nullptr;   // [rows, max_samples]; may be null
  float* logsumexp = nullptr;         // [rows]; may be null
  int32_t* top_token_ids = nullptr;   // [rows, max_top_n]; may be null
  float* top_logprobs = nullptr;      // [rows, max_top_n]; may be null
  int32_t* top_count = nullptr;       // [rows]; may be null
  int32_t* status = nullptr;          // [rows] ControlledStatus
  int32_t* error_token = nullptr;     // [rows]; -1 unless kNonFinite
  // [rows]; may be null. 1 = sampled from the row's candidates (the highest
  // logits of each chunk) with proof that the full passes agree; 0 = the
  // full passes over the row sampled it (the exact fallback).
  int32_t* certified = nullptr;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_TYPES_H_
