// The pending rows' merge (LaunchMergePendingEntries): each row's list
// entries, as ControlledPlan wrote them, sorted by id in shared memory and
// merged into the entries the plan's host merge (MergeEntries) writes, bit
// for bit: ids ascending, an id's bias the fp32 sum of its bias entries in
// list order, its flags and its output counts' sum.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/controls/controlled_math.h"
#include "kernels/controls/controlled_sampler.h"

namespace flashsampler {
namespace {

// 256 threads: a row of 196 keys (64 bias entries, 4 bans, 64 prompt and 64
// output ids) sorts in 36 steps of one compare a thread; 8192 keys take 16
// a thread a step.
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / 32;
// A key is id << kPlaceBits | place, its place in the row's list entries:
// ascending keys are ids ascending and an id's entries in list order.
constexpr int kPlaceBits = 13;
static_assert((1 << kPlaceBits) == kPendingMaxKeys,
              "a place must fit below the id");
static_assert(kPendingMaxVocab << kPlaceBits == int64_t{1} << 32,
              "a key must fit 32 bits");
constexpr uint32_t kIdMask = (1u << kPendingKindShift) - 1u;

__device__ __forceinline__ uint32_t KeyId(uint32_t key) {
  return key >> kPlaceBits;
}

__global__ void __launch_bounds__(kMergeThreads)
    MergePendingEntriesKernel(PendingMerges m) {
  extern __shared__ uint32_t keys[];  // [padded], padded a power of two
  __shared__ int32_t warp_heads[kMergeWarps];
  const PendingMergeRow merge = m.merges[blockIdx.x];
  const PendingListEntry* entries = m.entries + merge.key_begin;
  const int n = merge.key_count;
  int padded = 1;
  while (padded < n) padded <<= 1;
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < padded; i += kMergeThreads) {
    keys[i] = i < n ? (entries[i].id_kind & kIdMask) << kPlaceBits |
                          static_cast<uint32_t>(i)
                    : ~0u;
  }
  __syncthreads();
  // Bitonic sort, ascending. The keys are distinct (their places are), so
  // the order is the sort's whatever network sorts them.
  for (int size = 2; size <= padded; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < padded / 2; i += kMergeThreads) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const uint32_t a = keys[lo];
        const uint32_t b = keys[hi];
        if ((a > b) == ((lo & size) == 0)) {
          keys[lo] = b;
          keys[hi] = a;
        }
      }
      __syncthreads();
    }
  }

  // Each thread's span of sorted places; an id's entry is written by the
  // thread whose span holds its first key, at the count of first keys
  // before it.
  const int span = (n + kMergeThreads - 1) / kMergeThreads;
  const int begin = min(n, tid * span);
  const int end = min(n, begin + span);
  auto first_of_id = [n](int i) {
    return i < n && (i == 0 || KeyId(keys[i]) != KeyId(keys[i - 1]));
  };
  int heads = 0;
  for (int i = begin; i < end; ++i) heads += first_of_id(i) ? 1 : 0;
  // Exclusive scan of the threads' heads: within each warp, then across.
  const int lane = tid & 31;
  const int warp = tid >> 5;
  int inclusive = heads;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += v;
  }
  if (lane == 31) warp_heads[warp] = inclusive;
  __syncthreads();
  int before = inclusive - heads;
  int total = 0;
  for (int w = 0; w < kMergeWarps; ++w) {
    if (w < warp) before += warp_heads[w];
    total += warp_heads[w];
  }

  const ControlledRow& row = m.row_controls[merge.first_row];
  const int64_t out_begin = row.special_begin;
  const bool penalized = row.repetition_penalty != 1.0f;
  int64_t out = out_begin + before;
  for (int i = begin; i < end; ++i) {
    if (!first_of_id(i)) continue;
    const uint32_t id = KeyId(keys[i]);
    uint8_t flags = 0;
    float bias = 0.0f;
    int32_t count = 0;
    // MergeEntries' rules, entry by entry in list order.
    for (int j = i; j < n && KeyId(keys[j]) == id; ++j) {
      const PendingListEntry e = entries[keys[j] & (kPendingMaxKeys - 1)];
      switch (e.id_kind >> kPendingKindShift) {
        case kPendingBias:
          bias = (flags & controls::kSpecialHasBias)
                     ? __fadd_rn(bias, __uint_as_float(e.value))
                     : __uint_as_float(e.value);
          flags |= controls::kSpecialHasBias;
          break;
        case kPendingBanned:
          flags |= controls::kSpecialBanned;
          break;
        case kPendingPrompt:
          flags |= controls::kSpecialRepeated;
          break;
        default:
          if (penalized) flags |= controls::kSpecialRepeated;
          count += static_cast<int32_t>(e.value);
          break;
      }
    }
    m.special_ids[out] = static_cast<int32_t>(id);
    m.special_flags[out] = flags;
    m.special_bias[out] = bias;
    m.special_count[out] = count;
    ++out;
  }
  for (int r = tid; r < merge.rows; r += kMergeThreads) {
    m.row_controls[merge.first_row + r].special_end = out_begin + total;
  }
}

}  // namespace

cudaError_t LaunchMergePendingEntries(const PendingMerges& merges,
                                      cudaStream_t stream) {
  if (merges.count == 0) return cudaSuccess;
  if (merges.count < 0 || merges.max_keys < 1 ||
      merges.max_keys > kPendingMaxKeys || merges.merges == nullptr ||
      merges.entries == nullptr || merges.row_controls == nullptr ||
      merges.special_ids == nullptr || merges.special_flags == nullptr ||
      merges.special_bias == nullptr || merges.special_count == nullptr) {
    return cudaErrorInvalidValue;
  }
  int padded = 1;
  while (padded < merges.max_keys) padded <<= 1;
  const size_t shared = sizeof(uint32_t) * static_cast<size_t>(padded);
  MergePendingEntriesKernel<<<merges.count, kMergeThreads, shared, stream>>>(
      merges);
  return cudaGetLastError();
}

}  // namespace flashsampler
