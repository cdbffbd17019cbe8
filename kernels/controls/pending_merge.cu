// The pending rows' merge (LaunchMergePendingEntries): each row's list
// entries, as ControlledPlan wrote them, sorted by id in shared memory and
// merged into the entries the plan's host merge (MergeEntries) writes, bit
// for bit: ids ascending, an id's bias the fp32 sum of its bias entries in
// list order, its flags and its output counts' sum.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/controls/block_scan.cuh"
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
  // [padded] keys, padded a power of two, then [padded] values, flags and
  // counts.
  extern __shared__ uint32_t keys[];
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

  // Every sorted key's entry, gathered by all the threads at once: the key
  // keeps its id and takes the entry's kind in place of its place, and
  // values[] holds the entry's value.
  uint32_t* const values = keys + padded;
  uint32_t* const id_flags = values + padded;  // [distinct ids]
  int32_t* const id_counts =
      reinterpret_cast<int32_t*>(id_flags + padded);  // [distinct ids]
  constexpr uint32_t kPlaceMask = kPendingMaxKeys - 1;
  for (int i = tid; i < n; i += kMergeThreads) {
    const PendingListEntry e = entries[keys[i] & kPlaceMask];
    keys[i] = (keys[i] & ~kPlaceMask) | e.id_kind >> kPendingKindShift;
    values[i] = e.value;
    id_flags[i] = 0;
    id_counts[i] = 0;
  }
  __syncthreads();

  // Each thread's span of sorted keys. An id's flags and output counts are
  // gathered span by span (OR and an integer sum: any order gives the
  // same), so that no thread walks a long run of one id alone: walked by
  // the thread of its first key, a row of 8192 entries of one id took 0.70
  // ms (1.18 ms reading them from global memory); span by span 0.19 ms,
  // most of it the serial sum of its 2048 bias entries (H100). An id's
  // entry goes at the count of first keys before it.
  const int span = (n + kMergeThreads - 1) / kMergeThreads;
  const int begin = min(n, tid * span);
  const int end = min(n, begin + span);
  auto first_of_id = [n](int i) {
    return i < n && (i == 0 || KeyId(keys[i]) != KeyId(keys[i - 1]));
  };
  int heads = 0;
  for (int i = begin; i < end; ++i) heads += first_of_id(i) ? 1 : 0;
  int total = 0;  // the row's distinct ids
  const int before =
      controls::BlockExclusiveScan<kMergeWarps>(heads, warp_heads, &total);

  const ControlledRow& row = m.row_controls[merge.first_row];
  const int64_t out_begin = row.special_begin;
  const bool penalized = row.repetition_penalty != 1.0f;
  // MergeEntries' flags and counts, span by span; `index` is the id's
  // place among the row's distinct ids (the span's first key may continue
  // the span before's id).
  {
    int index = before - 1;
    uint32_t flags = 0;
    int32_t count = 0;
    for (int i = begin; i < end; ++i) {
      if (first_of_id(i)) {
        if (index >= 0 && (flags != 0 || count != 0)) {
          atomicOr(&id_flags[index], flags);
          atomicAdd(&id_counts[index], count);
        }
        ++index;
        flags = 0;
        count = 0;
      }
      const uint32_t kind = keys[i] & kPlaceMask;
      flags |= controls::ListEntryFlag(kind, penalized);
      if (kind == kPendingOutput) count += static_cast<int32_t>(values[i]);
    }
    if (index >= 0 && (flags != 0 || count != 0)) {
      atomicOr(&id_flags[index], flags);
      atomicAdd(&id_counts[index], count);
    }
  }
  __syncthreads();

  // The bias, an fp32 sum in list order, by the thread of the id's first
  // key: an id's bias entries come first among its keys (the lists' order),
  // so it walks those alone.
  int index = before;
  for (int i = begin; i < end; ++i) {
    if (!first_of_id(i)) continue;
    const uint32_t id = KeyId(keys[i]);
    float bias = 0.0f;
    for (int j = i; j < n && KeyId(keys[j]) == id &&
                    (keys[j] & kPlaceMask) == kPendingBias;
         ++j) {
      bias = j == i ? __uint_as_float(values[j])
                    : __fadd_rn(bias, __uint_as_float(values[j]));
    }
    const int64_t out = out_begin + index;
    m.special_ids[out] = static_cast<int32_t>(id);
    m.special_flags[out] = static_cast<uint8_t>(id_flags[index]);
    m.special_bias[out] = bias;
    m.special_count[out] = id_counts[index];
    ++index;
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
  // Keys, values, flags and counts: 128 KB for kPendingMaxKeys, above the
  // 48 KB a launch gets unless the kernel asks for more.
  const size_t shared = 4 * sizeof(uint32_t) * static_cast<size_t>(padded);
  constexpr size_t kDefaultShared = size_t{48} << 10;
  if (shared > kDefaultShared) {
    const cudaError_t raised = cudaFuncSetAttribute(
        MergePendingEntriesKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(shared));
    if (raised != cudaSuccess) return raised;
  }
  MergePendingEntriesKernel<<<merges.count, kMergeThreads, shared, stream>>>(
      merges);
  return cudaGetLastError();
}

}  // namespace flashsampler
