// Chi-squared goodness of fit for the statistical tests (CPU, GPU and
// tensor-parallel samplers): the exact upper-tail p-value and the binned test
// with the expected-count rule (>= 5 per bin, small bins pooled).
#ifndef FLASHSAMPLER_TESTS_TESTING_CHI_SQUARED_H_
#define FLASHSAMPLER_TESTS_TESTING_CHI_SQUARED_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace flashsampler {
namespace stats {

// Regularized upper incomplete gamma Q(a, x) (Numerical Recipes 6.2: series
// for x < a + 1, Lentz continued fraction otherwise), double precision.
inline double RegularizedGammaQ(double a, double x) {
  if (x <= 0) return 1.0;
  const double log_prefix = -x + a * std::log(x) - std::lgamma(a);
  if (x < a + 1) {
    double term = 1.0 / a;
    double sum = term;
    for (int n = 1; n < 100000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-15) break;
    }
    return 1.0 - sum * std::exp(log_prefix);
  }
  constexpr double kTiny = 1e-300;
  double b = x + 1 - a;
  double c = 1 / kTiny;
  double d = 1 / b;
  double h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1) < 1e-15) break;
  }
  return std::exp(log_prefix) * h;
}

// P(chi2_dof >= stat).
inline double ChiSquaredPValue(double stat, int dof) {
  return RegularizedGammaQ(0.5 * dof, 0.5 * stat);
}

struct ChiSquaredResult {
  double statistic = 0;
  int dof = 0;
  double p_value = 1;
  int bins = 0;
};

// Goodness of fit of `counts` (per token) to `probs` (sum 1). Tokens are
// sorted by expected count; each token with expected >= min_expected is its
// own bin, the rest are pooled, in that order, into bins of expected >=
// min_expected (a last short pool joins the previous bin).
inline ChiSquaredResult ChiSquaredTest(const std::vector<double>& probs,
                                       const std::vector<int64_t>& counts,
                                       double min_expected = 5.0) {
  const int64_t total =
      std::accumulate(counts.begin(), counts.end(), int64_t{0});
  std::vector<size_t> order(probs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return probs[a] > probs[b]; });
  std::vector<double> expected, observed;
  double pool_e = 0, pool_o = 0;
  for (size_t i : order) {
    const double e = probs[i] * total;
    if (e >= min_expected && pool_e == 0) {
      expected.push_back(e);
      observed.push_back(static_cast<double>(counts[i]));
      continue;
    }
    pool_e += e;
    pool_o += static_cast<double>(counts[i]);
    if (pool_e >= min_expected) {
      expected.push_back(pool_e);
      observed.push_back(pool_o);
      pool_e = pool_o = 0;
    }
  }
  if (pool_e > 0 || pool_o > 0) {
    if (expected.empty()) {
      expected.push_back(pool_e);
      observed.push_back(pool_o);
    } else {
      expected.back() += pool_e;
      observed.back() += pool_o;
    }
  }
  ChiSquaredResult r;
  r.bins = static_cast<int>(expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const double diff = observed[i] - expected[i];
    r.statistic += diff * diff / expected[i];
  }
  r.dof = std::max(1, r.bins - 1);
  r.p_value = ChiSquaredPValue(r.statistic, r.dof);
  return r;
}

}  // namespace stats
}  // namespace flashsampler

#endif  // FLASHSAMPLER_TESTS_TESTING_CHI_SQUARED_H_
