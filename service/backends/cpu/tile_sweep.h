// What a sweep does with one 256-token tile of raw logits for one row: the
// vLLM-ordered transforms (penalties.h, masks.h, temperature.h), then the
// visit of the row's current phase (row_state.h).
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_TILE_SWEEP_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_TILE_SWEEP_H_

#include <cstdint>

#include "service/backends/cpu/row_state.h"

namespace flashsampler {
namespace cpu {

// Tokens per tile: a sweep visits at most this many tokens at a time.
constexpr int kTileTokens = 256;

// Raw logits z -> processed l (bias, masks, penalties) -> x = l / T. A
// non-finite raw logit, or a NaN or +inf x, fails the task row.
void Transform(const Row& row, int64_t begin, int count, const float* z,
               float* l, float* x, TaskRow& tr);

// kStats: max of x, allowed count, and the best tokens into the buffer.
void VisitStats(const float* x, int64_t begin, int count, TaskRow& tr);
// kHist: the radix-select histogram of the survivors so far.
void VisitHist(const Row& row, const float* x, int64_t begin, int count,
               TaskRow& tr);
// kTies: how many tokens of this tile hold the cut value.
void VisitTies(const Row& row, const float* x, int count, TaskRow& tr);
// Raw logits after the masks alone (allowed bitmask, banned ids -> -inf),
// before logit_bias, penalties and temperature: what raw logprobs are taken
// over (vLLM's raw_logprobs). count <= kTileTokens.
void MaskedRaw(const Row& row, int64_t begin, int count, const float* z,
               float* raw);

// kFinal: samples, log-sum-exps and top-N over the survivors.
void VisitFinal(const Row& row, const float* z, const float* l, const float* x,
                int64_t begin, int count, float max_gumbel, TaskRow& tr);

// kRank: per sample, the tokens whose value in the logprobs' space (masked
// raw logit, or processed logit of a survivor) is >= the sample's.
void VisitRank(const Row& row, const float* z, const float* x, int64_t begin,
               int count, TaskRow& tr);

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_TILE_SWEEP_H_
