// Distribution tests of the CPU sampler: chi-squared goodness of fit against
// the exact softmax (computed in double) over a grid of vocabulary sizes that
// straddle tile boundaries and temperatures, plus top-k, min-p, top-p and
// n > 1, with a Bonferroni-corrected threshold; greedy against argmax.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "service/backends/cpu/cpu_sampler.h"
#include "tests/testing/chi_squared.h"

namespace flashsampler {
namespace {

using stats::ChiSquaredPValue;
using stats::RegularizedGammaQ;

TEST(ChiSquaredHelperTest, MatchesClosedFormsAndTables) {
  for (double x : {0.01, 0.5, 1.0, 3.84, 10.0, 40.0}) {
    EXPECT_NEAR(ChiSquaredPValue(x, 1), std::erfc(std::sqrt(x / 2)), 1e-12)
        << x;
    EXPECT_NEAR(ChiSquaredPValue(x, 2), std::exp(-x / 2), 1e-12) << x;
    // Integer a: Q(k, y) = exp(-y) sum_{i<k} y^i / i!.
    const double y = x / 2;
    double sum = 0, term = 1;
    for (int i = 0; i < 5; ++i) {
      sum += term;
      term *= y / (i + 1);
    }
    EXPECT_NEAR(RegularizedGammaQ(5, y), std::exp(-y) * sum, 1e-12) << x;
  }
  // Critical values from standard chi-squared tables.
  EXPECT_NEAR(ChiSquaredPValue(3.841, 1), 0.05, 1e-4);
  EXPECT_NEAR(ChiSquaredPValue(18.307, 10), 0.05, 1e-4);
  EXPECT_NEAR(ChiSquaredPValue(23.209, 10), 0.01, 1e-4);
  EXPECT_NEAR(ChiSquaredPValue(124.342, 100), 0.05, 1e-4);
  EXPECT_NEAR(ChiSquaredPValue(1118.948, 1000), 0.005, 2e-4);
}

// Goodness of fit of `counts` (n draws) to `probabilities`: bins with an
// expected count >= 5 stand alone, the others are merged into one tail bin
// (itself merged into the smallest bin when its expectation is still < 5).
// Tokens of probability 0 must never be drawn (asserted by the caller).
double GoodnessOfFit(const std::vector<int64_t>& counts,
                     const std::vector<double>& probabilities, int64_t n,
                     int* bins_used) {
  std::vector<double> expected;
  std::vector<double> observed;
  double tail_expected = 0, tail_observed = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double e = probabilities[i] * n;
    if (e >= 5.0) {
      expected.push_back(e);
      observed.push_back(static_cast<double>(counts[i]));
    } else {
      tail_expected += e;
      tail_observed += static_cast<double>(counts[i]);
    }
  }
  if (tail_expected >= 5.0 || expected.empty()) {
    expected.push_back(tail_expected);
    observed.push_back(tail_observed);
  } else if (tail_expected > 0.0 || tail_observed > 0.0) {
    const size_t smallest =
        std::min_element(expected.begin(), expected.end()) - expected.begin();
    expected[smallest] += tail_expected;
    observed[smallest] += tail_observed;
  }
  double statistic = 0;
  for (size_t b = 0; b < expected.size(); ++b) {
    const double d = observed[b] - expected[b];
    statistic += d * d / expected[b];
  }
  *bins_used = static_cast<int>(expected.size());
  if (expected.size() < 2) return 1.0;  // a single bin: nothing to test
  return ChiSquaredPValue(statistic, static_cast<int>(expected.size()) - 1);
}

constexpr int64_t kHidden = 16;
constexpr int kSamples = 20000;
// 7 vocabulary sizes x 3 temperatures, plus the 11 cases below (steps 1,
// top_k 3, min_p 2, top_p 2, n 3).
constexpr int kGridPoints = 21 + 11;
constexpr double kAlpha = 1e-3 / kGridPoints;  // Bonferroni

struct Model {
  int64_t vocab;
  std::unique_ptr<CpuSampler> sampler;
  std::vector<float> hidden;  // one row
  std::vector<float> logits;  // its fp32 logits, as the sampler computes them
};

// Random W and one hidden row with logits of standard deviation ~2, a
// realistic spread (a few dominant tokens, a long tail).
Model MakeModel(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto w = std::make_shared<std::vector<float>>(vocab * kHidden);
  for (float& v : *w) v = normal(rng);
  Model m;
  m.vocab = vocab;
  CpuSamplerOptions options;
  options.chunk_rows =
      1024;  // V = 4099 spans five chunks: stage 2 is exercised
  auto sampler = CpuSampler::Create(w, vocab, kHidden, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  m.sampler = std::move(sampler).value();
  m.hidden.resize(kHidden);
  for (float& v : m.hidden) v = 0.5f * normal(rng);
  m.logits.resize(vocab);
  EXPECT_TRUE(
      m.sampler->ComputeLogits(m.hidden.data(), 1, m.logits.data()).ok());
  return m;
}

// Exact distribution of x = fl(logit * fl(1 / T)) over `keep`, in double.
std::vector<double> Softmax(const Model& m, float temperature,
                            const std::vector<bool>& keep) {
  const float inv_t = 1.0f / temperature;
  std::vector<double> x(m.vocab);
  double max = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < m.vocab; ++i) {
    x[i] = static_cast<double>(m.logits[i] * inv_t);
    if (keep[i]) max = std::max(max, x[i]);
  }
  std::vector<double> p(m.vocab, 0.0);
  double sum = 0;
  for (int64_t i = 0; i < m.vocab; ++i) {
    if (keep[i]) sum += (p[i] = std::exp(x[i] - max));
  }
  for (double& v : p) v /= sum;
  return p;
}

// Draws kSamples rows (one hidden row replicated, distinct seeds, or one
// seed and distinct steps) and returns per-sample-index token counts.
std::vector<std::vector<int64_t>> Draw(
    const Model& m, const SamplingParams& p, uint64_t base, bool vary_step,
    std::vector<std::vector<int32_t>>* tokens = nullptr) {
  constexpr int kBatch = 1000;
  std::vector<float> hidden(kBatch * kHidden);
  for (int r = 0; r < kBatch; ++r) {
    std::copy(m.hidden.begin(), m.hidden.end(), hidden.begin() + r * kHidden);
  }
  std::vector<std::vector<int64_t>> counts(p.n,
                                           std::vector<int64_t>(m.vocab, 0));
  for (int start = 0; start < kSamples; start += kBatch) {
    std::vector<RowSpec> specs(kBatch);
    for (int r = 0; r < kBatch; ++r) {
      const uint64_t i = static_cast<uint64_t>(start + r);
      specs[r] = vary_step ? RowSpec{&p, base, i} : RowSpec{&p, base + i, 3};
    }
    std::vector<RowResult> out;
    const absl::Status status =
        m.sampler->Sample(hidden.data(), kBatch, specs.data(), &out);
    EXPECT_TRUE(status.ok()) << status;
    for (const RowResult& r : out) {
      for (int j = 0; j < p.n; ++j) ++counts[j][r.token_ids[j]];
      if (tokens != nullptr) tokens->push_back(r.token_ids);
    }
  }
  return counts;
}

void ExpectFits(const std::vector<int64_t>& counts,
                const std::vector<double>& probabilities,
                const std::string& what) {
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probabilities[i] == 0.0) {
      ASSERT_EQ(counts[i], 0) << what << ": token " << i << " is excluded";
    }
  }
  int bins = 0;
  const double p_value = GoodnessOfFit(counts, probabilities, kSamples, &bins);
  EXPECT_GT(p_value, kAlpha) << what << " (" << bins << " bins)";
}

TEST(CpuSamplerStatsTest, MatchesSoftmaxOverVocabSizesAndTemperatures) {
  uint32_t seed = 100;
  for (int64_t vocab : {2, 7, 127, 128, 129, 1000, 4099}) {
    const Model m = MakeModel(vocab, seed++);
    for (float temperature : {0.5f, 1.0f, 2.0f}) {
      SamplingParams p;
      p.temperature = temperature;
      const auto counts = Draw(m, p, 1000u * seed, /*vary_step=*/false);
      ExpectFits(
          counts[0], Softmax(m, temperature, std::vector<bool>(vocab, true)),
          "V=" + std::to_string(vocab) + " T=" + std::to_string(temperature));
    }
  }
}

// The decode step enters the counter: one seed, 20,000 steps.
TEST(CpuSamplerStatsTest, MatchesSoftmaxAcrossStepsOfOneSeed) {
  const Model m = MakeModel(1000, 7);
  SamplingParams p;
  const auto counts = Draw(m, p, 424242, /*vary_step=*/true);
  ExpectFits(counts[0], Softmax(m, 1.0f, std::vector<bool>(1000, true)),
             "steps");
}

// The sampling order: x = fl(logit * fl(1 / T)) descending, then id.
std::vector<int32_t> Ranked(const Model& m, float temperature) {
  const float inv_t = 1.0f / temperature;
  std::vector<float> x(m.vocab);
  for (int64_t i = 0; i < m.vocab; ++i) x[i] = m.logits[i] * inv_t;
  std::vector<int32_t> order(m.vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  });
  return order;
}

TEST(CpuSamplerStatsTest, TopKMatchesRenormalizedTruncatedSoftmax) {
  const Model m = MakeModel(1000, 8);
  for (int k : {1, 20, 300}) {
    SamplingParams p;
    p.top_k = k;
    p.temperature = 1.3f;
    std::vector<bool> keep(m.vocab, false);
    const std::vector<int32_t> order = Ranked(m, p.temperature);
    // Every x >= the k-th largest x (ties at the k-th value stay).
    const float inv_t = 1.0f / p.temperature;
    const float kth = m.logits[order[k - 1]] * inv_t;
    for (int64_t i = 0; i < m.vocab; ++i) keep[i] = m.logits[i] * inv_t >= kth;
    const auto counts = Draw(m, p, 77 + k, false);
    ExpectFits(counts[0], Softmax(m, p.temperature, keep),
               "top_k=" + std::to_string(k));
  }
}

TEST(CpuSamplerStatsTest, MinPMatchesRenormalizedTruncatedSoftmax) {
  const Model m = MakeModel(1000, 9);
  for (float min_p : {0.02f, 0.3f}) {
    SamplingParams p;
    p.min_p = min_p;
    const std::vector<double> full =
        Softmax(m, 1.0f, std::vector<bool>(m.vocab, true));
    const double p_max = *std::max_element(full.begin(), full.end());
    std::vector<bool> keep(m.vocab);
    for (int64_t i = 0; i < m.vocab; ++i) keep[i] = full[i] >= min_p * p_max;
    const auto counts = Draw(m, p, 99, false);
    ExpectFits(counts[0], Softmax(m, 1.0f, keep),
               "min_p=" + std::to_string(min_p));
  }
}

TEST(CpuSamplerStatsTest, TopPMatchesRenormalizedNucleus) {
  const Model m = MakeModel(1000, 10);
  for (float top_p : {0.5f, 0.9f}) {
    SamplingParams p;
    p.top_p = top_p;
    const std::vector<double> full =
        Softmax(m, 1.0f, std::vector<bool>(m.vocab, true));
    std::vector<bool> keep(m.vocab, false);
    double mass = 0;
    for (int32_t id : Ranked(m, 1.0f)) {
      keep[id] = true;
      mass += full[id];
      if (mass >= top_p) break;
    }
    const auto counts = Draw(m, p, 55, false);
    ExpectFits(counts[0], Softmax(m, 1.0f, keep),
               "top_p=" + std::to_string(top_p));
  }
}

// n samples per row: each sample index is a sample from the softmax, and the
// indices are independent (agreement rate sum p_i^2, not 1).
TEST(CpuSamplerStatsTest, EverySampleIndexMatchesSoftmaxIndependently) {
  const Model m = MakeModel(129, 11);
  SamplingParams p;
  p.n = 3;
  p.temperature = 2.0f;
  std::vector<std::vector<int32_t>> tokens;
  const auto counts = Draw(m, p, 31337, false, &tokens);
  const std::vector<double> probabilities =
      Softmax(m, 2.0f, std::vector<bool>(m.vocab, true));
  for (int j = 0; j < 3; ++j)
    ExpectFits(counts[j], probabilities, "sample " + std::to_string(j));
  double collision = 0;
  for (double q : probabilities) collision += q * q;
  int64_t agree = 0;
  for (const auto& t : tokens) agree += t[0] == t[1];
  const double sigma = std::sqrt(collision * (1 - collision) / kSamples);
  EXPECT_NEAR(static_cast<double>(agree) / kSamples, collision, 5 * sigma);
}

// Greedy is argmax with ties to the lowest id: small-integer logits are exact
// and tie often.
TEST(CpuSamplerStatsTest, GreedyIsArgmaxWithLowestIdOnTies) {
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> small(-2, 2);
  for (int64_t vocab : {2, 7, 129, 1000, 4099}) {
    auto w = std::make_shared<std::vector<float>>(vocab * 4);
    for (float& v : *w) v = static_cast<float>(small(rng));
    CpuSamplerOptions options;
    options.chunk_rows = 256;
    auto sampler = CpuSampler::Create(w, vocab, 4, options);
    ASSERT_TRUE(sampler.ok());
    const int rows = 50;
    std::vector<float> h(rows * 4);
    for (float& v : h) v = static_cast<float>(small(rng));
    SamplingParams p;
    p.temperature = 0.0f;
    std::vector<RowSpec> specs(rows);
    for (int r = 0; r < rows; ++r)
      specs[r] = RowSpec{&p, static_cast<uint64_t>(r), 0};
    std::vector<RowResult> out;
    ASSERT_TRUE((*sampler)->Sample(h.data(), rows, specs.data(), &out).ok());
    int ties = 0;
    for (int r = 0; r < rows; ++r) {
      int best = 0;
      float best_logit = -std::numeric_limits<float>::infinity();
      int at_best = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        float z = 0;
        for (int k = 0; k < 4; ++k) z += h[r * 4 + k] * (*w)[i * 4 + k];
        if (z > best_logit) {
          best_logit = z;
          best = static_cast<int>(i);
          at_best = 1;
        } else if (z == best_logit) {
          ++at_best;
        }
      }
      ties += at_best > 1;
      EXPECT_EQ(out[r].token_ids[0], best) << "V=" << vocab << " row " << r;
    }
    if (vocab >= 129) {
      EXPECT_GT(ties, 0) << "the case should contain ties";
    }
  }
}

}  // namespace
}  // namespace flashsampler
