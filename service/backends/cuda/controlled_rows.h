// Host glue between the service's per-row controls (SamplingParams) and the
// controlled sampler (kernels/controls/): which rows need it, the CPU
// sampler's range checks with its messages, the packer's plain input, the
// byte bound of a row's packed lists and the per-row error texts. No CUDA
// headers, so all of it is tested without a GPU.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CONTROLLED_ROWS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CONTROLLED_ROWS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/thread_pool.h"
#include "kernels/controls/controlled_plan.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {

// Samples per row the CUDA engine serves: the fused kernel's in-kernel
// stage 2 keeps at most 64 (kMaxFusedInKernelSamples), and the controlled
// path's outputs are sized for the same number so that both paths take
// the same rows.
constexpr int kCudaMaxSamples = 64;

// Most likely tokens a row may list (logprobs.top_logprobs). The serving
// layer's limit (ServerLimits::max_top_logprobs, 20 by default) is far
// below; the engine's outputs hold 256 per row: 256 rows x 256 x 8 bytes =
// 0.5 MB per slot. Each listed token costs the kernel one pass over V.
constexpr int kCudaMaxTopLogprobs = 256;

// Bytes of packed per-row inputs (ControlledPlan::bytes()) one slot stages
// for one launch of the controlled sampler. The proto does not bound the
// list lengths; 16 MB holds a full batch of 256 rows each with a V = 151936
// bitmask (19 KB) and ~4,500 list entries (13 bytes each). A batch over the
// budget runs in row chunks (each chunk one launch, the staging reused
// after the previous chunk's copy finished); only a row whose own lists
// exceed the budget is refused, with INVALID_ARGUMENT for that row alone.
constexpr size_t kControlledPlanBudgetBytes = size_t{16} << 20;

// ControlledPlan's layout pads each of its eight arrays to 256 bytes.
constexpr size_t kControlledPlanLayoutSlack = 8 * 256;

// The RowResult::exact_fallback label of controlled rows whose candidates
// could not certify the sample, so the full passes over the row's logits
// took it (flashsampler_exact_fallback_rows_total{reason="full_row_pass"}).
inline constexpr char kFullRowPassFallback[] = "full_row_pass";
// ... and of rows that unit candidates could not certify, sampled from
// their materialized logits by the candidate path
// (flashsampler_exact_fallback_rows_total{reason="materialized_logits"}).
inline constexpr char kMaterializedLogitsFallback[] = "materialized_logits";

// True when the row uses a control beyond temperature and n: the fused
// kernel alone cannot serve it, the controlled sampler over materialized
// logits can (docs/design.md#exactness-and-refusals).
bool NeedsControlledSampler(const SamplingParams& p);

// True when the controlled sampler's candidate path can take the row from
// the fused kernel's unit candidates, without its logits: temperature,
// top_k, top_p, min_p and n alone, or greedy with per-token transforms
// (bias, bans and penalized ids, which the units leave out and the merge
// kernel adds at their exact values; a bitmask, whose masked candidates the
// merge kernel leaves out), or transforms and logprobs under a filter that
// closes the set (top_k below V, top_p, min_p), or greedy with raw
// logprobs (every token's mass at T = 1, from the units' tails).
// Processed logprobs of a greedy row (over every token) need the logits,
// and so does a sampled row with transforms and no such filter, whose open
// set the units would rarely certify, and a row with raw logprobs and a
// top_p that top_k does not bound (a unit has one tail: the top_p mass or
// the raw mass). A bitmask row whose tails are summed (NeedsBitmaskInClasses)
// is served where the batch's token classes hold the bitmasks.
bool ServedFromUnitCandidates(const SamplingParams& p, int64_t vocab);

// True when the row's units must leave its masked tokens out of their tails:
// a bitmask, and raw logprobs (the mass of every allowed token at T = 1) or a
// top_p that top_k does not bound. The batch's token classes are then made
// with the bitmasks, which go to the GPU before the fused kernel.
bool NeedsBitmaskInClasses(const SamplingParams& p, int64_t vocab);

// True when the row has per-token entries (logit_bias, banned ids, prompt
// ids under a repetition penalty, output counts): the units leave those
// tokens out, by token classes made before the fused kernel.
bool HasTokenEntries(const SamplingParams& p);

// The CPU sampler's row checks (ValidateSamplingParams with
// SamplingRules::Engine(), the same messages), plus the engine's own limits
// (n <= kCudaMaxSamples, top logprobs <= kCudaMaxTopLogprobs, packed lists
// within kControlledPlanBudgetBytes). The controlled kernel assumes ids < V,
// so every row passes here before it is packed.
absl::Status ValidateCudaRow(const SamplingParams& p, int64_t vocab);

// Owns the flattened lists a ControlledRowInput points into; reused row
// after row (AddRow copies what it needs).
struct ControlledRowLists {
  std::vector<int32_t> bias_ids;
  std::vector<float> bias_values;
  std::vector<int32_t> output_ids;
  std::vector<int32_t> output_counts;
};

// SamplingParams + noise key -> the packer's plain input. Clears `lists`
// and points the input into it and into `spec.params`' vectors, which must
// outlive the AddRow call.
ControlledRowInput ControlledInputFrom(const RowSpec& spec,
                                       ControlledRowLists* lists);

// What PackControlledRows keeps from batch to batch: each packed row's
// flattened lists and input, and the rows it adds.
struct ControlledPackScratch {
  std::vector<ControlledRowLists> lists;
  std::vector<ControlledRowInput> inputs;
  std::vector<ControlledPlan::RowToAdd> rows;
};

// Rows whose list entries number fewer than this in all are merged on the
// calling thread alone: waking a worker costs tens of microseconds on a
// virtual machine, and 4096 entries merge in 80-110 us on one core of a
// development host (random ids).
inline constexpr size_t kParallelPackEntries = 4096;

// Rows whose list entries number this many or more in all are merged on
// the GPU where the caller allows it (PackControlledRows' device_merge):
// the host's merge of a batch runs beside its fused kernel, and from about
// this size on it can outlast it, where the device's takes microseconds.
inline constexpr size_t kDeviceMergeEntries = 4096;

// Adds rows [first, end) of `specs` to `plan` in order. A refused row
// (valid[i] == 0) keeps its place with `ride_along`'s controls (its outputs
// are ignored); a row whose params are the row before's (a request's
// broadcast params) repeats that row's packed controls
// (ControlledPlan::RepeatLastRow) instead of packing them again. With a
// `pool` and kParallelPackEntries or more entries, the rows' entries are
// merged on its workers and the calling thread; the plan is the same. With
// `device_merge` (the vocabulary at most kPendingMaxVocab) and
// kDeviceMergeEntries or more entries, the rows of up to kPendingMaxKeys
// keys are left pending for LaunchMergePendingEntries
// (ControlledPlan::AddRows).
void PackControlledRows(const RowSpec* specs, const std::vector<char>& valid,
                        int first, int end, const SamplingParams& ride_along,
                        ControlledPackScratch* scratch, ControlledPlan* plan,
                        ThreadPool* pool = nullptr, bool device_merge = false);

// The bitmasks PackControlledRows would pack for the same rows (its plan's
// packed_bitmasks()): one per row with a bitmask whose params are not the
// row before's. Reads the specs alone, so that a batch can be routed by it
// before it is packed.
size_t CountPackedBitmasks(const RowSpec* specs, const std::vector<char>& valid,
                           int first, int end,
                           const SamplingParams& ride_along);

// What the token classes' kernel (LaunchUnitTokenClasses) reads of a batch,
// written without merging any list: each row's entry ids as its lists hold
// them, the ids ControlledPlan::AddRows makes entries of (every logit_bias
// and banned id, the prompt's under a repetition penalty, the output ids
// with a positive count), in list order and repeated where the lists
// repeat them, which the kernel's bit sets allow; and, with the bitmasks,
// each packed bitmask. The merge then runs while the fused kernel does:
// merged first, one caller's 64 rows each with 64 bias entries and 128
// penalized ids took 1.64-1.73x the plain batch's time in the engine
// against 1.23-1.25x, at qwen's V on an H100 (fs_engine_bench).
class TokenClassInputs {
 public:
  // Rows [0, rows) of `specs`, a refused row (valid[i] == 0) with
  // `ride_along`'s controls and a row whose params are the row before's
  // reading that row's ids and bitmask (PackControlledRows' rule); only
  // the first row where `shared`. The specs' params must outlive
  // WriteBytes.
  void Build(const RowSpec* specs, const std::vector<char>& valid, int rows,
             const SamplingParams& ride_along, bool with_bitmask, bool shared);
  // Rows, ids and bitmask words, each at a 256-byte aligned offset.
  size_t byte_size() const { return MakeLayout().total; }
  void WriteBytes(void* out) const;
  // Points `params`' rows, vocab, row_controls, special_ids and bitmask
  // into a device copy of WriteBytes' bytes.
  void BindInputs(const void* device_bytes, int64_t vocab,
                  ControlledSampleParams* params) const;

 private:
  struct Layout {
    size_t rows, ids, bitmask, total;
  };
  Layout MakeLayout() const;

  std::vector<ControlledRow> rows_;            // special range, bitmask_offset
  std::vector<const SamplingParams*> packed_;  // each new row's params
  size_t ids_ = 0;
  size_t bitmask_words_ = 0;
};

// Upper bound of the bytes a row adds to ControlledPlan::bytes() (its
// ControlledRow, 13 bytes per list entry before merging, the entries as they
// come where the device merges them, its bitmask), without the layout's
// padding.
size_t ControlledRowBytesBound(const SamplingParams& p);

// Consecutive [first, end) row chunks whose bounds (each <= budget -
// kControlledPlanLayoutSlack) sum to at most budget - slack.
std::vector<std::pair<int, int>> SplitRowsByBudget(
    const std::vector<size_t>& row_bounds, size_t budget);

// The CPU sampler's RowResult::error for a controlled-sampler status:
// kControlledNonFinite names the lowest offending token with its raw and
// processed values ("logit of token %d is not finite (raw %g, processed
// %g)").
std::string ControlledRowError(int32_t status, int32_t error_token,
                               float raw_logit, float processed_logit);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CUDA_CONTROLLED_ROWS_H_
