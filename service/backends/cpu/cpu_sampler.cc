// CPU reference sampler. One Sample() call is a series of sweeps over the
// vocabulary; each sweep recomputes logits tile by tile (fixed-shape sgemm)
// and visits them with what each row still needs: row statistics (pass 1 of
// filtered rows), a radix-select histogram or tie counts (exact top-k / top-p
// cuts that the candidate buffer could not certify), and finally the
// Gumbel-max sample with logprobs. Unfiltered and greedy rows need one sweep.
#include "service/backends/cpu/cpu_sampler.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/noise/philox.h"

namespace flashsampler {

namespace {

// W rows per sgemm. Every product has the shape [row_block, 256] x [256, D]^T
// so that OpenBLAS takes the same kernel and K blocking for every call: a
// logit's rounding then depends only on (h, W row), never on batch size,
// position, chunking or threads (DESIGN.md rule 2).
constexpr int64_t kTile = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr double kNegInfD = -std::numeric_limits<double>::infinity();

// Radix select over the 32-bit order key: 11 + 11 + 10 bits, three passes,
// 2048 bins at most (48 KB of counts and masses per row).
constexpr int kRadixBits[3] = {11, 11, 10};
constexpr int kRadixShift[3] = {21, 10, 0};

using uint128 = unsigned __int128;

// A token of a row in the sampling order: higher x first, then lower id.
struct Entry {
  float x;
  int32_t id;
};

inline bool Before(const Entry& a, const Entry& b) {
  return a.x > b.x || (a.x == b.x && a.id < b.id);
}

// The best `capacity` entries offered so far (unordered until TakeSorted).
// Amortized O(1) per offer: grows to 2 x capacity, then nth_element trims.
class TopBuffer {
 public:
  void Reset(size_t capacity) {
    capacity_ = capacity;
    full_ = false;
    items_.clear();
  }
  size_t capacity() const { return capacity_; }

  void Offer(float x, int32_t id) {
    if (capacity_ == 0) return;
    const Entry e{x, id};
    if (full_ && !Before(e, worst_)) return;
    items_.push_back(e);
    if (items_.size() >= 2 * capacity_) Trim();
  }

  void Absorb(const TopBuffer& other) {
    for (const Entry& e : other.items_) Offer(e.x, e.id);
  }

  std::vector<Entry> TakeSorted() {
    Trim();
    std::sort(items_.begin(), items_.end(), Before);
    full_ = false;
    return std::move(items_);
  }

 private:
  void Trim() {
    if (items_.size() > capacity_) {
      std::nth_element(items_.begin(), items_.begin() + capacity_, items_.end(),
                       Before);
      items_.resize(capacity_);
    }
    if (capacity_ > 0 && items_.size() == capacity_) {
      full_ = true;
      worst_ = *std::max_element(items_.begin(), items_.end(), Before);
    }
  }

  size_t capacity_ = 0;
  bool full_ = false;
  Entry worst_{0.0f, 0};
  std::vector<Entry> items_;
};

// Online log-sum-exp in double.
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
  void Merge(const Lse& o) {
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
  double Value() const {
    return max == kNegInfD ? kNegInfD : max + std::log(sum);
  }
};

// Order-preserving map of a float (never NaN here) to uint32.
inline uint32_t OrderKey(float x) {
  const uint32_t bits = FloatToBits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

inline float KeyValue(uint32_t key) {
  return BitsToFloat((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// exp(x - x_max) in [0, 1] as an integer multiple of 2^-62. Sums of these are
// exact and associative in 128 bits (2^31 tokens x 2^62 < 2^93), so the top-p
// cut is the same whatever the chunking or summation order.
inline uint64_t FixedMass(float x, float x_max) {
  const double e =
      std::exp(static_cast<double>(x) - static_cast<double>(x_max));
  return static_cast<uint64_t>(std::ldexp(e, 62));
}

// ceil(p * z), exactly, for p in (0, 1).
uint128 CeilScaled(float p, uint128 z) {
  int exponent = 0;
  const float fraction = std::frexp(p, &exponent);  // p = fraction * 2^exponent
  const uint64_t mantissa = static_cast<uint64_t>(std::ldexp(fraction, 24));
  const int shift = 24 - exponent;  // p = mantissa * 2^-shift, shift >= 24
  const uint128 product = static_cast<uint128>(mantissa) * z;
  if (shift >= 128) return product != 0 ? 1 : 0;
  const uint128 quotient = product >> shift;
  const uint128 remainder = product & ((static_cast<uint128>(1) << shift) - 1);
  return quotient + (remainder != 0 ? 1 : 0);
}

// Smallest float f with (double)f - x_max >= ln(min_p): the min_p rule
// becomes one float comparison per token, with the same outcome.
float SmallestKept(float x_max, float min_p) {
  const double log_min_p = std::log(static_cast<double>(min_p));
  auto kept = [&](float f) {
    return static_cast<double>(f) - static_cast<double>(x_max) >= log_min_p;
  };
  float f = static_cast<float>(static_cast<double>(x_max) + log_min_p);
  if (!kept(f)) {
    while (!kept(f))
      f = std::nextafter(f, std::numeric_limits<float>::infinity());
    return f;
  }
  while (true) {
    const float lower = std::nextafter(f, kNegInf);
    if (lower == kNegInf || !kept(lower)) return f;
    f = lower;
  }
}

// A cut of the sampling order: keep x > v; of the tokens with x == v keep all,
// those with id <= max_id, or the first `ranks` of them in id order.
struct Cutoff {
  enum class Ties { kAll, kUpToId, kFirstRanks };
  bool active = false;
  float v = 0.0f;
  Ties ties = Ties::kAll;
  int32_t max_id = 0;
  int64_t ranks = 0;
  // kFirstRanks: number of tokens with x == v in the chunks before chunk c.
  std::vector<int64_t> tie_prefix;

  static Cutoff UpTo(const Entry& last) {
    Cutoff c;
    c.active = true;
    c.v = last.x;
    c.ties = Ties::kUpToId;
    c.max_id = last.id;
    return c;
  }
};

// Walks one chunk (or the sorted buffer) in id order and applies a Cutoff;
// Keep() must see every allowed token of the chunk, so that tie ranks count.
class CutoffCursor {
 public:
  void Start(const Cutoff& cut, int64_t chunk) {
    cut_ = &cut;
    seen_ = (cut.active && cut.ties == Cutoff::Ties::kFirstRanks && chunk >= 0)
                ? cut.tie_prefix[chunk]
                : 0;
  }
  bool Keep(float x, int32_t id) {
    if (!cut_->active || x > cut_->v) return true;
    if (x < cut_->v) return false;
    switch (cut_->ties) {
      case Cutoff::Ties::kAll:
        return true;
      case Cutoff::Ties::kUpToId:
        return id <= cut_->max_id;
      case Cutoff::Ties::kFirstRanks:
        return seen_++ < cut_->ranks;
    }
    return false;
  }

 private:
  const Cutoff* cut_ = nullptr;
  int64_t seen_ = 0;
};

// A per-token transform input (bias, ban, penalties), sorted by id.
struct Special {
  int32_t id = 0;
  bool has_bias = false;
  float bias = 0.0f;
  bool banned = false;
  bool repeated = false;  // in prompt ids or output ids
  int32_t count = 0;      // output count
};

enum class Phase { kStats, kHist, kTies, kFinal, kDone };
enum class Selecting { kNone, kTopK, kTopP };

struct BestOf {
  float score = kNegInf;
  int32_t id = kNoToken;
  float x = 0.0f;  // processed, temperature-scaled logit of `id`
  float z = 0.0f;  // raw logit of `id`
};

struct ChunkFinal {
  std::vector<BestOf> best;  // per sample (one for greedy rows)
  Lse processed;
  Lse raw;
};

// Radix select of the position where a count (top_k) or a mass (top_p)
// summed along the sampling order first reaches `target`.
struct RadixSelect {
  bool by_mass = false;
  uint128 target = 0;
  int level = 0;
  uint32_t prefix = 0;  // key bits fixed by the levels done so far
  uint128 above = 0;    // count or mass ranked above the current prefix range
  std::vector<uint64_t> count;
  std::vector<uint128> mass;

  void StartLevel(int new_level) {
    level = new_level;
    count.assign(size_t{1} << kRadixBits[level], 0);
    mass.assign(by_mass ? count.size() : 0, 0);
  }
};

// One row of a Sample() call: its plan, then what the sweeps found.
struct Row {
  const SamplingParams* params = nullptr;
  uint64_t seed = 0;
  uint64_t step = 0;
  bool greedy = false;
  float inv_t = 1.0f;  // 1 / T in fp32; 1 for greedy rows (logprobs at T = 1)
  int n = 1;           // samples computed (1 for greedy rows, then copied)
  std::vector<Special> specials;
  const uint32_t* bitmask = nullptr;
  bool use_min_p = false;
  bool use_top_k = false;
  bool use_top_p = false;
  bool want_processed_lse = false;
  bool want_raw_lse = false;
  size_t top_n_processed = 0;
  size_t top_n_raw = 0;

  Phase phase = Phase::kDone;
  // The candidate buffer could not certify the cut: exact radix select ran.
  bool used_radix_select = false;

  // Pass 1 (kStats): the row max of x, the allowed count, and the best
  // tokens in the sampling order.
  float x_max = kNegInf;
  uint64_t allowed = 0;
  TopBuffer buffer;
  std::vector<Entry> sorted;  // the buffer's min_p survivors, in order
  float min_floor = kNegInf;  // min_p: keep x >= min_floor
  Cutoff cut_k;
  Cutoff cut_p;
  Selecting selecting = Selecting::kNone;
  RadixSelect select;
  Cutoff* pending_ties = nullptr;
  std::vector<int64_t> tie_counts;  // per chunk

  std::vector<ChunkFinal> finals;  // per chunk
  TopBuffer top_processed;
  TopBuffer top_raw;

  absl::Mutex mu;  // guards merges from concurrent tasks
  int32_t error_token = kNoToken;
  std::string error;

  void SetError(int32_t token, std::string message) {
    absl::MutexLock lock(&mu);
    if (error.empty() || token < error_token) {
      error_token = token;
      error = std::move(message);
    }
  }
  bool failed() const { return !error.empty(); }
};

// What one task (row block x chunk) accumulates for one row before merging.
struct TaskRow {
  Row* row = nullptr;
  bool failed = false;
  int32_t error_token = kNoToken;
  std::string error;
  // kStats
  float x_max = kNegInf;
  uint64_t allowed = 0;
  TopBuffer buffer;
  // kHist
  std::vector<uint64_t> count;
  std::vector<uint128> mass;
  // kTies
  int64_t ties = 0;
  // kHist, kFinal
  CutoffCursor cursor_k;
  CutoffCursor cursor_p;
  // kFinal
  ChunkFinal fin;
  TopBuffer top_processed;
  TopBuffer top_raw;
  // Per sample: the cached NoiseBits4 group and noise block (its call and
  // E_min), each recomputed only when the token walk enters a new one.
  std::vector<uint32_t> noise_group;
  std::vector<Philox4x32> noise_bits;
  std::vector<uint32_t> noise_block_index;
  std::vector<NoiseBlock> noise_block;
  std::vector<float> noise_min_exponential;

  void Fail(int32_t token, std::string message) {
    if (!failed || token < error_token) {
      failed = true;
      error_token = token;
      error = std::move(message);
    }
  }
};

// Raw logits z -> processed l (vLLM v1 order, see cpu_sampler.h) -> x = l/T.
void Transform(const Row& row, int64_t begin, int count, const float* z,
               float* l, float* x, TaskRow& tr) {
  const SamplingParams& p = *row.params;
  for (int c = 0; c < count; ++c) l[c] = z[c];
  if (row.bitmask != nullptr) {
    for (int c = 0; c < count; ++c) {
      const int64_t id = begin + c;
      if (((row.bitmask[id >> 5] >> (id & 31)) & 1u) == 0) l[c] = kNegInf;
    }
  }
  if (!row.specials.empty()) {
    auto it = std::lower_bound(
        row.specials.begin(), row.specials.end(), begin,
        [](const Special& s, int64_t id) { return s.id < id; });
    for (; it != row.specials.end() && it->id < begin + count; ++it) {
      const int c = static_cast<int>(it->id - begin);
      const bool disallowed =
          row.bitmask != nullptr &&
          ((row.bitmask[it->id >> 5] >> (it->id & 31)) & 1u) == 0;
      float v = z[c];
      if (it->has_bias) v = v + it->bias;
      if (it->banned || disallowed) {
        v = kNegInf;
      } else {
        if (it->repeated) {
          v = v > 0.0f ? v / p.repetition_penalty : v * p.repetition_penalty;
        }
        if (it->count > 0) {
          v = v - p.frequency_penalty * static_cast<float>(it->count);
          v = v - p.presence_penalty;
        }
      }
      l[c] = v;
    }
  }
  for (int c = 0; c < count; ++c) {
    float xc = l[c] * row.inv_t;
    if (xc == 0.0f) xc = 0.0f;  // -0 and +0 are one value of the order
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
  const int level = sel.level;
  const uint32_t mask = (1u << kRadixBits[level]) - 1;
  for (int c = 0; c < count; ++c) {
    const float xc = x[c];
    if (xc == kNegInf) continue;
    const int32_t id = static_cast<int32_t>(begin + c);
    if (restrict_k && !tr.cursor_k.Keep(xc, id)) continue;
    if (xc < row.min_floor) continue;
    const uint32_t key = OrderKey(xc);
    if (level > 0 && (key >> kRadixShift[level - 1]) != sel.prefix) continue;
    const uint32_t digit = (key >> kRadixShift[level]) & mask;
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
  for (int c = 0; c < count; ++c) {
    const int32_t id = static_cast<int32_t>(begin + c);
    if (row.want_raw_lse) tr.fin.raw.Add(z[c]);
    if (row.top_n_raw > 0) tr.top_raw.Offer(z[c], id);
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
      BestOf& best = tr.fin.best[0];
      if (CandidateBetter(l[c], id, best.score, best.id))
        best = {l[c], id, xc, z[c]};
      continue;
    }
    const uint32_t group = static_cast<uint32_t>(id) >> 2;
    const uint32_t block = static_cast<uint32_t>(id) >> kNoiseBlockShift;
    const uint32_t slot = static_cast<uint32_t>(id) & (kNoiseBlockTokens - 1);
    for (int j = 0; j < row.n; ++j) {
      BestOf& best = tr.fin.best[j];
      // Exact pruning: score = fl(x + g) <= fl(x + max g) < best.
      if (xc + max_gumbel < best.score) continue;
      // GumbelNoise (kernels/noise/philox.h), with each Philox call made once.
      const auto sample = static_cast<uint32_t>(j);
      if (tr.noise_block_index[j] != block) {
        tr.noise_block_index[j] = block;
        tr.noise_block[j] = NoiseBlockOf(row.seed, row.step, sample, block);
        tr.noise_min_exponential[j] =
            BlockMinExponential(tr.noise_block[j].uniform, RoundedDivide{});
      }
      const bool first = slot == tr.noise_block[j].first_slot;
      if (!first && tr.noise_group[j] != group) {
        tr.noise_group[j] = group;
        tr.noise_bits[j] = NoiseBits4(row.seed, row.step, sample, group);
      }
      const float g = BlockSlotGumbel(tr.noise_min_exponential[j], first,
                                      first ? 0u : tr.noise_bits[j].v[id & 3],
                                      RoundedDivide{});
      const float score = GumbelScore(l[c], row.inv_t, g);
      if (CandidateBetter(score, id, best.score, best.id))
        best = {score, id, xc, z[c]};
    }
  }
}

absl::Status ValidateRow(const RowSpec& spec, int64_t vocab) {
  if (spec.params == nullptr)
    return absl::InvalidArgumentError("params is null");
  const SamplingParams& p = *spec.params;
  auto check_id = [&](int64_t id, const char* field) -> absl::Status {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: token id %d out of range [0, %d)", field, id, vocab));
    }
    return absl::OkStatus();
  };
  if (!(std::isfinite(p.temperature) && p.temperature >= 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature must be finite and >= 0, got ", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k must be >= 0, got ", p.top_k));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_p must be in [0, 1], got ", p.min_p));
  }
  if (!(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be finite and > 0, got ",
                     p.repetition_penalty));
  }
  if (!std::isfinite(p.presence_penalty) ||
      !std::isfinite(p.frequency_penalty)) {
    return absl::InvalidArgumentError(
        "presence_penalty and frequency_penalty must be finite");
  }
  if (p.n < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("n must be >= 1, got ", p.n));
  if (p.logprobs.top_n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logprobs.top_logprobs must be >= 0, got ", p.logprobs.top_n));
  }
  for (const TokenBias& b : p.logit_bias) {
    if (auto s = check_id(b.token_id, "logit_bias"); !s.ok()) return s;
    if (std::isnan(b.bias) ||
        b.bias == std::numeric_limits<float>::infinity()) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias of token ", b.token_id,
                       " must be finite or -inf, got ", b.bias));
    }
  }
  for (int32_t id : p.banned_token_ids) {
    if (auto s = check_id(id, "banned_token_ids"); !s.ok()) return s;
  }
  for (int32_t id : p.prompt_token_ids) {
    if (auto s = check_id(id, "prompt_token_ids"); !s.ok()) return s;
  }
  for (const TokenCount& tc : p.output_token_counts) {
    if (auto s = check_id(tc.token_id, "output_token_counts"); !s.ok())
      return s;
    if (tc.count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("output_token_counts: count of token ", tc.token_id,
                       " must be >= 0"));
    }
  }
  const size_t words = static_cast<size_t>((vocab + 31) / 32);
  if (!p.allowed_bitmask.empty() && p.allowed_bitmask.size() != words) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "allowed_token_bitmask has %d words, expected ceil(V / 32) = %d",
        p.allowed_bitmask.size(), words));
  }
  return absl::OkStatus();
}

// Fills the plan part of `row` from its spec (already validated).
void PlanRow(const RowSpec& spec, int64_t vocab, int64_t candidate_buffer,
             Row& row) {
  const SamplingParams& p = *spec.params;
  row.params = spec.params;
  row.seed = spec.seed;
  row.step = spec.step;
  row.greedy = p.greedy();
  row.inv_t = row.greedy ? 1.0f : 1.0f / p.temperature;
  row.n = row.greedy ? 1 : p.n;
  row.bitmask = p.allowed_bitmask.empty() ? nullptr : p.allowed_bitmask.data();

  std::map<int32_t, Special> specials;
  auto at = [&](int32_t id) -> Special& {
    Special& s = specials[id];
    s.id = id;
    return s;
  };
  for (const TokenBias& b : p.logit_bias) {
    Special& s = at(b.token_id);
    s.bias = s.has_bias ? s.bias + b.bias : b.bias;
    s.has_bias = true;
  }
  for (int32_t id : p.banned_token_ids) at(id).banned = true;
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : p.prompt_token_ids) at(id).repeated = true;
  }
  for (const TokenCount& tc : p.output_token_counts) {
    if (tc.count <= 0) continue;
    Special& s = at(tc.token_id);
    s.repeated = s.repeated || p.repetition_penalty != 1.0f;
    s.count += tc.count;
  }
  row.specials.clear();
  row.specials.reserve(specials.size());
  for (auto& [id, s] : specials) row.specials.push_back(s);

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
  // top_k alone needs only k buffered tokens; top_p uses the whole buffer.
  int64_t buffer = 0;
  if (row.use_top_p) {
    buffer = candidate_buffer;
  } else if (row.use_top_k) {
    buffer = p.top_k <= candidate_buffer ? p.top_k : candidate_buffer;
  }
  row.buffer.Reset(static_cast<size_t>(std::max<int64_t>(0, buffer)));
  row.phase = filtered ? Phase::kStats : Phase::kFinal;
}

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

// Top-p over a fully known, ordered survivor list: cut after the shortest
// prefix whose mass reaches ceil(p * total).
void ResolveTopPFromList(Row& row) {
  uint128 total = 0;
  for (const Entry& e : row.sorted) total += FixedMass(e.x, row.x_max);
  const uint128 target = CeilScaled(row.params->top_p, total);
  uint128 cum = 0;
  for (const Entry& e : row.sorted) {
    cum += FixedMass(e.x, row.x_max);
    if (cum >= target) {
      row.cut_p = Cutoff::UpTo(e);
      return;
    }
  }
}

void PlanTopP(Row& row, bool survivors_known, int64_t num_chunks) {
  if (!row.use_top_p) {
    EnterFinal(row, num_chunks);
  } else if (survivors_known) {
    ResolveTopPFromList(row);
    EnterFinal(row, num_chunks);
  } else {
    StartSelect(row, Selecting::kTopP);
  }
}

void AfterStats(Row& row, int64_t num_chunks) {
  if (row.allowed == 0) {
    row.SetError(
        -1, "every token is masked (banned ids, allowed bitmask or -inf bias)");
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
      row.cut_k = Cutoff::UpTo(row.sorted[k - 1]);
      row.sorted.resize(k);
      survivors_known = true;
    } else if (!min_p_complete) {
      StartSelect(row, Selecting::kTopK);
      return;
    }
  }
  PlanTopP(row, survivors_known, num_chunks);
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

// Top-p fast path after the level-0 pass has given the survivors' mass: the
// buffered prefix certifies the cut when its mass reaches the target.
bool TryTopPFromBuffer(Row& row) {
  CutoffCursor cursor;
  cursor.Start(row.cut_k, -1);
  uint128 cum = 0;
  for (const Entry& e : row.sorted) {
    if (!cursor.Keep(e.x, e.id)) return false;  // past top-k: the rest too
    cum += FixedMass(e.x, row.x_max);
    if (cum >= row.select.target) {
      row.cut_p = Cutoff::UpTo(e);
      return true;
    }
  }
  return false;
}

void AfterHist(Row& row, int64_t num_chunks) {
  RadixSelect& sel = row.select;
  if (sel.by_mass && sel.level == 0) {
    uint128 total = 0;
    for (uint128 m : sel.mass) total += m;
    sel.target = CeilScaled(row.params->top_p, total);
    if (TryTopPFromBuffer(row)) {
      EnterFinal(row, num_chunks);
      return;
    }
  }
  uint128 cum = sel.above;
  int64_t found = -1;
  for (int64_t b = static_cast<int64_t>(sel.count.size()) - 1; b >= 0; --b) {
    const uint128 value = sel.by_mass ? sel.mass[b] : sel.count[b];
    if (cum + value >= sel.target) {
      found = b;
      break;
    }
    cum += value;
  }
  Cutoff& cut = row.selecting == Selecting::kTopK ? row.cut_k : row.cut_p;
  if (found < 0) {  // fewer than k survivors: no cut
    AfterCut(row, num_chunks);
    return;
  }
  sel.above = cum;
  sel.prefix =
      (sel.prefix << kRadixBits[sel.level]) | static_cast<uint32_t>(found);
  if (sel.level < 2) {
    sel.StartLevel(sel.level + 1);
    return;
  }
  // The cut value is known exactly; decide how many of its ties to keep.
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

// Stage 2: merges the chunks' candidates and logprob partials into `out`.
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
    row.SetError(
        -1, "every token is masked (banned ids, allowed bitmask or -inf bias)");
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
    if (lp.sampled) {
      out.sampled_logprobs[j] =
          static_cast<float>(static_cast<double>(lp.raw ? b.z : b.x) - lse);
    }
  }
  if (lp.logsumexp) out.logsumexp = static_cast<float>(lse);
  if (lp.top_n > 0) {
    std::vector<Entry> top =
        lp.raw ? row.top_raw.TakeSorted() : row.top_processed.TakeSorted();
    out.top_token_ids.clear();
    out.top_logprobs.clear();
    for (const Entry& e : top) {
      out.top_token_ids.push_back(e.id);
      out.top_logprobs.push_back(
          static_cast<float>(static_cast<double>(e.x) - lse));
    }
  }
}

}  // namespace

struct CpuSampler::Call {
  const float* hidden = nullptr;
  int rows = 0;
  float max_gumbel = 0.0f;
  std::vector<std::unique_ptr<Row>> row;
};

float MaxGumbelNoise() {
  // Every noise is -log(E) with E >= the smallest E_min, the top cell's
  // -log(1 - 2^-24) / 16 (AccurateLog is within 1 ulp, so E_min is
  // non-increasing in U up to that): AccurateLog's error at that point and
  // at E is under 4e-6, far inside the 2^-10 added (philox_test checks
  // every block cell and samples of the other slots).
  const float smallest =
      BlockMinExponential(UniformFromBits(0xffffffffu), RoundedDivide{});
  return -AccurateLog(smallest) + 1.0f / 1024.0f;
}

CpuSampler::CpuSampler(std::shared_ptr<const std::vector<float>> weights,
                       int64_t vocab, int64_t hidden,
                       const CpuSamplerOptions& options)
    : weights_(std::move(weights)),
      vocab_(vocab),
      hidden_(hidden),
      options_(options) {
  num_tiles_ = (vocab_ + kTile - 1) / kTile;
  tiles_per_chunk_ =
      std::max<int64_t>(1, (options_.chunk_rows + kTile - 1) / kTile);
  num_chunks_ = (num_tiles_ + tiles_per_chunk_ - 1) / tiles_per_chunk_;
  if (vocab_ % kTile != 0) {
    const int64_t full = vocab_ / kTile;
    const int64_t rest = vocab_ - full * kTile;
    tail_tile_.assign(kTile * hidden_, 0.0f);
    std::memcpy(tail_tile_.data(), weights_->data() + full * kTile * hidden_,
                sizeof(float) * rest * hidden_);
  }
  int threads = options_.threads;
  if (threads <= 0)
    threads = static_cast<int>(std::thread::hardware_concurrency());
  pool_ = std::make_unique<ThreadPool>(std::max(1, threads));
}

absl::StatusOr<std::unique_ptr<CpuSampler>> CpuSampler::Create(
    std::shared_ptr<const std::vector<float>> weights_fp32, int64_t vocab,
    int64_t hidden, const CpuSamplerOptions& options) {
  if (weights_fp32 == nullptr)
    return absl::InvalidArgumentError("weights are null");
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max() - kTile) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab size out of range: ", vocab));
  }
  if (hidden < 1 || hidden > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden size out of range: ", hidden));
  }
  if (static_cast<int64_t>(weights_fp32->size()) != vocab * hidden) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "weights hold %d floats, expected vocab x hidden = %d x %d",
        weights_fp32->size(), vocab, hidden));
  }
  if (options.chunk_rows < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_rows must be >= 1, got ", options.chunk_rows));
  }
  // The pool provides the parallelism; BLAS threads inside each task would
  // only oversubscribe the cores.
  static std::once_flag blas_threads_once;
  std::call_once(blas_threads_once, [] { openblas_set_num_threads(1); });
  std::unique_ptr<CpuSampler> sampler(
      new CpuSampler(std::move(weights_fp32), vocab, hidden, options));
  if (!sampler->RowBlockIsPositionInvariant()) sampler->row_block_ = 1;
  return sampler;
}

const float* CpuSampler::Tile(int64_t tile) const {
  if ((tile + 1) * kTile <= vocab_)
    return weights_->data() + tile * kTile * hidden_;
  return tail_tile_.data();
}

void CpuSampler::TileLogits(const float* hblock, int64_t tile,
                            float* out) const {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, row_block_,
              static_cast<int>(kTile), static_cast<int>(hidden_), 1.0f, hblock,
              static_cast<int>(hidden_), Tile(tile), static_cast<int>(hidden_),
              0.0f, out, static_cast<int>(kTile));
}

// Start-up self-check of the BLAS (OpenBLAS picks its kernel per CPU): a row
// must give the same bits at every position of the block, whatever the other
// rows hold. If not, fall back to one row per product (slower, invariant).
bool CpuSampler::RowBlockIsPositionInvariant() const {
  uint32_t state = 0x9e3779b9u;
  auto next = [&state] {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    return static_cast<float>(state >> 8) * 0x1p-23f - 1.0f;
  };
  std::vector<float> h(hidden_);
  for (float& v : h) v = next();
  std::vector<float> block(row_block_ * hidden_, 0.0f);
  std::vector<float> out(row_block_ * kTile), reference(kTile);
  std::memcpy(block.data(), h.data(), sizeof(float) * hidden_);
  TileLogits(block.data(), 0, out.data());
  std::memcpy(reference.data(), out.data(), sizeof(float) * kTile);
  for (int pos = 0; pos < row_block_; ++pos) {
    for (float& v : block) v = next() * 8.0f;
    std::memcpy(block.data() + pos * hidden_, h.data(),
                sizeof(float) * hidden_);
    TileLogits(block.data(), 0, out.data());
    if (std::memcmp(out.data() + pos * kTile, reference.data(),
                    sizeof(float) * kTile) != 0) {
      return false;
    }
  }
  return true;
}

std::vector<std::string> CpuSampler::SupportedControls() const {
  return AllSamplingControls();
}

absl::Status CpuSampler::ComputeLogits(const float* hidden, int rows,
                                       float* logits) {
  if (rows < 0 || (rows > 0 && (hidden == nullptr || logits == nullptr))) {
    return absl::InvalidArgumentError("ComputeLogits: bad rows or null buffer");
  }
  const int blocks = (rows + row_block_ - 1) / row_block_;
  pool_->ParallelFor(blocks * num_chunks_, [&](int64_t task) {
    const int block = static_cast<int>(task / num_chunks_);
    const int64_t chunk = task % num_chunks_;
    const int r0 = block * row_block_;
    const int r1 = std::min(rows, r0 + row_block_);
    std::vector<float> hblock(row_block_ * hidden_, 0.0f);
    std::memcpy(hblock.data(), hidden + r0 * hidden_,
                sizeof(float) * (r1 - r0) * hidden_);
    std::vector<float> out(row_block_ * kTile);
    const int64_t t1 = std::min(num_tiles_, (chunk + 1) * tiles_per_chunk_);
    for (int64_t t = chunk * tiles_per_chunk_; t < t1; ++t) {
      TileLogits(hblock.data(), t, out.data());
      const int64_t begin = t * kTile;
      const int64_t count = std::min(kTile, vocab_ - begin);
      for (int r = r0; r < r1; ++r) {
        std::memcpy(logits + r * vocab_ + begin, out.data() + (r - r0) * kTile,
                    sizeof(float) * count);
      }
    }
  });
  return absl::OkStatus();
}

void CpuSampler::RunTask(Call& call, int block, int64_t chunk) const {
  const int r0 = block * row_block_;
  const int r1 = std::min(call.rows, r0 + row_block_);
  std::vector<TaskRow> trs;
  trs.reserve(r1 - r0);
  std::vector<int> offset;  // row's position in the block
  for (int r = r0; r < r1; ++r) {
    Row& row = *call.row[r];
    if (row.phase == Phase::kDone) continue;
    TaskRow& tr = trs.emplace_back();
    offset.push_back(r - r0);
    tr.row = &row;
    switch (row.phase) {
      case Phase::kStats:
        tr.buffer.Reset(row.buffer.capacity());
        break;
      case Phase::kHist:
        tr.count.assign(row.select.count.size(), 0);
        tr.mass.assign(row.select.mass.size(), 0);
        tr.cursor_k.Start(row.cut_k, chunk);
        break;
      case Phase::kFinal:
        tr.fin.best.assign(row.n, BestOf{});
        tr.top_processed.Reset(row.top_n_processed);
        tr.top_raw.Reset(row.top_n_raw);
        tr.noise_group.assign(row.n, 0xffffffffu);
        tr.noise_bits.assign(row.n, Philox4x32{});
        tr.noise_block_index.assign(row.n, 0xffffffffu);
        tr.noise_block.assign(row.n, NoiseBlock{});
        tr.noise_min_exponential.assign(row.n, 0.0f);
        tr.cursor_k.Start(row.cut_k, chunk);
        tr.cursor_p.Start(row.cut_p, chunk);
        break;
      case Phase::kTies:
      case Phase::kDone:
        break;
    }
  }
  if (trs.empty()) return;

  std::vector<float> hblock(row_block_ * hidden_, 0.0f);
  std::memcpy(hblock.data(), call.hidden + r0 * hidden_,
              sizeof(float) * (r1 - r0) * hidden_);
  std::vector<float> out(row_block_ * kTile);
  float l[kTile];
  float x[kTile];
  const int64_t t1 = std::min(num_tiles_, (chunk + 1) * tiles_per_chunk_);
  for (int64_t t = chunk * tiles_per_chunk_; t < t1; ++t) {
    TileLogits(hblock.data(), t, out.data());
    const int64_t begin = t * kTile;
    const int count = static_cast<int>(std::min(kTile, vocab_ - begin));
    for (size_t i = 0; i < trs.size(); ++i) {
      TaskRow& tr = trs[i];
      if (tr.failed) continue;
      const Row& row = *tr.row;
      const float* z = out.data() + offset[i] * kTile;
      Transform(row, begin, count, z, l, x, tr);
      if (tr.failed) continue;
      switch (row.phase) {
        case Phase::kStats:
          VisitStats(x, begin, count, tr);
          break;
        case Phase::kHist:
          VisitHist(row, x, begin, count, tr);
          break;
        case Phase::kTies:
          VisitTies(row, x, count, tr);
          break;
        case Phase::kFinal:
          VisitFinal(row, z, l, x, begin, count, call.max_gumbel, tr);
          break;
        case Phase::kDone:
          break;
      }
    }
  }

  for (TaskRow& tr : trs) {
    Row& row = *tr.row;
    if (tr.failed) {
      row.SetError(tr.error_token, std::move(tr.error));
      continue;
    }
    switch (row.phase) {
      case Phase::kStats: {
        absl::MutexLock lock(&row.mu);
        row.x_max = std::max(row.x_max, tr.x_max);
        row.allowed += tr.allowed;
        row.buffer.Absorb(tr.buffer);
        break;
      }
      case Phase::kHist: {
        absl::MutexLock lock(&row.mu);
        for (size_t b = 0; b < tr.count.size(); ++b)
          row.select.count[b] += tr.count[b];
        for (size_t b = 0; b < tr.mass.size(); ++b)
          row.select.mass[b] += tr.mass[b];
        break;
      }
      case Phase::kTies:
        row.tie_counts[chunk] = tr.ties;  // one task per (row, chunk): no race
        break;
      case Phase::kFinal: {
        row.finals[chunk] = std::move(tr.fin);
        absl::MutexLock lock(&row.mu);
        row.top_processed.Absorb(tr.top_processed);
        row.top_raw.Absorb(tr.top_raw);
        break;
      }
      case Phase::kDone:
        break;
    }
  }
}

absl::Status CpuSampler::Sample(const float* hidden, int rows,
                                const RowSpec* specs,
                                std::vector<RowResult>* results) {
  if (results == nullptr) return absl::InvalidArgumentError("results is null");
  if (rows < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("rows must be >= 0, got ", rows));
  results->assign(rows, RowResult{});
  if (rows == 0) return absl::OkStatus();
  if (hidden == nullptr || specs == nullptr) {
    return absl::InvalidArgumentError("hidden states or row specs are null");
  }
  Call call;
  call.hidden = hidden;
  call.rows = rows;
  call.max_gumbel = MaxGumbelNoise();
  call.row.reserve(rows);
  for (int r = 0; r < rows; ++r) {
    call.row.push_back(std::make_unique<Row>());
    Row& row = *call.row.back();
    if (absl::Status s = ValidateRow(specs[r], vocab_); !s.ok()) {
      row.SetError(-1, std::string(s.message()));
      row.phase = Phase::kDone;
      continue;
    }
    PlanRow(specs[r], vocab_, options_.candidate_buffer, row);
    if (row.phase == Phase::kFinal) EnterFinal(row, num_chunks_);
  }

  const int blocks = (rows + row_block_ - 1) / row_block_;
  std::vector<std::pair<int, int64_t>> tasks;
  while (true) {
    tasks.clear();
    for (int b = 0; b < blocks; ++b) {
      bool active = false;
      for (int r = b * row_block_; r < std::min(rows, (b + 1) * row_block_);
           ++r) {
        active = active || call.row[r]->phase != Phase::kDone;
      }
      if (!active) continue;
      for (int64_t c = 0; c < num_chunks_; ++c) tasks.emplace_back(b, c);
    }
    if (tasks.empty()) break;
    pool_->ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t i) {
      RunTask(call, tasks[i].first, tasks[i].second);
    });
    for (int r = 0; r < rows; ++r) {
      Row& row = *call.row[r];
      if (row.phase == Phase::kDone) continue;
      if (row.failed()) {
        row.phase = Phase::kDone;
        continue;
      }
      switch (row.phase) {
        case Phase::kStats:
          AfterStats(row, num_chunks_);
          break;
        case Phase::kHist:
          AfterHist(row, num_chunks_);
          break;
        case Phase::kTies:
          AfterTies(row, num_chunks_);
          break;
        case Phase::kFinal:
          FinishRow(row, (*results)[r]);
          row.phase = Phase::kDone;
          break;
        case Phase::kDone:
          break;
      }
    }
  }

  int failed = 0;
  int first = -1;
  for (int r = 0; r < rows; ++r) {
    if (call.row[r]->used_radix_select) {
      (*results)[r].exact_fallback = "radix_select";
    }
    if (!call.row[r]->failed()) continue;
    (*results)[r] = RowResult{};
    (*results)[r].error = call.row[r]->error;
    if (failed++ == 0) first = r;
  }
  if (failed == 0) return absl::OkStatus();
  std::string message =
      absl::StrCat("row ", first, ": ", call.row[first]->error);
  if (failed > 1)
    absl::StrAppend(&message, " (", failed - 1, " more rows failed)");
  return absl::InvalidArgumentError(message);
}

}  // namespace flashsampler
