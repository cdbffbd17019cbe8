// Block-wide exclusive scan of one int per thread, shared by the controlled
// sampler's kernels (controlled_sampler.cu) and the pending rows' merge
// (pending_merge.cu). Device code only: include from .cu files.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_BLOCK_SCAN_CUH_
#define FLASHSAMPLER_KERNELS_CONTROLS_BLOCK_SCAN_CUH_

namespace flashsampler {
namespace controls {

// Exclusive position of this thread's `count` items in thread order, and the
// block's total in `*total`, for a block of kBlockWarps warps through one
// slot per warp. Every thread calls it.
template <int kBlockWarps>
__device__ int BlockExclusiveScan(int count, int* warp_slots, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inclusive = count;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  __syncthreads();  // earlier readers of warp_slots are done
  if (lane == 31) warp_slots[warp] = inclusive;
  __syncthreads();
  int before = 0;
  int all = 0;
  for (int w = 0; w < kBlockWarps; ++w) {
    if (w < warp) before += warp_slots[w];
    all += warp_slots[w];
  }
  *total = all;
  return before + inclusive - count;
}

}  // namespace controls
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_BLOCK_SCAN_CUH_
