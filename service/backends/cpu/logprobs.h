// Logprobs: processed ones are the log-softmax of x over the survivors (the
// distribution actually sampled), raw ones the log-softmax of the raw logits
// over the tokens the masks allow (tile_sweep.h MaskedRaw); both from a
// log-sum-exp kept in double and merged across chunks, each logprob rounded
// once to fp32.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_LOGPROBS_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_LOGPROBS_H_

#include <cmath>
#include <vector>

#include "service/backends/cpu/sampling_order.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace cpu {

// Online log-sum-exp in double; -inf values are skipped.
struct Lse {
  double max = kNegInfD;
  double sum = 0.0;

  void Add(double v) {
    if (v == kNegInfD) return;
    if (v > max) {
      sum = (max == kNegInfD ? 0.0 : sum * std::exp(max - v)) + 1.0;
      max = v;
    } else {
      sum += std::exp(v - max);
    }
  }
  void Merge(const Lse& o);
  double Value() const {
    return max == kNegInfD ? kNegInfD : max + std::log(sum);
  }
};

// log p of a token of logit v in a row of log-sum-exp `lse`, in fp32.
inline float Logprob(float v, double lse) {
  return static_cast<float>(static_cast<double>(v) - lse);
}

// out->top_token_ids / top_logprobs from `top` (most likely first).
void FillTopLogprobs(const std::vector<Entry>& top, double lse, RowResult* out);

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_LOGPROBS_H_
