// Merging log-sum-exp partials and writing the top-N logprobs.
#include "service/backends/cpu/logprobs.h"

namespace flashsampler {
namespace cpu {

void Lse::Merge(const Lse& o) {
  if (o.max == kNegInfD) return;
  if (max == kNegInfD) {
    *this = o;
    return;
  }
  if (o.max > max) {
    sum = sum * std::exp(max - o.max) + o.sum;
    max = o.max;
  } else {
    sum += o.sum * std::exp(o.max - max);
  }
}

void FillTopLogprobs(const std::vector<Entry>& top, double lse,
                     RowResult* out) {
  out->top_token_ids.clear();
  out->top_logprobs.clear();
  for (const Entry& e : top) {
    out->top_token_ids.push_back(e.id);
    out->top_logprobs.push_back(Logprob(e.x, lse));
  }
}

}  // namespace cpu
}  // namespace flashsampler
