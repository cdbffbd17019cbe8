// Counter-based Gumbel noise shared by the CUDA kernels and the CPU backend.
// Noise is a pure function of (seed, step, global token id, sample index)
// (docs/design.md#noise; built per block of 16 token ids, see NoiseBlockOf),
// and host and device evaluate it with the same IEEE
// single-precision operations in the same order, so both produce bit-identical
// noise: a CPU result and a GPU result differ only where their logits differ.
#ifndef FLASHSAMPLER_KERNELS_NOISE_PHILOX_H_
#define FLASHSAMPLER_KERNELS_NOISE_PHILOX_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FS_HOST_DEVICE inline
#endif

namespace flashsampler {

// Correctly rounded single-precision operations that the compiler may not fuse
// into FMAs. nvcc contracts a*b+c by default; the _rn intrinsics opt out. Host
// code is built with -ffp-contract=off (see CMakeLists.txt) for the same
// reason.
#if defined(__CUDA_ARCH__)
#define FS_FADD(a, b) __fadd_rn((a), (b))
#define FS_FSUB(a, b) __fsub_rn((a), (b))
#define FS_FMUL(a, b) __fmul_rn((a), (b))
#define FS_FDIV(a, b) __fdiv_rn((a), (b))
#else
#define FS_FADD(a, b) ((a) + (b))
#define FS_FSUB(a, b) ((a) - (b))
#define FS_FMUL(a, b) ((a) * (b))
#define FS_FDIV(a, b) ((a) / (b))
#endif

struct Philox4x32 {
  uint32_t v[4];
};

// Multiplies two 32-bit words into a 64-bit product, returned as hi and lo.
FS_HOST_DEVICE void MulHiLo32(uint32_t a, uint32_t b, uint32_t* hi,
                              uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
#endif
}

// Philox4x32-10 (Salmon et al., SC'11): ten rounds, constants from the paper.
// Checked against the Random123 known-answer vectors in tests/philox_test.cc.
FS_HOST_DEVICE Philox4x32 Philox4x32_10(Philox4x32 counter, uint32_t key0,
                                        uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u;
  constexpr uint32_t kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u;
  constexpr uint32_t kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    MulHiLo32(kMul0, counter.v[0], &hi0, &lo0);
    MulHiLo32(kMul1, counter.v[2], &hi1, &lo1);
    counter = Philox4x32{
        {hi1 ^ counter.v[1] ^ key0, lo1, hi0 ^ counter.v[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return counter;
}

// Maps 32 random bits to a uniform strictly inside (0, 1): the top 23 bits
// pick one of 2^23 equal cells and the result is the cell's midpoint,
// (2m + 1) * 2^-24. Resolution 2^-23; the smallest value is 2^-24 and the
// largest 1 - 2^-24, both exact in fp32, so log(u) and log(-log(u)) are finite.
FS_HOST_DEVICE float UniformFromBits(uint32_t bits) {
  const uint32_t odd = ((bits >> 9) << 1) | 1u;  // < 2^24: exact in fp32.
  return FS_FMUL(static_cast<float>(odd), 5.9604644775390625e-08f);  // 2^-24
}

FS_HOST_DEVICE uint32_t FloatToBits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

FS_HOST_DEVICE float BitsToFloat(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

// Natural logarithm of a positive normal float, accurate to under 1 ulp,
// written in explicit round-to-nearest operations so that host and device
// agree bit for bit (CUDA's logf and glibc's logf are both accurate but not
// identical). Classic reduction x = 2^k * m with m in [sqrt(2)/2, sqrt(2)),
// then log(m) = 2 atanh(s), s = (m - 1) / (m + 1), with the fdlibm minimax
// coefficients for the odd series. `divide(a, b)` must return the correctly
// rounded a / b for the arguments used here: the CUDA epilogue passes a
// cheaper division that is exact on this range (fused_epilogue.cuh), so both
// share every other operation.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Divide>
FS_HOST_DEVICE float AccurateLogWithDivide(float x, Divide divide) {
  constexpr float kLn2Hi = 6.9313812256e-01f;  // ln 2, top bits (exact * k)
  constexpr float kLn2Lo = 9.0580006145e-06f;  // ln 2 - kLn2Hi
  constexpr float kLg1 = 0.66666662693f;
  constexpr float kLg2 = 0.40000972152f;
  constexpr float kLg3 = 0.28498786688f;
  constexpr float kLg4 = 0.24279078841f;
  uint32_t bits = FloatToBits(x);
  // Bias the exponent split so that the mantissa lands in [sqrt(2)/2, sqrt(2)).
  bits += 0x3f800000u - 0x3f3504f3u;
  const int k = static_cast<int>(bits >> 23) - 0x7f;
  bits = (bits & 0x007fffffu) + 0x3f3504f3u;
  const float f = FS_FSUB(BitsToFloat(bits), 1.0f);  // exact (Sterbenz)
  const float s = divide(f, FS_FADD(2.0f, f));
  const float z = FS_FMUL(s, s);
  const float w = FS_FMUL(z, z);
  const float t1 = FS_FMUL(w, FS_FADD(kLg2, FS_FMUL(w, kLg4)));
  const float t2 = FS_FMUL(z, FS_FADD(kLg1, FS_FMUL(w, kLg3)));
  const float r = FS_FADD(t2, t1);
  const float hfsq = FS_FMUL(0.5f, FS_FMUL(f, f));
  const float dk = static_cast<float>(k);
  // log(x) = k ln2 + f - hfsq + s (hfsq + r), summed small terms first.
  const float small =
      FS_FADD(FS_FMUL(s, FS_FADD(hfsq, r)), FS_FMUL(dk, kLn2Lo));
  return FS_FADD(FS_FMUL(dk, kLn2Hi), FS_FSUB(f, FS_FSUB(hfsq, small)));
}

// IEEE round-to-nearest division (the default of AccurateLog).
struct RoundedDivide {
  FS_HOST_DEVICE float operator()(float a, float b) const {
    return FS_FDIV(a, b);
  }
};

FS_HOST_DEVICE float AccurateLog(float x) {
  return AccurateLogWithDivide(x, RoundedDivide{});
}

// Standard Gumbel(0, 1) sample from a uniform in (0, 1): -log(-log(u)).
// With u in [2^-24, 1 - 2^-24] the result lies in about [-2.8, 16.6].
FS_HOST_DEVICE float GumbelFromUniform(float u) {
  return -AccurateLog(-AccurateLog(u));
}

// Token words: four consecutive global token ids 4*token_group ..
// 4*token_group+3 of one row share one Philox call keyed by the row's 64-bit
// seed, counter = (token_group, sample_index, step low word, step high
// word). Word j of the output is token 4*token_group + j. Nothing here
// depends on tiles, blocks, batch position or tensor-parallel rank
// (docs/design.md#noise).
FS_HOST_DEVICE Philox4x32 NoiseBits4(uint64_t seed, uint64_t step,
                                     uint32_t sample_index,
                                     uint32_t token_group) {
  const Philox4x32 counter{{token_group, sample_index,
                            static_cast<uint32_t>(step),
                            static_cast<uint32_t>(step >> 32)}};
  return Philox4x32_10(counter, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// Word `index` (0..3) of a Philox output, without a run-time index into an
// array (which would put the four words in local memory on the GPU).
FS_HOST_DEVICE uint32_t PhiloxWord(const Philox4x32& bits, uint32_t index) {
  const uint32_t low = (index & 1u) ? bits.v[1] : bits.v[0];
  const uint32_t high = (index & 1u) ? bits.v[3] : bits.v[2];
  return (index & 2u) ? high : low;
}

// Noise blocks. The Gumbel noise of a row is built per block of 16
// consecutive global token ids (block = token id / 16, a fixed partition of
// the vocabulary, like the token words) from the order statistics of
// exponentials: g_i = -log(E_i) with E_i i.i.d. Exp(1) is i.i.d. Gumbel(0, 1),
// and 16 i.i.d. Exp(1) are drawn exactly as
//   - their minimum E_min ~ Exp(16), i.e. -log(U) / 16 for a uniform U,
//   - the slot holding it, uniform over the 16 slots,
//   - every other slot E_min + E', with E' ~ Exp(1) i.i.d. (memorylessness),
//     E' = -log(v) for the slot's own uniform v from its token word.
// So every token's noise is still an exact, independent Gumbel(0, 1), a pure
// function of (seed, step, global token id, sample index) through Philox4x32-10
// counters built from those values, and argmax(logit / T + g) is still an
// exact sample; the same tokens come out at any batch, tile or TP degree. What
// the construction adds is the block's largest noise, -log(E_min), from one
// word: a block whose largest scaled logit plus that noise is below a score
// already reached cannot hold the winner, so none of its token words are
// needed (the kernels' pruning, docs/design.md#exactness-and-refusals).
// In terms of uniforms, the first slot's u is M = U^(1/16) (the maximum of 16
// uniforms) and the others' are M * v. Resolution: U and v have 2^23 cells
// (UniformFromBits), so the largest noise is about 19.4 (E_min >= 3.7e-9).
//
// The four blocks of a block group (64 consecutive ids, group = token id /
// 64) take their words from one Philox call, word j for block 4 * group + j:
// the wgmma kernel makes each call once for the four warps whose rows hold
// those blocks, not once per block (a quarter of the block words' Philox
// calls).
constexpr uint32_t kNoiseBlockTokens = 16;
constexpr uint32_t kNoiseBlockShift = 4;  // log2(kNoiseBlockTokens)
constexpr uint32_t kNoiseBlocksPerGroup = 4;
constexpr uint32_t kNoiseGroupShift = 2;  // log2(kNoiseBlocksPerGroup)
// Marks block-group counters: token groups are < 2^29 (token ids are int32).
constexpr uint32_t kNoiseBlockCounterFlag = 0x80000000u;

struct NoiseBlock {
  uint32_t first_slot;  // token id % 16 of the slot holding E_min
  float uniform;        // U: E_min = -log(U) / 16
};

// The words of block group `group` (blocks 4 * group .. 4 * group + 3): one
// Philox call per (row, sample, group), counter = (flag | group,
// sample_index, step low word, step high word), the row's seed as key.
FS_HOST_DEVICE Philox4x32 NoiseBlockWords(uint64_t seed, uint64_t step,
                                          uint32_t sample_index,
                                          uint32_t group) {
  const Philox4x32 counter{{kNoiseBlockCounterFlag | group, sample_index,
                            static_cast<uint32_t>(step),
                            static_cast<uint32_t>(step >> 32)}};
  return Philox4x32_10(counter, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// A block from its word: the first slot from the low 4 bits, U from the top
// 23 (UniformFromBits), which do not overlap.
FS_HOST_DEVICE NoiseBlock NoiseBlockFromWord(uint32_t word) {
  return NoiseBlock{word & (kNoiseBlockTokens - 1), UniformFromBits(word)};
}

// Block `block`: word block % 4 of its group's call.
FS_HOST_DEVICE NoiseBlock NoiseBlockOf(uint64_t seed, uint64_t step,
                                       uint32_t sample_index, uint32_t block) {
  return NoiseBlockFromWord(PhiloxWord(
      NoiseBlockWords(seed, step, sample_index, block >> kNoiseGroupShift),
      block & (kNoiseBlocksPerGroup - 1)));
}

// E_min = -log(U) / 16 (the division by 16 is exact).
template <typename Divide>
FS_HOST_DEVICE float BlockMinExponential(float uniform, Divide divide) {
  return FS_FMUL(-AccurateLogWithDivide(uniform, divide), 0.0625f);
}

// Gumbel noise of one slot of a block: -log(E_min) for the first slot,
// -log(E_min + (-log v)) with v = UniformFromBits(word) (the token's word of
// NoiseBits4) for the others. `divide` as in AccurateLogWithDivide.
template <typename Divide>
FS_HOST_DEVICE float BlockSlotGumbel(float min_exponential, bool first_slot,
                                     uint32_t word, Divide divide) {
  const float exponential =
      first_slot ? min_exponential
                 : FS_FADD(min_exponential, -AccurateLogWithDivide(
                                                UniformFromBits(word), divide));
  return -AccurateLogWithDivide(exponential, divide);
}

// The noise of all 16 slots of block `block`, slot by slot what GumbelNoise
// gives, with each Philox call (the block group's and the block's four
// token-word calls) made once: for samplers that walk a vocabulary block by
// block.
FS_HOST_DEVICE void BlockNoise(uint64_t seed, uint64_t step,
                               uint32_t sample_index, uint32_t block,
                               float (&noise)[kNoiseBlockTokens]) {
  const NoiseBlock noise_block = NoiseBlockOf(seed, step, sample_index, block);
  const float min_exponential =
      BlockMinExponential(noise_block.uniform, RoundedDivide{});
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (uint32_t run = 0; run < kNoiseBlockTokens / 4; ++run) {
    const Philox4x32 words = NoiseBits4(seed, step, sample_index,
                                        block * (kNoiseBlockTokens / 4) + run);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (uint32_t q = 0; q < 4; ++q) {
      const uint32_t slot = 4 * run + q;
      noise[slot] =
          BlockSlotGumbel(min_exponential, slot == noise_block.first_slot,
                          words.v[q], RoundedDivide{});
    }
  }
}

// Gumbel noise of one token: its block's word and, unless it holds the
// block's minimum, its token word.
FS_HOST_DEVICE float GumbelNoise(uint64_t seed, uint64_t step,
                                 uint32_t sample_index, uint32_t token_id) {
  const NoiseBlock block =
      NoiseBlockOf(seed, step, sample_index, token_id >> kNoiseBlockShift);
  const bool first = (token_id & (kNoiseBlockTokens - 1)) == block.first_slot;
  const uint32_t word =
      first ? 0u
            : NoiseBits4(seed, step, sample_index, token_id >> 2)
                  .v[token_id & 3u];
  return BlockSlotGumbel(BlockMinExponential(block.uniform, RoundedDivide{}),
                         first, word, RoundedDivide{});
}

// The perturbed score whose argmax over the vocabulary is an exact sample
// from softmax(logit * inv_temperature). Multiply (not divide) by a per-row
// reciprocal computed once on the host, unfused, identically everywhere.
FS_HOST_DEVICE float GumbelScore(float logit, float inv_temperature,
                                 float gumbel) {
  return FS_FADD(FS_FMUL(logit, inv_temperature), gumbel);
}

// One stage-1 candidate: the best perturbed score of a row within a vocabulary
// tile (or chunk, or shard) and its global token id.
struct Candidate {
  float score;
  int32_t token_id;
};

// Total order used by every reduction: higher score wins, equal scores go to
// the lowest global token id (docs/design.md#ties-and-reduction-order).
FS_HOST_DEVICE bool CandidateBetter(float score, int32_t token_id,
                                    float best_score, int32_t best_token_id) {
  return score > best_score ||
         (score == best_score && token_id < best_token_id);
}

// Identity of the reduction: loses to every real candidate.
constexpr int32_t kNoToken = 0x7fffffff;

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_NOISE_PHILOX_H_
