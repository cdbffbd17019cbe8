// Phase transitions of one row: statistics -> (radix select -> ties) ->
// final sweep -> result.
#include "service/backends/cpu/row_plan.h"

#include <algorithm>

#include "service/backends/cpu/temperature.h"

namespace flashsampler {
namespace cpu {

namespace {

constexpr const char kAllMasked[] =
    "every token is masked (banned ids, allowed bitmask or -inf bias)";

void EnterFinal(Row& row, int64_t num_chunks) {
  row.phase = Phase::kFinal;
  row.sorted.clear();
  row.sorted.shrink_to_fit();
  ChunkFinal empty;
  empty.best.assign(row.n, BestOf{});
  row.finals.assign(num_chunks, empty);
  row.top_processed.Reset(row.top_n_processed);
  row.top_raw.Reset(row.top_n_raw);
}

void StartSelect(Row& row, Selecting what) {
  row.used_radix_select = true;
  row.selecting = what;
  row.phase = Phase::kHist;
  row.select = RadixSelect{};
  row.select.by_mass = what == Selecting::kTopP;
  row.select.target =
      what == Selecting::kTopK ? static_cast<uint128>(row.params->top_k) : 0;
  row.select.StartLevel(0);
}

void PlanTopP(Row& row, bool survivors_known, int64_t num_chunks) {
  if (!row.use_top_p) {
    EnterFinal(row, num_chunks);
  } else if (survivors_known) {
    TopPCutOfList(row.sorted, row.params->top_p, row.x_max, &row.cut_p);
    EnterFinal(row, num_chunks);
  } else {
    StartSelect(row, Selecting::kTopP);
  }
}

// A cut is final; move on to top-p (after top-k) or to sampling.
void AfterCut(Row& row, int64_t num_chunks) {
  const Selecting was = row.selecting;
  row.selecting = Selecting::kNone;
  row.pending_ties = nullptr;
  if (was == Selecting::kTopK) {
    // The buffer could not hold the top-k survivors, so top-p needs passes.
    PlanTopP(row, /*survivors_known=*/false, num_chunks);
  } else {
    EnterFinal(row, num_chunks);
  }
}

}  // namespace

void PlanRow(const RowSpec& spec, int64_t vocab, int64_t candidate_buffer,
             int64_t num_chunks, Row& row) {
  const SamplingParams& p = *spec.params;
  row.params = spec.params;
  row.seed = spec.seed;
  row.step = spec.step;
  row.greedy = p.greedy();
  row.inv_t = InverseTemperature(p);
  row.n = row.greedy ? 1 : p.n;
  row.bitmask = p.allowed_bitmask.empty() ? nullptr : p.allowed_bitmask.data();
  row.edits = CollectTokenEdits(p);

  row.use_min_p = !row.greedy && p.min_p > 0.0f;
  row.use_top_k = !row.greedy && p.top_k > 0 && p.top_k < vocab;
  row.use_top_p = !row.greedy && p.top_p < 1.0f;
  const bool any_logprobs = p.logprobs.any();
  row.want_processed_lse = any_logprobs && !p.logprobs.raw;
  row.want_raw_lse = any_logprobs && p.logprobs.raw;
  const size_t top_n =
      static_cast<size_t>(std::min<int64_t>(p.logprobs.top_n, vocab));
  row.top_n_processed = p.logprobs.raw ? 0 : top_n;
  row.top_n_raw = p.logprobs.raw ? top_n : 0;
  const bool filtered = row.use_min_p || row.use_top_k || row.use_top_p;
  // top_k alone needs k buffered tokens and one more: an entry strictly
  // below the k-th value shows that every tie of that value is buffered.
  // top_p uses the whole buffer.
  int64_t buffer = 0;
  if (row.use_top_p) {
    buffer = candidate_buffer;
  } else if (row.use_top_k) {
    buffer = std::min<int64_t>(int64_t{p.top_k} + 1, candidate_buffer);
  }
  row.buffer.Reset(static_cast<size_t>(std::max<int64_t>(0, buffer)));
  if (filtered) {
    row.phase = Phase::kStats;
  } else {
    EnterFinal(row, num_chunks);
  }
}

void AfterStats(Row& row, int64_t num_chunks) {
  if (row.allowed == 0) {
    row.SetError(-1, kAllMasked);
    row.phase = Phase::kDone;
    return;
  }
  if (row.use_min_p) row.min_floor = SmallestKept(row.x_max, row.params->min_p);
  row.sorted = row.buffer.TakeSorted();
  row.buffer.Reset(0);
  const bool complete = row.allowed <= row.sorted.size();
  size_t kept = 0;
  while (kept < row.sorted.size() && row.sorted[kept].x >= row.min_floor)
    ++kept;
  // The min_p survivors form a prefix of the order: if one buffered token
  // fails, every token outside the buffer fails too.
  const bool min_p_complete = complete || kept < row.sorted.size();
  row.sorted.resize(kept);
  bool survivors_known = min_p_complete;
  if (row.use_top_k) {
    const size_t k = static_cast<size_t>(row.params->top_k);
    if (k <= row.sorted.size()) {
      // The buffer is a prefix of the order, so its k-th entry holds the
      // k-th largest x: top_k keeps every x >= v. Its survivors are all
      // buffered only when no tie of v can lie beyond the buffer: the buffer
      // holds every min_p survivor, or an entry strictly below v.
      const float v = row.sorted[k - 1].x;
      row.cut_k = Cutoff::AtLeast(v);
      if (min_p_complete || row.sorted.back().x < v) {
        size_t keep = k;
        while (keep < row.sorted.size() && row.sorted[keep].x >= v) ++keep;
        row.sorted.resize(keep);
        survivors_known = true;
      }
    } else if (!min_p_complete) {
      StartSelect(row, Selecting::kTopK);
      return;
    }
  }
  PlanTopP(row, survivors_known, num_chunks);
}

void AfterHist(Row& row, int64_t num_chunks) {
  RadixSelect& sel = row.select;
  if (sel.by_mass && sel.level == 0) {
    uint128 total = 0;
    for (uint128 m : sel.mass) total += m;
    sel.target = CeilScaled(row.params->top_p, total);
    // Fast path: the buffered prefix certifies the cut when its mass
    // reaches the target.
    if (TopPCutOfPrefix(row.sorted, row.cut_k, sel.target, row.x_max,
                        &row.cut_p)) {
      EnterFinal(row, num_chunks);
      return;
    }
  }
  uint128 above = 0;
  const int64_t found = sel.FindBin(&above);
  Cutoff& cut = row.selecting == Selecting::kTopK ? row.cut_k : row.cut_p;
  if (found < 0) {  // fewer than k survivors: no cut
    AfterCut(row, num_chunks);
    return;
  }
  sel.above = above;
  sel.prefix =
      (sel.prefix << kRadixBits[sel.level]) | static_cast<uint32_t>(found);
  if (sel.level < 2) {
    sel.StartLevel(sel.level + 1);
    return;
  }
  // The cut value is known exactly. top_k keeps every tie of it (the k-th
  // largest x is a value threshold); top_p decides how many ties to keep.
  if (row.selecting == Selecting::kTopK) {
    cut = Cutoff::AtLeast(KeyValue(sel.prefix));
    AfterCut(row, num_chunks);
    return;
  }
  const uint64_t ties = sel.count[found];
  const uint128 unit = sel.by_mass ? sel.mass[found] / ties : 1;
  const uint128 needed = (sel.target - sel.above + unit - 1) / unit;
  cut.active = true;
  cut.v = KeyValue(sel.prefix);
  if (needed >= ties) {
    cut.ties = Cutoff::Ties::kAll;
    AfterCut(row, num_chunks);
    return;
  }
  cut.ties = Cutoff::Ties::kFirstRanks;
  cut.ranks = static_cast<int64_t>(needed);
  row.pending_ties = &cut;
  row.tie_counts.assign(num_chunks, 0);
  row.phase = Phase::kTies;
}

void AfterTies(Row& row, int64_t num_chunks) {
  Cutoff& cut = *row.pending_ties;
  cut.tie_prefix.assign(num_chunks, 0);
  int64_t sum = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    cut.tie_prefix[c] = sum;
    sum += row.tie_counts[c];
  }
  AfterCut(row, num_chunks);
}

void FinishRow(Row& row, RowResult& out) {
  std::vector<BestOf> best(row.n);
  Lse processed, raw;
  for (const ChunkFinal& f : row.finals) {
    for (int j = 0; j < row.n; ++j) {
      const BestOf& b = f.best[j];
      if (CandidateBetter(b.score, b.id, best[j].score, best[j].id))
        best[j] = b;
    }
    processed.Merge(f.processed);
    raw.Merge(f.raw);
  }
  row.finals.clear();
  if (best[0].id == kNoToken) {
    row.SetError(-1, kAllMasked);
    return;
  }
  const SamplingParams& p = *row.params;
  const int samples = p.n;
  const LogprobRequest& lp = p.logprobs;
  const double lse = lp.raw ? raw.Value() : processed.Value();
  out.token_ids.resize(samples);
  if (lp.sampled) out.sampled_logprobs.resize(samples);
  for (int j = 0; j < samples; ++j) {
    const BestOf& b = best[row.greedy ? 0 : j];
    out.token_ids[j] = b.id;
    if (lp.sampled) out.sampled_logprobs[j] = Logprob(lp.raw ? b.z : b.x, lse);
  }
  if (lp.logsumexp) out.logsumexp = static_cast<float>(lse);
  if (lp.top_n > 0) {
    FillTopLogprobs(
        lp.raw ? row.top_raw.TakeSorted() : row.top_processed.TakeSorted(), lse,
        &out);
  }
  if (lp.rank) {
    row.rank_value.clear();
    for (int j = 0; j < row.n; ++j)
      row.rank_value.push_back(lp.raw ? best[j].z : best[j].x);
    row.rank_count.assign(row.n, 0);
  }
}

void FinishRanks(Row& row, RowResult& out) {
  out.sampled_ranks.resize(out.token_ids.size());
  for (size_t j = 0; j < out.sampled_ranks.size(); ++j) {
    out.sampled_ranks[j] =
        static_cast<int32_t>(row.rank_count[row.greedy ? 0 : j]);
  }
}

}  // namespace cpu
}  // namespace flashsampler
