// The per-row plan of a CpuSampler::Sample() call: which sweeps a row needs
// (row_state.h Phase) and what to do after each. Unfiltered and greedy rows
// go straight to the final sweep; filtered rows first gather statistics,
// and take exact radix-select sweeps only when the candidate buffer cannot
// certify a top-k or top-p cut (docs/design.md#exactness-and-refusals).
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_PLAN_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_PLAN_H_

#include <cstdint>

#include "service/backends/cpu/row_state.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace cpu {

// Fills the plan part of `row` from its spec (already validated) and sets
// its first phase.
void PlanRow(const RowSpec& spec, int64_t vocab, int64_t candidate_buffer,
             int64_t num_chunks, Row& row);

// After the sweep of the row's phase: decides the next phase.
void AfterStats(Row& row, int64_t num_chunks);
void AfterHist(Row& row, int64_t num_chunks);
void AfterTies(Row& row, int64_t num_chunks);

// After the final sweep: merges the chunks' candidates and logprob partials
// into `out` (or sets the row's error when every token is masked), and
// keeps each sample's value for the rank sweep.
void FinishRow(Row& row, RowResult& out);

// After the rank sweep: the sampled tokens' ranks into `out`.
void FinishRanks(Row& row, RowResult& out);

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_ROW_PLAN_H_
