// The controlled sampler's kernels. The candidate path (the chunk and merge
// kernels, below the full passes) samples every row it can certify from its
// chunks' highest logits; for the rest, the full passes: one CTA per row
// walks the row's fp32 logits in passes (transform, row statistics,
// radix-select cuts for top_k and top_p, one Gumbel-max pass per sample,
// logprobs), each pass a block-wide reduction with a fixed combining order,
// so the result is a pure function of the row's logits and controls.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/controls/block_scan.cuh"
#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_sampler.h"
#include "kernels/noise/philox.h"
#include "kernels/sampler/device_ptx.cuh"

namespace flashsampler {
namespace {

using controls::U128;

// 512 threads: at V = 151936 each thread visits ~300 tokens per pass. The
// kernel needs 64 registers, no spills and 5.3 KB of shared memory (ptxas -v
// for sm_90a and sm_80), under the 128 registers a thread may use at this
// block size, so the Philox rounds stay out of local memory. The merge
// kernel's chain of block-wide steps is shorter with more threads too: at
// 256, with every control on qwen, it took 31 against 28.5 us at one row
// and 32 against 29 us at 64 rows, the full passes 1.5x as long (H100,
// fs_controls_bench).
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int32_t kNoId = 0x7fffffff;

// The first statement of the kernels launched by LaunchAfterPrevious: waits
// until the kernel before them in the stream has finished and its stores
// are visible (a no-op for an ordinary launch, and before sm_90).
__device__ __forceinline__ void WaitForPreviousKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Per-bin sums of one radix level. A mass (<= 2^62) is added as its high and
// low 32-bit halves into 64-bit counters: each sum stays below 2^31 tokens x
// 2^32 = 2^63, and the bin's mass is hi * 2^32 + lo exactly, whatever the
// order of the atomics.
struct Histogram {
  uint32_t count[controls::kRadixBins];
  unsigned long long mass_hi[controls::kRadixBins];
  unsigned long long mass_lo[controls::kRadixBins];
};

// What thread 0 decides at the end of a radix level, read by every thread.
struct SelectState {
  U128 above;
  int digit;
};

struct SharedState {
  Histogram hist;
  SelectState select;
  alignas(16) unsigned long long scratch[kWarps];  // block reductions
  int bad_id;
};

// Block-wide reduction of one value per thread over a block of kBlockWarps
// warps, through one slot per warp; the warps' partials are combined in warp
// order by every thread, so the result (and, for doubles, its rounding) does
// not depend on scheduling. Every thread must call it.
template <int kBlockWarps, typename T, typename Op>
__device__ T BlockReduceInSlots(T value, Op op, T* warp_slots) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // the previous reduction's readers are done
  if ((threadIdx.x & 31) == 0) warp_slots[threadIdx.x >> 5] = value;
  __syncthreads();
  T result = warp_slots[0];
  for (int w = 1; w < kBlockWarps; ++w) result = op(result, warp_slots[w]);
  return result;
}

// The full passes' and the merge kernel's reduction (kThreads), through
// sh.scratch.
template <typename T, typename Op>
__device__ T BlockReduce(T value, Op op, SharedState& sh) {
  return BlockReduceInSlots<kWarps>(value, op,
                                    reinterpret_cast<T*>(sh.scratch));
}

struct MaxFloat {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};
struct MaxU64 {
  __device__ unsigned long long operator()(unsigned long long a,
                                           unsigned long long b) const {
    return a > b ? a : b;
  }
};
struct SumU64 {
  __device__ unsigned long long operator()(unsigned long long a,
                                           unsigned long long b) const {
    return a + b;
  }
};
struct SumDouble {
  __device__ double operator()(double a, double b) const {
    return __dadd_rn(a, b);
  }
};

struct SelectOutcome {
  bool found;
  uint32_t key;     // the selected key value
  U128 above;       // weight of the keys above it
  uint32_t ties;    // tokens with exactly this key
  U128 tie_weight;  // their total weight
};

// Radix select, descending, over the keys `key_of(i, &key)` yields (false =
// not a candidate): the key at which the weight summed along the descending
// order (count, or FixedMass of KeyValue(key) when kByMass) first reaches
// `target`. Four levels of 8 bits; every thread must call it.
template <bool kByMass, typename KeyOf>
__device__ SelectOutcome RadixSelect(int32_t vocab, KeyOf key_of, float x_max,
                                     U128 target, SharedState& sh) {
  Histogram& h = sh.hist;
  auto bin_weight = [&h](int digit) -> U128 {
    if constexpr (kByMass) {
      return (static_cast<U128>(h.mass_hi[digit]) << 32) +
             static_cast<U128>(h.mass_lo[digit]);
    }
    return static_cast<U128>(h.count[digit]);
  };
  SelectOutcome out{false, 0u, 0, 0u, 0};
  uint32_t prefix = 0;
  U128 above = 0;
  for (int level = 0; level < controls::kRadixLevels; ++level) {
    for (int b = threadIdx.x; b < controls::kRadixBins; b += kThreads) {
      h.count[b] = 0;
      h.mass_hi[b] = 0;
      h.mass_lo[b] = 0;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      uint32_t key;
      if (!key_of(i, &key)) continue;
      if (!controls::RadixPrefixMatches(key, level, prefix)) continue;
      const uint32_t digit = controls::RadixDigit(key, level);
      atomicAdd(&h.count[digit], 1u);
      if constexpr (kByMass) {
        const uint64_t mass =
            controls::FixedMass(controls::KeyValue(key), x_max);
        atomicAdd(&h.mass_hi[digit],
                  static_cast<unsigned long long>(mass >> 32));
        atomicAdd(&h.mass_lo[digit],
                  static_cast<unsigned long long>(mass & 0xffffffffu));
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      U128 a = above;
      sh.select.digit = controls::FindDigit(bin_weight, target, &a);
      sh.select.above = a;
    }
    __syncthreads();
    const int digit = sh.select.digit;
    if (digit < 0) {
      __syncthreads();  // everyone has read sh.select before it is reused
      return out;       // the candidates' weight falls short of the target
    }
    above = sh.select.above;
    prefix = (prefix << 8) | static_cast<uint32_t>(digit);
    if (level == controls::kRadixLevels - 1) {
      out.found = true;
      out.key = prefix;
      out.above = above;
      out.ties = h.count[digit];
      out.tie_weight = bin_weight(digit);
    }
    __syncthreads();  // the histogram is read before the next level clears it
  }
  return out;
}

// top_k: keep every token `member(i, x)` accepts whose x is >= the k-th
// largest x among them, every tie at that value included (vLLM's
// sort-and-threshold): the radix select's value alone. Inactive when fewer
// than k tokens are members.
template <typename Member>
__device__ controls::OrderCut TopKCut(const float* x, int32_t vocab,
                                      Member member, int32_t k,
                                      SharedState& sh) {
  const SelectOutcome kth = RadixSelect<false>(
      vocab,
      [&](int32_t i, uint32_t* key) {
        const float xi = x[i];
        if (!member(i, xi)) return false;
        *key = controls::OrderKey(xi);
        return true;
      },
      0.0f, static_cast<U128>(k), sh);
  if (!kth.found) return controls::OrderCut{false, 0u, 0};
  return controls::OrderCut{true, kth.key, kNoId};
}

// The cut of the sampling order at which the mass (top_p; or the count) of
// the tokens `member(i, x)` accepts first reaches `target`: keep the tokens
// ranked above the cut value and, of those equal to it, the lowest ids that
// the target still needs. Inactive when the members' weight falls short.
template <bool kByMass, typename Member>
__device__ controls::OrderCut SelectCut(const float* x, int32_t vocab,
                                        Member member, float x_max, U128 target,
                                        SharedState& sh) {
  const SelectOutcome value = RadixSelect<kByMass>(
      vocab,
      [&](int32_t i, uint32_t* key) {
        const float xi = x[i];
        if (!member(i, xi)) return false;
        *key = controls::OrderKey(xi);
        return true;
      },
      x_max, target, sh);
  if (!value.found) return controls::OrderCut{false, 0u, 0};
  const U128 unit =
      kByMass ? value.tie_weight / static_cast<U128>(value.ties) : U128{1};
  const uint64_t needed =
      controls::TiesNeeded(target, value.above, unit, value.ties);
  if (needed >= value.ties) return controls::OrderCut{true, value.key, kNoId};
  // The needed-th lowest id among the ties: a descending select over ~id.
  const uint32_t v = value.key;
  const SelectOutcome id = RadixSelect<false>(
      vocab,
      [&](int32_t i, uint32_t* key) {
        const float xi = x[i];
        if (!member(i, xi) || controls::OrderKey(xi) != v) return false;
        *key = ~static_cast<uint32_t>(i);
        return true;
      },
      x_max, static_cast<U128>(needed), sh);
  return controls::OrderCut{true, v, static_cast<int32_t>(~id.key)};
}

// Writes sample j's winning key as a token id (thread 0's job): a greedy
// row's single argmax fills all n samples.
__device__ void StoreWinner(unsigned long long winner, bool greedy, int n,
                            int j, int32_t* tokens) {
  const int32_t id = controls::PackedKeyId(winner);
  if (greedy) {
    for (int k = 0; k < n; ++k) tokens[k] = id;
  } else {
    tokens[j] = id;
  }
}

// Writes sample j's rank (thread 0's job), as StoreWinner its token: a
// greedy row's one count fills all n samples.
__device__ void StoreRank(unsigned long long count, bool greedy, int n, int j,
                          int32_t* ranks) {
  if (greedy) {
    for (int k = 0; k < n; ++k) ranks[k] = static_cast<int32_t>(count);
  } else {
    ranks[j] = static_cast<int32_t>(count);
  }
}

// Whether the row asks for any logprob output: a sampled logprob or rank,
// its logsumexp, or a top list.
__device__ bool WantsLogprobs(const ControlledRow& c) {
  return (c.logprob_flags &
          (kLogprobSampled | kLogprobRank | kLogprobLogsumexp)) != 0 ||
         c.top_n > 0;
}

// Marks row `r` failed: status, error token, no tokens, no top list.
__device__ void FailRow(const ControlledSampleParams& p, int r, int32_t status,
                        int32_t token) {
  if (threadIdx.x != 0) return;
  p.status[r] = status;
  p.error_token[r] = token;
  for (int j = 0; j < p.max_samples; ++j)
    p.token_ids[static_cast<int64_t>(r) * p.max_samples + j] = -1;
  if (p.top_count != nullptr) p.top_count[r] = 0;
}

__global__ void __launch_bounds__(kThreads)
    ControlledSampleKernel(const ControlledSampleParams p,
                           float* __restrict__ x_all, const int32_t* done) {
  WaitForPreviousKernel();
  __shared__ SharedState sh;
  const int r = blockIdx.x;
  // The merge kernel before this one wrote `done`: an L2 load, not the
  // read-only path a const __restrict__ pointer would allow, which the wait
  // for the previous kernel does not order.
  if (__ldcg(&done[r]) != 0) return;  // the candidate path sampled this row
  const int tid = threadIdx.x;
  const ControlledRow c = p.row_controls[r];
  const int32_t vocab = static_cast<int32_t>(p.vocab);
  const float* __restrict__ z = p.logits + r * p.logits_row_stride;
  float* __restrict__ x = x_all + static_cast<int64_t>(r) * vocab;

  const bool greedy = c.temperature == 0.0f;
  const bool want_sampled = (c.logprob_flags & kLogprobSampled) != 0;
  const bool want_rank = (c.logprob_flags & kLogprobRank) != 0;
  const bool want_lse = (c.logprob_flags & kLogprobLogsumexp) != 0;
  const bool raw = (c.logprob_flags & kLogprobRaw) != 0;
  const int32_t top_n = c.top_n < vocab ? c.top_n : vocab;
  if (c.n < 1 || c.n > p.max_samples || top_n < 0 || top_n > p.max_top_n ||
      (want_sampled && p.sampled_logprobs == nullptr) ||
      (want_rank && p.sampled_ranks == nullptr) ||
      (want_lse && p.logsumexp == nullptr) ||
      (top_n > 0 && (p.top_token_ids == nullptr || p.top_logprobs == nullptr ||
                     p.top_count == nullptr))) {
    FailRow(p, r, kControlledBadControls, -1);
    return;
  }

  // Transform: dense part (bitmask, 1 / T), then the row's merged entries,
  // each id once, so the writes never race.
  const uint32_t* bitmask =
      c.bitmask_offset >= 0 ? p.bitmask + c.bitmask_offset : nullptr;
  const float inv_t = greedy ? 1.0f : FS_FDIV(1.0f, c.temperature);
  if (tid == 0) sh.bad_id = kNoId;
  __syncthreads();
  for (int32_t i = tid; i < vocab; i += kThreads) {
    const float zi = z[i];
    const float li = controls::Disallowed(bitmask, i) ? controls::kNegInf : zi;
    x[i] = controls::ScaledLogit(li, inv_t);
    if (!controls::IsFinite(zi)) atomicMin(&sh.bad_id, i);
  }
  __syncthreads();
  for (int64_t k = c.special_begin + tid; k < c.special_end; k += kThreads) {
    const int32_t id = p.special_ids[k];
    const float v = controls::SpecialLogit(
        z[id], controls::Disallowed(bitmask, id), p.special_flags[k],
        p.special_bias[k], p.special_count[k], c.repetition_penalty,
        c.frequency_penalty, c.presence_penalty);
    x[id] = controls::ScaledLogit(v, inv_t);
  }
  __syncthreads();

  // Row statistics: x_max and the allowed count over x != -inf.
  float local_max = controls::kNegInf;
  unsigned long long local_allowed = 0;
  for (int32_t i = tid; i < vocab; i += kThreads) {
    const float xi = x[i];
    if (controls::IsNan(xi) || xi == controls::kPosInf) {
      atomicMin(&sh.bad_id, i);
    } else if (xi != controls::kNegInf) {
      ++local_allowed;
      local_max = xi > local_max ? xi : local_max;
    }
  }
  const float x_max = BlockReduce(local_max, MaxFloat{}, sh);
  const unsigned long long allowed = BlockReduce(local_allowed, SumU64{}, sh);
  const int bad_id = sh.bad_id;  // complete: BlockReduce synchronized
  if (bad_id != kNoId) {
    FailRow(p, r, kControlledNonFinite, bad_id);
    return;
  }
  if (allowed == 0) {
    FailRow(p, r, kControlledAllMasked, -1);
    return;
  }

  // Filters (ignored by greedy rows). min_p survivors are a prefix of the
  // order; top_k keeps those >= their k-th largest x, top_p cuts among the
  // top_k survivors.
  const bool use_min_p = !greedy && c.min_p > 0.0f;
  const bool use_top_k = !greedy && c.top_k > 0 && c.top_k < vocab;
  const bool use_top_p = !greedy && c.top_p < 1.0f;
  const float floor =
      use_min_p ? controls::MinPFloor(x_max, c.log_min_p) : controls::kNegInf;
  auto base = [floor](int32_t, float xi) {
    return xi != controls::kNegInf && xi >= floor;
  };
  controls::OrderCut cut_k{false, 0u, 0};
  if (use_top_k) cut_k = TopKCut(x, vocab, base, c.top_k, sh);
  auto within_k = [floor, cut_k](int32_t i, float xi) {
    return xi != controls::kNegInf && xi >= floor &&
           controls::CutKeeps(cut_k, controls::OrderKey(xi), i);
  };
  controls::OrderCut cut_p{false, 0u, 0};
  if (use_top_p) {
    // Total mass of the top_k survivors, as hi and lo 32-bit halves (each sum
    // < 2^63, see Histogram).
    unsigned long long hi = 0, lo = 0;
    for (int32_t i = tid; i < vocab; i += kThreads) {
      const float xi = x[i];
      if (!within_k(i, xi)) continue;
      const uint64_t mass = controls::FixedMass(xi, x_max);
      hi += mass >> 32;
      lo += mass & 0xffffffffu;
    }
    hi = BlockReduce(hi, SumU64{}, sh);
    lo = BlockReduce(lo, SumU64{}, sh);
    const U128 total = (static_cast<U128>(hi) << 32) + static_cast<U128>(lo);
    cut_p = SelectCut<true>(x, vocab, within_k, x_max,
                            controls::CeilScaled(c.top_p, total), sh);
  }
  auto survives = [within_k, cut_p](int32_t i, float xi) {
    return within_k(i, xi) &&
           controls::CutKeeps(cut_p, controls::OrderKey(xi), i);
  };

  // Gumbel-max per sample over the survivors, walking whole noise blocks (16
  // ids) so that each Philox call is made once per block or token word.
  int32_t* tokens = p.token_ids + static_cast<int64_t>(r) * p.max_samples;
  const float bound = controls::MaxGumbelNoiseBound();
  const int32_t num_blocks =
      (vocab + static_cast<int32_t>(kNoiseBlockTokens) - 1) /
      static_cast<int32_t>(kNoiseBlockTokens);
  const int computed = greedy ? 1 : c.n;
  for (int j = 0; j < computed; ++j) {
    const uint32_t sample = static_cast<uint32_t>(j);
    unsigned long long best_key = 0;
    float best_score = controls::kNegInf;
    for (int32_t blk = tid; blk < num_blocks; blk += kThreads) {
      bool have_block = false;
      NoiseBlock noise_block{0u, 0.0f};
      float min_exponential = 0.0f;
      uint32_t group_loaded = 0xffffffffu;
      Philox4x32 words{{0u, 0u, 0u, 0u}};
      const int32_t first_id = blk * static_cast<int32_t>(kNoiseBlockTokens);
      for (uint32_t slot = 0; slot < kNoiseBlockTokens; ++slot) {
        const int32_t id = first_id + static_cast<int32_t>(slot);
        if (id >= vocab) break;
        const float xi = x[id];
        if (!survives(id, xi)) continue;
        if (greedy) {
          const unsigned long long key = controls::PackedKey(xi, id);
          best_key = key > best_key ? key : best_key;
          continue;
        }
        // Exact pruning: score = fl(x + g) <= fl(x + bound) < best.
        if (FS_FADD(xi, bound) < best_score) continue;
        if (!have_block) {
          noise_block =
              NoiseBlockOf(c.seed, c.step, sample, static_cast<uint32_t>(blk));
          min_exponential =
              BlockMinExponential(noise_block.uniform, RoundedDivide{});
          have_block = true;
        }
        const bool first = slot == noise_block.first_slot;
        uint32_t word = 0u;
        if (!first) {
          const uint32_t group = static_cast<uint32_t>(id) >> 2;
          if (group != group_loaded) {
            words = NoiseBits4(c.seed, c.step, sample, group);
            group_loaded = group;
          }
          word = PhiloxWord(words, static_cast<uint32_t>(id) & 3u);
        }
        const float g =
            BlockSlotGumbel(min_exponential, first, word, RoundedDivide{});
        // GumbelScore(l, 1 / T, g) = fl(fl(l / T) + g) = fl(x + g): x only
        // folds -0 into +0, and the key folds the score's zero likewise.
        const float score = controls::FoldZero(FS_FADD(xi, g));
        const unsigned long long key = controls::PackedKey(score, id);
        if (key > best_key) {
          best_key = key;
          best_score = score;
        }
      }
    }
    const unsigned long long winner = BlockReduce(best_key, MaxU64{}, sh);
    if (winner == 0) {  // unreachable: the row's first token survives
      FailRow(p, r, kControlledAllMasked, -1);
      return;
    }
    if (tid == 0) StoreWinner(winner, greedy, c.n, j, tokens);
  }

  // Logprobs: log-softmax of x over the survivors, or of the raw logits
  // after the masks alone (controls::MaskedRawLogit); lse = max + log(sum
  // exp(v - max)) in double. A masked raw value is -inf: out of the sum and
  // never listed.
  auto raw_logit = [&](int32_t i) {
    return controls::MaskedRawLogit(
        z[i], x[i], controls::Disallowed(bitmask, i), p.special_ids,
        p.special_flags, c.special_begin, c.special_end, i);
  };
  if (WantsLogprobs(c)) {
    float v_max = x_max;  // the survivors' max is the row's first token
    if (raw) {
      float m = controls::kNegInf;
      for (int32_t i = tid; i < vocab; i += kThreads) {
        const float ri = raw_logit(i);
        m = ri > m ? ri : m;
      }
      v_max = BlockReduce(m, MaxFloat{}, sh);
    }
    double sum = 0.0;
    for (int32_t i = tid; i < vocab; i += kThreads) {
      float v;
      if (raw) {
        v = raw_logit(i);
        if (v == controls::kNegInf) continue;
      } else {
        v = x[i];
        if (!survives(i, v)) continue;
      }
      sum = __dadd_rn(
          sum, ::exp(static_cast<double>(v) - static_cast<double>(v_max)));
    }
    sum = BlockReduce(sum, SumDouble{}, sh);
    const double lse = static_cast<double>(v_max) + ::log(sum);
    if (tid == 0) {
      if (want_lse) p.logsumexp[r] = static_cast<float>(lse);
      if (want_sampled) {
        for (int k = 0; k < c.n; ++k) {
          const int32_t id = tokens[k];
          const float v = raw ? z[id] : x[id];
          p.sampled_logprobs[static_cast<int64_t>(r) * p.max_samples + k] =
              static_cast<float>(static_cast<double>(v) - lse);
        }
      }
    }
    // Top-N: N rounds of "the best key below the previous one" (N is small;
    // each round is one pass and one reduction).
    if (top_n > 0) {
      const int64_t out = static_cast<int64_t>(r) * p.max_top_n;
      unsigned long long previous = ~0ull;
      int32_t listed = 0;
      for (int32_t t = 0; t < top_n; ++t) {
        unsigned long long best = 0;
        for (int32_t i = tid; i < vocab; i += kThreads) {
          float v;
          if (raw) {
            v = raw_logit(i);
            if (v == controls::kNegInf) continue;
          } else {
            v = x[i];
            if (!survives(i, v)) continue;
          }
          const unsigned long long key = controls::PackedKey(v, i);
          if (key < previous && key > best) best = key;
        }
        const unsigned long long found = BlockReduce(best, MaxU64{}, sh);
        if (found == 0) break;  // fewer survivors than N
        if (tid == 0) {
          p.top_token_ids[out + t] = controls::PackedKeyId(found);
          p.top_logprobs[out + t] = static_cast<float>(
              static_cast<double>(controls::PackedKeyValue(found)) - lse);
        }
        previous = found;
        ++listed;
      }
      if (tid == 0) p.top_count[r] = listed;
    } else if (tid == 0 && p.top_count != nullptr) {
      p.top_count[r] = 0;
    }
    // Ranks: one pass per distinct sample (a greedy row's n are one token),
    // counting the tokens whose value is >= the sampled token's; the
    // lse's reduction above published the tokens.
    if (want_rank) {
      int32_t* ranks =
          p.sampled_ranks + static_cast<int64_t>(r) * p.max_samples;
      for (int k = 0; k < (greedy ? 1 : c.n); ++k) {
        const int32_t id = tokens[k];
        const float v_k = raw ? z[id] : x[id];
        unsigned long long count = 0;
        for (int32_t i = tid; i < vocab; i += kThreads) {
          const float v = raw ? raw_logit(i) : x[i];
          if (v >= v_k && (raw || survives(i, v))) ++count;
        }
        count = BlockReduce(count, SumU64{}, sh);
        if (tid == 0) StoreRank(count, greedy, c.n, k, ranks);
      }
    }
  } else if (tid == 0 && p.top_count != nullptr) {
    p.top_count[r] = 0;
  }
  if (tid == 0) {
    p.status[r] = kControlledOk;
    p.error_token[r] = -1;
  }
}

// ---------------------------------------------------------------------------
// The candidate path: most rows' survivors lie among a few hundred of the
// row's highest logits, so two small kernels sample them without the full
// passes above. The chunk kernel cuts the row into fixed 2048-token chunks
// (fixed, so the result does not depend on the batch) and writes up to 64 of
// each chunk's highest raw logits (eligible tokens: allowed, no per-token
// entry) with a bound on the rest. The merge kernel keeps every written id
// above the highest bound of a truncated chunk (the region: every eligible
// token above that bound is in it), adds the row's entries with their exact
// processed values, sorts the few it needs and decides top_k, min_p, top_p,
// the samples and the logprobs from them only where it can prove the full
// passes would decide the same: cuts strictly above the region's bound, and
// top-p targets that give one cut for every total mass the unseen tokens
// allow. A row it cannot certify leaves `done` unset and the full passes
// sample it. Without the logits (LaunchControlledSampleFromUnits) the merge
// kernel alone runs, over the fused kernel's unit candidates
// (GatherUnitCandidates), and a row it cannot certify is the caller's.

constexpr int kChunkTokens = 2048;
constexpr int kChunkThreads = 128;
constexpr int kChunkPerThread = kChunkTokens / kChunkThreads;
constexpr int kChunkWarps = kChunkThreads / 32;
constexpr int kChunkCandidates = 64;
// Distance bins below a maximum, 1/8 of a logit wide; the last bin takes
// everything further. Binning by distance (not by the key's top bits, where
// most logits share a handful of bins) keeps shared-memory atomics apart.
constexpr int kDistanceBins = 256;
constexpr float kBinsPerLogit = 8.0f;
// Thread t of the chunk kernel holds bins kBinsPerThread * t onwards.
constexpr int kBinsPerThread = kDistanceBins / kChunkThreads;
static_assert(kDistanceBins % kChunkThreads == 0, "bins per thread");
// The candidate slots the merge kernel holds (shared memory): rows of up to
// 8192 / 64 = 128 chunks (V <= 262144) take the candidate path.
constexpr int kMergeCandidateRoom = 8192;

// Shared memory for one row's candidate slots past MergeShared: raw logit
// and id per slot, and each chunk's count of written slots.
__host__ __device__ constexpr size_t MergeCandidateBytes(int chunks) {
  return static_cast<size_t>(chunks) *
         (kChunkCandidates * (sizeof(float) + sizeof(int32_t)) +
          sizeof(int32_t));
}
// The row's per-token entries the merge kernel holds; rows with more take
// the full passes.
constexpr int kMergeEntryRoom = 2048;
static_assert(kMergeCandidateRoom + kMergeEntryRoom <= 65536,
              "the merge kernel's 32-bit sums of 16-bit mass quarters");
// The most candidates the merge kernel sorts (the top_k / top_p prefix).
constexpr int kMergeSortCapacity = 2048;
// The most samples a row the merge kernel takes; rows with more take the
// full passes.
constexpr int kMergeSampleRoom = 64;

constexpr int32_t kChunkTruncated = 1;  // eligible tokens were left out
constexpr int32_t kChunkNonFinite = 2;  // a raw logit is not finite

struct ChunkSummary {
  // Every eligible token left out has OrderKey(raw) <= boundary (truncated
  // chunks only).
  uint32_t boundary;
  int32_t written;  // candidates written, <= kChunkCandidates
  int32_t flags;    // kChunk* bits
  float raw_max;    // max raw logit over allowed, unbanned tokens
  double raw_sum;   // sum exp(raw - raw_max) over them (raw logprobs only)
  // sum exp(x - x(boundary)) over the eligible tokens left out, x the
  // processed logit, in float (top_p rows without top_k only): bounds the
  // mass the merge cannot see.
  double tail_sum;
};

struct CandidateWorkspace {
  int chunks;               // chunks per row
  ChunkSummary* summaries;  // [rows, chunks]
  int32_t* ids;             // [rows, chunks, kChunkCandidates]
  float* raws;              // [rows, chunks, kChunkCandidates] raw logits
  int32_t* done;            // [rows] 1 = sampled by the merge
};

__device__ float RowInverseTemperature(const ControlledRow& c) {
  return c.temperature == 0.0f ? 1.0f : FS_FDIV(1.0f, c.temperature);
}

// The distance bin of `v` below `top` (v <= top): never decreasing as v
// decreases, so a bin's members all rank below the bins before it.
__device__ int DistanceBin(float top, float v) {
  const float d = FS_FMUL(FS_FSUB(top, v), kBinsPerLogit);
  return d < static_cast<float>(kDistanceBins - 1) ? static_cast<int>(d)
                                                   : kDistanceBins - 1;
}

// The first of a row's entries [lo, hi) of `ids` (strictly ascending) whose
// id is >= `id`, `hi` when there is none: SpecialLowerBound with 32 pivots
// per step, one per lane, so a chunk of a row with a few thousand entries
// finds its first one in three dependent loads. Every lane of the warp
// calls it and gets the same answer.
__device__ int64_t WarpSpecialLowerBound(const int32_t* ids, int64_t lo,
                                         int64_t hi, int32_t id) {
  const int lane = threadIdx.x & 31;
  while (hi > lo) {
    const int64_t step = (hi - lo + 31) / 32;  // pivots lo + lane * step
    const int64_t at = lo + lane * step;
    const bool below = at < hi && ids[at] < id;
    const int k = __popc(__ballot_sync(0xffffffffu, below));
    if (k == 0) return lo;
    const int64_t last_below = lo + (k - 1) * step;
    lo = last_below + 1;
    hi = min(hi, last_below + step);  // pivot k (or hi) is >= id
  }
  return lo;
}

// The chunk's first reduction: eligible tokens (sum), their highest value
// and the highest allowed raw logit (max), non-finite logits (or), one
// barrier for all four (warps in order, so the result is fixed).
struct ChunkTotals {
  int eligible;
  float top;
  float raw_max;
  int non_finite;
};

__device__ ChunkTotals ChunkBlockTotals(ChunkTotals mine, ChunkTotals* slots) {
  mine.eligible = __reduce_add_sync(0xffffffffu, mine.eligible);
  mine.non_finite = __reduce_or_sync(0xffffffffu, mine.non_finite);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    mine.top = fmaxf(mine.top, __shfl_xor_sync(0xffffffffu, mine.top, offset));
    mine.raw_max =
        fmaxf(mine.raw_max, __shfl_xor_sync(0xffffffffu, mine.raw_max, offset));
  }
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = mine;
  __syncthreads();
  ChunkTotals all = slots[0];
  for (int wi = 1; wi < kChunkWarps; ++wi) {
    const ChunkTotals other = slots[wi];
    all.eligible += other.eligible;
    all.top = fmaxf(all.top, other.top);
    all.raw_max = fmaxf(all.raw_max, other.raw_max);
    all.non_finite |= other.non_finite;
  }
  return all;
}

// The chunk kernel's first pass over a thread's tokens begin + threadIdx.x
// + kChunkThreads j, in place: raws[j], the token's raw logit, stays where
// the token is allowed, unbanned and finite and becomes -inf otherwise; bit
// j of *eligible marks such a token without a per-token entry (a
// candidate); *totals gathers their counts and maxima.
// kFiltered: the row has a bitmask or the chunk has entries (their bit
// tables, one bit per token of the chunk); lane j's mask_word is the
// bitmask word of the warp's tokens in round j (~0 without a bitmask).
// Every lane of the warp calls it. The tables are read as words and
// combined without branches: tested token by token behind short-circuits,
// each bitmask word a load of its own, the filtered loop ran 17M of the
// kernel's 39.4M instructions at [64, 151936] with every control on; now
// 32.9M in 49 against 63 us (Nsight Compute, H100).
template <bool kFiltered>
__device__ __forceinline__ void ClassifyChunkTokens(
    float (&raws)[kChunkPerThread], int32_t begin, int32_t end,
    bool has_entries, const uint32_t* banned_bits, const uint32_t* special_bits,
    uint32_t mask_word, uint32_t* eligible, ChunkTotals* totals) {
#pragma unroll
  for (int j = 0; j < kChunkPerThread; ++j) {
    const int32_t off = threadIdx.x + j * kChunkThreads;
    const int32_t i = begin + off;
    const float zi = raws[j];
    const bool in_chunk = i < end;
    const bool finite = controls::IsFinite(zi);
    totals->non_finite |= in_chunk && !finite;
    bool allowed = in_chunk && finite;
    bool candidate = allowed;
    if constexpr (kFiltered) {
      const uint32_t bit = 1u << (off & 31);
      const uint32_t allowed_bits = __shfl_sync(0xffffffffu, mask_word, j);
      const uint32_t banned = has_entries ? banned_bits[off >> 5] : 0u;
      const uint32_t special = has_entries ? special_bits[off >> 5] : 0u;
      allowed = allowed & ((allowed_bits & ~banned & bit) != 0u);
      candidate = allowed & ((special & bit) == 0u);
    }
    raws[j] = allowed ? zi : controls::kNegInf;
    totals->raw_max = fmaxf(totals->raw_max, raws[j]);
    *eligible |= static_cast<uint32_t>(candidate) << j;
    totals->top = fmaxf(totals->top,
                        candidate ? controls::FoldZero(zi) : controls::kNegInf);
    totals->eligible += candidate;
  }
}

// exp(x - top) for x <= top, as 2^((x - top) log2 e) by ex2.approx.ftz:
// within (2 + 1.3 |x - top|) ulp (the MUFU's 2, the subtraction's and the
// product's roundings and log2 e's own), a term under 2^-126 flushed to
// zero, two instructions where expf takes about ten. On top_p 0.9 rows
// (the tail) the chunk and merge kernels took 71.7-71.9 against 75.0-75.1
// us with expf at qwen B = 64, 248 against 250-258 at 256 (H100, two
// alternating runs of fs_controls_bench's sampler_only_topp0.9).
__device__ __forceinline__ float ChunkTerm(float x, float top) {
  return ptx::Exp2FlushSubnormal(FS_FMUL(FS_FSUB(x, top), ptx::kLog2e));
}

// One block per (chunk, row); thread t holds tokens begin + t + 128 j, all
// read once. This kernel is bound by its instructions, not by the logits it
// reads (Nsight Compute at [256, 151936] with top_k + top_p + min_p on an
// H100: 0.80 warp instructions issued per scheduler and cycle, 26% of
// DRAM's bandwidth), and a block's reductions, scans and barriers cost the
// same whatever its tokens per thread: 128 threads of 16 tokens (64
// registers, eight blocks per SM) ran 106.6M instructions in 133.5 us
// there, 256 threads of 8 tokens 134.5M in 165 us; 64 threads of 32
// spilled 120 bytes and took 114 KB of code.
__global__ void __launch_bounds__(kChunkThreads, 8)
    CandidateChunkKernel(const ControlledSampleParams p, CandidateWorkspace w) {
  __shared__ uint32_t special_bits[kChunkTokens / 32];
  __shared__ uint32_t banned_bits[kChunkTokens / 32];
  __shared__ uint32_t hist[kDistanceBins];
  __shared__ int warp_slots[kChunkWarps];
  __shared__ ChunkTotals total_slots[kChunkWarps];
  __shared__ double double_slots[kChunkWarps];
  __shared__ int64_t first_entry;
  __shared__ int cut_bin;
  __shared__ uint32_t boundary_key;

  const int chunk = blockIdx.x;
  const int r = blockIdx.y;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const ControlledRow c = p.row_controls[r];
  const int32_t vocab = static_cast<int32_t>(p.vocab);
  const int32_t begin = chunk * kChunkTokens;
  const int32_t end = min(vocab, begin + kChunkTokens);
  const float* __restrict__ z = p.logits + r * p.logits_row_stride;
  const int64_t slot = static_cast<int64_t>(r) * w.chunks + chunk;

  // The logits first, so that their loads are in flight through the entry
  // search and the barriers below: a load issued where its value is used
  // stalls there on its own (38% of the kernel's stall samples, Nsight
  // Compute at [128, 151936] on an H100).
  float raws[kChunkPerThread];
#pragma unroll
  for (int j = 0; j < kChunkPerThread; ++j) {
    const int32_t i = begin + tid + j * kChunkThreads;
    raws[j] = i < end ? z[i] : 0.0f;
  }
  // The bitmask words too: a warp's 32 tokens of round j are the bits of
  // one word, which lane j loads (ClassifyChunkTokens shuffles it out).
  const uint32_t* bitmask =
      c.bitmask_offset >= 0 ? p.bitmask + c.bitmask_offset : nullptr;
  uint32_t mask_word = ~0u;
  if (bitmask != nullptr) {
    const int lane = tid & 31;
    const int32_t round_first = begin + (tid - lane) + lane * kChunkThreads;
    if (lane < kChunkPerThread && round_first < end)
      mask_word = bitmask[round_first >> 5];
  }
  for (int b = tid; b < kDistanceBins; b += kChunkThreads) hist[b] = 0u;
  if (warp == 0) {
    // The row's first entry at or after `begin`, found by a warp in at
    // most three dependent loads: every other thread waits for it at the
    // barrier below, and one thread's binary search (seven loads for 128
    // entries) made the kernel at [128, 151936] with every control on take
    // 163 against 135 us with the logits' loads above (Nsight Compute,
    // H100).
    const int64_t first = WarpSpecialLowerBound(p.special_ids, c.special_begin,
                                                c.special_end, begin);
    if (tid == 0) {
      first_entry = first;
      cut_bin = kDistanceBins;
      boundary_key = 0u;
    }
  }
  __syncthreads();
  // Most chunks hold none of the row's per-token entries: they skip the
  // entries' bit tables (the same answer for every thread).
  const bool has_entries =
      first_entry < c.special_end && p.special_ids[first_entry] < end;
  if (has_entries) {
    for (int i = tid; i < kChunkTokens / 32; i += kChunkThreads) {
      special_bits[i] = 0u;
      banned_bits[i] = 0u;
    }
    __syncthreads();
    for (int64_t k = first_entry + tid; k < c.special_end; k += kChunkThreads) {
      const int32_t id = p.special_ids[k];
      if (id >= end) break;  // ascending: the later entries are beyond too
      const int32_t off = id - begin;
      atomicOr(&special_bits[off >> 5], 1u << (off & 31));
      if (p.special_flags[k] & controls::kSpecialBanned)
        atomicOr(&banned_bits[off >> 5], 1u << (off & 31));
    }
    __syncthreads();
  }

  const float inv_t = RowInverseTemperature(c);
  // Bit j of `eligible`: raws[j] is a candidate's (its key is
  // OrderKey(FoldZero(raws[j]))).
  uint32_t eligible = 0u;
  ChunkTotals mine{0, controls::kNegInf, controls::kNegInf, 0};
  // Without a bitmask and entries in the chunk (most chunks of most rows)
  // every finite logit is a candidate: that case has its own copy of the
  // loop, without the tables' lookups, which the compiler otherwise wraps
  // in per-token branches (half of this kernel's instructions at [256,
  // 151936] with top_k + top_p + min_p, Nsight Compute, H100).
  if (has_entries || bitmask != nullptr) {
    ClassifyChunkTokens<true>(raws, begin, end, has_entries, banned_bits,
                              special_bits, mask_word, &eligible, &mine);
  } else {
    ClassifyChunkTokens<false>(raws, begin, end, false, banned_bits,
                               special_bits, ~0u, &eligible, &mine);
  }
  const ChunkTotals totals = ChunkBlockTotals(mine, total_slots);
  const float top = totals.top;
  const float chunk_max = totals.raw_max;

  // More eligible tokens than slots: write the distance bins below the
  // chunk's max that hold at most kChunkCandidates together; the first bin
  // left out bounds the rest, its highest key the boundary. Bins never
  // rise as values fall, so a token is written exactly when its bin is
  // before the cut; the bins are recomputed rather than kept as a byte per
  // token, in one histogram for the block rather than one per warp (with
  // 256 threads of 8 tokens: 134.5M against 141M instructions, 165 against
  // 172 us at [256, 151936], Nsight Compute, H100).
  const bool truncated = totals.eligible > kChunkCandidates;
  uint32_t writes = eligible;
  if (truncated) {
#pragma unroll
    for (int j = 0; j < kChunkPerThread; ++j) {
      if (eligible & (1u << j)) {
        atomicAdd(&hist[DistanceBin(top, controls::FoldZero(raws[j]))], 1u);
      }
    }
    __syncthreads();
    int counts[kBinsPerThread];
    int bin_count = 0;
#pragma unroll
    for (int k = 0; k < kBinsPerThread; ++k) {
      counts[k] = hist[kBinsPerThread * tid + k];
      bin_count += counts[k];
    }
    int all = 0;
    int before =
        controls::BlockExclusiveScan<kChunkWarps>(bin_count, warp_slots, &all);
#pragma unroll
    for (int k = 0; k < kBinsPerThread; ++k) {
      if (before <= kChunkCandidates && before + counts[k] > kChunkCandidates)
        cut_bin = kBinsPerThread * tid + k;
      before += counts[k];
    }
    __syncthreads();
    const int cut = cut_bin;
    uint32_t highest_left_out = 0u;
    writes = 0u;
#pragma unroll
    for (int j = 0; j < kChunkPerThread; ++j) {
      if (eligible & (1u << j)) {
        const float v = controls::FoldZero(raws[j]);
        if (DistanceBin(top, v) < cut) {
          writes |= 1u << j;
        } else {
          highest_left_out = max(highest_left_out, controls::OrderKey(v));
        }
      }
    }
    highest_left_out = __reduce_max_sync(0xffffffffu, highest_left_out);
    if ((tid & 31) == 0) atomicMax(&boundary_key, highest_left_out);
  }
  // The scan's barriers also publish boundary_key.
  int written = 0;
  int at = controls::BlockExclusiveScan<kChunkWarps>(__popc(writes), warp_slots,
                                                     &written);
  int32_t* ids = w.ids + slot * kChunkCandidates;
  float* values = w.raws + slot * kChunkCandidates;
#pragma unroll
  for (int j = 0; j < kChunkPerThread; ++j) {
    if (writes & (1u << j)) {
      ids[at] = begin + tid + j * kChunkThreads;
      values[at] = controls::FoldZero(raws[j]);
      ++at;
    }
  }

  // Raw sum (raw logprobs), and the tail's processed mass (top_p).
  const bool greedy = c.temperature == 0.0f;
  const bool want_raw_sum =
      WantsLogprobs(c) && (c.logprob_flags & kLogprobRaw) != 0;
  // The merge bounds unseen mass only for top_p rows that top_k does not
  // bound; the double exp over every token of such a sum made this kernel
  // compute-bound (0.25 ms at [128, 151936] on an H100), so both sums take
  // each term as one ex2.approx.ftz (ChunkTerm): the raw sum in float per
  // thread and in double across the block, the tail in float (each term
  // within 7e-6 at |x - top| <= 87.4, below which it flushes to zero, the
  // sum within 2e-4 of exact: covered by the merge's headroom).
  const bool want_tail = truncated && !greedy && c.top_p < 1.0f &&
                         !(c.top_k > 0 && c.top_k < vocab);
  const uint32_t boundary = boundary_key;
  double raw_sum = 0.0;
  float tail_sum = 0.0f;
  if (want_raw_sum) {
    // Weighted by the terms, the chunk's sum is within (2 + 1.3 H) ulp
    // (ChunkTerm), H <= ln 2048 the entropy of the chunk's softmax (the
    // terms' mean |d|): 7e-7; the thread's 16 terms summed in float add at
    // most 15 ulp (9e-7): an lse within 2e-6, where the raw logprobs'
    // contract is 1e-5 of the CPU sampler's. With expf and each term added
    // in double, this kernel and the merge kernel took 326-336 us against
    // 300-308 at qwen B = 256 with every control and raw logprobs, 97
    // against 92 at B = 64 (H100, two alternating runs of
    // fs_controls_bench's sampler_only_everything_raw).
    float thread_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kChunkPerThread; ++j) {
      if (raws[j] != controls::kNegInf) {
        thread_sum = FS_FADD(thread_sum, ChunkTerm(raws[j], chunk_max));
      }
    }
    raw_sum = BlockReduceInSlots<kChunkWarps>(
        static_cast<double>(thread_sum),
        [](double a, double b) { return __dadd_rn(a, b); }, double_slots);
  }
  if (want_tail) {
    const float tail_top =
        controls::ScaledLogit(controls::KeyValue(boundary), inv_t);
    const uint32_t left_out = eligible & ~writes;
#pragma unroll
    for (int j = 0; j < kChunkPerThread; ++j) {
      if (left_out & (1u << j)) {
        tail_sum =
            FS_FADD(tail_sum,
                    ChunkTerm(controls::ScaledLogit(raws[j], inv_t), tail_top));
      }
    }
    tail_sum = BlockReduceInSlots<kChunkWarps>(
        tail_sum, [](float a, float b) { return FS_FADD(a, b); },
        reinterpret_cast<float*>(double_slots));
  }
  if (tid == 0) {
    ChunkSummary s;
    s.boundary = boundary;
    s.written = written;
    s.flags = (truncated ? kChunkTruncated : 0) |
              (totals.non_finite ? kChunkNonFinite : 0);
    s.raw_max = chunk_max;
    s.raw_sum = raw_sum;
    s.tail_sum = tail_sum;
    w.summaries[slot] = s;
  }
}

// Sum of 128-bit masses over the block, as hi and lo 32-bit halves.
__device__ U128 BlockMassSum(unsigned long long hi, unsigned long long lo,
                             SharedState& sh) {
  hi = BlockReduce(hi, SumU64{}, sh);
  lo = BlockReduce(lo, SumU64{}, sh);
  return (static_cast<U128>(hi) << 32) + static_cast<U128>(lo);
}

// Bounds on the top-p mass (FixedMass units) of the members the merge does
// not see, from `tail`, the left-out tokens' mass x 2^62 from float sums
// (within 2e-4 of exact: 1e-3 of headroom either way, and one unit per
// token for FixedMass's truncation), and `written`, the exact mass of the
// candidates at or below the bound that are members. The tails count
// toward the lower bound only without a min_p floor, where every unseen
// token they sum is a member.
struct UnseenMass {
  U128 lower;
  U128 upper;
};

__device__ U128 DoubleToU128(double v) {
  if (!(v > 0.0)) return 0;
  const double two64 = 18446744073709551616.0;
  const double hi = ::floor(v / two64);
  const double lo = v - hi * two64;
  return (static_cast<U128>(static_cast<unsigned long long>(hi)) << 64) +
         static_cast<U128>(static_cast<unsigned long long>(lo));
}

__device__ UnseenMass UnseenMassFromSums(double tail, U128 written, float floor,
                                         int32_t vocab) {
  UnseenMass bounds;
  bounds.upper =
      DoubleToU128(tail * (1.0 + 1e-3) + static_cast<double>(vocab)) + 1 +
      written;
  bounds.lower =
      (floor == controls::kNegInf
           ? DoubleToU128(tail * (1.0 - 1e-3) - static_cast<double>(vocab))
           : 0) +
      written;
  return bounds;
}

// The same bounds from the units' path's sums, tail and written both in
// fp64 relative to x_max (within 3e-5 of exact: GatherUnitCandidates), so
// that the headroom covers both; written counts toward the lower bound
// whatever the floor (its terms are members).
__device__ UnseenMass UnseenMassFromApprox(double tail, double written,
                                           float floor, int32_t vocab) {
  constexpr double kTwo62 = 4611686018427387904.0;
  UnseenMass bounds;
  bounds.upper = DoubleToU128((tail + written) * kTwo62 * (1.0 + 1e-3) +
                              static_cast<double>(vocab)) +
                 1;
  bounds.lower =
      DoubleToU128(((floor == controls::kNegInf ? tail : 0.0) + written) *
                       kTwo62 * (1.0 - 1e-3) -
                   static_cast<double>(vocab));
  return bounds;
}

// The unseen mass of a row on the chunks' candidates: the truncated chunks'
// tails, and the written candidates at or below the bound from the merge
// kernel's shared copies of the row's slots (cand_raw) and of each chunk's
// count of written slots. Every thread calls it.
__device__ UnseenMass UnseenMassBounds(
    const CandidateWorkspace& w, const ChunkSummary* summaries,
    const float* cand_raw, const int32_t* chunk_written, uint32_t bound_key,
    float floor, float x_max, float inv_t, int32_t vocab, SharedState& sh) {
  double tail = 0.0;
  for (int q = threadIdx.x; q < w.chunks; q += kThreads) {
    const ChunkSummary& s = summaries[q];
    if (!(s.flags & kChunkTruncated)) continue;
    const float top =
        controls::ScaledLogit(controls::KeyValue(s.boundary), inv_t);
    tail += s.tail_sum *
            ::exp(static_cast<double>(top) - static_cast<double>(x_max)) *
            4611686018427387904.0;
  }
  tail = BlockReduce(tail, SumDouble{}, sh);
  unsigned long long hi = 0, lo = 0;
  const int slots = w.chunks * kChunkCandidates;
  for (int s = threadIdx.x; s < slots; s += kThreads) {
    if ((s % kChunkCandidates) >= chunk_written[s / kChunkCandidates]) continue;
    const float v = cand_raw[s];
    if (controls::OrderKey(v) > bound_key) continue;
    const float x = controls::ScaledLogit(v, inv_t);
    if (!(x >= floor)) continue;
    const uint64_t mass = controls::FixedMass(x, x_max);
    hi += mass >> 32;
    lo += mass & 0xffffffffu;
  }
  return UnseenMassFromSums(tail, BlockMassSum(hi, lo, sh), floor, vocab);
}

// The merge kernel's shared memory, followed by the row's candidate slots
// (MergeCandidateBytes). The candidates live in shared memory and are
// visited by rolled loops so that the kernel's code stays small: this one
// block per row is a chain of dependent steps, and code that misses the
// instruction cache stalls all of it (docs/performance.md#sampling-controls).
struct MergeShared {
  SharedState sh;  // BlockReduce's scratch
  int32_t entry_id[kMergeEntryRoom];
  float entry_x[kMergeEntryRoom];
  float entry_raw[kMergeEntryRoom];
  uint32_t bin_count[kDistanceBins];
  // Top-p masses per bin as four 16-bit quarters, each summed in 32 bits
  // (below 2^32 for up to 65536 members; the room is 10240) with the
  // native 32-bit shared atomics: 64-bit ones are compare-and-swap loops,
  // which retried about four times a member and took a fifth of this
  // kernel's stall samples for top_p alone at [64, 151936]; with these
  // (and UnseenMassBounds reading shared memory) the kernel took 27-28
  // against 36-37 us there (Nsight Compute, H100). The bin's mass is the
  // sum of quarter k << 16 k.
  uint32_t bin_mass_quarter[4][kDistanceBins];
  // The sorted prefix: PackedKey(x, id), descending, and each one's mass.
  unsigned long long sorted[kMergeSortCapacity];
  unsigned long long mass[kMergeSortCapacity];
  int warp_slots[kWarps];
  // The units' path (GatherUnitCandidates): the row's maxima, the
  // candidates gathered, and for top-p rows the sums below the bound.
  uint32_t unit_row_bound;
  uint32_t unit_row_top;
  float entries_top;  // the largest processed logit of the row's entries
  int gathered;
  double unit_tail;
  double unit_written;
  float unit_sum_ref;  // what unit_tail and unit_written are relative to
  // Each computed sample's processed logit (the sampled logprob's), and on
  // the units' path its raw logit (raw logprobs).
  float sample_x[kMergeSampleRoom];
  float sample_raw[kMergeSampleRoom];
  int sorted_count;
  int select_bin;
  int cut_index;     // survivors: sorted[0 .. cut_index]
  int cut_index_hi;  // the same cut at the unseen mass's upper end
};

// Sorts keys[0, n) descending (n <= kMergeSortCapacity). Up to
// kRankSortKeys keys, thread i counts the keys ranked above keys[i] (equal
// ones at lower positions first) and moves it there: two barriers, against
// one per step of the bitonic network (28 at 64 keys, where the network
// took 7% of the merge kernel's 22 us at one row; Nsight Compute, H100).
// Beyond that, the network's steps cost less than every thread reading
// every key: the rest up to the next power of two is padded with 0, below
// every key.
constexpr int kRankSortKeys = 256;
static_assert(kRankSortKeys <= kThreads, "one key per thread");
__device__ void SortDescending(unsigned long long* keys, int n) {
  if (n <= kRankSortKeys) {
    const int i = threadIdx.x;
    unsigned long long key = 0;
    int rank = 0;
    if (i < n) {
      key = keys[i];
      for (int j = 0; j < n; ++j) {
        const unsigned long long other = keys[j];
        rank += other > key || (other == key && j < i);
      }
    }
    __syncthreads();
    if (i < n) keys[rank] = key;
    __syncthreads();
    return;
  }
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += kThreads) keys[i] = 0ull;
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += kThreads) {
        const int partner = i ^ j;
        if (partner <= i) continue;
        const bool descending = (i & k) == 0;
        const unsigned long long a = keys[i];
        const unsigned long long b = keys[partner];
        if (descending ? a < b : a > b) {
          keys[i] = b;
          keys[partner] = a;
        }
      }
      __syncthreads();
    }
  }
}

// A warp shuffle of a U128 as its two 64-bit halves: shuffle(half) is one
// __shfl_*_sync of an unsigned long long.
template <typename Shuffle>
__device__ U128 ShuffleU128(U128 v, Shuffle shuffle) {
  const unsigned long long hi =
      shuffle(static_cast<unsigned long long>(v >> 64));
  const unsigned long long lo = shuffle(static_cast<unsigned long long>(v));
  return (static_cast<U128>(hi) << 64) + static_cast<U128>(lo);
}

// The inclusive sum of v over lanes 0 .. this lane. Every lane of the warp
// calls it.
__device__ U128 WarpInclusiveSumU128(U128 v) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const U128 up = ShuffleU128(v, [offset](unsigned long long half) {
      return __shfl_up_sync(kAll, half, offset);
    });
    if (lane >= offset) v += up;
  }
  return v;
}

// Warp 0's scan of the distance bins, lane l summing bins 8l .. 8l + 7:
// the first bin at which the running weight(b) reaches `target`, or -1
// where the bins' total falls short; every lane gets it. Every lane of
// warp 0 calls it.
template <typename Weight>
__device__ int FirstBinReaching(Weight weight, U128 target) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kBinsPerLane = kDistanceBins / 32;
  const int lane = threadIdx.x & 31;
  U128 sum = 0;
  for (int b = 0; b < kBinsPerLane; ++b) sum += weight(kBinsPerLane * lane + b);
  const U128 inclusive = WarpInclusiveSumU128(sum);
  const unsigned owners = __ballot_sync(kAll, inclusive >= target);
  if (owners == 0u) return -1;
  const int owner = __ffs(owners) - 1;
  int reached = kBinsPerLane * lane + kBinsPerLane - 1;
  if (lane == owner) {
    U128 cum = inclusive - sum;
    for (int b = 0; b < kBinsPerLane; ++b) {
      cum += weight(kBinsPerLane * lane + b);
      if (cum >= target) {
        reached = kBinsPerLane * lane + b;
        break;
      }
    }
  }
  return __shfl_sync(kAll, reached, owner);
}

// What GatherUnitCandidates hands the merge kernel besides the candidates
// and, in m.unit_tail and m.unit_written for top-p rows that top_k does not
// bound, the mass relative to x_max of the tokens the units left out and of
// the written candidates left out that are members.
struct UnitGather {
  int count;       // candidates gathered, all keyed above `bound`
  uint32_t bound;  // the row's highest unit bound: 0 when none left any out
  float x_max;     // the row's largest processed logit
};

// Visits this thread's share of row r's unit records, q = threadIdx.x +
// kThreads j in order: on_unit(bound, tail) for each record and
// on_candidate(unit, slot, raw) for its candidates, in order, until one
// returns false. The records of kInFlight consecutive j are loaded whole
// before any is read: loaded one at a time, a record's candidates waited on
// its slots (two dependent L2 round trips per record, ten records a thread at
// qwen's V), and the gather took a third of the merge kernel's 22 us at one
// row (Nsight Compute stall sampling, H100).
template <int kInFlight, typename OnUnit, typename OnCandidate>
__device__ void VisitUnits(const ControlledUnits& u, int r, int64_t units,
                           OnUnit on_unit, OnCandidate on_candidate) {
  const uint4* row = reinterpret_cast<const uint4*>(u.records + r * units);
  for (int64_t first = threadIdx.x; first < units;
       first += kInFlight * kThreads) {
    uint4 raws[kInFlight];
    uint4 rest[kInFlight];  // slots, bound, tail
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t q = first + i * kThreads;
      if (q < units) {
        raws[i] = row[2 * q];
        rest[i] = row[2 * q + 1];
      }
    }
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      const int64_t q = first + i * kThreads;
      if (q >= units) break;
      const uint32_t raw_bits[kUnitCandidates] = {raws[i].x, raws[i].y,
                                                  raws[i].z, raws[i].w};
#pragma unroll
      for (int k = 0; k < kUnitCandidates; ++k) {
        const uint32_t slot = (rest[i].x >> (8 * k)) & 0xffu;
        if (slot == kUnitNoSlot ||
            !on_candidate(q, static_cast<int>(slot),
                          controls::FoldZero(__uint_as_float(raw_bits[k])))) {
          break;
        }
      }
      on_unit(rest[i].y, __uint_as_float(rest[i].z));
    }
  }
}

// Drops row r's records from L2 once the block has read them (a barrier
// first: every thread's reads are done), so that they are never written
// back to DRAM and their persisting lines (FusedSampleSetAsideL2ForUnits)
// are free for the next launch's records and other accesses. Only the
// 128-byte lines wholly inside the row: a line shared with the next row
// still holds records another block has not read. Nothing reads a row's
// records after the merge kernel (the fused kernel writes all of them on
// every launch).
__device__ void DiscardRowRecords(const ControlledUnits& u, int r,
                                  int64_t units) {
  __syncthreads();
  constexpr uintptr_t kLine = 128;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(u.records + r * units);
  const uintptr_t end = begin + sizeof(UnitRecord) * units;
  const uintptr_t first = (begin + kLine - 1) / kLine * kLine;
  for (uintptr_t line = first + threadIdx.x * kLine; line + kLine <= end;
       line += kThreads * kLine) {
    asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");
  }
}

// The merge kernel's candidates from the fused kernel's unit candidates
// (kernels/sampler/unit_candidates.h) rather than from the chunk kernel:
// the row's highest unit bound and highest key, atomic maxima of the fused
// kernel (in m.unit_row_bound / unit_row_top), say before any unit is read
// that the candidates keyed above that bound are the region (every token a
// unit left out is at or below it) and what the row's maximum is, so one
// pass over the row's records gathers them into cand_raw / cand_id and, for
// top_p rows, sums the mass below the bound. More of them than `room`
// (small vocabularies, flat rows): a histogram of their distance bins picks
// the highest bins that fit, and the bound rises to the highest key left
// out, as the chunk kernel's cut does. The units rank every token but the
// row's per-token entries (UnitCandidates::token_classes), whose exact
// values are the merge kernel's; masked tokens (the row's bitmask) are
// ranked too unless the classes hold the bitmask, and gathered here like
// the others (left out below), so that the bound bounds every allowed
// token left out.
// For raw-logprob rows (want_raw_mass) it sums instead the mass at T = 1
// of the tokens the units left out and of the written candidates not
// gathered, relative to the units' highest raw logit (m.unit_sum_ref).
// False (in every thread) where the row cannot be certified here: per-token
// entries the units did not leave out (no token classes), a bitmask on a
// row whose tail is wanted or whose raw mass is, unless the classes hold
// the bitmask (else the units' tails hold masked tokens), a non-finite
// logit, a maximum not above every bound, a tail summed at another
// temperature (1 for raw mass), or a closest bin alone over `room`.
// use_min_p and want_tail (top_p that top_k does not bound) are the merge
// kernel's filters of the row; x_max is the row's
// largest processed logit (the units' highest key or an entry's), on a
// row with a bitmask an upper bound on it (the units' highest may be
// masked), and g->x_max the largest itself. Every thread calls it.
__device__ bool GatherUnitCandidates(const ControlledSampleParams& p,
                                     const ControlledUnits& u,
                                     const ControlledRow& c, int r, float inv_t,
                                     float x_max, bool use_min_p,
                                     bool want_tail, bool want_raw_mass,
                                     float* cand_raw, int32_t* cand_id,
                                     int room, MergeShared& m, UnitGather* g) {
  const uint32_t unit_bound = m.unit_row_bound;
  const uint32_t top = m.unit_row_top;
  // One sum at most: a top_p tail (at 1 / T, below x_max, over members) or
  // the raw logprobs' mass (at T = 1, below the units' highest raw logit,
  // over every allowed token): a unit holds one tail.
  const bool want_sums = want_tail || want_raw_mass;
  const float sum_inv_t = want_raw_mass ? 1.0f : inv_t;
  if ((c.special_begin != c.special_end && !u.token_classes) ||
      (want_tail && want_raw_mass) ||
      (c.bitmask_offset >= 0 && want_sums && !u.bitmask_in_classes) ||
      unit_bound == kUnitNonFinite || !(top > unit_bound) ||
      (want_sums && (u.tail_inv_temperature == nullptr ||
                     u.tail_inv_temperature[r] != sum_inv_t))) {
    return false;
  }
  const float floor = use_min_p && !want_raw_mass
                          ? controls::MinPFloor(x_max, c.log_min_p)
                          : controls::kNegInf;
  const float sum_ref = want_raw_mass ? controls::KeyValue(top) : x_max;
  const int64_t units = UnitsPerRow(p.vocab);
  // The unseen tokens' mass relative to sum_ref, fp32 terms summed per
  // thread in fp64. Each term is within 3e-5 of exact (a unit's fp32 tail
  // within 2e-5: StoreStagedQuadUnits; expf within 2 ulp, the rounding of
  // x - sum_ref within |x - sum_ref| 2^-24 < 6e-6 where expf does not
  // underflow; a term that underflows is below 2^-126, far under one
  // FixedMass unit, 2^-62): inside UnseenMassFromApprox's 1e-3 of headroom,
  // and a raw lse within 3e-5 times the unseen tokens' share of the row's
  // mass. `tail`: the tokens the units left out (members where there is no
  // min_p floor); `written`: the written candidates left out that are
  // members. Against a double exp per term (FixedMass's), qwen top_p 0.9 at
  // 16 and 128 rows: 457 and 492 against 464 and 500 us (H100, two calls).
  double tail = 0.0;
  double written = 0.0;
  unsigned long long bad = 0;
  auto add_written = [&](float raw) {
    const float x = controls::ScaledLogit(raw, sum_inv_t);
    if (x >= floor) written += expf(FS_FSUB(x, sum_ref));
  };
  // One shared atomic per candidate, from the lanes' own early exits, and
  // the bitmask in a pass over the gathered candidates after the visit.
  // With every control at qwen B = 1 / 16 / 64 this merge kernel took 30 /
  // 26 / 29 us; a warp-uniform visit appending by warp (a ballot, one
  // atomic, a shuffle) took 38 / 34 / 37, and a visit that read each
  // record's two bitmask words (copied into shared memory by cp.async
  // beside the entries) 34 / 29 / 33, its rows without a bitmask 3-6 us
  // slower too (H100, fs_controls_bench, alternating runs in two calls). A
  // quarter of the kernel's stall cycles wait on instruction fetch (Nsight
  // Compute, B = 1), and its time follows its code's size and registers
  // (docs/performance.md#design-decisions-the-measurements-settled).
  auto gather = [&](int64_t q, int slot, float raw) {
    const int at = atomicAdd(&m.gathered, 1);
    if (at < room) {
      cand_raw[at] = raw;
      cand_id[at] = static_cast<int32_t>(UnitSlotRow(q, slot));
    }
  };
  VisitUnits<4>(
      u, r, units,
      [&](uint32_t bound, float unit_tail) {
        if (!want_sums || bound == 0u) return;
        if (!(unit_tail >= 0.0f)) bad = 1;  // not summed at this row's 1 / T
        const float unit_top =
            controls::ScaledLogit(controls::KeyValue(bound), sum_inv_t);
        tail += FS_FMUL(unit_tail, expf(FS_FSUB(unit_top, sum_ref)));
      },
      [&](int64_t q, int slot, float raw) {
        if (controls::OrderKey(raw) > unit_bound) {
          gather(q, slot, raw);
          return true;
        }
        if (want_sums) add_written(raw);
        // Every unit bound has its low 5 bits set, so a key is above the
        // highest one iff its top 27 bits are, and a record's candidates
        // come in descending order of those: once one is not above, none
        // after it is.
        return want_sums;
      });
  __syncthreads();
  int count = m.gathered;
  uint32_t bound = unit_bound;
  if (count > room) {
    for (int b = threadIdx.x; b < kDistanceBins; b += kThreads)
      m.bin_count[b] = 0u;
    __syncthreads();
    auto no_unit = [](uint32_t, float) {};
    VisitUnits<1>(u, r, units, no_unit, [&](int64_t, int, float raw) {
      if (controls::OrderKey(raw) <= unit_bound) return false;
      atomicAdd(
          &m.bin_count[DistanceBin(x_max, controls::ScaledLogit(raw, inv_t))],
          1u);
      return true;
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      // The first bin whose running count passes `room` (there is one:
      // count > room); the bins before it are kept.
      const int keep = FirstBinReaching(
          [&](int b) { return static_cast<U128>(m.bin_count[b]); },
          static_cast<U128>(room) + 1);
      if (threadIdx.x == 0) {
        m.select_bin = keep;
        m.gathered = 0;
      }
    }
    __syncthreads();
    const int keep = m.select_bin;  // bins [0, keep) are gathered
    if (keep == 0) return false;
    unsigned long long left_out = 0;  // the highest key left out
    VisitUnits<1>(u, r, units, no_unit, [&](int64_t q, int slot, float raw) {
      const uint32_t key = controls::OrderKey(raw);
      if (key <= unit_bound) return false;
      if (DistanceBin(x_max, controls::ScaledLogit(raw, inv_t)) < keep) {
        gather(q, slot, raw);
      } else {
        left_out = key > left_out ? key : left_out;
        if (want_sums) add_written(raw);
      }
      return true;
    });
    left_out = BlockReduce(left_out, MaxU64{}, m.sh);
    bound = static_cast<uint32_t>(left_out);
    count = m.gathered;  // <= room; BlockReduce's barriers order it
  }
  if (want_sums) {
    bad = BlockReduce(bad, MaxU64{}, m.sh);
    tail = BlockReduce(tail, SumDouble{}, m.sh);
    written = BlockReduce(written, SumDouble{}, m.sh);
    if (threadIdx.x == 0) {
      m.unit_tail = tail;
      m.unit_written = written;
      m.unit_sum_ref = sum_ref;
    }
  }
  if (bad) return false;
  if (c.bitmask_offset >= 0) {
    // The units rank masked tokens too unless the classes hold the bitmask:
    // they leave the candidates here (id -1, as an unused slot), and the
    // row's maximum is an allowed candidate's or an entry's, not the units'
    // highest key. The gather's barriers published the candidates; the
    // reduction's publishes ids.
    const uint32_t* row_mask = p.bitmask + c.bitmask_offset;
    float local = m.entries_top;
    for (int s = threadIdx.x; s < count; s += kThreads) {
      if (controls::Disallowed(row_mask, cand_id[s])) {
        cand_id[s] = -1;
      } else {
        local = fmaxf(local, controls::ScaledLogit(cand_raw[s], inv_t));
      }
    }
    x_max = BlockReduce(local, MaxFloat{}, m.sh);
  }
  g->count = count;
  g->bound = bound;
  g->x_max = x_max;
  return true;
}

// One block per row over the candidates of the chunk kernel (kFromUnits
// false) or of the fused kernel's units (true). Two blocks share an SM
// (at most 64 registers: 56 over the chunks, 64 and a 12-byte spill over
// the units; ptxas -v, sm_90a): batches run up to 256 rows.
template <bool kFromUnits>
__global__ void __launch_bounds__(kThreads, 2)
    CandidateMergeKernel(const ControlledSampleParams p, CandidateWorkspace w,
                         ControlledUnits u) {
  WaitForPreviousKernel();
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  MergeShared& m = *reinterpret_cast<MergeShared*>(dynamic_shared);
  SharedState& sh = m.sh;
  const int r = blockIdx.x;
  const int tid = threadIdx.x;
  if constexpr (kFromUnits) {
    // Every row's maxima go back to zero for the fused kernel's next launch,
    // whatever this row's fate.
    if (tid == 0) {
      m.unit_row_bound = u.row_bound[r];
      m.unit_row_top = u.row_top[r];
      u.row_bound[r] = 0u;
      u.row_top[r] = 0u;
      m.gathered = 0;
    }
    __syncthreads();
  }
  const ControlledRow c = p.row_controls[r];
  const int32_t vocab = static_cast<int32_t>(p.vocab);
  const float* __restrict__ z = p.logits + r * p.logits_row_stride;
  if (tid == 0) {
    w.done[r] = 0;
    if (p.certified != nullptr) p.certified[r] = 0;
  }

  const bool greedy = c.temperature == 0.0f;
  const bool want_sampled = (c.logprob_flags & kLogprobSampled) != 0;
  const bool want_rank = (c.logprob_flags & kLogprobRank) != 0;
  const bool want_lse = (c.logprob_flags & kLogprobLogsumexp) != 0;
  const bool raw_mode = (c.logprob_flags & kLogprobRaw) != 0;
  const int32_t top_n = c.top_n < vocab ? c.top_n : vocab;
  const int64_t entries = c.special_end - c.special_begin;
  if (c.n < 1 || c.n > p.max_samples || top_n < 0 || top_n > p.max_top_n ||
      (want_sampled && p.sampled_logprobs == nullptr) ||
      (want_rank && p.sampled_ranks == nullptr) ||
      (want_lse && p.logsumexp == nullptr) ||
      (top_n > 0 && (p.top_token_ids == nullptr || p.top_logprobs == nullptr ||
                     p.top_count == nullptr)) ||
      entries > kMergeEntryRoom || c.n > kMergeSampleRoom ||
      w.chunks * kChunkCandidates > kMergeCandidateRoom) {
    return;  // the full passes report or take it
  }
  const ChunkSummary* summaries =
      w.summaries + static_cast<int64_t>(r) * w.chunks;
  const float inv_t = RowInverseTemperature(c);
  const bool use_min_p = !greedy && c.min_p > 0.0f;
  const bool use_top_k = !greedy && c.top_k > 0 && c.top_k < vocab;
  const bool use_top_p = !greedy && c.top_p < 1.0f;

  // The candidates, slot s of `slots`: raw logit and id, id -1 where the
  // slot holds none (the processed logit is recomputed from the raw one).
  // On the chunks' path slot s = chunk * kChunkCandidates + k, and
  // chunk_written[chunk] counts the chunk's written slots; the units' path
  // packs them.
  const int room = w.chunks * kChunkCandidates;
  float* const cand_raw =
      reinterpret_cast<float*>(dynamic_shared + sizeof(MergeShared));
  int32_t* const cand_id = reinterpret_cast<int32_t*>(cand_raw + room);
  int32_t* const chunk_written = cand_id + room;
  // The row's per-token entries at their exact processed values, read from
  // the logits (on the units' path, the fused kernel wrote the entries'
  // alone: UnitCandidates::entry_logits). entries_max: their largest x, +inf
  // where one is NaN or +inf (the full passes report those).
  const uint32_t* bitmask =
      c.bitmask_offset >= 0 ? p.bitmask + c.bitmask_offset : nullptr;
  float entries_max = controls::kNegInf;
  for (int64_t k = tid; k < entries; k += kThreads) {
    const int64_t e = c.special_begin + k;
    const int32_t id = p.special_ids[e];
    const float zi = z[id];
    const bool disallowed = controls::Disallowed(bitmask, id);
    const float x = controls::ScaledLogit(
        controls::SpecialLogit(zi, disallowed, p.special_flags[e],
                               p.special_bias[e], p.special_count[e],
                               c.repetition_penalty, c.frequency_penalty,
                               c.presence_penalty),
        inv_t);
    m.entry_id[k] = id;
    m.entry_x[k] = x;
    m.entry_raw[k] =
        (disallowed || (p.special_flags[e] & controls::kSpecialBanned))
            ? controls::kNegInf
            : zi;
    entries_max =
        controls::IsNan(x) ? controls::kPosInf : fmaxf(entries_max, x);
  }
  int slots = room;
  bool outside = false;  // tokens the merge cannot see
  uint32_t bound_key = 0u;
  UnitGather gathered{};
  float x_max = controls::kNegInf;  // the row's largest processed logit
  if constexpr (kFromUnits) {
    // The units' highest key, or an entry's x. The reduction's barrier also
    // publishes the entries.
    const float entries_top = BlockReduce(entries_max, MaxFloat{}, sh);
    if (tid == 0) m.entries_top = entries_top;  // for a bitmask row's gather
    x_max =
        fmaxf(controls::ScaledLogit(controls::KeyValue(m.unit_row_top), inv_t),
              entries_top);
    // UnitTailWanted is use_top_p && !use_top_k: the rows whose tails the
    // engine asks the fused kernel for.
    const bool from_units = GatherUnitCandidates(
        p, u, c, r, inv_t, x_max, use_min_p,
        controls::UnitTailWanted(c.temperature, c.top_k, c.top_p, vocab),
        raw_mode && WantsLogprobs(c), cand_raw, cand_id, room, m, &gathered);
    DiscardRowRecords(u, r, UnitsPerRow(p.vocab));
    if (!from_units) return;
    slots = gathered.count;
    outside = gathered.bound != 0u;
    bound_key = gathered.bound;
    x_max = gathered.x_max;
  } else {
    // The region's bound: the highest boundary of a truncated chunk.
    unsigned long long bound_plus_one = 0;  // 0: no chunk truncated
    unsigned long long flags = 0;
    for (int q = tid; q < w.chunks; q += kThreads) {
      const ChunkSummary& s = summaries[q];
      flags |= static_cast<unsigned long long>(s.flags);
      if (s.flags & kChunkTruncated) {
        const unsigned long long b =
            static_cast<unsigned long long>(s.boundary) + 1;
        bound_plus_one = b > bound_plus_one ? b : bound_plus_one;
      }
    }
    bound_plus_one = BlockReduce(bound_plus_one, MaxU64{}, sh);
    flags = BlockReduce(
        flags, [](unsigned long long a, unsigned long long b) { return a | b; },
        sh);
    if (flags & kChunkNonFinite) return;
    outside = bound_plus_one != 0;
    bound_key = static_cast<uint32_t>(bound_plus_one - 1);
    // Each slot's raw logit and id are loaded together, unconditionally
    // (every slot of the row's workspace exists), so that a thread's loads
    // are all in flight at once; the chunks' counts say which slots were
    // written.
    const int64_t row_slots =
        static_cast<int64_t>(r) * w.chunks * kChunkCandidates;
    for (int q = tid; q < w.chunks; q += kThreads)
      chunk_written[q] = summaries[q].written;
    __syncthreads();
#pragma unroll 4
    for (int s = tid; s < slots; s += kThreads) {
      const float v = w.raws[row_slots + s];
      const int32_t id = w.ids[row_slots + s];
      const bool kept =
          (s % kChunkCandidates) < chunk_written[s / kChunkCandidates] &&
          !(outside && controls::OrderKey(v) <= bound_key);
      cand_raw[s] = v;
      cand_id[s] = kept ? id : -1;
    }
  }
  // Every unseen token has raw <= raw_bound and x <= x_bound.
  const float raw_bound =
      outside ? controls::KeyValue(bound_key) : controls::kNegInf;
  const float x_bound = controls::ScaledLogit(raw_bound, inv_t);
  for (int b = tid; b < kDistanceBins; b += kThreads) {
    m.bin_count[b] = 0u;
    for (int k = 0; k < 4; ++k) m.bin_mass_quarter[k][b] = 0u;
  }
  __syncthreads();
  const int num_entries = static_cast<int>(entries);
  // Visits every candidate and entry: f(x, raw, id). A thread visits its
  // slots in the same order in every pass, so its partial sums are summed in
  // a fixed order.
  auto for_each = [&](auto f) {
#pragma unroll 1
    for (int s = tid; s < slots; s += kThreads) {
      const int32_t id = cand_id[s];
      if (id < 0) continue;
      const float raw = cand_raw[s];
      f(controls::ScaledLogit(raw, inv_t), raw, id);
    }
#pragma unroll 1
    for (int k = tid; k < num_entries; k += kThreads)
      f(m.entry_x[k], m.entry_raw[k], m.entry_id[k]);
  };

  // x_max, and no NaN or +inf (the full passes report those). The units
  // know theirs: the scaled highest key or an entry's, every candidate
  // finite (x = l / T, T > 0, is NaN nowhere and +inf at most at the
  // maximum).
  unsigned long long bad = x_max == controls::kPosInf;
  if constexpr (!kFromUnits) {
    float local_max = controls::kNegInf;
    for_each([&](float x, float, int32_t) {
      if (controls::IsNan(x) || x == controls::kPosInf) {
        bad = 1;
      } else if (x > local_max) {
        local_max = x;
      }
    });
    x_max = BlockReduce(local_max, MaxFloat{}, sh);
    bad = BlockReduce(bad, MaxU64{}, sh);
  }
  // The row's max must be seen: strictly above every unseen token.
  if (bad || x_max == controls::kNegInf || !(x_max > x_bound)) return;

  const float floor =
      use_min_p ? controls::MinPFloor(x_max, c.log_min_p) : controls::kNegInf;
  auto is_member = [floor](float x) {
    return x != controls::kNegInf && x >= floor;
  };
  // closed: every member of the current set is seen.
  bool closed = !outside || floor > x_bound;
  // Survivors: sorted[0 .. m.cut_index] when `prefix`, else every member.
  bool prefix = false;
  if (use_top_k || use_top_p) {
    // Members by distance bin below x_max: counts, and masses for top_p.
    unsigned long long mass_hi = 0, mass_lo = 0;
    for_each([&](float x, float, int32_t) {
      if (!is_member(x)) return;
      const int b = DistanceBin(x_max, x);
      atomicAdd(&m.bin_count[b], 1u);
      if (use_top_p && !use_top_k) {  // top_k rows sum within_k later
        const uint64_t mass = controls::FixedMass(x, x_max);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          atomicAdd(&m.bin_mass_quarter[k][b],
                    static_cast<uint32_t>(mass >> (16 * k)) & 0xffffu);
        }
        mass_hi += mass >> 32;
        mass_lo += mass & 0xffffffffu;
      }
    });
    __syncthreads();  // every bin complete before warp 0 scans them
    const U128 member_mass =
        use_top_p && !use_top_k ? BlockMassSum(mass_hi, mass_lo, sh) : 0;
    // The bins to sort: through the k-th member for top_k, else through the
    // bin where the mass reaches the largest top-p target the unseen tokens
    // allow.
    U128 unseen = 0;
    U128 unseen_lower = 0;
    if (use_top_p && !use_top_k && !closed) {
      UnseenMass bounds;
      if constexpr (kFromUnits) {
        bounds =
            UnseenMassFromApprox(m.unit_tail, m.unit_written, floor, vocab);
      } else {
        bounds = UnseenMassBounds(w, summaries, cand_raw, chunk_written,
                                  bound_key, floor, x_max, inv_t, vocab, sh);
      }
      unseen = bounds.upper;
      unseen_lower = bounds.lower;
    }
    if (tid < 32) {
      // The first bin at which the count reaches k (top_k), or the mass the
      // largest top-p target (top_p alone).
      auto weight = [&](int b) -> U128 {
        if (use_top_k) return static_cast<U128>(m.bin_count[b]);
        U128 mass = 0;
        for (int k = 0; k < 4; ++k)
          mass += static_cast<U128>(m.bin_mass_quarter[k][b]) << (16 * k);
        return mass;
      };
      const U128 target =
          use_top_k ? static_cast<U128>(c.top_k)
                    : controls::CeilScaled(c.top_p, member_mass + unseen);
      const int reached = FirstBinReaching(weight, target);
      if (tid == 0) {
        // Short of the target: top_k with fewer than k members takes every
        // member, if all are seen.
        m.select_bin = reached >= 0          ? reached
                       : use_top_k && closed ? kDistanceBins - 1
                                             : -1;
        m.sorted_count = 0;
      }
    }
    __syncthreads();
    const int chosen = m.select_bin;
    if (chosen < 0) return;  // unseen members could rank inside the cut
    int total = 0;
    {
      int count = 0;
      for (int b = tid; b <= chosen; b += kThreads) count += m.bin_count[b];
      int sum_all = 0;
      controls::BlockExclusiveScan<kWarps>(count, m.warp_slots, &sum_all);
      total = sum_all;
    }
    if (total > kMergeSortCapacity) return;
    for_each([&](float x, float, int32_t id) {
      if (!is_member(x) || DistanceBin(x_max, x) > chosen) return;
      m.sorted[atomicAdd(&m.sorted_count, 1)] = controls::PackedKey(x, id);
    });
    __syncthreads();
    SortDescending(m.sorted, total);
    for (int i = tid; i < total; i += kThreads) {
      m.mass[i] = use_top_p ? controls::FixedMass(
                                  controls::PackedKeyValue(m.sorted[i]), x_max)
                            : 0ull;
    }
    __syncthreads();
    if (tid < 32) {
      // Warp 0, every lane with the same view: top_k's end, then top_p's
      // cut by chunks of 32 masses (a scan and a ballot each). Walked by
      // thread 0 alone, one mass at a time, a nucleus of up to 2048 sorted
      // tokens took tens of us: top_p 0.99 on flat rows at qwen B = 16 took
      // 549-551 against 483-488 us this way (the rows then fail to certify;
      // peaked rows the same either way; H100, alternating runs in one
      // call). U128 sums are exact, so the order of the adds is free.
      constexpr unsigned kAll = 0xffffffffu;
      const int lane = tid;
      // top_k: every member ranked at or above the k-th value (ties kept).
      int end = total;  // within_k = sorted[0, end)
      bool ok = true;
      if (use_top_k && total >= c.top_k) {
        const uint32_t kth = static_cast<uint32_t>(m.sorted[c.top_k - 1] >> 32);
        // Unseen tokens (x <= x_bound) must fall below the k-th value.
        if (outside && !(controls::KeyValue(kth) > x_bound)) ok = false;
        end = c.top_k;
        while (end < total && static_cast<uint32_t>(m.sorted[end] >> 32) == kth)
          ++end;
      } else if (use_top_k && !closed) {
        ok = false;
      }
      int cut = end - 1;
      int cut_hi = cut;
      if (ok && use_top_p) {
        // The shortest prefix whose mass reaches ceil(p * total): the full
        // passes' cut (ties in id order). Total: within_k's mass when top_k
        // bounds it, else every member's plus between `unseen_lower` and
        // `unseen`.
        U128 known = 0;
        if (use_top_k) {
          for (int i = lane; i < end; i += 32) known += m.mass[i];
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) {
            known += ShuffleU128(known, [offset](unsigned long long half) {
              return __shfl_xor_sync(kAll, half, offset);
            });
          }
        } else {
          known = member_mass;
        }
        const U128 target_lo =
            controls::CeilScaled(c.top_p, known + unseen_lower);
        const U128 target_hi = controls::CeilScaled(c.top_p, known + unseen);
        U128 carry = 0;  // the mass of sorted[0, base)
        cut = -1;
        cut_hi = -1;
        for (int base = 0; base < end && cut_hi < 0; base += 32) {
          const int i = base + lane;
          const U128 cum =
              WarpInclusiveSumU128(i < end ? static_cast<U128>(m.mass[i]) : 0) +
              carry;
          const unsigned reach_lo =
              __ballot_sync(kAll, i < end && cum >= target_lo);
          const unsigned reach_hi =
              __ballot_sync(kAll, i < end && cum >= target_hi);
          if (cut < 0 && reach_lo != 0u) cut = base + __ffs(reach_lo) - 1;
          if (reach_hi != 0u) cut_hi = base + __ffs(reach_hi) - 1;
          carry = ShuffleU128(cum, [](unsigned long long half) {
            return __shfl_sync(kAll, half, 31);
          });
        }
        if (cut < 0) ok = false;
      }
      if (lane == 0) {
        m.cut_index = ok ? cut : -1;
        m.cut_index_hi = cut_hi;
      }
    }
    __syncthreads();
    if (m.cut_index < 0) return;
    if (use_top_p && !closed && !use_top_k) {
      // One cut for every total the unseen mass allows, strictly above them.
      if (m.cut_index_hi != m.cut_index ||
          !(controls::PackedKeyValue(m.sorted[m.cut_index]) > x_bound)) {
        return;
      }
    }
    closed = true;
    prefix = true;
  }
  const bool processed_logprobs = !raw_mode && WantsLogprobs(c);
  if (processed_logprobs && !closed) return;  // the survivors are not all seen
  const int survivors = prefix ? m.cut_index + 1 : 0;

  // Samples. An open set (no filter bounds it) is certified when the winner's
  // score beats every unseen token's best possible score.
  int32_t* tokens = p.token_ids + static_cast<int64_t>(r) * p.max_samples;
  const float unseen_best =
      closed ? controls::kPosInf
             : FS_FADD(x_bound, controls::MaxGumbelNoiseBound());
  const int computed = greedy ? 1 : c.n;
  for (int j = 0; j < computed; ++j) {
    unsigned long long best = 0;
    float best_x = 0.0f;  // best's processed logit
    auto consider = [&](float x, int32_t id) {
      unsigned long long key;
      if (greedy) {
        key = controls::PackedKey(x, id);
      } else {
        const float g = GumbelNoise(c.seed, c.step, static_cast<uint32_t>(j),
                                    static_cast<uint32_t>(id));
        key = controls::PackedKey(controls::FoldZero(FS_FADD(x, g)), id);
      }
      if (key > best) {
        best = key;
        best_x = x;
      }
    };
    if (prefix) {
      for (int i = tid; i < survivors; i += kThreads) {
        consider(controls::PackedKeyValue(m.sorted[i]),
                 controls::PackedKeyId(m.sorted[i]));
      }
    } else {
      for_each([&](float x, float, int32_t id) {
        if (greedy ? x != controls::kNegInf : is_member(x)) consider(x, id);
      });
    }
    const unsigned long long winner = BlockReduce(best, MaxU64{}, sh);
    if (winner == 0) return;
    // Keys are distinct (they carry the id): one thread holds the winner.
    if (best == winner) m.sample_x[j] = best_x;
    if (!greedy && !closed &&
        !(controls::PackedKeyValue(winner) > unseen_best)) {
      return;
    }
    if (tid == 0) StoreWinner(winner, greedy, c.n, j, tokens);
  }

  // Logprobs, as the full passes: raw over the masked raw logits, else over
  // the survivors (a greedy row's are every allowed token).
  int listed = 0;
  if (WantsLogprobs(c)) {
    double lse = 0.0;
    if (raw_mode && kFromUnits) {
      // The gathered candidates and the entries the masks allow, in fp64,
      // with the units' left-out mass (GatherUnitCandidates), relative to
      // the units' highest raw logit. Each sample's raw logit from the
      // candidate or entry that holds its id.
      const double ref = static_cast<double>(m.unit_sum_ref);
      double sum = 0.0;
      for_each([&](float, float raw, int32_t) {
        if (raw != controls::kNegInf)
          sum = __dadd_rn(sum, ::exp(static_cast<double>(raw) - ref));
      });
      sum = BlockReduce(sum, SumDouble{}, sh);  // also publishes the tokens
      if (want_sampled || want_rank) {
        for_each([&](float, float raw, int32_t id) {
          for (int k = 0; k < (greedy ? 1 : c.n); ++k) {
            if (id == tokens[k]) m.sample_raw[k] = raw;
          }
        });
        __syncthreads();
      }
      lse = ref + ::log(sum + m.unit_tail + m.unit_written);
    } else if (raw_mode) {
      // Per-chunk partial sums, combined in chunk order by warp 0; its
      // result goes through sh.scratch, which the last BlockReduce's
      // readers must be done with.
      __syncthreads();
      if (tid < 32) {
        float top = controls::kNegInf;
        for (int q = tid; q < w.chunks; q += 32)
          top = fmaxf(top, summaries[q].raw_max);
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
          top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        double sum = 0.0;
        for (int q = tid; q < w.chunks; q += 32) {
          const ChunkSummary& s = summaries[q];
          if (s.raw_max == controls::kNegInf) continue;
          sum =
              __dadd_rn(sum, s.raw_sum * ::exp(static_cast<double>(s.raw_max) -
                                               static_cast<double>(top)));
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1)
          sum = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
        if (tid == 0) {
          sh.scratch[0] = static_cast<unsigned long long>(
              __double_as_longlong(static_cast<double>(top) + ::log(sum)));
        }
      }
      __syncthreads();
      lse = __longlong_as_double(static_cast<long long>(sh.scratch[0]));
      __syncthreads();
    } else {
      double sum = 0.0;
      auto add = [&](float x) {
        sum = __dadd_rn(
            sum, ::exp(static_cast<double>(x) - static_cast<double>(x_max)));
      };
      if (prefix) {
        for (int i = tid; i < survivors; i += kThreads)
          add(controls::PackedKeyValue(m.sorted[i]));
      } else {
        for_each([&](float x, float, int32_t) {
          if (greedy ? x != controls::kNegInf : is_member(x)) add(x);
        });
      }
      sum = BlockReduce(sum, SumDouble{}, sh);
      lse = static_cast<double>(x_max) + ::log(sum);
    }
    // Top-N: the sorted survivors' first N, or N rounds of "the best key
    // below the previous one", checked against the unseen tokens.
    const int64_t out = static_cast<int64_t>(r) * p.max_top_n;
    if (!raw_mode && prefix) {
      listed = top_n < survivors ? top_n : survivors;
      for (int t = tid; t < listed; t += kThreads) {
        p.top_token_ids[out + t] = controls::PackedKeyId(m.sorted[t]);
        p.top_logprobs[out + t] = static_cast<float>(
            static_cast<double>(controls::PackedKeyValue(m.sorted[t])) - lse);
      }
    } else {
      unsigned long long previous = ~0ull;
      for (int32_t t = 0; t < top_n; ++t) {
        unsigned long long best = 0;
        for_each([&](float x, float raw, int32_t id) {
          float v;
          if (raw_mode) {
            v = raw;
            if (v == controls::kNegInf) return;
          } else {
            v = x;
            if (greedy ? v == controls::kNegInf : !is_member(v)) return;
          }
          const unsigned long long key = controls::PackedKey(v, id);
          if (key < previous && key > best) best = key;
        });
        const unsigned long long found = BlockReduce(best, MaxU64{}, sh);
        const float bound = raw_mode ? raw_bound : x_bound;
        if (outside &&
            (found == 0 || !(controls::PackedKeyValue(found) > bound))) {
          return;  // an unseen token could rank here
        }
        if (found == 0) break;
        if (tid == 0) {
          p.top_token_ids[out + t] = controls::PackedKeyId(found);
          p.top_logprobs[out + t] = static_cast<float>(
              static_cast<double>(controls::PackedKeyValue(found)) - lse);
        }
        previous = found;
        ++listed;
      }
    }
    // Ranks: the tokens whose value is >= the sampled token's. Processed:
    // the survivors, all seen (closed). Raw: the candidates and entries,
    // where the value lies above every unseen token's raw logit; else the
    // row is not certified.
    int32_t* const ranks =
        want_rank ? p.sampled_ranks + static_cast<int64_t>(r) * p.max_samples
                  : nullptr;
    // A sample's raw logit: on the units' path from its candidate or entry
    // (the raw lse's pass above), else from the logits.
    auto sampled_raw = [&](int k) {
      if constexpr (kFromUnits) {
        return m.sample_raw[k];
      } else {
        return z[tokens[k]];
      }
    };
    for (int k = 0; want_rank && k < (greedy ? 1 : c.n); ++k) {
      const float v_k = raw_mode ? sampled_raw(k) : m.sample_x[k];
      if (raw_mode && outside && !(v_k > raw_bound)) return;
      unsigned long long count = 0;
      if (!raw_mode && prefix) {
        for (int i = tid; i < survivors; i += kThreads)
          count += controls::PackedKeyValue(m.sorted[i]) >= v_k ? 1 : 0;
      } else {
        for_each([&](float x, float raw, int32_t) {
          if (raw_mode ? raw >= v_k
                       : x >= v_k &&
                             (greedy ? x != controls::kNegInf : is_member(x))) {
            ++count;
          }
        });
      }
      count = BlockReduce(count, SumU64{}, sh);
      if (tid == 0) StoreRank(count, greedy, c.n, k, ranks);
    }
    if (tid == 0) {
      if (want_lse) p.logsumexp[r] = static_cast<float>(lse);
      if (want_sampled) {
        // The logprobs' reductions above published sample_x and
        // sample_raw.
        for (int k = 0; k < c.n; ++k) {
          const float v = raw_mode ? sampled_raw(greedy ? 0 : k)
                                   : m.sample_x[greedy ? 0 : k];
          p.sampled_logprobs[static_cast<int64_t>(r) * p.max_samples + k] =
              static_cast<float>(static_cast<double>(v) - lse);
        }
      }
    }
  }
  if (tid == 0) {
    if (p.top_count != nullptr) p.top_count[r] = listed;
    p.status[r] = kControlledOk;
    p.error_token[r] = -1;
    w.done[r] = 1;
    if (p.certified != nullptr) p.certified[r] = 1;
  }
}

// One block per row: the row's UnitCandidates::token_classes words, every
// allowed token ranked (every token where params carries no bitmask for the
// row), then each per-token entry moved from ranked to entry. Rows past
// `vocab` in the last word have neither bit. Without the bitmask the merge
// kernel leaves masked candidates out of its gather, and the bitmask words
// are copied while the fused kernel runs instead of before it; with it,
// masked tokens are in no tail either (a top_p tail or the raw logprobs'
// mass of a bitmask row).
__global__ void __launch_bounds__(kThreads)
    UnitTokenClassesKernel(const ControlledSampleParams p,
                           uint32_t* __restrict__ classes) {
  const int r = blockIdx.x;
  const ControlledRow c = p.row_controls[r];
  const int64_t words = UnitClassWordsPerRow(p.vocab);
  const uint32_t* mask = c.bitmask_offset >= 0 && p.bitmask != nullptr
                             ? p.bitmask + c.bitmask_offset
                             : nullptr;
  uint32_t* row = classes + r * words;
  for (int64_t j = threadIdx.x; j < words; j += kThreads) {
    uint32_t ranked = 0xffffu;
    const int64_t left = p.vocab - 16 * j;
    if (left < 16) ranked &= (1u << left) - 1u;
    // Tokens 16 j .. 16 j + 15: half j % 2 of bitmask word j / 2.
    if (mask != nullptr) ranked &= mask[j >> 1] >> (16 * (j & 1));
    row[j] = ranked;
  }
  __syncthreads();
  for (int64_t e = c.special_begin + threadIdx.x; e < c.special_end;
       e += kThreads) {
    const int32_t id = p.special_ids[e];
    const uint32_t bit = 1u << (id % 16);
    atomicAnd(row + id / 16, ~bit);
    atomicOr(row + id / 16, bit << 16);
  }
}

__global__ void FixedMassProbeKernel(const float* __restrict__ x, int64_t count,
                                     float x_max, uint64_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = controls::FixedMass(x[i], x_max);
}

constexpr size_t kWorkspaceAlign = 256;

}  // namespace

namespace {

// Launches `kernel` as a programmatic dependent of the kernel before it in
// the stream: its blocks are scheduled while that kernel's last blocks
// finish, and WaitForPreviousKernel, its first statement, holds them until
// the results are there, so the gap between two launches on one stream (a
// few us, against 27 us for one row's whole sampler on an H100) is hidden.
// Only where the kernel's code comes from PTX for sm_90 or later, which holds
// the wait: a newer GPU that runs the sm_80 build (compiled from its PTX)
// launches it as an ordinary kernel.
template <typename... Params, typename... Args>
cudaError_t LaunchAfterPrevious(void (*kernel)(Params...), unsigned blocks,
                                size_t shared_bytes, cudaStream_t stream,
                                Args... args) {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess) return error;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = attributes.ptxVersion >= 90 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

size_t AlignUp(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

int ChunksPerRow(int64_t vocab) {
  return static_cast<int>((vocab + kChunkTokens - 1) / kChunkTokens);
}

// The workspace of `rows` rows: the full pass's processed logits, then the
// candidate path's chunk summaries, chunk ids and done flags.
struct WorkspaceLayout {
  size_t summaries, ids, raws, done, total;
};

WorkspaceLayout LayoutOf(int rows, int64_t vocab) {
  const size_t n = static_cast<size_t>(rows);
  const size_t chunks = static_cast<size_t>(ChunksPerRow(vocab));
  WorkspaceLayout l;
  l.summaries = AlignUp(sizeof(float) * n * static_cast<size_t>(vocab));
  l.ids = l.summaries + AlignUp(sizeof(ChunkSummary) * n * chunks);
  l.raws = l.ids + AlignUp(sizeof(int32_t) * n * chunks * kChunkCandidates);
  l.done = l.raws + AlignUp(sizeof(float) * n * chunks * kChunkCandidates);
  // The launch aligns the candidate arrays itself: the engine hands each
  // row chunk the workspace from its first row's logits on.
  l.total = l.done + AlignUp(sizeof(int32_t) * n) + kWorkspaceAlign;
  return l;
}

// The arguments every launch checks: rows, vocab, controls and outputs.
bool ValidOutputs(const ControlledSampleParams& params, void* workspace,
                  size_t workspace_bytes) {
  return params.vocab >= 1 && params.vocab <= 0x7fffffff &&
         params.row_controls != nullptr && params.max_samples >= 1 &&
         params.max_top_n >= 0 && params.token_ids != nullptr &&
         params.status != nullptr && params.error_token != nullptr &&
         workspace != nullptr &&
         workspace_bytes >=
             ControlledSampleWorkspaceSize(params.rows, params.vocab);
}

// The candidate path's arrays in `workspace`, past the full passes'
// processed logits.
CandidateWorkspace CandidateWorkspaceIn(const ControlledSampleParams& params,
                                        void* workspace) {
  const WorkspaceLayout layout = LayoutOf(params.rows, params.vocab);
  const uintptr_t x_end = reinterpret_cast<uintptr_t>(workspace) +
                          sizeof(float) * static_cast<size_t>(params.rows) *
                              static_cast<size_t>(params.vocab);
  char* base = reinterpret_cast<char*>(AlignUp(x_end)) - layout.summaries;
  CandidateWorkspace candidates;
  candidates.chunks = ChunksPerRow(params.vocab);
  candidates.summaries =
      reinterpret_cast<ChunkSummary*>(base + layout.summaries);
  candidates.ids = reinterpret_cast<int32_t*>(base + layout.ids);
  candidates.raws = reinterpret_cast<float*>(base + layout.raws);
  candidates.done = reinterpret_cast<int32_t*>(base + layout.done);
  return candidates;
}

// Whether this device can run the merge kernel over `chunks` chunks a row,
// and the dynamic shared memory it takes: 107,100 bytes at V = 151936; a
// device with less per block (101,376 on sm_86 and sm_89 at V > 129024)
// samples every row by the full passes.
cudaError_t MergeFits(int chunks, bool* fits, size_t* shared_bytes) {
  *shared_bytes = sizeof(MergeShared) + MergeCandidateBytes(chunks);
  int device = 0;
  int shared_optin = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  error = cudaDeviceGetAttribute(
      &shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (error != cudaSuccess) return error;
  *fits = chunks * kChunkCandidates <= kMergeCandidateRoom &&
          *shared_bytes <= static_cast<size_t>(shared_optin);
  return cudaSuccess;
}

// What a launch over rows >= 1 prepares: the candidate path's arrays in
// the workspace, and whether (with how much shared memory) the merge kernel
// runs on this device.
struct CandidateLaunch {
  CandidateWorkspace candidates;
  bool fits = false;
  size_t shared_bytes = 0;
};

// `inputs_valid`: the launcher's own checks of its inputs.
cudaError_t PrepareLaunch(const ControlledSampleParams& params, void* workspace,
                          size_t workspace_bytes, bool inputs_valid,
                          CandidateLaunch* launch) {
  if (!inputs_valid || !ValidOutputs(params, workspace, workspace_bytes)) {
    return cudaErrorInvalidValue;
  }
  launch->candidates = CandidateWorkspaceIn(params, workspace);
  return MergeFits(launch->candidates.chunks, &launch->fits,
                   &launch->shared_bytes);
}

template <bool kFromUnits>
cudaError_t LaunchMerge(const ControlledSampleParams& params,
                        const CandidateWorkspace& candidates,
                        const ControlledUnits& units, size_t shared_bytes,
                        cudaStream_t stream) {
  const cudaError_t error =
      cudaFuncSetAttribute(CandidateMergeKernel<kFromUnits>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(shared_bytes));
  if (error != cudaSuccess) return error;
  return LaunchAfterPrevious(CandidateMergeKernel<kFromUnits>,
                             static_cast<unsigned>(params.rows), shared_bytes,
                             stream, params, candidates, units);
}

}  // namespace

size_t ControlledSampleWorkspaceSize(int rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  return LayoutOf(rows, vocab).total;
}

cudaError_t LaunchControlledSample(const ControlledSampleParams& params,
                                   void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  if (params.rows < 0) return cudaErrorInvalidValue;
  if (params.rows == 0) return cudaSuccess;
  CandidateLaunch launch;
  cudaError_t error = PrepareLaunch(
      params, workspace, workspace_bytes,
      params.logits_row_stride >= params.vocab && params.logits != nullptr,
      &launch);
  if (error != cudaSuccess) return error;
  const CandidateWorkspace& candidates = launch.candidates;
  if (launch.fits) {
    CandidateChunkKernel<<<dim3(static_cast<unsigned>(candidates.chunks),
                                static_cast<unsigned>(params.rows)),
                           kChunkThreads, 0, stream>>>(params, candidates);
    error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    error = LaunchMerge<false>(params, candidates, ControlledUnits{},
                               launch.shared_bytes, stream);
    if (error != cudaSuccess) return error;
    return LaunchAfterPrevious(ControlledSampleKernel,
                               static_cast<unsigned>(params.rows), 0, stream,
                               params, static_cast<float*>(workspace),
                               static_cast<const int32_t*>(candidates.done));
  } else {
    const size_t flags = sizeof(int32_t) * static_cast<size_t>(params.rows);
    error = cudaMemsetAsync(candidates.done, 0, flags, stream);
    if (error != cudaSuccess) return error;
    if (params.certified != nullptr) {
      error = cudaMemsetAsync(params.certified, 0, flags, stream);
      if (error != cudaSuccess) return error;
    }
  }
  ControlledSampleKernel<<<params.rows, kThreads, 0, stream>>>(
      params, static_cast<float*>(workspace), candidates.done);
  return cudaGetLastError();
}

cudaError_t ControlledCandidatePathFits(int64_t vocab, bool* fits) {
  *fits = false;
  if (vocab < 1 || vocab > 0x7fffffff) return cudaSuccess;
  size_t shared_bytes = 0;
  return MergeFits(ChunksPerRow(vocab), fits, &shared_bytes);
}

cudaError_t LaunchControlledSampleFromUnits(
    const ControlledSampleParams& params, const ControlledUnits& units,
    void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (params.rows < 0) return cudaErrorInvalidValue;
  if (params.rows == 0) return cudaSuccess;
  CandidateLaunch launch;
  const cudaError_t error = PrepareLaunch(
      params, workspace, workspace_bytes,
      params.certified != nullptr && units.records != nullptr &&
          units.row_bound != nullptr && units.row_top != nullptr &&
          (units.token_classes == nullptr ||
           (params.logits != nullptr &&
            params.logits_row_stride >= params.vocab)),
      &launch);
  if (error != cudaSuccess) return error;
  if (!launch.fits) return cudaErrorNotSupported;
  return LaunchMerge<true>(params, launch.candidates, units,
                           launch.shared_bytes, stream);
}

cudaError_t LaunchUnitTokenClasses(const ControlledSampleParams& params,
                                   uint32_t* classes, cudaStream_t stream) {
  if (params.rows < 0 || params.vocab < 1 || params.vocab > 0x7fffffff ||
      (params.rows > 0 &&
       (classes == nullptr || params.row_controls == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (params.rows == 0) return cudaSuccess;
  UnitTokenClassesKernel<<<static_cast<unsigned>(params.rows), kThreads, 0,
                           stream>>>(params, classes);
  return cudaGetLastError();
}

cudaError_t LaunchControlledFixedMassProbe(const float* x, int64_t count,
                                           float x_max, uint64_t* out,
                                           cudaStream_t stream) {
  if (count < 0 || (count > 0 && (x == nullptr || out == nullptr)))
    return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  constexpr int kProbeThreads = 256;
  const int64_t blocks = (count + kProbeThreads - 1) / kProbeThreads;
  FixedMassProbeKernel<<<static_cast<unsigned>(blocks), kProbeThreads, 0,
                         stream>>>(x, count, x_max, out);
  return cudaGetLastError();
}

}  // namespace flashsampler
