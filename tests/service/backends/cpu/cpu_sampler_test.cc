// CpuSampler against a slow, obviously correct reference that materializes
// whole rows, plus the properties of docs/design.md#invariance: batch
// invariance (batch size, position, chunking, threads), exact small-integer
// logits, each transform on a hand-built case, and errors for rows that
// cannot be sampled.
#include "service/backends/cpu/cpu_sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "common/dtype_convert.h"
#include "kernels/noise/philox.h"
#include "service/backends/cpu/cpu_engine.h"
#include "service/weights/weights.h"

namespace flashsampler {
namespace {

using ::testing::HasSubstr;
using uint128 = unsigned __int128;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::shared_ptr<std::vector<float>> RandomWeights(int64_t vocab, int64_t hidden,
                                                  uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  auto w = std::make_shared<std::vector<float>>(vocab * hidden);
  for (float& v : *w) v = normal(rng);
  return w;
}

std::vector<float> RandomHidden(int rows, int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(rows * hidden);
  for (float& v : h) v = normal(rng);
  return h;
}

std::shared_ptr<std::vector<float>> SmallIntWeights(int64_t vocab,
                                                    int64_t hidden,
                                                    uint32_t seed, int range) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  auto w = std::make_shared<std::vector<float>>(vocab * hidden);
  for (float& v : *w) v = static_cast<float>(dist(rng));
  return w;
}

std::unique_ptr<CpuSampler> MakeSampler(std::shared_ptr<std::vector<float>> w,
                                        int64_t vocab, int64_t hidden,
                                        CpuSamplerOptions options = {}) {
  auto sampler = CpuSampler::Create(std::move(w), vocab, hidden, options);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  return std::move(sampler).value();
}

// ---------------------------------------------------------------------------
// The reference: the documented semantics (cpu_sampler.h) on a whole row.

struct Reference {
  std::vector<int32_t> tokens;
  std::vector<double> sampled_logprobs;
  std::vector<int32_t> sampled_ranks;
  double logsumexp = 0.0;
  std::vector<int32_t> top_ids;
  std::vector<double> top_logprobs;
  bool ok = true;
};

Reference ReferenceSample(const std::vector<float>& z, const RowSpec& spec) {
  const SamplingParams& p = *spec.params;
  const int64_t vocab = static_cast<int64_t>(z.size());
  std::vector<float> l(z);
  std::map<int32_t, float> bias;
  for (const TokenBias& b : p.logit_bias) {
    auto it = bias.find(b.token_id);
    if (it == bias.end()) {
      bias[b.token_id] = b.bias;
    } else {
      it->second = it->second + b.bias;
    }
  }
  for (const auto& [id, b] : bias) l[id] = z[id] + b;
  std::vector<bool> masked(vocab, false);
  for (int32_t id : p.banned_token_ids) masked[id] = true;
  if (!p.allowed_bitmask.empty()) {
    for (int64_t i = 0; i < vocab; ++i) {
      if (((p.allowed_bitmask[i / 32] >> (i % 32)) & 1u) == 0) masked[i] = true;
    }
  }
  std::vector<int32_t> counts(vocab, 0);
  for (const TokenCount& tc : p.output_token_counts)
    counts[tc.token_id] += tc.count;
  std::vector<bool> repeated(vocab, false);
  for (int32_t id : p.prompt_token_ids) repeated[id] = true;
  for (int64_t i = 0; i < vocab; ++i)
    repeated[i] = repeated[i] || counts[i] > 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (masked[i]) {
      l[i] = kNegInf;
      continue;
    }
    if (repeated[i] && p.repetition_penalty != 1.0f) {
      l[i] = l[i] > 0.0f ? l[i] / p.repetition_penalty
                         : l[i] * p.repetition_penalty;
    }
    if (counts[i] > 0) {
      l[i] = l[i] - p.frequency_penalty * static_cast<float>(counts[i]);
      l[i] = l[i] - p.presence_penalty;
    }
  }
  const bool greedy = p.temperature < 1e-5f;  // tiny T included (vLLM)
  const float inv_t = greedy ? 1.0f : 1.0f / p.temperature;
  std::vector<float> x(vocab);
  for (int64_t i = 0; i < vocab; ++i) x[i] = l[i] * inv_t;

  // Survivors, in the order (x descending, id ascending).
  std::vector<int32_t> order;
  for (int64_t i = 0; i < vocab; ++i) {
    if (x[i] != kNegInf) order.push_back(static_cast<int32_t>(i));
  }
  Reference ref;
  if (order.empty()) {
    ref.ok = false;
    return ref;
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return x[a] > x[b] || (x[a] == x[b] && a < b);
  });
  const double x_max = x[order[0]];
  if (!greedy) {
    if (p.min_p > 0.0f) {
      const double log_min_p = std::log(static_cast<double>(p.min_p));
      size_t keep = 0;
      while (keep < order.size() && x[order[keep]] - x_max >= log_min_p) ++keep;
      order.resize(keep);
    }
    if (p.top_k > 0 && static_cast<size_t>(p.top_k) < order.size()) {
      // Every token tied with the k-th largest x stays.
      const float v = x[order[p.top_k - 1]];
      size_t keep = p.top_k;
      while (keep < order.size() && x[order[keep]] >= v) ++keep;
      order.resize(keep);
    }
    if (p.top_p < 1.0f) {
      std::vector<uint64_t> mass(order.size());
      uint128 total = 0;
      for (size_t i = 0; i < order.size(); ++i) {
        mass[i] = static_cast<uint64_t>(
            std::ldexp(std::exp(x[order[i]] - x_max), 62));
        total += mass[i];
      }
      // ceil(p * total), exactly: p = m / 2^s with m < 2^24, total < 2^93.
      int e = 0;
      const float f = std::frexp(p.top_p, &e);
      const uint128 m = static_cast<uint128>(std::ldexp(f, 24));
      const int s = 24 - e;
      const uint128 product = m * total;
      uint128 target = product >> s;
      if ((product & ((static_cast<uint128>(1) << s) - 1)) != 0) ++target;
      uint128 cum = 0;
      size_t keep = 0;
      while (keep < order.size()) {
        cum += mass[keep++];
        if (cum >= target) break;
      }
      order.resize(keep);
    }
  }
  std::vector<bool> in_s(vocab, false);
  for (int32_t id : order) in_s[id] = true;
  const int samples = p.n;
  for (int j = 0; j < samples; ++j) {
    float best_score = kNegInf;
    int32_t best = kNoToken;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!in_s[i]) continue;
      const int32_t id = static_cast<int32_t>(i);
      const float score =
          greedy ? l[i]
                 : GumbelScore(l[i], inv_t,
                               GumbelNoise(spec.seed, spec.step,
                                           static_cast<uint32_t>(j), id));
      if (CandidateBetter(score, id, best_score, best)) {
        best_score = score;
        best = id;
      }
    }
    ref.tokens.push_back(best);
  }
  // Logprobs, naive double. Raw ones: the raw logits of the tokens the
  // masks (banned ids, bitmask) allow.
  const bool raw = p.logprobs.raw;
  std::vector<bool> listed(vocab);
  for (int64_t i = 0; i < vocab; ++i) listed[i] = raw ? !masked[i] : in_s[i];
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (listed[i]) m = std::max(m, static_cast<double>(raw ? z[i] : x[i]));
  }
  double sum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (listed[i]) sum += std::exp((raw ? z[i] : x[i]) - m);
  }
  ref.logsumexp = m + std::log(sum);
  for (int32_t t : ref.tokens)
    ref.sampled_logprobs.push_back((raw ? z[t] : x[t]) - ref.logsumexp);
  // Rank: the listed tokens whose value is >= the sampled token's.
  for (int32_t t : ref.tokens) {
    int32_t rank = 0;
    for (int64_t i = 0; i < vocab; ++i)
      rank += listed[i] && (raw ? z[i] >= z[t] : x[i] >= x[t]) ? 1 : 0;
    ref.sampled_ranks.push_back(rank);
  }
  std::vector<int32_t> ranked;
  for (int64_t i = 0; i < vocab; ++i) {
    if (listed[i]) ranked.push_back(static_cast<int32_t>(i));
  }
  const std::vector<float>& key = raw ? z : x;
  std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
  });
  ranked.resize(std::min<size_t>(ranked.size(), p.logprobs.top_n));
  ref.top_ids = ranked;
  for (int32_t t : ranked) ref.top_logprobs.push_back(key[t] - ref.logsumexp);
  return ref;
}

void ExpectMatchesReference(const RowResult& got, const Reference& want,
                            const SamplingParams& p, const std::string& what) {
  ASSERT_TRUE(want.ok) << what;
  EXPECT_EQ(got.token_ids, want.tokens) << what;
  if (p.logprobs.sampled) {
    ASSERT_EQ(got.sampled_logprobs.size(), want.sampled_logprobs.size())
        << what;
    for (size_t j = 0; j < want.sampled_logprobs.size(); ++j) {
      EXPECT_NEAR(got.sampled_logprobs[j], want.sampled_logprobs[j], 1e-5)
          << what;
    }
  }
  if (p.logprobs.rank) {
    EXPECT_EQ(got.sampled_ranks, want.sampled_ranks) << what;
  } else {
    EXPECT_TRUE(got.sampled_ranks.empty()) << what;
  }
  if (p.logprobs.logsumexp) {
    EXPECT_NEAR(got.logsumexp, want.logsumexp,
                1e-5 * std::max(1.0, std::abs(want.logsumexp)))
        << what;
  }
  if (p.logprobs.top_n > 0) {
    EXPECT_EQ(got.top_token_ids, want.top_ids) << what;
    ASSERT_EQ(got.top_logprobs.size(), want.top_logprobs.size()) << what;
    for (size_t i = 0; i < want.top_logprobs.size(); ++i) {
      EXPECT_NEAR(got.top_logprobs[i], want.top_logprobs[i], 1e-5) << what;
    }
  }
}

// Random but valid controls, covering every control and their combinations.
SamplingParams RandomParams(std::mt19937& rng, int64_t vocab) {
  auto pick = [&rng](auto... options) {
    const std::vector<std::common_type_t<decltype(options)...>> v{options...};
    return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
  };
  auto coin = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  std::uniform_int_distribution<int32_t> token(0,
                                               static_cast<int32_t>(vocab - 1));
  SamplingParams p;
  // 1e-38 and 9.9e-6 are greedy (below 1e-5); 1e-5 samples.
  p.temperature = pick(0.0f, 1e-38f, 9.9e-6f, 1e-5f, 0.4f, 1.0f, 1.0f, 1.7f);
  p.top_k = coin(0.5) ? pick(1, 2, 7, 50, 300, 2000) : 0;
  p.top_p = coin(0.5) ? pick(0.05f, 0.5f, 0.9f, 0.99f) : 1.0f;
  p.min_p = coin(0.3) ? pick(0.01f, 0.1f, 0.5f, 1.0f) : 0.0f;
  if (coin(0.3)) {
    for (int i = 0; i < 5; ++i)
      p.logit_bias.push_back({token(rng), pick(-3.0f, 0.5f, 2.5f)});
  }
  if (coin(0.3)) {
    for (int i = 0; i < 20; ++i) p.banned_token_ids.push_back(token(rng));
  }
  if (coin(0.3)) {
    p.allowed_bitmask.assign((vocab + 31) / 32, 0);
    for (int64_t i = 0; i < vocab; ++i) {
      if (coin(0.6))
        p.allowed_bitmask.mutable_words()[i / 32] |= 1u << (i % 32);
    }
  }
  if (coin(0.3)) {
    p.repetition_penalty = pick(0.8f, 1.3f, 2.0f);
    for (int i = 0; i < 10; ++i) p.prompt_token_ids.push_back(token(rng));
  }
  if (coin(0.3)) {
    p.frequency_penalty = pick(-0.5f, 0.3f, 1.0f);
    p.presence_penalty = pick(-0.2f, 0.0f, 0.7f);
  }
  if (coin(0.5)) {
    for (int i = 0; i < 10; ++i)
      p.output_token_counts.push_back({token(rng), pick(1, 2, 5)});
  }
  p.n = pick(1, 1, 3);
  if (coin(0.5)) {
    p.logprobs.sampled = coin(0.7);
    p.logprobs.logsumexp = coin(0.7);
    p.logprobs.top_n = pick(0, 1, 5, 20);
    p.logprobs.raw = coin(0.3);
    p.logprobs.rank = coin(0.5);
  }
  return p;
}

// ---------------------------------------------------------------------------

TEST(CpuSamplerTest, SmallIntegerLogitsEqualNaiveTripleLoopBitForBit) {
  // Integer products and sums below 2^24 are exact in fp32 in any order.
  const int64_t vocab = 1003, hidden = 37;
  const int rows = 13;
  auto w = SmallIntWeights(vocab, hidden, 1, 8);
  std::vector<float> h(rows * hidden);
  std::mt19937 rng(2);
  std::uniform_int_distribution<int> dist(-8, 8);
  for (float& v : h) v = static_cast<float>(dist(rng));
  for (int64_t chunk_rows : {256, 1000, 4096}) {
    CpuSamplerOptions options;
    options.chunk_rows = chunk_rows;
    options.threads = 2;
    auto sampler = MakeSampler(w, vocab, hidden, options);
    std::vector<float> logits(rows * vocab, std::nanf(""));
    ASSERT_TRUE(sampler->ComputeLogits(h.data(), rows, logits.data()).ok());
    for (int r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < vocab; ++i) {
        float acc = 0.0f;
        for (int64_t k = 0; k < hidden; ++k)
          acc += h[r * hidden + k] * (*w)[i * hidden + k];
        ASSERT_EQ(FloatToBits(logits[r * vocab + i]), FloatToBits(acc))
            << "row " << r << " token " << i << " chunk_rows " << chunk_rows;
      }
    }
  }
}

// The core promise (docs/design.md#invariance) with random floats, where
// summation order matters: a row gives the same logits and tokens alone or
// anywhere in any batch, for any chunking and thread count.
TEST(CpuSamplerTest, BatchInvariantAcrossBatchPositionChunkingAndThreads) {
  const int64_t vocab = 4099,
                hidden = 96;  // 4096 + 3: a ragged last tile and chunk
  const int rows = 64;
  auto w = RandomWeights(vocab, hidden, 3, 0.3f);
  const std::vector<float> h = RandomHidden(rows, hidden, 4);

  // Controls that take different paths: plain, filtered (several passes), n
  // > 1.
  std::vector<SamplingParams> kinds(4);
  kinds[1].top_k = 40;
  kinds[1].top_p = 0.8f;
  kinds[1].min_p = 0.02f;
  kinds[1].logprobs.sampled = true;
  kinds[2].n = 3;
  kinds[2].temperature = 0.7f;
  kinds[3].top_p = 0.95f;  // without top_k: the top-p select path
  std::vector<RowSpec> specs(rows);
  for (int r = 0; r < rows; ++r) {
    specs[r].params = &kinds[r % kinds.size()];
    specs[r].seed = 1000 + r;
    specs[r].step = r * 7;
  }

  // Reference: every row alone, one thread, default chunking.
  CpuSamplerOptions base;
  base.threads = 1;
  auto reference = MakeSampler(w, vocab, hidden, base);
  std::vector<std::vector<int32_t>> want_tokens(rows);
  std::vector<float> want_logits(rows * vocab);
  for (int r = 0; r < rows; ++r) {
    std::vector<RowResult> out;
    ASSERT_TRUE(reference->Sample(&h[r * hidden], 1, &specs[r], &out).ok());
    want_tokens[r] = out[0].token_ids;
    ASSERT_TRUE(
        reference->ComputeLogits(&h[r * hidden], 1, &want_logits[r * vocab])
            .ok());
  }

  std::mt19937 rng(5);
  for (int threads : {1, 2, 3}) {
    for (int64_t chunk_rows : {256, 1024, 4096}) {
      CpuSamplerOptions options;
      options.threads = threads;
      options.chunk_rows = chunk_rows;
      auto sampler = MakeSampler(w, vocab, hidden, options);
      for (int batch : {2, 3, 8, 9, 17, 64}) {
        // A random selection and order of rows: each lands at some position.
        std::vector<int> perm(rows);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        perm.resize(batch);
        std::vector<float> hb(batch * hidden);
        std::vector<RowSpec> sb(batch);
        for (int i = 0; i < batch; ++i) {
          std::memcpy(&hb[i * hidden], &h[perm[i] * hidden],
                      sizeof(float) * hidden);
          sb[i] = specs[perm[i]];
        }
        std::vector<RowResult> out;
        ASSERT_TRUE(sampler->Sample(hb.data(), batch, sb.data(), &out).ok());
        std::vector<float> logits(batch * vocab);
        ASSERT_TRUE(
            sampler->ComputeLogits(hb.data(), batch, logits.data()).ok());
        for (int i = 0; i < batch; ++i) {
          EXPECT_EQ(out[i].token_ids, want_tokens[perm[i]])
              << "row " << perm[i] << " at position " << i << " of " << batch
              << ", threads " << threads << ", chunk_rows " << chunk_rows;
          ASSERT_EQ(
              std::memcmp(&logits[i * vocab], &want_logits[perm[i] * vocab],
                          sizeof(float) * vocab),
              0)
              << "logits of row " << perm[i] << " at position " << i << " of "
              << batch;
        }
      }
    }
  }
}

// Every control and combination, against the whole-row reference, through
// each exact path: the candidate buffer, a small buffer that forces the
// top-p mass check and top-k radix select, and no buffer (radix only).
TEST(CpuSamplerTest, MatchesWholeRowReferenceOnRandomControls) {
  const int64_t vocab = 1003, hidden = 32;
  const int rows = 200;
  auto w = RandomWeights(vocab, hidden, 6, 0.4f);
  const std::vector<float> h = RandomHidden(rows, hidden, 7);
  std::mt19937 rng(8);
  std::vector<SamplingParams> params(rows);
  std::vector<RowSpec> specs(rows);
  for (int r = 0; r < rows; ++r) {
    params[r] = RandomParams(rng, vocab);
    specs[r] = RowSpec{&params[r], rng(), rng()};
  }
  auto logit_source = MakeSampler(w, vocab, hidden);
  std::vector<float> logits(rows * vocab);
  ASSERT_TRUE(logit_source->ComputeLogits(h.data(), rows, logits.data()).ok());
  std::vector<Reference> want(rows);
  for (int r = 0; r < rows; ++r) {
    want[r] =
        ReferenceSample(std::vector<float>(logits.begin() + r * vocab,
                                           logits.begin() + (r + 1) * vocab),
                        specs[r]);
  }
  for (int64_t buffer : {4096, 64, 0}) {
    CpuSamplerOptions options;
    options.chunk_rows = 256;
    options.threads = 2;
    options.candidate_buffer = buffer;
    auto sampler = MakeSampler(w, vocab, hidden, options);
    std::vector<RowResult> out;
    const absl::Status status =
        sampler->Sample(h.data(), rows, specs.data(), &out);
    bool any_masked = false;
    for (int r = 0; r < rows; ++r) any_masked = any_masked || !want[r].ok;
    ASSERT_EQ(status.ok(), !any_masked) << status;
    // With no candidate buffer the filtered rows can only be certified by the
    // radix-select fallback, and say so (docs/design.md#exactness-and-refusals:
    // a counter records it).
    int fallbacks = 0;
    for (const RowResult& row : out) fallbacks += row.exact_fallback != nullptr;
    if (buffer == 0) {
      EXPECT_GT(fallbacks, 0);
    }
    for (int r = 0; r < rows; ++r) {
      if (!want[r].ok) continue;
      ExpectMatchesReference(
          out[r], want[r], params[r],
          "row " + std::to_string(r) + " buffer " + std::to_string(buffer));
    }
  }
}

// Small-integer logits make exact ties common: a top-k cut inside a run of
// equal logits keeps the whole run, a top-p cut keeps its lowest ids, across
// chunks.
TEST(CpuSamplerTest, CutsInsideTiesKeepLowestIdsOnEveryPath) {
  const int64_t vocab = 2000, hidden = 4;
  const int rows = 24;
  auto w = SmallIntWeights(vocab, hidden, 9, 2);
  std::vector<float> h(rows * hidden);
  std::mt19937 rng(10);
  std::uniform_int_distribution<int> dist(-1, 1);
  for (float& v : h) v = static_cast<float>(dist(rng));
  std::vector<SamplingParams> params(rows);
  std::vector<RowSpec> specs(rows);
  for (int r = 0; r < rows; ++r) {
    SamplingParams& p = params[r];
    p.top_k = (r % 3 == 0) ? 0 : 37 + 101 * r;
    p.top_p = (r % 3 == 1) ? 1.0f : 0.3f + 0.02f * r;
    p.min_p = (r % 4 == 0) ? 0.2f : 0.0f;
    p.n = 2;
    p.logprobs.sampled = true;
    p.logprobs.top_n = 3;
    // Ranks over survivors cut inside ties (processed) and over every
    // token (raw).
    p.logprobs.rank = true;
    p.logprobs.raw = r % 5 == 2;
    specs[r] = RowSpec{&p, static_cast<uint64_t>(77 + r), 3};
  }
  auto logit_source = MakeSampler(w, vocab, hidden);
  std::vector<float> logits(rows * vocab);
  ASSERT_TRUE(logit_source->ComputeLogits(h.data(), rows, logits.data()).ok());
  // 138 = the top_k of row 1: a buffer of exactly k entries, where ties at
  // the k-th value run past the buffer.
  for (int64_t buffer : {4096, 138, 100, 0}) {
    CpuSamplerOptions options;
    options.chunk_rows = 256;
    options.candidate_buffer = buffer;
    auto sampler = MakeSampler(w, vocab, hidden, options);
    std::vector<RowResult> out;
    ASSERT_TRUE(sampler->Sample(h.data(), rows, specs.data(), &out).ok());
    for (int r = 0; r < rows; ++r) {
      const Reference want =
          ReferenceSample(std::vector<float>(logits.begin() + r * vocab,
                                             logits.begin() + (r + 1) * vocab),
                          specs[r]);
      ExpectMatchesReference(
          out[r], want, params[r],
          "row " + std::to_string(r) + " buffer " + std::to_string(buffer));
    }
  }
}

// A sampler over hand-made logits, exactly: D = 1, W[i] = {logit i} and the
// hidden state is {1}, so h . W[i] = logit i with no rounding.
struct DirectLogits {
  explicit DirectLogits(const std::vector<float>& logits,
                        CpuSamplerOptions options = {}) {
    const int64_t vocab = static_cast<int64_t>(logits.size());
    sampler = MakeSampler(std::make_shared<std::vector<float>>(logits), vocab,
                          1, options);
  }
  absl::Status Sample(const SamplingParams& p, uint64_t seed,
                      RowResult* result) {
    std::vector<RowResult> out;
    absl::Status s = SampleSeeds(p, seed, 1, &out);
    *result = out[0];
    return s;
  }
  // One batch of `count` rows with seeds first, first + 1, ...
  absl::Status SampleSeeds(const SamplingParams& p, uint64_t first, int count,
                           std::vector<RowResult>* out) {
    const std::vector<float> ones(count, 1.0f);
    std::vector<RowSpec> specs(count);
    for (int i = 0; i < count; ++i) specs[i] = RowSpec{&p, first + i, 0};
    return sampler->Sample(ones.data(), count, specs.data(), out);
  }
  std::unique_ptr<CpuSampler> sampler;
};

TEST(CpuSamplerTest, LogitBiasForcesAToken) {
  std::vector<float> logits(300);
  for (int i = 0; i < 300; ++i) logits[i] = std::sin(i * 0.1f) * 3.0f;
  DirectLogits d(logits);
  SamplingParams p;
  p.logit_bias.push_back({217, 100.0f});
  std::vector<RowResult> out;
  ASSERT_TRUE(d.SampleSeeds(p, 0, 50, &out).ok());
  for (const RowResult& r : out)
    EXPECT_EQ(r.token_ids, std::vector<int32_t>{217});
}

TEST(CpuSamplerTest, BannedTokenIsNeverDrawn) {
  std::vector<float> logits(64, 0.0f);
  logits[5] = 3.0f;  // the likeliest token, then banned
  logits[6] = 2.5f;
  DirectLogits d(logits);
  SamplingParams p;
  p.banned_token_ids = {5};
  int drawn_6 = 0;
  std::vector<RowResult> out;
  ASSERT_TRUE(d.SampleSeeds(p, 0, 2000, &out).ok());
  for (const RowResult& r : out) {
    ASSERT_NE(r.token_ids[0], 5);
    drawn_6 += r.token_ids[0] == 6;
  }
  EXPECT_GT(drawn_6, 100);  // the mass moved to the others
}

TEST(CpuSamplerTest, AllowedBitmaskRestrictsToItsTokens) {
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[i] = static_cast<float>(i % 7);
  DirectLogits d(logits);
  SamplingParams p;
  p.allowed_bitmask.assign(4, 0);
  const std::set<int32_t> allowed = {0, 33, 64, 99};
  for (int32_t id : allowed)
    p.allowed_bitmask.mutable_words()[id / 32] |= 1u << (id % 32);
  std::set<int32_t> seen;
  std::vector<RowResult> out;
  ASSERT_TRUE(d.SampleSeeds(p, 0, 400, &out).ok());
  for (const RowResult& r : out) {
    ASSERT_TRUE(allowed.count(r.token_ids[0])) << r.token_ids[0];
    seen.insert(r.token_ids[0]);
  }
  EXPECT_EQ(seen, allowed);
}

// Penalties against a hand computation: processed top logprobs of every token
// give the processed logits up to one constant.
TEST(CpuSamplerTest, PenaltiesFollowVllmDefinitions) {
  const std::vector<float> logits = {4.0f,  -3.0f, 2.0f, 0.5f,
                                     -1.0f, 1.0f,  0.0f, 3.0f};
  DirectLogits d(logits);
  SamplingParams p;
  p.temperature = 0.0f;  // greedy: processed space at temperature 1
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  p.prompt_token_ids = {0, 4};
  p.output_token_counts = {{1, 2}, {7, 1}, {2, 0}};
  p.logit_bias = {{3, 1.5f}, {3, 0.25f}};
  p.logprobs.top_n = 8;
  std::vector<double> want = {
      4.0 / 2,  // prompt, positive: divided
      -3.0 * 2 - 0.5 * 2 -
          0.25,    // output x2, negative: multiplied, then freq, presence
      2.0,         // count 0: no penalty
      0.5 + 1.75,  // bias entries summed
      -1.0 * 2,    // prompt, negative
      1.0,
      0.0,
      3.0 / 2 - 0.5 - 0.25,  // output x1
  };
  RowResult r;
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  EXPECT_EQ(r.token_ids[0], 3);  // 2.25 is the largest processed logit
  ASSERT_EQ(r.top_token_ids.size(), 8u);
  std::map<int32_t, double> got;
  for (size_t i = 0; i < 8; ++i) got[r.top_token_ids[i]] = r.top_logprobs[i];
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(got[i] - got[6], want[i] - want[6], 1e-5) << "token " << i;
  }
}

TEST(CpuSamplerTest, LogprobsMatchDoublePrecision) {
  const int64_t vocab = 500;
  std::vector<float> logits(vocab);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : logits) v = normal(rng);
  DirectLogits d(logits, CpuSamplerOptions{2, 256, 4096});
  for (bool raw : {false, true}) {
    SamplingParams p;
    p.temperature = 0.7f;
    p.n = 2;
    p.logit_bias = {{10, 2.0f}};
    p.logprobs = {true, true, 5, raw};
    RowResult r;
    ASSERT_TRUE(d.Sample(p, 42, &r).ok());
    const float inv_t = 1.0f / 0.7f;
    std::vector<double> v(vocab);
    for (int64_t i = 0; i < vocab; ++i) {
      const float l = i == 10 ? logits[i] + 2.0f : logits[i];
      v[i] = raw ? logits[i] : static_cast<double>(l * inv_t);
    }
    const double m = *std::max_element(v.begin(), v.end());
    double s = 0;
    for (double e : v) s += std::exp(e - m);
    const double lse = m + std::log(s);
    EXPECT_NEAR(r.logsumexp, lse, 1e-5);
    ASSERT_EQ(r.sampled_logprobs.size(), 2u);
    for (int j = 0; j < 2; ++j) {
      EXPECT_NEAR(r.sampled_logprobs[j], v[r.token_ids[j]] - lse, 1e-5);
    }
    std::vector<int32_t> ids(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::sort(ids.begin(), ids.end(),
              [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    ASSERT_EQ(r.top_token_ids.size(), 5u);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(r.top_token_ids[i], ids[i]);
      EXPECT_NEAR(r.top_logprobs[i], v[ids[i]] - lse, 1e-5);
    }
  }
}

// Tokens sampled by `p` over `logits` with seeds 0..seeds-1, on every exact
// path (candidate buffer, a buffer too small to certify, radix select only).
std::set<int32_t> SampledSet(const std::vector<float>& logits,
                             const SamplingParams& p, int seeds) {
  std::set<int32_t> seen;
  for (int64_t buffer : {4096, 2, 0}) {
    DirectLogits d(logits, CpuSamplerOptions{2, 256, buffer});
    std::vector<RowResult> out;
    EXPECT_TRUE(d.SampleSeeds(p, 0, seeds, &out).ok());
    std::set<int32_t> here;
    for (const RowResult& r : out)
      here.insert(r.token_ids.begin(), r.token_ids.end());
    if (buffer != 4096) {
      EXPECT_EQ(here, seen) << "buffer " << buffer;
    }
    seen = here;
  }
  return seen;
}

// Regression guard for the min_p threshold: the boundary token is the
// smallest float with x - x_max >= ln(min_p) in double; one ulp below is out.
// Several min_p values, so that fl(x_max + ln(min_p)) lands on both sides.
TEST(CpuSamplerTest, MinPBoundaryIsExact) {
  const float x_max = 0.75f;
  for (float min_p : {0.05f, 0.1f, 0.25f, 0.3f, 0.7f}) {
    const double log_min_p = std::log(static_cast<double>(min_p));
    auto kept = [&](float f) {
      return static_cast<double>(f) - x_max >= log_min_p;
    };
    float f = static_cast<float>(x_max + log_min_p);
    while (!kept(f)) f = std::nextafter(f, 1e30f);
    while (kept(std::nextafter(f, -1e30f))) f = std::nextafter(f, -1e30f);
    std::vector<float> logits(300, -50.0f);
    logits[0] = x_max;
    logits[1] = f;                            // kept
    logits[257] = std::nextafter(f, -1e30f);  // dropped (another chunk)
    SamplingParams p;
    p.min_p = min_p;
    EXPECT_EQ(SampledSet(logits, p, 120), (std::set<int32_t>{0, 1}))
        << "min_p " << min_p;
  }
}

// top_p keeps the shortest prefix whose mass reaches p: four equal tokens and
// p = 0.5 keep exactly the two lowest ids (mass exactly 0.5, not above it).
TEST(CpuSamplerTest, TopPKeepsShortestPrefixReachingP) {
  std::vector<float> logits(600, -100.0f);
  for (int32_t id : {3, 270, 271, 590}) logits[id] = 1.0f;
  SamplingParams p;
  p.top_p = 0.5f;
  EXPECT_EQ(SampledSet(logits, p, 200), (std::set<int32_t>{3, 270}));
  p.top_p = 0.75f;
  EXPECT_EQ(SampledSet(logits, p, 200), (std::set<int32_t>{3, 270, 271}));
  p.top_p = 0.7500001f;
  EXPECT_EQ(SampledSet(logits, p, 200), (std::set<int32_t>{3, 270, 271, 590}));
}

// top_k keeps every token tied with the k-th largest x (vLLM's
// sort-and-threshold), so more than k tokens may stay; then top_p cuts the
// renormalized survivors. Every path: buffers that hold all ties, exactly k
// entries (ties beyond the buffer), fewer than k, and none (radix select).
TEST(CpuSamplerTest, TopKKeepsEveryTieAtTheKthValue) {
  std::vector<float> logits(600, -3.0f);
  logits[500] = 2.0f;
  for (int32_t id : {7, 260, 400, 599}) logits[id] = 1.0f;
  const std::set<int32_t> top5 = {500, 7, 260, 400, 599};
  std::set<int32_t> every;
  for (int32_t i = 0; i < 600; ++i) every.insert(i);
  const struct {
    int32_t top_k;
    float top_p;
    std::set<int32_t> want;
  } cases[] = {
      {1, 1.0f, {500}},
      {2, 1.0f, top5},
      {3, 1.0f, top5},
      {5, 1.0f, top5},
      {6, 1.0f, every},  // the k-th value is -3: every token ties
      // Masses e^2 and 4 x e^1 (total 18.26): p = 0.5 needs 9.13, reached
      // at id 7; p = 0.9 needs 16.43, reached only at the last tie.
      {3, 0.5f, {500, 7}},
      {3, 0.9f, top5},
  };
  for (int64_t buffer : {4096, 6, 5, 4, 3, 2, 1, 0}) {
    DirectLogits d(logits, CpuSamplerOptions{2, 256, buffer});
    for (const auto& c : cases) {
      SamplingParams p;
      p.top_k = c.top_k;
      p.top_p = c.top_p;
      std::vector<RowResult> out;
      ASSERT_TRUE(d.SampleSeeds(p, 0, 600, &out).ok());
      std::set<int32_t> seen;
      for (const RowResult& r : out) seen.insert(r.token_ids[0]);
      if (c.want.size() <= 5) {
        EXPECT_EQ(seen, c.want) << "top_k " << c.top_k << " top_p " << c.top_p
                                << " buffer " << buffer;
      } else {
        // 600 tokens of near-equal mass: every draw is allowed, most differ.
        EXPECT_GT(seen.size(), 100u) << "buffer " << buffer;
      }
    }
  }
  // Processed logprobs are over the five survivors of top_k = 3.
  DirectLogits d(logits);
  SamplingParams p;
  p.top_k = 3;
  p.logprobs.logsumexp = true;
  p.logprobs.top_n = 7;
  RowResult r;
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  const double lse = std::log(std::exp(2.0) + 4.0 * std::exp(1.0));
  EXPECT_NEAR(r.logsumexp, lse, 1e-6);
  EXPECT_EQ(r.top_token_ids, (std::vector<int32_t>{500, 7, 260, 400, 599}));
}

// Raw logprobs (vLLM's raw_logprobs) are over the raw logits after the
// masks: banned and bitmask-disallowed tokens are out of the log-sum-exp and
// never listed; logit_bias (even -inf), penalties and temperature do not
// apply.
TEST(CpuSamplerTest, RawLogprobsExcludeMaskedTokens) {
  const int64_t vocab = 300;
  std::vector<float> logits(vocab);
  for (int64_t i = 0; i < vocab; ++i) logits[i] = std::sin(i * 0.37f) * 2.0f;
  logits[40] = 9.0f;   // banned
  logits[290] = 8.0f;  // disallowed by the bitmask
  logits[17] = 7.0f;   // -inf bias: still in the raw distribution
  logits[5] = 6.0f;    // penalized: raw ignores it
  for (int64_t buffer : {4096, 0}) {
    DirectLogits d(logits, CpuSamplerOptions{2, 256, buffer});
    SamplingParams p;
    p.temperature = 0.6f;
    p.top_k = 30;
    p.banned_token_ids = {40};
    p.allowed_bitmask.assign((vocab + 31) / 32, ~0u);
    p.allowed_bitmask.mutable_words()[290 / 32] &= ~(1u << (290 % 32));
    p.logit_bias = {{17, -std::numeric_limits<float>::infinity()}, {100, 3.0f}};
    p.repetition_penalty = 3.0f;
    p.prompt_token_ids = {5};
    p.n = 3;
    p.logprobs = {true, true, 4, true};
    RowResult r;
    ASSERT_TRUE(d.Sample(p, 7, &r).ok());
    double m = -1e30;
    for (int64_t i = 0; i < vocab; ++i) {
      if (i != 40 && i != 290) m = std::max(m, static_cast<double>(logits[i]));
    }
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (i != 40 && i != 290) sum += std::exp(logits[i] - m);
    }
    const double lse = m + std::log(sum);
    EXPECT_NEAR(r.logsumexp, lse, 1e-5) << buffer;
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < vocab; ++i) {
      if (i != 40 && i != 290) ids.push_back(i);
    }
    std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ids.resize(4);
    EXPECT_EQ(ids[0], 17);
    EXPECT_EQ(ids[1], 5);
    EXPECT_EQ(r.top_token_ids, ids) << buffer;
    ASSERT_EQ(r.top_logprobs.size(), 4u);
    for (int i = 0; i < 4; ++i)
      EXPECT_NEAR(r.top_logprobs[i], logits[ids[i]] - lse, 1e-5) << i;
    ASSERT_EQ(r.sampled_logprobs.size(), 3u);
    for (int j = 0; j < 3; ++j) {
      EXPECT_NE(r.token_ids[j], 17);
      EXPECT_NEAR(r.sampled_logprobs[j], logits[r.token_ids[j]] - lse, 1e-5);
    }
  }
}

// Regression: T = 1e-38 failed on the CPU backend with INVALID_ARGUMENT
// "logit ... not finite" (1 / T overflowed, x = l / T reached inf) and gave a
// wrong token on the CUDA backend. Below 1e-5 a row is greedy (vLLM's rule):
// argmax of l, lowest id on ties, filters ignored, logprobs at T = 1.
TEST(CpuSamplerTest, TinyTemperatureFailedOnCpuAndGaveWrongTokenOnCuda) {
  std::vector<float> logits(600);
  for (int i = 0; i < 600; ++i) logits[i] = std::cos(i * 0.21f) * 4.0f;
  logits[130] = 6.0f;
  logits[444] = 6.0f;  // an exact tie: greedy takes 130, sampling either
  DirectLogits d(logits, CpuSamplerOptions{2, 256, 4096});
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.n = 3;
  greedy.logprobs = {true, true, 3, false};
  std::vector<RowResult> want;
  ASSERT_TRUE(d.SampleSeeds(greedy, 0, 40, &want).ok());
  ASSERT_EQ(want[0].token_ids, (std::vector<int32_t>{130, 130, 130}));
  for (float t : {1e-38f, 1e-30f, 9.9e-6f}) {
    SamplingParams p = greedy;
    p.temperature = t;
    p.top_k = 5;  // ignored, as for T = 0
    p.min_p = 0.5f;
    std::vector<RowResult> got;
    const absl::Status status = d.SampleSeeds(p, 0, 40, &got);
    ASSERT_TRUE(status.ok()) << "T " << t << ": " << status;
    for (int r = 0; r < 40; ++r) {
      EXPECT_EQ(got[r].token_ids, want[r].token_ids) << "T " << t;
      EXPECT_EQ(got[r].sampled_logprobs, want[r].sampled_logprobs) << t;
      EXPECT_EQ(got[r].logsumexp, want[r].logsumexp) << "T " << t;
      EXPECT_EQ(got[r].top_token_ids, want[r].top_token_ids) << "T " << t;
      EXPECT_EQ(got[r].top_logprobs, want[r].top_logprobs) << "T " << t;
    }
  }
  // From 1e-5 up a row samples: the tie splits between its two tokens.
  for (float t : {1e-5f, 1e-3f}) {
    SamplingParams p;
    p.temperature = t;
    std::vector<RowResult> got;
    ASSERT_TRUE(d.SampleSeeds(p, 0, 200, &got).ok()) << t;
    std::set<int32_t> seen;
    for (const RowResult& r : got) seen.insert(r.token_ids[0]);
    EXPECT_EQ(seen, (std::set<int32_t>{130, 444})) << "T " << t;
  }
}

TEST(CpuSamplerTest, GreedyTakesLowestIdAmongTies) {
  std::vector<float> logits(600, 1.0f);
  logits[300] = 5.0f;
  logits[513] = 5.0f;  // an exact tie in another chunk, later id
  logits[299] = 4.0f;
  DirectLogits d(logits, CpuSamplerOptions{2, 256, 4096});
  SamplingParams p;
  p.temperature = 0.0f;
  p.n = 3;
  RowResult r;
  ASSERT_TRUE(d.Sample(p, 9, &r).ok());
  EXPECT_EQ(r.token_ids, (std::vector<int32_t>{300, 300, 300}));
  p.banned_token_ids = {300};
  ASSERT_TRUE(d.Sample(p, 9, &r).ok());
  EXPECT_EQ(r.token_ids[0], 513);
}

// vLLM's rank: 1 + the other tokens whose logprob is >= the sampled one's,
// ties counted against it, in the space the logprobs are taken in.
TEST(CpuSamplerTest, SampledRankCountsTiesInTheLogprobsSpace) {
  const std::vector<float> logits = {3.0f, 1.0f, 3.0f, 2.0f, 1.0f, 0.5f};
  DirectLogits d(logits, CpuSamplerOptions{2, 256, 4096});
  SamplingParams p;
  p.temperature = 0.0f;
  p.n = 2;
  p.logprobs.rank = true;
  RowResult r;
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  EXPECT_EQ(r.token_ids, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(r.sampled_ranks, (std::vector<int32_t>{2, 2}));
  EXPECT_TRUE(r.sampled_logprobs.empty());
  // A bias makes token 4 the argmax: first of the processed logits, 4th
  // and 5th of the raw ones (tied with token 1) until token 1 is banned.
  p.logit_bias = {{4, 10.0f}};
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  EXPECT_EQ(r.token_ids[0], 4);
  EXPECT_EQ(r.sampled_ranks, (std::vector<int32_t>{1, 1}));
  p.logprobs.raw = true;
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  EXPECT_EQ(r.sampled_ranks, (std::vector<int32_t>{5, 5}));
  p.banned_token_ids = {1};
  ASSERT_TRUE(d.Sample(p, 1, &r).ok());
  EXPECT_EQ(r.sampled_ranks, (std::vector<int32_t>{4, 4}));
  // Processed, sampled: only survivors count. top_k = 2 keeps the two 3s.
  SamplingParams s;
  s.top_k = 2;
  s.n = 4;
  s.logprobs.rank = true;
  for (uint64_t seed = 0; seed < 8; ++seed) {
    ASSERT_TRUE(d.Sample(s, seed, &r).ok());
    EXPECT_EQ(r.sampled_ranks, (std::vector<int32_t>(4, 2))) << seed;
  }
}

TEST(CpuSamplerTest, RowWithEveryTokenMaskedIsAnErrorNamingTheRow) {
  const int64_t vocab = 70;
  auto w = RandomWeights(vocab, 8, 12, 1.0f);
  auto sampler = MakeSampler(w, vocab, 8);
  const std::vector<float> h = RandomHidden(3, 8, 13);
  SamplingParams fine;
  std::vector<SamplingParams> broken(3);
  broken[0].allowed_bitmask.assign(3, 0);  // nothing allowed
  broken[1].banned_token_ids.resize(vocab);
  std::iota(broken[1].banned_token_ids.begin(),
            broken[1].banned_token_ids.end(), 0);
  broken[1].top_k = 5;  // the filtered path finds it too
  broken[2].temperature = 0.0f;
  for (int32_t i = 0; i < vocab; ++i)
    broken[2].logit_bias.push_back({i, kNegInf});
  for (const SamplingParams& bad : broken) {
    std::vector<RowSpec> specs = {{&fine, 1, 0}, {&bad, 2, 0}, {&fine, 3, 0}};
    std::vector<RowResult> out;
    const absl::Status s = sampler->Sample(h.data(), 3, specs.data(), &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("row 1"));
    EXPECT_THAT(s.message(), HasSubstr("masked"));
    ASSERT_EQ(out.size(), 3u);
    EXPECT_TRUE(out[1].token_ids.empty());
    EXPECT_THAT(out[1].error, HasSubstr("masked"));
    EXPECT_EQ(out[0].token_ids.size(), 1u);  // the other rows are still sampled
    EXPECT_EQ(out[2].token_ids.size(), 1u);
    EXPECT_TRUE(out[0].error.empty());
    EXPECT_TRUE(out[2].error.empty());
  }
}

// Through the Engine interface a bad row is that row's error, not the batch's:
// the batch holds other callers' rows (regression: one caller's all-masked row
// failed every request that shared its batch).
TEST(CpuEngineTest, MaskedRowFailsAloneThroughTheEngine) {
  const int64_t vocab = 70, hidden = 8;
  auto w = RandomWeights(vocab, hidden, 12, 1.0f);
  auto engine = CpuEngine::CreateFromFloat(w, vocab, hidden, DType::kFp32,
                                           CpuEngineOptions{});
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<float> h = RandomHidden(3, hidden, 13);
  std::memcpy((*engine)->slot_input(0), h.data(), sizeof(float) * h.size());
  SamplingParams fine, bad;
  bad.allowed_bitmask.assign(3, 0);
  std::vector<RowSpec> specs = {{&fine, 1, 0}, {&bad, 2, 0}, {&fine, 3, 0}};
  std::vector<RowResult> out;
  ASSERT_TRUE((*engine)->Sample(BatchView{0, 3, specs.data()}, &out).ok());
  ASSERT_EQ(out.size(), 3u);
  EXPECT_THAT(out[1].error, HasSubstr("masked"));
  EXPECT_EQ(out[0].token_ids.size(), 1u);
  EXPECT_EQ(out[2].token_ids.size(), 1u);
}

TEST(CpuSamplerTest, InvalidControlsAreRejectedByName) {
  auto sampler = MakeSampler(RandomWeights(40, 4, 14, 1.0f), 40, 4);
  const std::vector<float> h = RandomHidden(1, 4, 15);
  auto status_of = [&](const SamplingParams& p) {
    RowSpec spec{&p, 0, 0};
    std::vector<RowResult> out;
    return sampler->Sample(h.data(), 1, &spec, &out);
  };
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THAT(status_of(p).message(), HasSubstr("top_p"));
  p = {};
  p.allowed_bitmask.assign(1, ~0u);
  EXPECT_THAT(status_of(p).message(), HasSubstr("allowed_token_bitmask"));
  p = {};
  p.banned_token_ids = {40};
  EXPECT_THAT(status_of(p).message(), HasSubstr("banned_token_ids"));
  p = {};
  p.temperature = -1.0f;
  EXPECT_EQ(status_of(p).code(), absl::StatusCode::kInvalidArgument);
  p = {};
  p.n = 0;
  EXPECT_THAT(status_of(p).message(), HasSubstr("row 0: n"));
}

TEST(CpuSamplerTest, SupportsEveryControl) {
  auto sampler = MakeSampler(RandomWeights(10, 2, 16, 1.0f), 10, 2);
  EXPECT_EQ(sampler->SupportedControls(), AllSamplingControls());
}

// Engine slots call Sample() concurrently on one sampler and one pool; each
// call must get exactly what it gets alone.
TEST(CpuSamplerTest, ConcurrentCallsGiveTheSameResultsAsSequentialOnes) {
  const int64_t vocab = 3000, hidden = 16;
  auto w = RandomWeights(vocab, hidden, 19, 0.5f);
  CpuSamplerOptions options;
  options.threads = 3;
  options.chunk_rows = 512;
  auto sampler = MakeSampler(w, vocab, hidden, options);
  const int rows = 20;
  const std::vector<float> h = RandomHidden(rows, hidden, 20);
  std::vector<SamplingParams> kinds(3);
  kinds[1].top_p = 0.7f;
  kinds[1].logprobs.top_n = 3;
  kinds[2].top_k = 5;
  kinds[2].n = 2;
  std::vector<std::vector<RowSpec>> specs(4, std::vector<RowSpec>(rows));
  std::vector<std::vector<RowResult>> want(4);
  for (int caller = 0; caller < 4; ++caller) {
    for (int r = 0; r < rows; ++r) {
      specs[caller][r] = RowSpec{&kinds[(r + caller) % 3],
                                 static_cast<uint64_t>(caller * 100 + r), 1};
    }
    ASSERT_TRUE(
        sampler->Sample(h.data(), rows, specs[caller].data(), &want[caller])
            .ok());
  }
  std::vector<std::thread> callers;
  std::vector<int> mismatches(4, 0);
  for (int caller = 0; caller < 4; ++caller) {
    callers.emplace_back([&, caller] {
      for (int iteration = 0; iteration < 20; ++iteration) {
        std::vector<RowResult> out;
        if (!sampler->Sample(h.data(), rows, specs[caller].data(), &out).ok()) {
          ++mismatches[caller];
          continue;
        }
        for (int r = 0; r < rows; ++r) {
          mismatches[caller] +=
              out[r].token_ids != want[caller][r].token_ids ||
              out[r].top_token_ids != want[caller][r].top_token_ids;
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(CpuEngineTest, DescribesItselfAndSamplesFromSlots) {
  const int64_t vocab = 777, hidden = 24;
  auto w = RandomWeights(vocab, hidden, 17, 0.5f);
  CpuEngineOptions options;
  options.max_batch_rows = 16;
  options.slots = 2;
  options.sampler.threads = 2;
  auto engine =
      CpuEngine::CreateFromFloat(w, vocab, hidden, DType::kBf16, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const EngineInfo& info = (*engine)->info();
  EXPECT_EQ(info.backend, "cpu");
  EXPECT_EQ(info.vocab_size, vocab);
  EXPECT_EQ(info.hidden_size, hidden);
  EXPECT_EQ(info.weight_dtype, DType::kBf16);
  EXPECT_EQ(info.input_dtype, DType::kFp32);
  EXPECT_EQ(info.max_batch_rows, 16);
  ASSERT_EQ(info.shards.size(), 1u);
  EXPECT_EQ(info.shards[0].device, -1);
  EXPECT_EQ(info.shards[0].vocab_end, vocab);
  EXPECT_EQ(info.supported_controls, AllSamplingControls());
  EXPECT_EQ((*engine)->max_slots(), 2);

  const std::vector<float> h = RandomHidden(5, hidden, 18);
  SamplingParams p;
  std::vector<RowSpec> specs(5, RowSpec{&p, 5, 6});
  for (int slot = 0; slot < 2; ++slot) {
    std::memcpy((*engine)->slot_input(slot), h.data(),
                sizeof(float) * h.size());
    std::vector<RowResult> via_engine, direct;
    ASSERT_TRUE(
        (*engine)->Sample(BatchView{slot, 5, specs.data()}, &via_engine).ok());
    ASSERT_TRUE(
        (*engine)->sampler().Sample(h.data(), 5, specs.data(), &direct).ok());
    for (int r = 0; r < 5; ++r)
      EXPECT_EQ(via_engine[r].token_ids, direct[r].token_ids);
  }
  std::vector<RowResult> out;
  EXPECT_EQ((*engine)->slot_input(2), nullptr);
  EXPECT_EQ((*engine)->Sample(BatchView{2, 1, specs.data()}, &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*engine)->Sample(BatchView{0, 17, specs.data()}, &out).code(),
            absl::StatusCode::kInvalidArgument);
}

// Create() converts bf16 / fp16 weights to fp32 once; the engine then samples
// exactly like a sampler built from the converted floats.
TEST(CpuEngineTest, CreateConvertsLoadedWeightsToFloat) {
  for (const char* dtype : {"bf16", "fp16", "fp32"}) {
    WeightsOptions options;
    options.source =
        std::string("synthetic:vocab=515,hidden=16,seed=3,dtype=") + dtype;
    auto weights = Weights::Load(options);
    ASSERT_TRUE(weights.ok()) << weights.status();
    const Weights& w = **weights;
    auto engine = CpuEngine::Create(w, CpuEngineOptions{});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->info().weight_dtype, w.dtype());
    EXPECT_EQ((*engine)->info().vocab_size, 515);

    auto floats = std::make_shared<std::vector<float>>(515 * 16);
    for (size_t i = 0; i < floats->size(); ++i) {
      const auto* bits = static_cast<const uint16_t*>(w.data());
      switch (w.dtype()) {
        case DType::kBf16:
          (*floats)[i] = Bf16ToFloat(bits[i]);
          break;
        case DType::kFp16:
          (*floats)[i] = HalfToFloat(bits[i]);
          break;
        case DType::kFp32:
          (*floats)[i] = static_cast<const float*>(w.data())[i];
          break;
      }
    }
    auto direct = MakeSampler(floats, 515, 16);
    const std::vector<float> h = RandomHidden(3, 16, 21);
    std::vector<float> want(3 * 515), got(3 * 515);
    ASSERT_TRUE(direct->ComputeLogits(h.data(), 3, want.data()).ok());
    ASSERT_TRUE(
        (*engine)->sampler().ComputeLogits(h.data(), 3, got.data()).ok());
    EXPECT_EQ(std::memcmp(want.data(), got.data(), sizeof(float) * want.size()),
              0)
        << dtype;
  }
}

}  // namespace
}  // namespace flashsampler
