// Shared pieces of the controlled-sampler tests: batches packed the way the
// CUDA engine packs them (ControlledInputFrom), exact small-integer logits from
// the CPU sampler, the batches of mixed controls every test sweeps, and the
// comparison with RowResult.
#ifndef FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_TEST_UTIL_H_
#define FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/controls/controlled_plan.h"
#include "kernels/controls/controlled_types.h"
#include "service/backends/cpu/cpu_sampler.h"
#include "service/backends/cuda/controlled_rows.h"
#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace testing_controls {

inline ControlledPlan PlanOf(const std::vector<RowSpec>& specs) {
  ControlledPlan plan;
  for (const RowSpec& spec : specs) {
    ControlledRowLists lists;
    plan.AddRow(ControlledInputFrom(spec, &lists));
  }
  return plan;
}

// A row's input pointing into the lists (which must outlive it).
inline ControlledRowInput InputOfLists(
    const std::vector<int32_t>& bias_ids, const std::vector<float>& bias_values,
    const std::vector<int32_t>& banned, const std::vector<int32_t>& prompt,
    const std::vector<int32_t>& output_ids,
    const std::vector<int32_t>& output_counts) {
  ControlledRowInput in;
  in.bias_ids = bias_ids.data();
  in.bias_values = bias_values.data();
  in.num_bias = bias_ids.size();
  in.banned_ids = banned.data();
  in.num_banned = banned.size();
  in.prompt_ids = prompt.data();
  in.num_prompt = prompt.size();
  in.output_ids = output_ids.data();
  in.output_counts = output_counts.data();
  in.num_output = output_ids.size();
  return in;
}

// ControlledPlan::AddRows' for_each on the calling thread, in order.
struct InOrder {
  template <typename Fn>
  void operator()(int64_t n, const Fn& fn) const {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
};

// The same rows with each row's merge of up to kPendingMaxKeys keys left to
// the device (ControlledPlan::AddRows' pending rows).
inline ControlledPlan PendingPlanOf(const std::vector<RowSpec>& specs) {
  std::vector<ControlledRowLists> lists(specs.size());
  std::vector<ControlledRowInput> inputs;
  inputs.reserve(specs.size());
  std::vector<ControlledPlan::RowToAdd> rows;
  for (size_t i = 0; i < specs.size(); ++i) {
    inputs.push_back(ControlledInputFrom(specs[i], &lists[i]));
    ControlledPlan::RowToAdd row;
    row.in = &inputs.back();
    rows.push_back(row);
  }
  ControlledPlan plan;
  plan.AddRows(rows, InOrder{}, kPendingMaxKeys);
  return plan;
}

// Small-integer W and h: every product and partial sum is an exact integer
// in fp32, so the logits do not depend on the accumulation order.
struct Model {
  int64_t vocab = 0;
  int hidden = 0;
  std::unique_ptr<CpuSampler> sampler;
};

inline Model MakeModel(int64_t vocab, int hidden, uint64_t seed) {
  Model m;
  m.vocab = vocab;
  m.hidden = hidden;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(-3, 3);
  auto weights = std::make_shared<std::vector<float>>(vocab * hidden);
  for (float& v : *weights) v = static_cast<float>(pick(rng));
  CpuSamplerOptions options;
  options.threads = 2;
  auto sampler = CpuSampler::Create(weights, vocab, hidden, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  if (sampler.ok()) m.sampler = std::move(*sampler);
  return m;
}

// Hidden states: small integers, or all zero (a flat distribution: every
// logit 0) for rows whose index is in `flat_rows`.
inline std::vector<float> MakeHidden(int rows, int hidden, uint64_t seed,
                                     const std::vector<int>& flat_rows = {}) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick(-2, 2);
  std::vector<float> h(static_cast<size_t>(rows) * hidden);
  for (float& v : h) v = static_cast<float>(pick(rng));
  for (int r : flat_rows) {
    for (int d = 0; d < hidden; ++d) h[static_cast<size_t>(r) * hidden + d] = 0;
  }
  return h;
}

// A named set of row controls; rows take them in turn.
struct Case {
  std::string name;
  std::vector<SamplingParams> params;
  std::vector<int> flat_rows;  // rows with all-zero hidden states
};

inline std::vector<uint32_t> Bitmask(int64_t vocab, uint64_t seed,
                                     double keep) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution allow(keep);
  std::vector<uint32_t> words((vocab + 31) / 32, 0u);
  for (int64_t id = 0; id < vocab; ++id) {
    if (allow(rng)) words[id >> 5] |= 1u << (id & 31);
  }
  return words;
}

inline LogprobRequest AllLogprobs(int top_n, bool raw) {
  LogprobRequest lp;
  lp.sampled = true;
  lp.rank = true;
  lp.logsumexp = true;
  lp.top_n = top_n;
  lp.raw = raw;
  return lp;
}

// Every control alone and in the combinations the GPU path must serve.
inline std::vector<Case> Cases(int64_t vocab) {
  std::vector<Case> cases;
  std::mt19937_64 rng(vocab);
  auto id = [&] { return static_cast<int32_t>(rng() % vocab); };
  auto with = [](auto edit) {
    SamplingParams p;
    edit(p);
    return p;
  };
  cases.push_back({"greedy",
                   {with([](SamplingParams& p) {
                     p.temperature = 0.0f;
                     p.n = 3;
                     p.top_k = 5;  // ignored by greedy rows
                     p.logprobs = AllLogprobs(5, false);
                   })},
                   {}});
  cases.push_back({"temperature_n4",
                   {with([](SamplingParams& p) {
                     p.temperature = 0.8f;
                     p.n = 4;
                   })},
                   {}});
  cases.push_back({"temperature_top_k",
                   {with([](SamplingParams& p) {
                     p.temperature = 1.7f;
                     p.top_k = 7;
                     p.n = 2;
                   })},
                   {}});
  cases.push_back({"top_k_above_vocab",
                   {with([&](SamplingParams& p) {
                     p.top_k = static_cast<int32_t>(vocab + 5);
                     p.logprobs = AllLogprobs(3, false);
                   })},
                   {}});
  cases.push_back({"top_k_top_p",
                   {with([](SamplingParams& p) {
                     p.top_k = 40;
                     p.top_p = 0.7f;
                     p.n = 4;
                   })},
                   {}});
  cases.push_back({"min_p_top_p",
                   {with([](SamplingParams& p) {
                     p.min_p = 0.05f;
                     p.top_p = 0.9f;
                     p.n = 2;
                   })},
                   {}});
  cases.push_back({"top_p_one",
                   {with([](SamplingParams& p) {
                     p.top_p = 1.0f;
                     p.logprobs = AllLogprobs(4, false);
                   })},
                   {}});
  cases.push_back({"flat_top_p_099",
                   {with([](SamplingParams& p) {
                      p.top_p = 0.99f;
                      p.n = 4;
                      p.logprobs = AllLogprobs(6, false);
                    }),
                    with([](SamplingParams& p) {
                      p.top_k = 10;
                      p.top_p = 0.5f;
                      p.logprobs = AllLogprobs(20, false);
                    })},
                   {0, 1}});
  {
    SamplingParams p;
    p.top_p = 0.8f;
    p.repetition_penalty = 1.3f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    for (int i = 0; i < 50; ++i) p.prompt_token_ids.push_back(id());
    for (int i = 0; i < 20; ++i) {
      p.output_token_counts.push_back({id(), static_cast<int32_t>(i % 4)});
    }
    p.n = 2;
    cases.push_back({"penalties_top_p", {p}, {}});
  }
  {
    SamplingParams p;
    p.temperature = 0.9f;
    for (int i = 0; i < 30; ++i) {
      p.logit_bias.push_back({id(), static_cast<float>(i % 7) - 3.0f});
    }
    p.logit_bias.push_back({p.logit_bias[0].token_id, 0.375f});  // repeats
    p.logit_bias.push_back({id(), -std::numeric_limits<float>::infinity()});
    for (int i = 0; i < 25; ++i) p.banned_token_ids.push_back(id());
    p.allowed_bitmask = Bitmask(vocab, vocab + 1, 0.6);
    p.logprobs = AllLogprobs(5, false);
    p.n = 3;
    cases.push_back({"bias_banned_bitmask", {p}, {}});
  }
  cases.push_back({"logprobs_every_filter",
                   {with([](SamplingParams& p) {
                      p.temperature = 1.2f;
                      p.top_k = 50;
                      p.top_p = 0.85f;
                      p.min_p = 0.01f;
                      p.logprobs = AllLogprobs(20, false);
                    }),
                    with([](SamplingParams& p) {
                      p.temperature = 0.6f;
                      p.top_k = 50;
                      p.top_p = 0.85f;
                      p.min_p = 0.01f;
                      p.logprobs = AllLogprobs(20, true);
                    })},
                   {}});
  {
    // Raw logprobs after the masks: banned and bitmask-disallowed tokens
    // leave the raw distribution; a -inf bias, other biases and penalties do
    // not touch it. top_k = 2 over small-integer logits cuts inside ties.
    SamplingParams p;
    p.temperature = 0.7f;
    p.top_k = 2;
    p.top_p = 0.95f;
    for (int i = 0; i < 25; ++i) p.banned_token_ids.push_back(id());
    p.logit_bias = {{id(), -std::numeric_limits<float>::infinity()},
                    {id(), 1.5f}};
    p.repetition_penalty = 1.5f;
    for (int i = 0; i < 10; ++i) p.prompt_token_ids.push_back(id());
    p.allowed_bitmask = Bitmask(vocab, vocab + 2, 0.5);
    p.logprobs = AllLogprobs(8, true);
    p.n = 3;
    SamplingParams greedy = p;
    greedy.temperature = 0.0f;
    SamplingParams processed = p;
    processed.logprobs = AllLogprobs(8, false);
    cases.push_back({"raw_logprobs_masked", {p, greedy, processed}, {}});
  }
  // top_k keeps every tie of the k-th value: small-integer logits tie often.
  cases.push_back({"top_k_ties",
                   {with([](SamplingParams& p) {
                      p.top_k = 1;
                      p.n = 3;
                      p.logprobs = AllLogprobs(6, false);
                    }),
                    with([](SamplingParams& p) {
                      p.top_k = 3;
                      p.n = 2;
                      p.logprobs = AllLogprobs(12, false);
                    }),
                    with([](SamplingParams& p) {
                      p.top_k = 3;
                      p.top_p = 0.6f;
                      p.n = 2;
                    }),
                    with([](SamplingParams& p) {
                      p.top_k = 12;
                      p.min_p = 0.1f;
                      p.logprobs = AllLogprobs(3, true);
                    })},
                   {2}});
  // Below 1e-5 a row is greedy (filters ignored, logprobs at T = 1); 1e-5
  // samples.
  cases.push_back({"tiny_temperature",
                   {with([](SamplingParams& p) {
                      p.temperature = 1e-38f;
                      p.top_k = 3;
                      p.n = 2;
                      p.logprobs = AllLogprobs(4, false);
                    }),
                    with([](SamplingParams& p) {
                      p.temperature = 9.9e-6f;
                      p.top_p = 0.5f;
                      p.logprobs = AllLogprobs(4, true);
                    }),
                    with([](SamplingParams& p) {
                      p.temperature = 1e-5f;
                      p.n = 3;
                      p.logprobs = AllLogprobs(4, false);
                    })},
                   {}});
  {
    SamplingParams masked;
    masked.allowed_bitmask.assign((vocab + 31) / 32, 0u);
    SamplingParams fine;
    fine.top_k = 3;
    fine.logprobs = AllLogprobs(2, false);
    cases.push_back({"one_row_all_masked", {fine, masked, fine}, {}});
  }
  {
    // Every row different.
    std::vector<SamplingParams> mixed;
    for (int i = 0; i < 8; ++i) {
      SamplingParams p;
      p.temperature = i == 0 ? 0.0f : 0.4f + 0.3f * static_cast<float>(i);
      p.top_k = (i % 3 == 1) ? 4 + i : 0;
      p.top_p = (i % 2 == 0) ? 0.6f + 0.05f * static_cast<float>(i) : 1.0f;
      p.min_p = (i % 4 == 3) ? 0.02f : 0.0f;
      p.n = 1 + i % 4;
      if (i % 3 == 2) p.logprobs = AllLogprobs(i, i % 2 == 1);
      if (i == 5) p.banned_token_ids = {id(), id(), id()};
      if (i == 6) p.logit_bias = {{id(), 2.5f}, {id(), -1.0f}};
      mixed.push_back(p);
    }
    cases.push_back({"mixed_batch", mixed, {}});
  }
  return cases;
}

// The rows of one case: `rows` rows taking the case's params in turn.
inline std::vector<RowSpec> Specs(const Case& c, int rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<RowSpec> specs(rows);
  for (int r = 0; r < rows; ++r) {
    specs[r].params = &c.params[r % c.params.size()];
    specs[r].seed = rng();
    specs[r].step = rng() % 100000;
  }
  return specs;
}

// Tokens, ranks and top ids exactly, logprobs within 1e-5 (relative, 1e-6
// absolute near zero), errors by kind.
inline void ExpectRowEqual(const RowResult& cpu, int32_t status,
                           const std::vector<int32_t>& token_ids,
                           const std::vector<float>& sampled_logprobs,
                           const std::vector<int32_t>& sampled_ranks,
                           float logsumexp, const std::vector<int32_t>& top_ids,
                           const std::vector<float>& top_logprobs,
                           const SamplingParams& p, const std::string& where) {
  auto near = [](float a, float b) {
    return std::fabs(a - b) <= 1e-5f * std::max(1.0f, std::fabs(b));
  };
  if (!cpu.error.empty()) {
    EXPECT_NE(status, kControlledOk)
        << where << ": CPU failed with " << cpu.error;
    if (cpu.error.rfind("every token is masked", 0) == 0) {
      EXPECT_EQ(status, kControlledAllMasked) << where;
    }
    return;
  }
  ASSERT_EQ(status, kControlledOk) << where;
  EXPECT_EQ(token_ids, cpu.token_ids) << where;
  if (p.logprobs.sampled) {
    ASSERT_EQ(sampled_logprobs.size(), cpu.sampled_logprobs.size()) << where;
    for (size_t j = 0; j < sampled_logprobs.size(); ++j) {
      EXPECT_TRUE(near(sampled_logprobs[j], cpu.sampled_logprobs[j]))
          << where << " sample " << j << ": " << sampled_logprobs[j] << " vs "
          << cpu.sampled_logprobs[j];
    }
  }
  if (p.logprobs.rank) {
    EXPECT_EQ(sampled_ranks, cpu.sampled_ranks) << where;
  }
  if (p.logprobs.logsumexp) {
    EXPECT_TRUE(near(logsumexp, cpu.logsumexp))
        << where << ": logsumexp " << logsumexp << " vs " << cpu.logsumexp;
  }
  if (p.logprobs.top_n > 0) {
    EXPECT_EQ(top_ids, cpu.top_token_ids) << where;
    ASSERT_EQ(top_logprobs.size(), cpu.top_logprobs.size()) << where;
    for (size_t t = 0; t < top_logprobs.size(); ++t) {
      EXPECT_TRUE(near(top_logprobs[t], cpu.top_logprobs[t]))
          << where << " top " << t << ": " << top_logprobs[t] << " vs "
          << cpu.top_logprobs[t];
    }
  }
}

// One case's batch, as every controlled-sampler test runs it: at least
// rows_per_case rows (one per parameter set), exact small-integer logits and
// the CPU sampler's results for them, and the batch packed as the engine
// packs it. `c` must outlive the batch (the specs point into it).
struct CaseBatch {
  int rows = 0;
  std::vector<RowSpec> specs;
  std::vector<float> logits;  // [rows, vocab]
  std::vector<RowResult> cpu;
  ControlledPlan plan;
};

inline void PrepareCase(const Model& model, const Case& c, int rows_per_case,
                        CaseBatch* out) {
  out->rows = std::max<int>(rows_per_case, static_cast<int>(c.params.size()));
  out->specs = Specs(c, out->rows, model.vocab * 31 + out->rows);
  const std::vector<float> hidden =
      MakeHidden(out->rows, model.hidden, model.vocab + 7, c.flat_rows);
  out->logits.assign(static_cast<size_t>(out->rows) * model.vocab, 0.0f);
  ASSERT_TRUE(
      model.sampler->ComputeLogits(hidden.data(), out->rows, out->logits.data())
          .ok());
  // Rows that fail (every token masked) fail here too; the tests compare.
  (void)model.sampler->Sample(hidden.data(), out->rows, out->specs.data(),
                              &out->cpu);
  out->plan = PlanOf(out->specs);
}

}  // namespace testing_controls
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_KERNELS_CONTROLS_CONTROLLED_TEST_UTIL_H_
