// Stage-1 dispatcher: validates a launch, picks the tensor-core path for the
// device (one path per device, for every batch size: DESIGN.md rule 2) and
// the batch columns per CTA, encodes the TMA descriptors of the wgmma path,
// and calls the typed launcher.
#include "kernels/sampler/fused_sampler.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

#include "kernels/sampler/fused_sampler_internal.h"

namespace flashsampler {
namespace {

using fused::DTypeTag;
using fused::FusedArgs;

constexpr int kMaxDevices = 64;
// Elements of D per wgmma ring stage (FusedSampleParams::w_stage_k).
constexpr int kDefaultWgmmaStageK = 64;
// TMA L2 eviction hints (CUTLASS's CacheHintSm90 encodings).
constexpr uint64_t kL2EvictNormal = 0x1000000000000000ull;
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
// W at most this large streams with evict-first at block_n 16 (see the
// default hint in LaunchFusedSample).
constexpr int64_t kEvictFirstMaxWeightBytes = int64_t{320} << 20;
// Per device: 0 = not resolved yet, else 1 + static_cast<int>(FusedKernel).
std::atomic<int> resolved_path[kMaxDevices];

FusedKernel ResolveAuto() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= kMaxDevices) {
    return FusedKernel::kMmaSync;
  }
  const int cached = resolved_path[device].load(std::memory_order_relaxed);
  if (cached != 0) return static_cast<FusedKernel>(cached - 1);
  FusedKernel path = FusedKernel::kMmaSync;
  int major = 0;
  int binary_version = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) == cudaSuccess &&
      major == 9 &&
      fused::WgmmaKernelBinaryVersion(&binary_version) == cudaSuccess &&
      binary_version == 90) {
    path = FusedKernel::kWgmma;
  }
  resolved_path[device].store(1 + static_cast<int>(path),
                              std::memory_order_relaxed);
  return path;
}

// The driver's tensor-map encoder, reached through the runtime so that the
// library links only libcudart.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encoder = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult query;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function,
                                         12000, cudaEnableDefault,
                                         &query) == cudaSuccess &&
        query == cudaDriverEntryPointSuccess) {
      encoder = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
    }
  });
  return encoder;
}

// A [rows, cols] row-major bf16/fp16 matrix read in boxes of 64 columns
// (128 bytes, the swizzle width) x box_rows rows; out-of-bounds reads fill
// zeros.
cudaError_t EncodeTensorMap(
    CUtensorMap* map, const void* base, KernelDType dtype, uint64_t cols,
    uint64_t rows, uint32_t box_rows,
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(fused::kBlockK), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      encode(map,
             dtype == KernelDType::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             2, const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// Batch columns per work item. Small batches are memory-bound: the narrowest
// tile that covers the batch reads W once and keeps the epilogue short.
// Large batches need wide tiles to reuse each W tile across many rows; on
// the mma.sync path the 128-wide tile spills and runs slower than two
// 64-wide ones (device run 1: 1456 vs 752 us at B = 128).
// On the wgmma path B = 17..64 picks between 16-wide tiles (ceil(B / 16)
// of them per vocab tile; W comes from L2 after the first) and one 64-wide
// tile by a count of rounds: the persistent grid's time is its rounds of
// items, and a 16-wide item costs ~3/8 of a 64-wide one (its wgmmas are a
// quarter, its W loads are not). That count picks 16 at B = 17..32 on every
// shape: fused_wgmma_n16 beat the 64-wide tile at B = 32 in all three H200
// runs of 2026-11-22 04:50-05:00 UTC (qwen 0.941-0.959 vs 0.976-1.021 of
// cuBLAS; llama 0.957-0.968 vs 0.964-1.010). At B = 33..64 it picks 16
// only where the 64-wide items leave the last round mostly empty: qwen's
// TP8 shard (149 vocab tiles on 132 SMs: two rounds of 64-wide items for
// 1.13 rounds of work), 6-11% faster at B = 33..64 in alternating
// (fs_bench --ab) runs of session 5, and its TP4 shard at B = 33..48
// (5-8%); it keeps 64 where those runs had the 64-wide tile ahead (the
// full vocabularies, llama's TP4 and TP8 shards but for 1% at llama TP4
// B = 33, qwen's TP4 shard at B = 56..64; docs/perf/
// fused_kernel_attempts.md, attempt 25).
// B = 65..128 on the wgmma path: one 128-wide tile per vocab tile, except on
// a shard of at most 5 vocab tiles per SM (a tensor-parallel shard), where
// two 64-wide ones were 12-20% faster in the H200 run of 2026-11-22 11:00
// UTC (half-size items: a finer last round, half the last item's exposed
// noise epilogue; qwen's TP8 shard at B = 128: 71 vs 86 us). On the full
// vocabularies (7.6-9 tiles per SM) 128 was as fast (qwen) or 10% faster
// (llama) in session 2's runs (docs/perf/fused_kernel_attempts.md, attempt
// 19). B = 129..192 (three 64-wide batch tiles against two 128-wide ones):
// 64-wide tiles at D >= 8192, 6-8% faster on llama's vocabulary and TP4
// shard (with 128-deep stages: DefaultWgmmaStageK) and 24% on its TP8
// shard, and at D <= 4096 where the 128-wide ones would give each SM at
// most 2.5 items (qwen's TP8 shard: 82-84 against 96-117 us); qwen's full
// vocabulary keeps 128 (64 was 15% slower at B = 136 and 160, 8% faster
// at 192). B = 193..256: 128 everywhere, qwen's TP8 shard included (86 vs
// 100 us at B = 256; the 64-wide tile had won there in session 4, before
// the noise blocks and the rotated batch tiles). One H200, fs_bench --ab,
// 2026-11-23 (docs/perf/fused_kernel_attempts.md, attempt 51).
int DefaultBlockN(FusedKernel path, int batch, int64_t vocab_rows,
                  int hidden_size, int multiprocessors) {
  if (batch <= 16) return 16;
  const int64_t tiles = FusedSampleNumTiles(vocab_rows);
  const int64_t sms = multiprocessors;
  if (batch <= 64 && path == FusedKernel::kWgmma) {
    const int64_t rounds_of_64 = (tiles + sms - 1) / sms;
    const int64_t items_of_16 = tiles * ((batch + 15) / 16);
    const int64_t rounds_of_16 = (items_of_16 + sms - 1) / sms;
    return 3 * rounds_of_16 < 8 * rounds_of_64 ? 16 : 64;
  }
  if (batch <= 64 || path == FusedKernel::kMmaSync) return 64;
  if (batch <= 128) return tiles <= 5 * sms ? 64 : 128;
  if (batch <= 192) {
    const int64_t items_of_128 = tiles * 2;
    if (hidden_size >= 8192 ||
        (hidden_size <= 4096 && 2 * items_of_128 <= 5 * sms)) {
      return 64;
    }
  }
  return 128;
}

// Elements of D per wgmma ring stage when FusedSampleParams::w_stage_k is 0:
// 128 for the 16-wide tiles up to B = 32, 64 otherwise. Chosen from
// fs_bench --ab pairs (the variant against the default, call for call), not
// from the sweep's medians, which move by several percent with a variant's
// place in it (docs/perf/fused_kernel_attempts.md, attempt 22). Four such
// runs on one H200 (2026-11-22): 64-deep stages on the 128-wide tiles were
// 1.9-3.5% faster at B = 256 on qwen's full vocabulary and the qwen TP4,
// llama TP4 and TP8 shards, 0-0.5% on llama's full vocabulary, and
// 0.2-1% at B = 128. On the 16-wide tiles they were 0.3-1.2% slower at
// B = 1 and 16 (within the small pairs' spread; 128-deep stages had won
// the sweeps of 04:55 UTC by 1-2.6%) and 3-4% faster at B = 64 on qwen's
// TP8 shard, where DefaultBlockN now takes 16-wide tiles. Same k order for
// every choice: same bits. The 64-wide tiles at B = 129..192 and D >= 8192
// (DefaultBlockN) take 128-deep stages: 15-21% faster than 64-deep ones
// on llama's vocabulary and TP4 shard (attempt 51).
int DefaultWgmmaStageK(int block_n, int batch, int hidden_size) {
  if (block_n == 16 && batch <= 32) return 128;
  if (block_n == 64 && batch > 128 && hidden_size >= 8192) return 128;
  return kDefaultWgmmaStageK;
}

// Bytes of this shard's W (bf16 and fp16 alike: 2 per element).
int64_t WeightBytes(const FusedSampleParams& params) {
  return params.vocab_rows * params.hidden_size * int64_t{2};
}

// Multiprocessors of the current device (the persistent grid), cached.
int MultiprocessorCount() {
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= kMaxDevices) {
    return 132;
  }
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount,
                               device) != cudaSuccess ||
        count <= 0) {
      count = 132;
    }
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

template <DTypeTag kDType>
cudaError_t LaunchMmaFor(int block_n, const FusedArgs& args,
                         cudaStream_t stream) {
  switch (block_n) {
    case 16:
      return fused::LaunchMma<kDType, 16>(args, stream);
    case 64:
      return fused::LaunchMma<kDType, 64>(args, stream);
    case 128:
      return fused::LaunchMma<kDType, 128>(args, stream);
    default:
      return cudaErrorNotSupported;
  }
}

template <DTypeTag kDType, int kHalves>
cudaError_t LaunchWgmmaFor(int block_n, const FusedArgs& args,
                           const CUtensorMap& map_w, const CUtensorMap* maps_h,
                           cudaStream_t stream) {
  const int grid = MultiprocessorCount();
  switch (block_n) {
    case 16:
      return fused::LaunchWgmma<kDType, 16, kHalves>(args, &map_w, maps_h, grid,
                                                     stream);
    case 64:
      return fused::LaunchWgmma<kDType, 64, kHalves>(args, &map_w, maps_h, grid,
                                                     stream);
    case 128:
      return fused::LaunchWgmma<kDType, 128, kHalves>(args, &map_w, maps_h,
                                                      grid, stream);
    default:
      return cudaErrorNotSupported;
  }
}

template <DTypeTag kDType>
cudaError_t LaunchWgmmaFor(int block_n, int stage_k, const FusedArgs& args,
                           const CUtensorMap& map_w, const CUtensorMap* maps_h,
                           cudaStream_t stream) {
  return stage_k == 128
             ? LaunchWgmmaFor<kDType, 2>(block_n, args, map_w, maps_h, stream)
             : LaunchWgmmaFor<kDType, 1>(block_n, args, map_w, maps_h, stream);
}

bool Aligned16(const void* pointer) {
  return (reinterpret_cast<uintptr_t>(pointer) & 15u) == 0;
}

}  // namespace

int FusedSampleTileRows() { return fused::kTileRows; }

int64_t FusedSampleNumTiles(int64_t vocab_rows) {
  return (vocab_rows + fused::kTileRows - 1) / fused::kTileRows;
}

size_t FusedSampleWorkspaceSize(int batch, int64_t /*vocab_rows*/,
                                int /*hidden_size*/) {
  return fused::kWorkspaceCounterBytes + sizeof(unsigned long long) *
                                             static_cast<size_t>(batch) *
                                             fused::kMaxInKernelReduceSamples;
}

FusedKernel FusedSampleResolveKernel(FusedKernel requested) {
  return requested == FusedKernel::kAuto ? ResolveAuto() : requested;
}

cudaError_t LaunchFusedSample(const FusedSampleParams& params, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  const bool reduce_in_kernel =
      params.token_ids != nullptr || params.shard_winners != nullptr;
  // The workspace's keys: the in-kernel stage 2, or (tensor parallel) only a
  // pruning floor next to per-tile candidates.
  const bool use_keys =
      reduce_in_kernel ||
      (params.floor_in_workspace &&
       params.num_samples <= fused::kMaxInKernelReduceSamples);
  if (use_keys && (workspace == nullptr ||
                   workspace_bytes <
                       FusedSampleWorkspaceSize(params.batch, params.vocab_rows,
                                                params.hidden_size) ||
                   params.num_samples > fused::kMaxInKernelReduceSamples ||
                   (reinterpret_cast<uintptr_t>(workspace) & 255u) != 0)) {
    return cudaErrorInvalidValue;
  }
  if (params.weights == nullptr || params.hidden == nullptr ||
      params.inv_temperature == nullptr || params.seeds == nullptr ||
      params.steps == nullptr ||
      (params.candidates == nullptr && !reduce_in_kernel) ||
      !Aligned16(params.weights) || !Aligned16(params.hidden) ||
      params.hidden_size <= 0 || params.hidden_size % fused::kBlockK != 0 ||
      params.batch < 1 || params.batch > kMaxFusedBatch ||
      (params.hidden_capacity_rows != 0 &&
       params.hidden_capacity_rows < params.batch) ||
      params.num_samples < 1 || params.vocab_rows < 1 ||
      params.vocab_offset < 0 ||
      params.vocab_offset + params.vocab_rows > int64_t{INT32_MAX} ||
      FusedSampleNumTiles(params.vocab_rows) > 65535) {
    return cudaErrorInvalidValue;
  }
  const FusedKernel path = FusedSampleResolveKernel(params.kernel);
  const int block_n =
      params.block_n != 0
          ? params.block_n
          : DefaultBlockN(path, params.batch, params.vocab_rows,
                          params.hidden_size, MultiprocessorCount());
  FusedArgs args;
  args.weights = params.weights;
  args.hidden = params.hidden;
  args.vocab_rows = params.vocab_rows;
  args.vocab_offset = params.vocab_offset;
  args.hidden_size = params.hidden_size;
  args.batch = params.batch;
  args.num_samples = params.num_samples;
  args.inv_temperature = params.inv_temperature;
  args.seeds = params.seeds;
  args.steps = params.steps;
  args.candidates = params.candidates;
  args.logits_out = params.logits_out;
  args.counter = use_keys ? static_cast<unsigned int*>(workspace) : nullptr;
  args.keys =
      use_keys
          ? reinterpret_cast<unsigned long long*>(
                static_cast<char*>(workspace) + fused::kWorkspaceCounterBytes)
          : nullptr;
  args.token_ids = params.token_ids;
  args.winning_scores = params.winning_scores;
  args.shard_winners = params.shard_winners;
  args.split_last_round = params.split_last_round;
  args.share_last_epilogue = params.share_last_epilogue;
  args.multicast_h = params.multicast_h;
  args.timeline = params.timeline;
  args.timeline_pieces = params.timeline_pieces;
  // W streams through L2 once, unless a second batch tile re-reads it.
  switch (params.w_l2_hint) {
    case L2Hint::kEvictFirst:
      args.w_cache_hint = kL2EvictFirst;
      break;
    case L2Hint::kEvictNormal:
      args.w_cache_hint = kL2EvictNormal;
      break;
    default:
      // Evict-first for the 16-wide tiles of a small shard, normal
      // otherwise. Alternating pairs (fs_bench --ab, one H200, 2026-11-22
      // 17:33 UTC, B = 1, 8, 16, two runs; fused_kernel_attempts.md,
      // attempt 26): evict-first was 5-9% faster on qwen's TP8 shard
      // (156 MB of W), 0.5-2.5% on llama's (263 MB), 0-1.5% on qwen's TP4
      // shard (311 MB), but 2-3% slower on llama's TP4 shard (525 MB) and
      // 4-6% slower on the full vocabularies (1.2-2.1 GB).
      args.w_cache_hint =
          block_n == 16 && WeightBytes(params) <= kEvictFirstMaxWeightBytes
              ? kL2EvictFirst
              : kL2EvictNormal;
  }
  if (path == FusedKernel::kMmaSync) {
    return params.dtype == KernelDType::kBf16
               ? LaunchMmaFor<DTypeTag::kBf16>(block_n, args, stream)
               : LaunchMmaFor<DTypeTag::kFp16>(block_n, args, stream);
  }
  if (ResolveAuto() != FusedKernel::kWgmma) return cudaErrorNotSupported;
  if (block_n != 16 && block_n != 64 && block_n != 128) {
    return cudaErrorNotSupported;
  }
  CUtensorMap map_w;
  // H in boxes of block_n rows, and of block_n / 2 rows for the half pieces
  // of a split last round (block_n 128 only; a copy of the first map
  // otherwise).
  CUtensorMap maps_h[2];
  // Default promotion: 128 B at block_n 16 (pure W streaming at B <= 32),
  // where two H200 runs measured it 2-3% faster than 256 B
  // (fused_wgmma_n16_normal_p128 in docs/perf/h200x2_2026-11-22*/), and at
  // block_n 64 (measured at B = 33..64: fused_wgmma_n64_normal_p128 2.4-2.7%
  // faster on both configs, docs/perf/fused_kernel_attempts.md attempt 14);
  // 256 B at block_n 128, where neither won consistently. block_n 16 at
  // B = 33..64 (small shards, DefaultBlockN) keeps the 16-wide tile's 128 B.
  const int promotion_bytes = params.w_l2_promotion != 0 ? params.w_l2_promotion
                              : block_n == 128           ? 256
                                                         : 128;
  CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  if (promotion_bytes == 128) {
    promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  } else if (promotion_bytes < 0) {
    promotion = CU_TENSOR_MAP_L2_PROMOTION_NONE;
  }
  cudaError_t error = EncodeTensorMap(&map_w, params.weights, params.dtype,
                                      static_cast<uint64_t>(params.hidden_size),
                                      static_cast<uint64_t>(params.vocab_rows),
                                      fused::kTileRows, promotion);
  if (error != cudaSuccess) return error;
  // H's rows as TMA sees them: the batch rounded up to the tile width where
  // the caller's buffer has those rows (FusedSampleParams::
  // hidden_capacity_rows), so that no box crosses the tensor's end; the
  // epilogue ignores the columns past the batch either way.
  const int64_t padded_batch =
      (static_cast<int64_t>(params.batch) + block_n - 1) / block_n * block_n;
  const int64_t h_rows = std::max<int64_t>(
      params.batch,
      std::min<int64_t>(params.hidden_capacity_rows, padded_batch));
  const auto encode_h = [&](CUtensorMap* map, int box_rows) {
    return EncodeTensorMap(map, params.hidden, params.dtype,
                           static_cast<uint64_t>(params.hidden_size),
                           static_cast<uint64_t>(h_rows),
                           static_cast<uint32_t>(box_rows));
  };
  error = encode_h(&maps_h[0], block_n);
  if (error != cudaSuccess) return error;
  maps_h[1] = maps_h[0];
  if (block_n == 128) {
    error = encode_h(&maps_h[1], block_n / 2);
    if (error != cudaSuccess) return error;
  }
  int stage_k =
      params.w_stage_k != 0
          ? params.w_stage_k
          : DefaultWgmmaStageK(block_n, params.batch, params.hidden_size);
  if (stage_k != 64 && stage_k != 128) return cudaErrorNotSupported;
  // 128-deep stages need whole stages; the same k order either way.
  if (params.hidden_size % 128 != 0) stage_k = 64;
  return params.dtype == KernelDType::kBf16
             ? LaunchWgmmaFor<DTypeTag::kBf16>(block_n, stage_k, args, map_w,
                                               maps_h, stream)
             : LaunchWgmmaFor<DTypeTag::kFp16>(block_n, stage_k, args, map_w,
                                               maps_h, stream);
}

}  // namespace flashsampler
