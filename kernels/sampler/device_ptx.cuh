// Thin inline-PTX wrappers used by the stage-1 kernels: cp.async, ldmatrix,
// mma.sync (sm_80+), mbarrier, TMA and wgmma (sm_90a), and the global timer.
// Each wrapper is one instruction so that the kernels read as the algorithm;
// the sm_90a ones compile to nothing on other targets (their callers are
// guarded too).
#ifndef FLASHSAMPLER_KERNELS_DEVICE_PTX_CUH_
#define FLASHSAMPLER_KERNELS_DEVICE_PTX_CUH_

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FS_SM90A_ENABLED 1
#else
#define FS_SM90A_ENABLED 0
#endif

namespace flashsampler {
namespace ptx {

__device__ __forceinline__ uint32_t SmemAddr(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// ---- sm_80: cp.async, ldmatrix, mma.sync --------------------------------

// 16-byte global -> shared copy that bypasses L1; zero-fills when !valid
// (src-size 0 reads nothing, so `src` only has to be some valid pointer).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                          bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
               "l"(src), "r"(src_size));
}

constexpr float kLog2e = 1.44269504f;  // log2 e, rounded to fp32

// 2^x (ex2.approx.ftz: within 2 ulp; a result below 2^-126 is 0): the MUFU
// instruction alone, where exp2f and __expf's ex2 without .ftz add a
// compare and two multiplies around it to keep a subnormal result.
__device__ __forceinline__ float Exp2FlushSubnormal(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t address, uint32_t& r0,
                                           uint32_t& r1, uint32_t& r2,
                                           uint32_t& r3) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
      : "r"(address));
}

// D += A * B for one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void MmaM16N8K16(float (&d)[4],
                                            const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1);

template <>
__device__ __forceinline__ void MmaM16N8K16<__nv_bfloat16>(
    float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void MmaM16N8K16<__half>(float (&d)[4],
                                                    const uint32_t (&a)[4],
                                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Named barrier over `count` threads (a multiple of 32), id 1..15.
__device__ __forceinline__ void NamedBarrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// ---- sm_90a: mbarrier, TMA, wgmma ---------------------------------------

__device__ __forceinline__ void MbarrierInit(uint32_t bar, uint32_t count) {
#if FS_SM90A_ENABLED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar),
               "r"(count));
#endif
}

// Makes barrier initialisation visible to the async proxy (TMA).
__device__ __forceinline__ void FenceBarrierInit() {
#if FS_SM90A_ENABLED
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar,
                                                       uint32_t bytes) {
#if FS_SM90A_ENABLED
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
#endif
}

__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
#if FS_SM90A_ENABLED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar)
               : "memory");
#endif
}

// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
#if FS_SM90A_ENABLED
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "FS_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra FS_WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
#if FS_SM90A_ENABLED
  asm volatile(
      "prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map))
      : "memory");
#endif
}

// L2 eviction-priority hints for TMA and hinted stores (the encodings
// CUTLASS uses for CacheHintSm90): W streams through once (evict first);
// the hidden states are re-read by every vocabulary tile (evict last).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kL2EvictLast = 0x14F0000000000000ull;

// A 16-byte global store with an L2 eviction-priority hint (sm_80+).
__device__ __forceinline__ void StoreGlobalHinted(uint4* dst, uint4 value,
                                                  uint64_t cache_hint) {
  asm volatile(
      "st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(
          dst),
      "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w), "l"(cache_hint)
      : "memory");
}

// 2-D tiled TMA load of box (c0 = innermost coordinate, c1) into `dst`,
// completing `bytes` on the mbarrier `bar`.
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const CUtensorMap* map,
                                          int32_t c0, int32_t c1, uint32_t bar,
                                          uint64_t cache_hint) {
#if FS_SM90A_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar),
      "l"(cache_hint)
      : "memory");
#endif
}

// ---- sm_90a: thread-block clusters -------------------------------------

// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank = 0;
#if FS_SM90A_ENABLED
  // Not volatile: the rank is constant, so repeated reads may be merged.
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#endif
  return rank;
}

// Every thread of every CTA of the cluster; orders shared-memory writes
// (barrier initialisation) before the peers' accesses after the wait.
__device__ __forceinline__ void ClusterSync() {
#if FS_SM90A_ENABLED
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// Arrives `count` times at once (the count form of mbarrier.arrive).
__device__ __forceinline__ void MbarrierArriveCount(uint32_t bar,
                                                    uint32_t count) {
#if FS_SM90A_ENABLED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(count)
               : "memory");
#endif
}

// Arrives on the mbarrier at the same shared-memory offset as `bar` in the
// cluster's CTA `rank` (CUTLASS's ClusterBarrier::arrive(cta_id): the
// default .release.cta semantics; .release.cluster measured twice as
// slow).
__device__ __forceinline__ void MbarrierArriveRemote(uint32_t bar,
                                                     uint32_t rank) {
#if FS_SM90A_ENABLED
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
#endif
}

// TmaLoad2d into the same shared-memory offset of every CTA in `cta_mask`,
// completing the bytes on the mbarrier at `bar`'s offset in each of them.
__device__ __forceinline__ void TmaLoad2dMulticast(
    uint32_t dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint32_t bar,
    uint16_t cta_mask, uint64_t cache_hint) {
#if FS_SM90A_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::"
      "bytes.multicast::cluster.L2::cache_hint [%0], [%1, {%2, %3}], [%4], "
      "%5, %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar),
      "h"(cta_mask), "l"(cache_hint)
      : "memory");
#endif
}

__device__ __forceinline__ void WgmmaFence() {
#if FS_SM90A_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void WgmmaCommit() {
#if FS_SM90A_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if FS_SM90A_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending)
               : "memory");
#endif
}

// Shared-memory matrix descriptor for a K-major operand whose rows are 128
// bytes (64 bf16/fp16 of K) stored in TMA's 128-byte swizzle: 8-row atoms of
// 1024 bytes (stride byte offset), swizzle mode 1 (128B) in bits 62-63. The
// atom base must be 1024-byte aligned (base offset 0). Advancing K by 16
// elements inside the atom adds 32 bytes to the start address.
//
// Only the low word (start address >> 4, leading byte offset 16) depends on
// the address; the high word (stride byte offset, swizzle) is a constant.
// The main loop advances descriptors with 32-bit adds on the low word: the
// address field (bits 0-13) cannot carry, shared memory being < 256 KB. A
// 64-bit add cost a carry chain and twice the moves into uniform registers
// per wgmma (~216 instructions per k-step in a device profile).
__device__ __forceinline__ uint32_t WgmmaDescriptorLow(uint32_t smem_address) {
  return ((smem_address & 0x3FFFFu) >> 4) | ((16u >> 4) << 16);
}

__device__ __forceinline__ uint64_t WgmmaDescriptorFromLow(uint32_t low) {
  constexpr uint32_t kHigh = (1024u >> 4) | (1u << 30);  // 128-byte swizzle
  return (static_cast<uint64_t>(kHigh) << 32) | low;
}

__device__ __forceinline__ uint64_t WgmmaDescriptor(uint32_t smem_address) {
  return WgmmaDescriptorFromLow(WgmmaDescriptorLow(smem_address));
}

// Nanoseconds of the GPU's global timer (one clock for all SMs).
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace ptx
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_DEVICE_PTX_CUH_
