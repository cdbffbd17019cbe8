// Stage 1 on the portable tensor-core path (sm_80+): "swap AB" mma.sync
// m16n8k16 with W rows as M (the vocabulary is large, the batch small) and
// hidden rows as N, fed by a cp.async multi-stage pipeline through a
// 128-byte XOR-swizzled shared-memory layout read with ldmatrix.
//
// Each CTA owns one 128-row vocabulary tile (one candidate per row and
// sample) and kBlockN batch columns. A stage holds 128 vocab rows x 64 of D
// (16 KB of W) plus kBlockN x 64 of the hidden states; every logit is one
// fp32 accumulator fed k-steps 0..D in order, whatever kBlockN is, so a
// row's logits do not depend on the batch (docs/design.md#invariance).
#ifndef FLASHSAMPLER_KERNELS_FUSED_SAMPLER_MMA_CUH_
#define FLASHSAMPLER_KERNELS_FUSED_SAMPLER_MMA_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/sampler/device_ptx.cuh"
#include "kernels/sampler/fused_epilogue.cuh"
#include "kernels/sampler/fused_sampler_internal.h"

namespace flashsampler {
namespace fused {

// kWarpsM x kWarpsN warps tile the 128 x kBlockN CTA tile; kStages pipeline
// stages; kMinBlocks CTAs per SM (bounds registers).
template <typename T, int kBlockN, int kWarpsM, int kWarpsN, int kStages,
          int kMinBlocks>
struct MmaKernelConfig {
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static_assert(kWarpsM * kWarpsN == kWarps, "8 warps per CTA");
  static constexpr int kWarpRows = kTileRows / kWarpsM;
  static constexpr int kWarpCols = kBlockN / kWarpsN;
  static constexpr int kMi = kWarpRows / 16;  // m16 slabs per warp
  static constexpr int kNj = kWarpCols / 8;   // n8 blocks per warp
  static_assert(kMi >= 1 && kNj >= 2 && kNj % 2 == 0, "warp tile shape");
  static constexpr int kStageBytesA = kTileRows * kBlockK * 2;  // 16 KB
  static constexpr int kStageBytesB = kBlockN * kBlockK * 2;
  using Epilogue = EpilogueShared<kBlockN, kWarps>;
  static constexpr size_t kSmemBytes =
      static_cast<size_t>(kStages) * (kStageBytesA + kStageBytesB) +
      sizeof(Epilogue);
};

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a stage whose
// rows are 128 bytes: chunk index XOR (row % 8), so that the 8 rows an
// ldmatrix phase reads (same logical chunk) land in 8 distinct bank groups.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

template <typename T, int kBlockN, int kWarpsM, int kWarpsN, int kStages,
          int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks)
    FusedMmaKernel(FusedArgs args) {
  using Config =
      MmaKernelConfig<T, kBlockN, kWarpsM, kWarpsN, kStages, kMinBlocks>;
  constexpr int kThreads = Config::kThreads;
  constexpr int kMi = Config::kMi;
  constexpr int kNj = Config::kNj;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + kStages * Config::kStageBytesA;
  auto& epilogue = *reinterpret_cast<typename Config::Epilogue*>(
      smem_b + kStages * Config::kStageBytesB);

  const int thread = threadIdx.x;
  const int warp = thread >> 5;
  const int lane = thread & 31;
  const int64_t tile = blockIdx.y;
  const int batch_base = blockIdx.x * kBlockN;
  const int64_t tile_row0 = tile * kTileRows;
  const int hidden = args.hidden_size;
  const T* weights = static_cast<const T*>(args.weights) + tile_row0 * hidden;
  const T* hidden_states = static_cast<const T*>(args.hidden) +
                           static_cast<int64_t>(batch_base) * hidden;
  const int64_t rows_left = args.vocab_rows - tile_row0;
  const int rows_valid =
      rows_left < kTileRows ? static_cast<int>(rows_left) : kTileRows;
  const int cols_valid = min(kBlockN, args.batch - batch_base);

  LoadColumnParams(args, batch_base, thread, kThreads, epilogue);

  // Issues the cp.async copies of k-block `kb` into stage `stage`. Rows past
  // the shard or the batch are zero-filled (and ignored by the epilogue).
  auto load_stage = [&](int stage, int kb) {
    const int k0 = kb * kBlockK;
    const uint32_t a_base =
        ptx::SmemAddr(smem_a + stage * Config::kStageBytesA);
#pragma unroll
    for (int i = 0; i < kTileRows * 8 / kThreads; ++i) {
      const int index = thread + i * kThreads;
      const int row = index >> 3;
      const int chunk = index & 7;
      const bool valid = row < rows_valid;
      const T* src =
          valid ? weights + static_cast<int64_t>(row) * hidden + k0 + chunk * 8
                : weights;
      ptx::CpAsync16(a_base + SwizzledOffset(row, chunk), src, valid);
    }
    const uint32_t b_base =
        ptx::SmemAddr(smem_b + stage * Config::kStageBytesB);
#pragma unroll
    for (int i = 0; i < (kBlockN * 8 + kThreads - 1) / kThreads; ++i) {
      const int index = thread + i * kThreads;
      if (kBlockN * 8 % kThreads == 0 || index < kBlockN * 8) {
        const int row = index >> 3;
        const int chunk = index & 7;
        const bool valid = row < cols_valid;
        const T* src = valid ? hidden_states +
                                   static_cast<int64_t>(row) * hidden + k0 +
                                   chunk * 8
                             : hidden_states;
        ptx::CpAsync16(b_base + SwizzledOffset(row, chunk), src, valid);
      }
    }
  };

  const int num_kb = hidden / kBlockK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kb) load_stage(s, s);
    ptx::CpAsyncCommit();
  }

  const int warp_row0 = (warp % kWarpsM) * Config::kWarpRows;
  const int warp_col0 = (warp / kWarpsM) * Config::kWarpCols;
  float acc[kMi][kNj][4];
#pragma unroll
  for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
    for (int nj = 0; nj < kNj; ++nj) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.0f;
    }
  }

  for (int kb = 0; kb < num_kb; ++kb) {
    ptx::CpAsyncWait<kStages - 2>();
    __syncthreads();
    // The stage refilled here was consumed at kb - 1 by every warp (all are
    // past the barrier above).
    const int next = kb + kStages - 1;
    if (next < num_kb) load_stage(next % kStages, next);
    ptx::CpAsyncCommit();

    const int stage = kb % kStages;
    const uint32_t a_base =
        ptx::SmemAddr(smem_a + stage * Config::kStageBytesA);
    const uint32_t b_base =
        ptx::SmemAddr(smem_b + stage * Config::kStageBytesB);
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      uint32_t a[kMi][4];
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
        const int row = warp_row0 + mi * 16 + (lane & 15);
        const int chunk = 2 * kk + (lane >> 4);
        ptx::LdMatrixX4(a_base + SwizzledOffset(row, chunk), a[mi][0], a[mi][1],
                        a[mi][2], a[mi][3]);
      }
      uint32_t b[kNj][2];
#pragma unroll
      for (int p = 0; p < kNj / 2; ++p) {
        const int row = warp_col0 + p * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int chunk = 2 * kk + ((lane >> 3) & 1);
        ptx::LdMatrixX4(b_base + SwizzledOffset(row, chunk), b[2 * p][0],
                        b[2 * p][1], b[2 * p + 1][0], b[2 * p + 1][1]);
      }
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
        for (int nj = 0; nj < kNj; ++nj) {
          ptx::MmaM16N8K16<T>(acc[mi][nj], a[mi], b[nj][0], b[nj][1]);
        }
      }
    }
  }
  ptx::CpAsyncWait<0>();

  float* staging = epilogue.staging[warp];
  for (int sample = 0; sample < args.num_samples; ++sample) {
    for (int i = thread; i < kBlockN; i += kThreads) {
      epilogue.best[i] = IdentityKey();
    }
    __syncthreads();
    // Fragment mi covers vocab rows row0 + 16 mi .. + 15.
    const int64_t row0 = tile_row0 + warp_row0;
#pragma unroll 1
    for (int nj = 0; nj < kNj; ++nj) {
      float frags[kMi][4];
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) {
#pragma unroll
        for (int e = 0; e < 4; ++e) frags[mi][e] = acc[mi][0][e];
      }
      ScoreFragments(frags, row0, warp_col0 + nj * 8, sample, sample == 0,
                     batch_base, args, staging, epilogue);
      // Block nj + 1 moves to position 0.
#pragma unroll
      for (int mi = 0; mi < kMi; ++mi) RotateBlocks(acc[mi]);
    }
    __syncthreads();
    StoreCandidates(args, tile, sample, batch_base, kBlockN, thread, kThreads,
                    epilogue);
  }
  __shared__ int last_flag;
  FinishInKernelReduce(args, thread, kThreads, gridDim.x * gridDim.y,
                       &last_flag, [] { __syncthreads(); });
}

template <typename T, int kBlockN, int kWarpsM, int kWarpsN, int kStages,
          int kMinBlocks>
cudaError_t LaunchMmaKernel(const FusedArgs& args, cudaStream_t stream) {
  using Config =
      MmaKernelConfig<T, kBlockN, kWarpsM, kWarpsN, kStages, kMinBlocks>;
  auto kernel =
      FusedMmaKernel<T, kBlockN, kWarpsM, kWarpsN, kStages, kMinBlocks>;
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Config::kSmemBytes));
  if (error != cudaSuccess) return error;
  const int64_t tiles = (args.vocab_rows + kTileRows - 1) / kTileRows;
  if (tiles > 65535) return cudaErrorInvalidValue;
  const dim3 grid((args.batch + kBlockN - 1) / kBlockN,
                  static_cast<unsigned>(tiles));
  kernel<<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// Warp layout, pipeline depth and occupancy per kBlockN. Shared memory per
// CTA stays under 113 KB so that two CTAs share an SM (one CTA's epilogue
// overlaps the other's loads): e.g. kBlockN = 64: 4 stages x (16 + 8) KB.
template <int kBlockN>
struct MmaTileConfig;
template <>
struct MmaTileConfig<16> {
  static constexpr int kWarpsM = 8, kWarpsN = 1, kStages = 5, kMinBlocks = 2;
};
template <>
struct MmaTileConfig<64> {
  static constexpr int kWarpsM = 8, kWarpsN = 1, kStages = 4, kMinBlocks = 2;
};
template <>
struct MmaTileConfig<128> {
  static constexpr int kWarpsM = 2, kWarpsN = 4, kStages = 3, kMinBlocks = 2;
};

template <DType kDType, int kBlockN>
cudaError_t LaunchMma(const FusedArgs& args, cudaStream_t stream) {
  using Tile = MmaTileConfig<kBlockN>;
  return LaunchMmaKernel<typename ElementOf<kDType>::Type, kBlockN,
                         Tile::kWarpsM, Tile::kWarpsN, Tile::kStages,
                         Tile::kMinBlocks>(args, stream);
}

}  // namespace fused
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_FUSED_SAMPLER_MMA_CUH_
