// Internals shared by the stage-1 dispatcher (fused_sampler.cc) and the
// kernel instantiation files: the device-side argument struct and the typed
// launchers, one explicit instantiation per (path, dtype, block_n).
#ifndef FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_
#define FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/noise/philox.h"
#include "kernels/sampler/fused_sampler.h"

namespace flashsampler {
namespace fused {

// Vocabulary rows per CTA tile and per candidate (FusedSampleTileRows()).
constexpr int kTileRows = 128;
// Elements of D per pipeline stage: one 128-byte row of bf16/fp16.
constexpr int kBlockK = 64;

// Everything a stage-1 kernel reads, passed by value (flash-attn's params
// struct): the caller's FusedSampleParams, validated by LaunchFusedSample,
// and what the dispatcher derives from them.
struct FusedArgs : FusedSampleParams {
  explicit FusedArgs(const FusedSampleParams& params)
      : FusedSampleParams(params) {}

  // The in-kernel stage 2's workspace (both null when off): packed
  // per-(sample, row) winners [n][batch], zero between launches, and the
  // arrival counter. With per-tile candidates and no token_ids they hold
  // the pruning floor alone (FusedSampleParams::floor_in_workspace).
  unsigned long long* keys = nullptr;
  unsigned int* counter = nullptr;
  uint64_t w_cache_hint = 0;  // TMA L2 hint for W (wgmma path)
};

// Workspace of the in-kernel stage 2: the counter, then the keys.
constexpr size_t kWorkspaceCounterBytes = 256;
constexpr int kMaxInKernelReduceSamples = kMaxFusedInKernelSamples;

// Typed launchers for DType::kBf16 and DType::kFp16 (no fp32 operands).
// Defined in the fused_sampler_{mma,wgmma}_{bf16,fp16}.cu instantiation
// files.
template <DType kDType, int kBlockN>
cudaError_t LaunchMma(const FusedArgs& args, cudaStream_t stream);
// tensor_map_w: two CUtensorMaps of W, kTileRows-row and kTileRows / 2-row
// boxes; tensor_map_h: two of H, kBlockN-row and kBlockN / 2-row boxes.
// The launch carries UnitRecordsL2Window(args) as an attribute.
template <DType kDType, int kBlockN, int kHalves>
cudaError_t LaunchWgmma(const FusedArgs& args, const void* tensor_map_w,
                        const void* tensor_map_h, int grid,
                        cudaStream_t stream);

// The access policy window that keeps a launch's unit records in L2's
// persisting set-aside (FusedSampleSetAsideL2ForUnits): num_bytes 0 where
// there are no records or nothing is set aside. Records beyond the
// set-aside (hitRatio < 1: 256 rows at qwen's V are 39 MB) are streamed.
// Defined in fused_sampler.cc.
cudaAccessPolicyWindow UnitRecordsL2Window(const FusedSampleParams& params);

// Binary version (e.g. 90) of the wgmma kernel image the current device would
// run; only 90 (sm_90a code) carries the wgmma instructions.
cudaError_t WgmmaKernelBinaryVersion(int* version);

}  // namespace fused
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_SAMPLER_FUSED_SAMPLER_INTERNAL_H_
