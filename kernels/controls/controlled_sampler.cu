// The controlled sampler kernel: one CTA per row walks the row's fp32 logits
// in passes (transform, row statistics, radix-select cuts for top_k and
// top_p, one Gumbel-max pass per sample, logprobs), each pass a block-wide
// reduction with a fixed combining order, so the result is a pure function
// of the row's logits and controls.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_sampler.h"
#include "kernels/noise/philox.h"

namespace flashsampler {
namespace {

using controls::U128;

// 512 threads: at V = 151936 each thread visits ~300 tokens per pass. The
// kernel needs 64 registers, no spills and 5.3 KB of shared memory (ptxas -v
// for sm_90a and sm_80), under the 128 registers a thread may use at this
// block size, so the Philox rounds stay out of local memory.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int32_t kNoId = 0x7fffffff;

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

// Block-wide reduction of one value per thread; the warps' partials are
// combined in warp order by every thread, so the result (and, for doubles,
// its rounding) does not depend on scheduling. Every thread must call it.
template <typename T, typename Op>
__device__ T BlockReduce(T value, Op op, SharedState& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  T* slots = reinterpret_cast<T*>(sh.scratch);
  __syncthreads();  // the previous reduction's readers are done
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = value;
  __syncthreads();
  T result = slots[0];
  for (int w = 1; w < kWarps; ++w) result = op(result, slots[w]);
  return result;
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
                           float* __restrict__ x_all) {
  __shared__ SharedState sh;
  const int r = blockIdx.x;
  const int tid = threadIdx.x;
  const ControlledRow c = p.row_controls[r];
  const int32_t vocab = static_cast<int32_t>(p.vocab);
  const float* __restrict__ z = p.logits + r * p.logits_row_stride;
  float* __restrict__ x = x_all + static_cast<int64_t>(r) * vocab;

  const bool greedy = c.temperature == 0.0f;
  const bool want_sampled = (c.logprob_flags & kLogprobSampled) != 0;
  const bool want_lse = (c.logprob_flags & kLogprobLogsumexp) != 0;
  const bool raw = (c.logprob_flags & kLogprobRaw) != 0;
  const int32_t top_n = c.top_n < vocab ? c.top_n : vocab;
  if (c.n < 1 || c.n > p.max_samples || top_n < 0 || top_n > p.max_top_n ||
      (want_sampled && p.sampled_logprobs == nullptr) ||
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
    if (tid == 0) {
      const int32_t id = controls::PackedKeyId(winner);
      if (greedy) {
        for (int k = 0; k < c.n; ++k) tokens[k] = id;
      } else {
        tokens[j] = id;
      }
    }
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
  if (want_sampled || want_lse || top_n > 0) {
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
  } else if (tid == 0 && p.top_count != nullptr) {
    p.top_count[r] = 0;
  }
  if (tid == 0) {
    p.status[r] = kControlledOk;
    p.error_token[r] = -1;
  }
}

__global__ void FixedMassProbeKernel(const float* __restrict__ x, int64_t count,
                                     float x_max, uint64_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = controls::FixedMass(x[i], x_max);
}

constexpr size_t kWorkspaceAlign = 256;

}  // namespace

size_t ControlledSampleWorkspaceSize(int rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0) return 0;
  const size_t bytes =
      sizeof(float) * static_cast<size_t>(rows) * static_cast<size_t>(vocab);
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

cudaError_t LaunchControlledSample(const ControlledSampleParams& params,
                                   void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  if (params.rows < 0) return cudaErrorInvalidValue;
  if (params.rows == 0) return cudaSuccess;
  if (params.vocab < 1 || params.vocab > 0x7fffffff ||
      params.logits_row_stride < params.vocab || params.logits == nullptr ||
      params.row_controls == nullptr || params.max_samples < 1 ||
      params.max_top_n < 0 || params.token_ids == nullptr ||
      params.status == nullptr || params.error_token == nullptr ||
      workspace == nullptr ||
      workspace_bytes <
          ControlledSampleWorkspaceSize(params.rows, params.vocab)) {
    return cudaErrorInvalidValue;
  }
  ControlledSampleKernel<<<params.rows, kThreads, 0, stream>>>(
      params, static_cast<float*>(workspace));
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
