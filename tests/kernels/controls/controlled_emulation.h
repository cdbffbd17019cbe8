// A sequential host run of the controlled sampler's per-row algorithm, pass
// for pass what kernels/controls/controlled_sampler.cu does (the same
// controlled_math.h helpers, radix levels, tie selection and Gumbel walk),
// so the algorithm is checked against the CPU sampler without a GPU.
#ifndef FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_EMULATION_H_
#define FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_EMULATION_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_types.h"
#include "kernels/noise/philox.h"

namespace flashsampler {
namespace testing_controls {

struct EmulatedRow {
  int32_t status = kControlledOk;
  int32_t error_token = -1;
  std::vector<int32_t> token_ids;
  std::vector<float> sampled_logprobs;
  std::vector<int32_t> sampled_ranks;
  float logsumexp = 0.0f;
  std::vector<int32_t> top_token_ids;
  std::vector<float> top_logprobs;
};

struct EmulatedSelect {
  bool found = false;
  uint32_t key = 0;
  controls::U128 above = 0;
  uint64_t ties = 0;
  controls::U128 tie_weight = 0;
};

// The kernel's RadixSelect: four 8-bit levels, descending.
template <typename KeyOf>
EmulatedSelect EmulateRadixSelect(bool by_mass, int32_t vocab, KeyOf key_of,
                                  float x_max, controls::U128 target) {
  EmulatedSelect out;
  uint32_t prefix = 0;
  controls::U128 above = 0;
  for (int level = 0; level < controls::kRadixLevels; ++level) {
    std::vector<uint64_t> count(controls::kRadixBins, 0);
    std::vector<controls::U128> mass(controls::kRadixBins, 0);
    for (int32_t i = 0; i < vocab; ++i) {
      uint32_t key;
      if (!key_of(i, &key)) continue;
      if (!controls::RadixPrefixMatches(key, level, prefix)) continue;
      const uint32_t digit = controls::RadixDigit(key, level);
      ++count[digit];
      if (by_mass)
        mass[digit] += controls::FixedMass(controls::KeyValue(key), x_max);
    }
    auto weight = [&](int d) -> controls::U128 {
      return by_mass ? mass[d] : static_cast<controls::U128>(count[d]);
    };
    const int digit = controls::FindDigit(weight, target, &above);
    if (digit < 0) return out;
    prefix = (prefix << 8) | static_cast<uint32_t>(digit);
    if (level == controls::kRadixLevels - 1) {
      out.found = true;
      out.key = prefix;
      out.above = above;
      out.ties = count[digit];
      out.tie_weight = weight(digit);
    }
  }
  return out;
}

template <typename Member>
controls::OrderCut EmulateSelectCut(bool by_mass, const std::vector<float>& x,
                                    Member member, float x_max,
                                    controls::U128 target) {
  const int32_t vocab = static_cast<int32_t>(x.size());
  const EmulatedSelect value = EmulateRadixSelect(
      by_mass, vocab,
      [&](int32_t i, uint32_t* key) {
        if (!member(i, x[i])) return false;
        *key = controls::OrderKey(x[i]);
        return true;
      },
      x_max, target);
  if (!value.found) return controls::OrderCut{false, 0u, 0};
  const controls::U128 unit =
      by_mass ? value.tie_weight / static_cast<controls::U128>(value.ties)
              : controls::U128{1};
  const uint64_t needed =
      controls::TiesNeeded(target, value.above, unit, value.ties);
  if (needed >= value.ties)
    return controls::OrderCut{true, value.key, 0x7fffffff};
  const uint32_t v = value.key;
  const EmulatedSelect id = EmulateRadixSelect(
      false, vocab,
      [&](int32_t i, uint32_t* key) {
        if (!member(i, x[i]) || controls::OrderKey(x[i]) != v) return false;
        *key = ~static_cast<uint32_t>(i);
        return true;
      },
      x_max, static_cast<controls::U128>(needed));
  return controls::OrderCut{true, v, static_cast<int32_t>(~id.key)};
}

// The kernel's TopKCut: the k-th largest x among the members, every tie of
// it kept; inactive when fewer than k tokens are members.
template <typename Member>
controls::OrderCut EmulateTopKCut(const std::vector<float>& x, Member member,
                                  int64_t k) {
  const EmulatedSelect kth = EmulateRadixSelect(
      false, static_cast<int32_t>(x.size()),
      [&](int32_t i, uint32_t* key) {
        if (!member(i, x[i])) return false;
        *key = controls::OrderKey(x[i]);
        return true;
      },
      0.0f, static_cast<controls::U128>(k));
  if (!kth.found) return controls::OrderCut{false, 0u, 0};
  return controls::OrderCut{true, kth.key, 0x7fffffff};
}

// One row, as the kernel computes it; `z` is the row's raw logits.
inline EmulatedRow EmulateRow(const ControlledPlan& plan, int r, const float* z,
                              int32_t vocab) {
  EmulatedRow out;
  const ControlledRow& c = plan.row_controls()[r];
  const bool greedy = c.temperature == 0.0f;
  const bool want_sampled = (c.logprob_flags & kLogprobSampled) != 0;
  const bool want_rank = (c.logprob_flags & kLogprobRank) != 0;
  const bool want_lse = (c.logprob_flags & kLogprobLogsumexp) != 0;
  const bool raw = (c.logprob_flags & kLogprobRaw) != 0;
  const int32_t top_n = c.top_n < vocab ? c.top_n : vocab;
  const std::vector<uint32_t> words =
      c.bitmask_offset >= 0 ? plan.bitmask() : std::vector<uint32_t>();
  const uint32_t* bitmask =
      c.bitmask_offset >= 0 ? words.data() + c.bitmask_offset : nullptr;
  const float inv_t = greedy ? 1.0f : 1.0f / c.temperature;
  std::vector<float> x(vocab);
  int32_t bad = 0x7fffffff;
  for (int32_t i = 0; i < vocab; ++i) {
    const float li =
        controls::Disallowed(bitmask, i) ? controls::kNegInf : z[i];
    x[i] = controls::ScaledLogit(li, inv_t);
    if (!controls::IsFinite(z[i]) && i < bad) bad = i;
  }
  for (int64_t k = c.special_begin; k < c.special_end; ++k) {
    const int32_t id = plan.special_ids()[k];
    const float v = controls::SpecialLogit(
        z[id], controls::Disallowed(bitmask, id), plan.special_flags()[k],
        plan.special_bias()[k], plan.special_count()[k], c.repetition_penalty,
        c.frequency_penalty, c.presence_penalty);
    x[id] = controls::ScaledLogit(v, inv_t);
  }
  float x_max = controls::kNegInf;
  uint64_t allowed = 0;
  for (int32_t i = 0; i < vocab; ++i) {
    if (controls::IsNan(x[i]) || x[i] == controls::kPosInf) {
      if (i < bad) bad = i;
    } else if (x[i] != controls::kNegInf) {
      ++allowed;
      x_max = std::max(x_max, x[i]);
    }
  }
  if (bad != 0x7fffffff) {
    out.status = kControlledNonFinite;
    out.error_token = bad;
    return out;
  }
  if (allowed == 0) {
    out.status = kControlledAllMasked;
    return out;
  }
  const bool use_min_p = !greedy && c.min_p > 0.0f;
  const bool use_top_k = !greedy && c.top_k > 0 && c.top_k < vocab;
  const bool use_top_p = !greedy && c.top_p < 1.0f;
  const float floor =
      use_min_p ? controls::MinPFloor(x_max, c.log_min_p) : controls::kNegInf;
  auto base = [floor](int32_t, float xi) {
    return xi != controls::kNegInf && xi >= floor;
  };
  controls::OrderCut cut_k{false, 0u, 0};
  if (use_top_k) cut_k = EmulateTopKCut(x, base, c.top_k);
  auto within_k = [floor, cut_k](int32_t i, float xi) {
    return xi != controls::kNegInf && xi >= floor &&
           controls::CutKeeps(cut_k, controls::OrderKey(xi), i);
  };
  controls::OrderCut cut_p{false, 0u, 0};
  if (use_top_p) {
    controls::U128 total = 0;
    for (int32_t i = 0; i < vocab; ++i) {
      if (within_k(i, x[i])) total += controls::FixedMass(x[i], x_max);
    }
    cut_p = EmulateSelectCut(true, x, within_k, x_max,
                             controls::CeilScaled(c.top_p, total));
  }
  auto survives = [within_k, cut_p](int32_t i, float xi) {
    return within_k(i, xi) &&
           controls::CutKeeps(cut_p, controls::OrderKey(xi), i);
  };
  out.token_ids.assign(c.n, -1);
  const int computed = greedy ? 1 : c.n;
  for (int j = 0; j < computed; ++j) {
    uint64_t best = 0;
    for (int32_t i = 0; i < vocab; ++i) {
      if (!survives(i, x[i])) continue;
      float score = x[i];
      if (!greedy) {
        score = controls::FoldZero(
            x[i] + GumbelNoise(c.seed, c.step, static_cast<uint32_t>(j),
                               static_cast<uint32_t>(i)));
      }
      best = std::max(best, controls::PackedKey(score, i));
    }
    const int32_t id = controls::PackedKeyId(best);
    if (greedy) {
      for (int k = 0; k < c.n; ++k) out.token_ids[k] = id;
    } else {
      out.token_ids[j] = id;
    }
  }
  // The kernel's raw values: the raw logits after the masks alone.
  std::vector<float> masked_raw(vocab);
  for (int32_t i = 0; i < vocab; ++i) {
    masked_raw[i] = controls::MaskedRawLogit(
        z[i], x[i], controls::Disallowed(bitmask, i), plan.special_ids().data(),
        plan.special_flags().data(), c.special_begin, c.special_end, i);
  }
  auto listed = [&](int32_t i) {
    return raw ? masked_raw[i] != controls::kNegInf : survives(i, x[i]);
  };
  if (want_sampled || want_rank || want_lse || top_n > 0) {
    float v_max = x_max;
    if (raw) {
      v_max = controls::kNegInf;
      for (int32_t i = 0; i < vocab; ++i)
        v_max = std::max(v_max, masked_raw[i]);
    }
    double sum = 0.0;
    for (int32_t i = 0; i < vocab; ++i) {
      if (!listed(i)) continue;
      const float v = raw ? masked_raw[i] : x[i];
      sum += std::exp(static_cast<double>(v) - static_cast<double>(v_max));
    }
    const double lse = static_cast<double>(v_max) + std::log(sum);
    if (want_lse) out.logsumexp = static_cast<float>(lse);
    if (want_sampled) {
      for (int k = 0; k < c.n; ++k) {
        const int32_t id = out.token_ids[k];
        out.sampled_logprobs.push_back(
            static_cast<float>(static_cast<double>(raw ? z[id] : x[id]) - lse));
      }
    }
    if (want_rank) {
      for (int k = 0; k < c.n; ++k) {
        const int32_t id = out.token_ids[k];
        const float v_k = raw ? z[id] : x[id];
        int32_t count = 0;
        for (int32_t i = 0; i < vocab; ++i)
          count += listed(i) && (raw ? masked_raw[i] : x[i]) >= v_k ? 1 : 0;
        out.sampled_ranks.push_back(count);
      }
    }
    uint64_t previous = ~0ull;
    for (int32_t t = 0; t < top_n; ++t) {
      uint64_t best = 0;
      for (int32_t i = 0; i < vocab; ++i) {
        if (!listed(i)) continue;
        const uint64_t key = controls::PackedKey(raw ? masked_raw[i] : x[i], i);
        if (key < previous && key > best) best = key;
      }
      if (best == 0) break;
      out.top_token_ids.push_back(controls::PackedKeyId(best));
      out.top_logprobs.push_back(static_cast<float>(
          static_cast<double>(controls::PackedKeyValue(best)) - lse));
      previous = best;
    }
  }
  return out;
}

}  // namespace testing_controls
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_EMULATION_H_
