// Stage-1 dispatcher: validates a launch, picks the tensor-core path for the
// device (one path per device, for every batch size: docs/design.md#invariance)
// and the batch columns per CTA, encodes the TMA descriptors of the wgmma path,
// and calls the typed launcher.
#include "kernels/sampler/fused_sampler.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kernels/sampler/fused_sampler_internal.h"

namespace flashsampler {
namespace {

using fused::FusedArgs;

constexpr int kMaxDevices = 64;
// Elements of D per wgmma ring stage (FusedTuning::w_stage_k).
constexpr int kDefaultWgmmaStageK = 64;
// TMA L2 eviction hints (CUTLASS's CacheHintSm90 encodings).
constexpr uint64_t kL2EvictNormal = 0x1000000000000000ull;
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
// W at most this large streams with evict-first at block_n 16
// (WeightL2Hint).
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
    CUtensorMap* map, const void* base, DType dtype, uint64_t cols,
    uint64_t rows, uint32_t box_rows,
    CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  CUtensorMapDataType type;
  switch (dtype) {
    case DType::kBf16:
      type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
      break;
    case DType::kFp16:
      type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {cols * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(fused::kBlockK), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = encode(
      map, type, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The width of two equal batch tiles that cover `batch` (129..256): the
// batch's half rounded up to the epilogue's 16 columns, 80 to 128.
int BalancedBlockN(int batch) { return ((batch + 1) / 2 + 15) / 16 * 16; }

// Batch columns per work item. Small batches are memory-bound: the narrowest
// tile that covers the batch reads W once. Larger ones need wide tiles to
// reuse each W tile across rows, and the persistent grid's time is its
// rounds of items, so the wgmma rule counts rounds (a 16-wide item costs
// ~3/8 of a 64-wide one):
//   B <= 16: 16 on both paths;
//   mma.sync, B > 16: 64 (its 128-wide tile spills: 1456 vs 752 us, B = 128);
//   B = 17..64: 16 while 3 x its rounds < 8 x the 64-wide rounds (B <= 32,
//     and shards whose 64-wide last round is mostly empty: qwen TP8 6-11%);
//   B = 65..128: 64 on <= 5 vocab tiles per SM (TP shards, 12-20%), else 128;
//   B = 129..256 on > 5 vocab tiles per SM (a whole vocabulary): two equal
//     tiles (BalancedBlockN), so that the pair of CTAs that share a vocab
//     tile's W multiply at most 31 empty columns instead of up to 127:
//     qwen B = 136 432 against 700 us for 128 + 128 and llama B = 136 752
//     against 865 for 64-wide tiles (H100, docs/performance.md);
//   shards, B = 129..192: 64 at D >= 8192 (llama TP8, 24%) or where 128-wide
//     items give each SM <= 2.5 (qwen TP8: 82 vs 96 us), else 128;
//   shards, B = 193..256: 128 (its half-empty last round splits).
// fs_bench --ab pairs on H200 unless stated (docs/performance.md).
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
  if (tiles > 5 * sms) return BalancedBlockN(batch);
  if (batch <= 192) {
    const int64_t items_of_128 = tiles * 2;
    if (hidden_size >= 8192 ||
        (hidden_size <= 4096 && 2 * items_of_128 <= 5 * sms)) {
      return 64;
    }
  }
  return 128;
}

// Elements of D per wgmma ring stage when FusedTuning::w_stage_k is 0: 128
// for the 16-wide tiles up to B = 32 (1-2.6% faster) and for the 64-wide
// tiles at B > 128 and D >= 8192 (15-21% faster on llama's shapes), else 64
// (1.9-3.5% faster on the 128-wide tiles at B = 256). fs_bench --ab pairs
// on H200 (docs/performance.md); the same k order, so the same bits. The
// two-tile widths 80..112 keep 64 at D >= 8192 too: 768 against 985 us
// (80, B = 136), 768 against 859 (96, B = 168) and 796 against 927 (112,
// B = 200) on llama, fs_bench's sweep on an H100.
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

template <DType kDType>
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

// The wgmma kernel's batch tile widths (instantiated in
// fused_sampler_wgmma_{bf16,fp16}.cu).
bool IsWgmmaBlockN(int block_n) {
  switch (block_n) {
    case 16:
    case 64:
    case 80:
    case 96:
    case 112:
    case 128:
      return true;
    default:
      return false;
  }
}

template <DType kDType, int kHalves>
cudaError_t LaunchWgmmaFor(int block_n, const FusedArgs& args,
                           const CUtensorMap* maps_w, const CUtensorMap* maps_h,
                           cudaStream_t stream) {
  const int grid = MultiprocessorCount();
  switch (block_n) {
    case 16:
      return fused::LaunchWgmma<kDType, 16, kHalves>(args, maps_w, maps_h, grid,
                                                     stream);
    case 64:
      return fused::LaunchWgmma<kDType, 64, kHalves>(args, maps_w, maps_h, grid,
                                                     stream);
    case 80:
      return fused::LaunchWgmma<kDType, 80, kHalves>(args, maps_w, maps_h, grid,
                                                     stream);
    case 96:
      return fused::LaunchWgmma<kDType, 96, kHalves>(args, maps_w, maps_h, grid,
                                                     stream);
    case 112:
      return fused::LaunchWgmma<kDType, 112, kHalves>(args, maps_w, maps_h,
                                                      grid, stream);
    case 128:
      return fused::LaunchWgmma<kDType, 128, kHalves>(args, maps_w, maps_h,
                                                      grid, stream);
    default:
      return cudaErrorNotSupported;
  }
}

template <DType kDType>
cudaError_t LaunchWgmmaFor(int block_n, int stage_k, const FusedArgs& args,
                           const CUtensorMap* maps_w, const CUtensorMap* maps_h,
                           cudaStream_t stream) {
  return stage_k == 128
             ? LaunchWgmmaFor<kDType, 2>(block_n, args, maps_w, maps_h, stream)
             : LaunchWgmmaFor<kDType, 1>(block_n, args, maps_w, maps_h, stream);
}

// Calls launch(std::integral_constant<DType, d>()) for the runtime dtype d:
// the tensor cores take bf16 and fp16 operands, anything else is refused.
template <typename Launch>
cudaError_t DispatchDType(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kBf16:
      return launch(std::integral_constant<DType, DType::kBf16>());
    case DType::kFp16:
      return launch(std::integral_constant<DType, DType::kFp16>());
    default:
      return cudaErrorInvalidValue;
  }
}

// TMA L2 hint of W's loads. Default: evict-first for the 16-wide tiles of a
// shard of at most kEvictFirstMaxWeightBytes (5-9% faster on qwen's TP8
// shard, 156 MB), normal otherwise (evict-first was 2-6% slower from
// 525 MB up, where a second batch tile re-reads W). fs_bench --ab pairs on
// H200 (docs/performance.md).
uint64_t WeightL2Hint(const FusedSampleParams& params, int block_n) {
  switch (params.tuning.w_l2_hint) {
    case L2Hint::kEvictFirst:
      return kL2EvictFirst;
    case L2Hint::kEvictNormal:
      return kL2EvictNormal;
    default:
      return block_n == 16 && WeightBytes(params) <= kEvictFirstMaxWeightBytes
                 ? kL2EvictFirst
                 : kL2EvictNormal;
  }
}

// Whether a launch's CTA pairs multicast W (FusedTuning::multicast_w): at
// the two-tile width 128 (B = 225..256 on a whole vocabulary), and at 112
// (B = 193..224) below D = 8192, for launches that score noise or nothing
// else. There a pair's CTAs drift apart without it and the second reads
// its W tile from DRAM again: 549 against 615 us at qwen B = 256, 488
// against 574 at B = 200, 886 against 944 at llama B = 256 (fs_bench --ab,
// flat rows, H100). Where the drift costs less than the pair's lockstep it
// is off: llama at 112 (B = 200-224: 1.4% slower with it), and 80 and 96
// (B = 129..192: from 1.3% faster to 1.7% slower over two runs). The unit
// candidates' epilogue is long and uneven between a pair's batch tiles,
// and in lockstep the faster CTA waits: qwen B = 256 top_k + top_p + min_p
// from units 566-579 against 559-564 us, everything 603-614 against
// 589-592 (two alternating runs).
bool PairsShareWeights(const FusedSampleParams& params, int block_n) {
  const bool width =
      block_n == 128 || (block_n == 112 && params.hidden_size < 8192);
  return params.tuning.multicast_w && width && params.batch > block_n &&
         params.unit_candidates.records == nullptr;
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

cudaError_t FusedSampleSetAsideL2ForUnits(int64_t bytes, size_t* set_aside) {
  *set_aside = 0;
  int device = 0;
  int l2 = 0;
  int most = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  }
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&most, cudaDevAttrMaxPersistingL2CacheSize,
                                   device);
  }
  if (error != cudaSuccess) {
    cudaGetLastError();  // nothing left pending for the caller's next check
    return error;
  }
  // 2/5 of the L2 (20 of 50 MiB on an H100) holds the records of 128 rows
  // at V = 151936 (19.5 MB). The set-aside costs other kernels L2 even
  // while no persisting line holds it (H100, qwen): 25 MiB slowed the
  // fused kernel with fp32 logits out by 9 us at B = 128 and 40 at 256
  // (20 MiB: 3 and 17), 28 MiB the plain kernel by 2% at every B; top_k +
  // top_p + min_p from units took 461 us at B = 128 with 20 or 25 MiB
  // against 476 without.
  const size_t wanted =
      bytes < 0 ? static_cast<size_t>(l2) / 5 * 2 : static_cast<size_t>(bytes);
  const size_t size = std::min(wanted, static_cast<size_t>(std::max(most, 0)));
  error = cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, size);
  if (error != cudaSuccess) {
    cudaGetLastError();  // MIG, MPS: refused; nothing left pending
    return error;
  }
  *set_aside = size;
  return cudaSuccess;
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
  if ((params.dtype != DType::kBf16 && params.dtype != DType::kFp16) ||
      params.weights == nullptr || params.hidden == nullptr ||
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
  const UnitCandidates& units = params.unit_candidates;
  if (units.records != nullptr &&
      (units.row_bound == nullptr || units.row_top == nullptr ||
       (reinterpret_cast<uintptr_t>(units.records) & 31u) != 0 ||
       (units.token_classes != nullptr && units.entry_logits == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const FusedTuning& tuning = params.tuning;
  const FusedKernel path = FusedSampleResolveKernel(tuning.kernel);
  // The units are the wgmma epilogue's warps' rows.
  if (units.records != nullptr && path != FusedKernel::kWgmma) {
    return cudaErrorNotSupported;
  }
  const int block_n =
      tuning.block_n != 0
          ? tuning.block_n
          : DefaultBlockN(path, params.batch, params.vocab_rows,
                          params.hidden_size, MultiprocessorCount());
  FusedArgs args(params);
  if (use_keys) {
    args.counter = static_cast<unsigned int*>(workspace);
    args.keys = reinterpret_cast<unsigned long long*>(
        static_cast<char*>(workspace) + fused::kWorkspaceCounterBytes);
  }
  args.w_cache_hint = WeightL2Hint(params, block_n);
  args.tuning.multicast_w = PairsShareWeights(params, block_n);
  if (path == FusedKernel::kMmaSync) {
    return DispatchDType(params.dtype, [&](auto dtype) {
      return LaunchMmaFor<decltype(dtype)::value>(block_n, args, stream);
    });
  }
  if (ResolveAuto() != FusedKernel::kWgmma) return cudaErrorNotSupported;
  if (!IsWgmmaBlockN(block_n)) return cudaErrorNotSupported;
  // W in boxes of a vocab tile's rows, and of half of them where a pair
  // may multicast W (each CTA's share; a copy of the first map otherwise).
  CUtensorMap maps_w[2];
  // H in boxes of block_n rows, and of block_n / 2 rows for the half pieces
  // of a split last round (block_n 128 only; a copy of the first map
  // otherwise).
  CUtensorMap maps_h[2];
  // Default promotion: 128 B at block_n 16 and 64 (2-3% faster than 256 B
  // there), 256 B at block_n 128 (neither won consistently) and at the
  // two-tile widths 80..112, which stream W like it (not compared
  // separately). fs_bench --ab pairs on H200 (docs/performance.md).
  const int promotion_bytes = tuning.w_l2_promotion != 0 ? tuning.w_l2_promotion
                              : block_n >= 80            ? 256
                                                         : 128;
  CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  if (promotion_bytes == 128) {
    promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  } else if (promotion_bytes < 0) {
    promotion = CU_TENSOR_MAP_L2_PROMOTION_NONE;
  }
  const auto encode_w = [&](CUtensorMap* map, int box_rows) {
    return EncodeTensorMap(map, params.weights, params.dtype,
                           static_cast<uint64_t>(params.hidden_size),
                           static_cast<uint64_t>(params.vocab_rows),
                           static_cast<uint32_t>(box_rows), promotion);
  };
  cudaError_t error = encode_w(&maps_w[0], fused::kTileRows);
  if (error != cudaSuccess) return error;
  maps_w[1] = maps_w[0];
  if (args.tuning.multicast_w) {
    error = encode_w(&maps_w[1], fused::kTileRows / 2);
    if (error != cudaSuccess) return error;
  }
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
      tuning.w_stage_k != 0
          ? tuning.w_stage_k
          : DefaultWgmmaStageK(block_n, params.batch, params.hidden_size);
  if (stage_k != 64 && stage_k != 128) return cudaErrorNotSupported;
  // 128-deep stages need whole stages; the same k order either way.
  if (params.hidden_size % 128 != 0) stage_k = 64;
  return DispatchDType(params.dtype, [&](auto dtype) {
    return LaunchWgmmaFor<decltype(dtype)::value>(block_n, stage_k, args,
                                                  maps_w, maps_h, stream);
  });
}

namespace fused {

cudaAccessPolicyWindow UnitRecordsL2Window(const FusedSampleParams& params) {
  cudaAccessPolicyWindow window = {};
  if (params.unit_candidates.records == nullptr) return window;
  int device = 0;
  int max_window = 0;
  size_t set_aside = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&max_window, cudaDevAttrMaxAccessPolicyWindowSize,
                             device) != cudaSuccess ||
      cudaDeviceGetLimit(&set_aside, cudaLimitPersistingL2CacheSize) !=
          cudaSuccess) {
    cudaGetLastError();  // a GPU without the limit: no window
    return window;
  }
  if (set_aside == 0 || max_window <= 0) return window;
  const size_t bytes =
      std::min(sizeof(UnitRecord) * static_cast<size_t>(params.batch) *
                   static_cast<size_t>(UnitsPerRow(params.vocab_rows)),
               static_cast<size_t>(max_window));
  window.base_ptr = params.unit_candidates.records;
  window.num_bytes = bytes;
  window.hitRatio = static_cast<float>(std::min(
      1.0, static_cast<double>(set_aside) / static_cast<double>(bytes)));
  window.hitProp = cudaAccessPropertyPersisting;
  window.missProp = cudaAccessPropertyStreaming;
  return window;
}

}  // namespace fused

}  // namespace flashsampler
