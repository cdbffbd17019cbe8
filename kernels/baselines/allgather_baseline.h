// The tensor-parallel baseline the fused exchange is measured against: what a
// serving stack does today. Per rank a cuBLAS GEMM writes the shard's logits
// to memory (bf16/fp16, fp32 accumulation), ncclAllGather gives every rank the
// full [B, V] logits, and a sampling kernel draws Gumbel-max samples from
// them with the project's noise (kernels/noise/philox.h), on every rank.
#ifndef FLASHSAMPLER_KERNELS_BASELINES_ALLGATHER_BASELINE_H_
#define FLASHSAMPLER_KERNELS_BASELINES_ALLGATHER_BASELINE_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/sampler/fused_sampler.h"
#include "kernels/tp/tp_exchange.h"
#include "kernels/tp/tp_layout.h"

namespace flashsampler {

struct AllGatherBaselineOptions {
  DType dtype = DType::kBf16;      // of W, hidden and the logits: bf16 or fp16
  int hidden_size = 0;             // D
  int max_batch = kMaxFusedBatch;  // rows per step, upper bound
  int max_samples = 1;             // samples per row, upper bound
};

// Workspaces (cuBLAS handles, per-rank logits, gathered logits) are allocated
// once at Create. ncclAllGather needs the same count from every rank, so each
// rank's logits are padded to the largest shard: rank r's block of the
// gathered buffer is [B][max_rows], of which its first vocab_rows columns are
// real. Worked number: V = 128256 over 2, B = 256: 2 x 256 x 64128 bf16 =
// 65.7 MB gathered on every rank.
class AllGatherBaseline {
 public:
  // `comms` must outlive the baseline; layout ranks = comms ranks. The
  // layout's tile_rows plays no part here.
  static TpStatus Create(TpComms* comms, const TpLayout& layout,
                         const AllGatherBaselineOptions& options,
                         std::unique_ptr<AllGatherBaseline>* out);
  ~AllGatherBaseline();
  AllGatherBaseline(const AllGatherBaseline&) = delete;
  AllGatherBaseline& operator=(const AllGatherBaseline&) = delete;

  // One step. params[r] is rank r's shard exactly as for the fused kernel
  // (weights, hidden, per-row inv_temperature / seeds / steps on rank r's GPU;
  // candidates and logits_out ignored). token_ids[r]: [batch][num_samples]
  // int32 on rank r's GPU; every rank samples the same tokens.
  TpStatus Step(const std::vector<FusedSampleParams>& params,
                const std::vector<int32_t*>& token_ids,
                const std::vector<cudaStream_t>& streams);

  // Rank r's gathered logits of the last step, [ranks][batch][padded_rows()]
  // (for tests); valid once the step's stream work completed.
  const void* gathered_logits(int rank) const { return gathered_[rank]; }
  int64_t padded_rows() const { return max_rows_; }

 private:
  AllGatherBaseline() = default;

  TpComms* comms_ = nullptr;
  TpLayout layout_;
  AllGatherBaselineOptions options_;
  int64_t max_rows_ = 0;  // largest shard
  std::vector<cublasHandle_t> cublas_;
  std::vector<void*> cublas_workspace_;
  std::vector<cudaStream_t> cublas_stream_;  // stream each handle is bound to
  std::vector<void*> local_;                 // per rank [max_batch][max_rows]
  std::vector<void*> gathered_;  // per rank [ranks][max_batch][max_rows]
  // Per rank, on its GPU: the shards' vocab_offset / vocab_rows for the
  // sampling kernel.
  std::vector<int64_t*> shard_table_;
};

// The sampling half alone: Gumbel-max over gathered logits laid out
// [ranks][batch][row_stride] (rank r's real columns: shard_rows[r], global id
// shard_offsets[r] + column). One block per (row, sample); greedy rows
// (inv_temperature 0) take the argmax of the logit; dtype bf16 or fp16
// (else cudaErrorInvalidValue). Exposed for tests.
cudaError_t LaunchGatheredLogitsSample(
    const void* gathered, DType dtype, int num_ranks,
    const int64_t* shard_table, int64_t row_stride, int batch, int num_samples,
    const float* inv_temperature, const uint64_t* seeds, const uint64_t* steps,
    int32_t* token_ids, cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_BASELINES_ALLGATHER_BASELINE_H_
