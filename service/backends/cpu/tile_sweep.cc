// One row x one tile of a sweep: transforms, then the phase's visit.
#include "service/backends/cpu/tile_sweep.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_format.h"
#include "service/backends/cpu/masks.h"
#include "service/backends/cpu/temperature.h"

namespace flashsampler {
namespace cpu {

void Transform(const Row& row, int64_t begin, int count, const float* z,
               float* l, float* x, TaskRow& tr) {
  for (int c = 0; c < count; ++c) l[c] = z[c];
  ApplyAllowedBitmask(row.bitmask, begin, count, l);
  ApplyTokenEdits(row.edits, row.bitmask, *row.params, begin, count, z, l);
  for (int c = 0; c < count; ++c) {
    const float xc = ScaleLogit(l[c], row.inv_t);
    x[c] = xc;
    if (!std::isfinite(z[c]) || std::isnan(xc) ||
        xc == std::numeric_limits<float>::infinity()) {
      const int32_t id = static_cast<int32_t>(begin + c);
      tr.Fail(id, absl::StrFormat(
                      "logit of token %d is not finite (raw %g, processed %g)",
                      id, z[c], xc));
    }
  }
}

void MaskedRaw(const Row& row, int64_t begin, int count, const float* z,
               float* raw) {
  for (int c = 0; c < count; ++c) raw[c] = z[c];
  ApplyAllowedBitmask(row.bitmask, begin, count, raw);
  auto it = std::lower_bound(
      row.edits.begin(), row.edits.end(), begin,
      [](const TokenEdit& e, int64_t id) { return e.id < id; });
  for (; it != row.edits.end() && it->id < begin + count; ++it) {
    if (it->banned) raw[it->id - begin] = kNegInf;
  }
}

void VisitStats(const float* x, int64_t begin, int count, TaskRow& tr) {
  for (int c = 0; c < count; ++c) {
    if (x[c] == kNegInf) continue;
    ++tr.allowed;
    tr.x_max = std::max(tr.x_max, x[c]);
    tr.buffer.Offer(x[c], static_cast<int32_t>(begin + c));
  }
}

void VisitHist(const Row& row, const float* x, int64_t begin, int count,
               TaskRow& tr) {
  const RadixSelect& sel = row.select;
  const bool restrict_k = row.selecting == Selecting::kTopP;
  for (int c = 0; c < count; ++c) {
    const float xc = x[c];
    if (xc == kNegInf) continue;
    const int32_t id = static_cast<int32_t>(begin + c);
    if (restrict_k && !tr.cursor_k.Keep(xc, id)) continue;
    if (xc < row.min_floor) continue;
    const int64_t digit = sel.Digit(OrderKey(xc));
    if (digit < 0) continue;
    ++tr.count[digit];
    if (sel.by_mass) tr.mass[digit] += FixedMass(xc, row.x_max);
  }
}

void VisitTies(const Row& row, const float* x, int count, TaskRow& tr) {
  const float v = row.pending_ties->v;
  for (int c = 0; c < count; ++c) tr.ties += (x[c] == v) ? 1 : 0;
}

void VisitFinal(const Row& row, const float* z, const float* l, const float* x,
                int64_t begin, int count, float max_gumbel, TaskRow& tr) {
  const bool filtered = row.use_min_p || row.use_top_k || row.use_top_p;
  if (row.want_raw_lse || row.top_n_raw > 0) {
    float raw[kTileTokens];
    MaskedRaw(row, begin, count, z, raw);
    for (int c = 0; c < count; ++c) {
      if (raw[c] == kNegInf) continue;  // masked: not in the raw softmax
      if (row.want_raw_lse) tr.fin.raw.Add(raw[c]);
      if (row.top_n_raw > 0)
        tr.top_raw.Offer(raw[c], static_cast<int32_t>(begin + c));
    }
  }
  for (int c = 0; c < count; ++c) {
    const int32_t id = static_cast<int32_t>(begin + c);
    const float xc = x[c];
    if (xc == kNegInf) continue;
    if (filtered) {
      // Both cursors see every allowed token (tie ranks), then min_p.
      const bool keep_k = tr.cursor_k.Keep(xc, id);
      const bool keep_p = tr.cursor_p.Keep(xc, id);
      if (!keep_k || !keep_p || xc < row.min_floor) continue;
    }
    if (row.want_processed_lse) tr.fin.processed.Add(xc);
    if (row.top_n_processed > 0) tr.top_processed.Offer(xc, id);
    if (row.greedy) {
      OfferGreedy(l[c], id, xc, z[c], &tr.fin.best[0]);
      continue;
    }
    for (int j = 0; j < row.n; ++j) {
      OfferSample(l[c], row.inv_t, id, xc, z[c], max_gumbel, &tr.noise[j],
                  &tr.fin.best[j]);
    }
  }
}

void VisitRank(const Row& row, const float* z, const float* x, int64_t begin,
               int count, TaskRow& tr) {
  float v[kTileTokens];
  if (row.params->logprobs.raw) {
    MaskedRaw(row, begin, count, z, v);  // masked: -inf, below every sample
  } else {
    const bool filtered = row.use_min_p || row.use_top_k || row.use_top_p;
    for (int c = 0; c < count; ++c) {
      const int32_t id = static_cast<int32_t>(begin + c);
      const float xc = x[c];
      v[c] = xc;
      if (xc == kNegInf || !filtered) continue;
      // As VisitFinal: both cursors see every allowed token, then min_p.
      const bool keep_k = tr.cursor_k.Keep(xc, id);
      const bool keep_p = tr.cursor_p.Keep(xc, id);
      if (!keep_k || !keep_p || xc < row.min_floor) v[c] = kNegInf;
    }
  }
  for (size_t j = 0; j < row.rank_value.size(); ++j) {
    const float at = row.rank_value[j];
    int64_t counted = 0;
    for (int c = 0; c < count; ++c) counted += v[c] >= at ? 1 : 0;
    tr.rank_count[j] += counted;
  }
}

}  // namespace cpu
}  // namespace flashsampler
