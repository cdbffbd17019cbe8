// The exact reference sampler: logits h . W[i] with OpenBLAS one vocabulary
// chunk at a time, vLLM-ordered transforms, Gumbel-max with the shared Philox
// noise, and exact top-k / top-p / min-p and logprobs. Every GPU result is
// checked against it, and it serves when no GPU is present.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_SAMPLER_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_SAMPLER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/thread_pool.h"
#include "service/backends/cpu/sample.h"  // MaxGumbelNoise()
#include "service/backends/sampling_params.h"

namespace flashsampler {

struct CpuSamplerOptions {
  // Threads sampling one batch, its caller included; 0 =
  // std::thread::hardware_concurrency().
  int threads = 0;
  // Vocabulary rows per chunk (rounded up to whole 256-row tiles). A chunk of
  // one row block is one unit of parallel work and one stage-1 candidate; per
  // row at most one chunk of logits is held (in fact one tile at a time).
  int64_t chunk_rows = 4096;
  // Size of the per-row buffer of the best tokens kept by the first pass of a
  // row that uses top_k or top_p: top_k < this (unless ties at the k-th value
  // run past the buffer) and most top_p nuclei resolve from it without
  // further passes. Anything it cannot certify falls back to an exact radix
  // select over extra passes (same result, more time).
  int64_t candidate_buffer = 4096;
};

// Sampling semantics, beyond sampling_params.h (these are the definitions the
// CUDA backend is compared against; vLLM v1's):
// - l = raw logit + sum of its logit_bias entries (summed in list order);
//   banned or bitmask-disallowed -> -inf; then, in fp32, repetition penalty r
//   on prompt ids U output ids (l > 0 ? l / r : l * r), l -= f * count,
//   l -= presence (count > 0); x = l * (1 / T) with 1 / T rounded to fp32.
// - Greedy (SamplingParams::greedy(): T < kMinSamplingTemperature = 1e-5,
//   T = 0 included): argmax of l, lowest id on ties, no noise; top_k, top_p
//   and min_p are ignored (as vLLM does) and logprobs use T = 1.
// - Tokens are ordered by (x descending, id ascending). min_p keeps
//   x - x_max >= ln(min_p) (evaluated in double); top_k (0, -1 or >= V =
//   off) keeps every min_p survivor with x >= the k-th largest x among them
//   (ties at the k-th value all stay, as vLLM's sort-and-threshold keeps
//   them, so more than k tokens may remain); top_p then keeps, of the top_k
//   survivors in the order, each token whose mass ranked strictly above it
//   is < p of their total (the top token always stays; masses exp(x - x_max)
//   in 2^-62 fixed point, summed exactly, so the cut does not depend on
//   chunking or threads).
// - Sample j of a row is argmax over the survivors of
//   GumbelScore(l, 1 / T, GumbelNoise(seed, step, j, id)), ties to the
//   lowest id.
// - Processed logprobs are log-softmax of x over the survivors (the
//   distribution actually sampled). Raw logprobs (vLLM's raw_logprobs) are
//   log-softmax of the raw logits after the masks alone: banned and
//   bitmask-disallowed tokens are -inf (out of the log-sum-exp, never
//   listed), logit_bias (even -inf), penalties, temperature and filters do
//   not apply. top-N lists only tokens of non-zero probability (at most N),
//   most likely first, ties to the lowest id. The rank of a sampled token
//   is the count of tokens whose value in the logprobs' space (masked raw
//   logit, or x of a survivor) is >= its own, itself included: 1 for the
//   most likely token, and ties count against it (vLLM's count).
class CpuSampler {
 public:
  // `weights_fp32` is row-major [vocab, hidden] and is shared, not copied
  // (except the ragged last 256-row tile, copied once into a zero-padded
  // buffer so that every matrix product has the same shape).
  static absl::StatusOr<std::unique_ptr<CpuSampler>> Create(
      std::shared_ptr<const std::vector<float>> weights_fp32, int64_t vocab,
      int64_t hidden, const CpuSamplerOptions& options);

  CpuSampler(const CpuSampler&) = delete;
  CpuSampler& operator=(const CpuSampler&) = delete;

  // Samples `rows` rows; `hidden` is fp32 [rows, hidden_size]. `results` is
  // resized to `rows`. Rows are independent: a row's result depends only on
  // (W, its hidden state, its spec). A row that cannot be sampled (every
  // token masked, a non-finite logit, controls refused by
  // ValidateSamplingParams with SamplingRules::Engine()) makes the call return
  // INVALID_ARGUMENT naming the first such row; the other rows' results are
  // still filled in, each failed row carries its reason in RowResult::error
  // and empty token_ids. Rows that took the exact radix-select fallback say
  // so in RowResult::exact_fallback.
  // Thread-safe: concurrent calls share the worker pool.
  absl::Status Sample(const float* hidden, int rows, const RowSpec* specs,
                      std::vector<RowResult>* results);

  // fp32 [rows, vocab] logits computed with exactly the arithmetic Sample()
  // uses (same matrix shapes, same accumulation order).
  absl::Status ComputeLogits(const float* hidden, int rows, float* logits);

  // Every control in AllSamplingControls(): all are implemented exactly.
  std::vector<std::string> SupportedControls() const;

  int64_t vocab_size() const { return vocab_; }
  int64_t hidden_size() const { return hidden_; }
  int num_threads() const { return pool_->num_threads() + 1; }
  // Hidden rows per matrix product: 8, or 1 when the start-up self-check
  // found that this BLAS's result for a row depends on its position in the
  // block (which would break batch invariance).
  int row_block() const { return row_block_; }

 private:
  struct Call;  // per-Sample() state, defined in cpu_sampler.cc

  CpuSampler(std::shared_ptr<const std::vector<float>> weights, int64_t vocab,
             int64_t hidden, const CpuSamplerOptions& options);

  const float* Tile(int64_t tile) const;
  // out [row_block_, 256] = hblock [row_block_, hidden] x W[tile]^T.
  void TileLogits(const float* hblock, int64_t tile, float* out) const;
  bool RowBlockIsPositionInvariant() const;
  void RunTask(Call& call, int block, int64_t chunk) const;

  std::shared_ptr<const std::vector<float>> weights_;
  int64_t vocab_;
  int64_t hidden_;
  CpuSamplerOptions options_;
  int64_t num_tiles_;
  int64_t tiles_per_chunk_;
  int64_t num_chunks_;
  int row_block_ = 8;
  // The last 256-row tile, zero-padded: [256, hidden]; empty if V % 256 == 0.
  std::vector<float> tail_tile_;
  std::unique_ptr<ThreadPool> pool_;
};

}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_CPU_SAMPLER_H_
