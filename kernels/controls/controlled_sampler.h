// Host API of the controlled sampler: the exact GPU path for every sampling
// control (bias, bans, bitmask, penalties, min_p, top_k, top_p, n, logprobs)
// over MATERIALIZED fp32 logits [rows, V]. It returns what the CPU reference
// sampler (service/backends/cpu/cpu_sampler.h, "Sampling semantics") returns
// for the same logits, token for token: top_k as a value threshold (ties at
// the k-th value kept), raw logprobs over the masked raw logits, greedy at
// temperature 0 (controlled_types.h). No allocation happens in a launcher.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_
#define FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/controls/controlled_types.h"
#include "kernels/sampler/unit_candidates.h"

namespace flashsampler {

// Bytes of device workspace a launch over `rows` x `vocab` needs: the
// processed logits x = l / T of the full passes, 4 * rows * vocab bytes
// (0.6 MB a row at V = 151936, kept apart so the raw logits stay for raw
// logprobs), then the candidate path's per-chunk ids and sums (22 KB a row).
size_t ControlledSampleWorkspaceSize(int rows, int64_t vocab);

// Samples every row: first from the row's candidates (each 2048-token
// chunk's 64 highest logits), and where that cannot be proven to give the
// full passes' result, by the full passes (ControlledSampleParams::certified
// says which). Returns cudaErrorInvalidValue for bad arguments (null
// required pointers, workspace too small, rows < 0, vocab out of range) and
// the launch error otherwise; per-row problems go to `status`.
cudaError_t LaunchControlledSample(const ControlledSampleParams& params,
                                   void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream);

// Whether the candidate path (the chunk and merge kernels) runs on the
// current device at this vocabulary size: V <= 262144, and the merge
// kernel's shared memory (107,100 bytes at V = 151936) within the device's
// per-block limit. Where it does not, LaunchControlledSample samples every
// row by the full passes and LaunchControlledSampleFromUnits refuses.
cudaError_t ControlledCandidatePathFits(int64_t vocab, bool* fits);

// The fused kernel's unit candidates of the same rows
// (FusedSampleParams::unit_candidates, one GPU: the shard is all of V).
struct ControlledUnits {
  const UnitRecord* records = nullptr;  // [rows][UnitsPerRow(vocab)]
  // The fused kernel's per-row maxima (UnitCandidates::row_bound, row_top):
  // read, and set back to zero for its next launch.
  uint32_t* row_bound = nullptr;
  uint32_t* row_top = nullptr;
  // The 1 / T the kernel summed each row's tail mass at (its
  // UnitCandidates::tail_inv_temperature): a top_p row whose value differs
  // from the row's own is not certified.
  const float* tail_inv_temperature = nullptr;
  // The token classes the kernel ranked by (UnitCandidates::token_classes,
  // from LaunchUnitTokenClasses over the same rows' entries), or null: a
  // row with per-token entries is then not certified.
  const uint32_t* token_classes = nullptr;
  // The classes were made with the rows' bitmasks (LaunchUnitTokenClasses
  // with params.bitmask set): masked tokens are in no unit and no tail, so
  // a bitmask row's tail masses (top_p that top_k does not bound, raw
  // logprobs) can be used.
  bool bitmask_in_classes = false;
};

// The fused kernel's UnitCandidates::token_classes for params' rows
// ([rows][UnitClassWordsPerRow(vocab)] at `classes`): every token but each
// row's per-token entries ranked, the entries' logits kept, and where
// params.bitmask is set, each bitmask row's masked tokens in neither class.
// Reads params' rows, vocab, row_controls, special_ids and bitmask alone;
// a row's ids need not be merged (ascending, distinct): the kernel only sets
// bits, so the lists' ids as they come mark the same tokens
// (TokenClassInputs). With params.bitmask null the merge kernel leaves masked
// candidates out itself, so that the controls needed before the fused kernel
// can be the entries alone, not the bitmask words (19 KB a row at V = 151936).
cudaError_t LaunchUnitTokenClasses(const ControlledSampleParams& params,
                                   uint32_t* classes, cudaStream_t stream);

// The candidate path without the logits: the merge kernel over the units'
// candidates above the row's highest unit bound. params.logits is read at
// the rows' per-token entries alone (the fused kernel's
// UnitCandidates::entry_logits), and only where units.token_classes is set.
// A row the merge certifies gets its tokens, outputs, status kControlledOk
// and certified = 1; every other row gets certified = 0 and nothing else,
// and the caller samples it with LaunchControlledSample over its logits. A
// row with per-token entries (bias, bans, penalized ids) is certified here
// only where the fused kernel ranked by token classes; a row with a
// bitmask and a tail to sum (top_p that top_k does not bound, raw
// logprobs) only where the classes hold the bitmask (else the units' tails
// hold masked tokens); a row with raw logprobs (the mass of every allowed
// token at T = 1) only where its
// tail_inv_temperature is 1 and no top_p tail is wanted (a unit holds one
// tail). Returns
// cudaErrorNotSupported where the candidate path cannot run (V > 262144, or
// a device without the merge kernel's shared memory),
// cudaErrorInvalidValue for bad arguments (as LaunchControlledSample;
// certified and the units are required).
cudaError_t LaunchControlledSampleFromUnits(
    const ControlledSampleParams& params, const ControlledUnits& units,
    void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Merges the pending rows' list entries (ControlledPlan::AddRows'
// pending_max_keys) in a device copy of the plan's bytes, one CTA a row:
// afterwards those bytes are what the host merge would have written (the
// pending rows' entries and special_end; the rest of each row's region
// unused). Must run after the copy and before any kernel that reads the
// entries. Every record's key_count must be at most merges.max_keys (the
// shared memory is sized by it). cudaErrorInvalidValue for bad arguments;
// nothing to merge is cudaSuccess.
cudaError_t LaunchMergePendingEntries(const PendingMerges& merges,
                                      cudaStream_t stream);

// Self-check of the top-p masses: out[i] = the device's FixedMass(x[i],
// x_max) (kernels/controls/controlled_math.h), for comparing its exp with
// the host's.
cudaError_t LaunchControlledFixedMassProbe(const float* x, int64_t count,
                                           float x_max, uint64_t* out,
                                           cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_
