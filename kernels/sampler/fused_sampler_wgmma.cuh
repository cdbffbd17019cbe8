// Stage 1 on Hopper (sm_90a): a persistent, warp-specialised "ping-pong"
// kernel. TMA loads W and hidden tiles into 128-byte-swizzled stages of a
// ring guarded by full/empty mbarriers; wgmma m64nNk16 multiplies with W
// rows as M ("swap AB": the vocabulary is the large dimension, the batch is
// N); the shared epilogue adds the noise and reduces.
//
// One CTA per SM, 384 threads: warpgroup 0 is the producer (one thread
// issues the TMA copies; setmaxnreg gives its registers away), warpgroups
// 1 and 2 are consumers. Each consumer multiplies whole pieces (an item: a
// 128-row vocab tile x kBlockN batch columns, or half of one in a split
// last round; two m64 wgmmas per k-step, kBlockN fp32 accumulators per
// thread) and the two alternate: consumer 1 starts piece j+1 once consumer 0
// has received the last stage of piece j, so one consumer's epilogue (the
// noise, pruned exactly: fused_epilogue.cuh) runs while the other's wgmmas
// run, and the producer streams W across piece boundaries without draining
// the ring. With kBlockN >= 64 the CTA's last piece is scored by both
// consumers (its owner hands its last 16-column quads, half of them rounded
// down, to the other through shared memory; FusedTuning::
// share_last_epilogue).
//
// Items go round-robin to the persistent CTAs (WorkSchedule). Where the
// last round would leave more than half the SMs idle, its 128-wide items
// are cut into two 64-wide halves on twice as many CTAs, so that the round
// costs half an item per SM instead of a whole one.
//
// CTAs run as 2-CTA clusters that load an operand both need once per pair
// (TMA multicast). With one 128-wide batch tile (B = 65..128) every CTA
// multiplies the same H (PairMulticast::kHidden): 3% faster at qwen B =
// 128. With two batch tiles of 112 or 128 columns (B = 193..256 on a whole
// vocabulary) the two CTAs of a pair take the same vocab tile's two batch
// tiles in every round (PairMulticast::kWeights): W leaves L2 once per
// pair, and the pair cannot drift apart so far that the second CTA reads W
// from DRAM again: 7-18% faster at qwen B = 200..256 and llama B = 225..256
// (where and why not elsewhere: PairsShareWeights in fused_sampler.cc).
//
// The k-steps of D are issued in order into one fp32 accumulator per logit
// whatever the wgmma's N is, so a row's logits do not depend on the batch
// or on the schedule (docs/design.md#invariance). Rows past the shard or the
// batch are zero-filled by TMA's out-of-bounds handling and ignored by the
// epilogue.
#ifndef FLASHSAMPLER_KERNELS_FUSED_SAMPLER_WGMMA_CUH_
#define FLASHSAMPLER_KERNELS_FUSED_SAMPLER_WGMMA_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kernels/sampler/device_ptx.cuh"
#include "kernels/sampler/fused_epilogue.cuh"
#include "kernels/sampler/fused_sampler_internal.h"
#include "kernels/sampler/wgmma_ops.cuh"

namespace flashsampler {
namespace fused {

// kHalves: 64-wide k-blocks per ring stage. 2 makes each stage read 256
// contiguous bytes of every W row instead of 128 (fewer DRAM row openings
// per byte, half the barrier round trips), at half the stages.
template <int kBlockN, int kStages, int kHalves>
struct WgmmaKernelConfig {
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 128;  // per consumer warpgroup
  static constexpr int kHalfBytesA = kTileRows * kBlockK * 2;  // 16 KB
  static constexpr int kHalfBytesB = kBlockN * kBlockK * 2;
  static constexpr int kStageBytesA = kHalfBytesA * kHalves;
  static constexpr int kStageBytesB = kHalfBytesB * kHalves;
  static_assert(kHalfBytesB % 1024 == 0, "swizzle atoms are 1024 bytes");
  static_assert(kBlockN % 16 == 0, "the epilogue scores 16 columns per call");
  using Epilogue =
      EpilogueShared<kBlockN, 4, kQuadStagingFloats, kTileRows / 16>;
  static constexpr size_t kEpilogueBytes = (sizeof(Epilogue) + 15) / 16 * 16;
  static constexpr size_t kPipelineBytes =
      static_cast<size_t>(kStages) * (kStageBytesA + kStageBytesB);
  static constexpr size_t kBarrierOffset = kPipelineBytes + 2 * kEpilogueBytes;
  // +1024: the dynamic shared memory base is only guaranteed 16-byte
  // aligned; the kernel rounds it up to the 1024 bytes swizzle atoms need.
  static constexpr size_t kSmemBytes =
      kBarrierOffset + 2 * kStages * sizeof(uint64_t) + 16 + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA");
};

// Keeps the compiler from moving accumulator reads or writes across the
// asynchronous wgmma instructions (CUTLASS's warpgroup_fence_operand).
template <int kCount>
__device__ __forceinline__ void FenceAccumulators(float (&acc)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) {
    asm volatile("" : "+f"(acc[i])::"memory");
  }
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// TMA's box of `map` at (c0, c1) into `dst`, completing on the mbarrier
// `bar`: into this CTA alone, or, where `pair`, into the same place of both
// CTAs of the 2-CTA cluster (this CTA's share of a multicast operand).
__device__ __forceinline__ void LoadBoxToCtaOrPair(uint32_t dst,
                                                   const CUtensorMap* map,
                                                   int32_t c0, int32_t c1,
                                                   uint32_t bar, bool pair,
                                                   uint64_t cache_hint) {
  if (pair) {
    ptx::TmaLoad2dMulticast(dst, map, c0, c1, bar, 0x3, cache_hint);
  } else {
    ptx::TmaLoad2d(dst, map, c0, c1, bar, cache_hint);
  }
}

// Which operand a 2-CTA cluster's pair loads once for both (above).
enum class PairMulticast {
  kNone,     // no clusters: every CTA loads its own W and H
  kHidden,   // one batch tile: the pair shares H
  kWeights,  // two batch tiles: the pair shares each round's W tile
};

// One CTA's share of the work: whole items (vocab tile x kBlockN batch
// columns) round-robin, item i on CTA i % grid in round i / grid, and, when
// the last round is at most half full and kBlockN is 128, that round's items
// in halves of 64 columns, two CTAs per item. Without the split a CTA's cost
// is ceil(items / grid) items; the split makes the last round half an item
// (qwen's TP8 shard at B = 128: 85 instead of 100 us;
// docs/performance.md). Producer and consumers walk the
// same sequence of pieces.
//
// Where the grid is a multiple of the batch tiles, a vocab tile's items
// share a round, on neighbouring CTAs that read its W once from DRAM and
// then from L2. With a partial last batch tile (B = 136: 128 + 8 columns)
// their batch tiles rotate by one per round, so that no CTA draws the
// partial tile all launch long: such CTAs scored almost nothing, ran ahead
// of their neighbours, and read W from DRAM again by the time the
// neighbours reached it (without the rotation, qwen B = 136 took 666 us
// sampled against 549 all greedy; docs/performance.md). Equal batch tiles
// do not rotate.
struct WorkPiece {
  int64_t tile;  // vocab tile
  int col0;      // first batch column
  bool half;     // kBlockN / 2 columns instead of kBlockN
};

// kRotate: rotate the batch tiles where they differ (above); off in the
// 2-CTA cluster kernels: with one batch tile there is nothing to rotate (and
// the check cost ptxas a spill), and a pair that shares W moves in step.
template <int kBlockN, bool kRotate = true>
struct WorkSchedule {
  static constexpr bool kCanSplit = kBlockN == 128;
  int batch_tiles;
  int full_rounds;
  int tail_items;  // items of the last, partial round
  bool split_tail;
  bool rotate;  // the batch tiles rotate per round (above)

  // Counts fit 32 bits: the dispatcher caps vocab tiles at 65535 and the
  // batch at kMaxFusedBatch.
  __device__ WorkSchedule(int num_items, int batches, int grid,
                          bool allow_split, int batch)
      : batch_tiles(batches),
        full_rounds(num_items / grid),
        tail_items(num_items % grid),
        split_tail(kCanSplit && allow_split && tail_items > 0 &&
                   2 * tail_items <= grid),
        rotate(kRotate && batches > 1 && batch % kBlockN != 0 &&
               grid % batches == 0) {}

  __device__ int PiecesOf(int cta) const {
    const int tail_pieces = split_tail ? 2 * tail_items : tail_items;
    return full_rounds + (cta < tail_pieces ? 1 : 0);
  }

  __device__ WorkPiece PieceAt(int j, int cta, int grid) const {
    WorkPiece piece;
    piece.half = j == full_rounds && split_tail;
    // 64-bit: with 32-bit item numbers ptxas -v showed the consumer
    // spilling 132 bytes, with 64-bit 36 (reloaded once per piece, outside
    // the scoring loops).
    const int64_t item =
        piece.half ? static_cast<int64_t>(full_rounds) * grid + cta / 2
                   : cta + static_cast<int64_t>(j) * grid;
    piece.tile = item / batch_tiles;
    int batch_tile = static_cast<int>(item % batch_tiles);
    // The round's items of one vocab tile are batch_tiles consecutive CTAs
    // (the grid is a multiple of batch_tiles), so rotating within them
    // keeps every item exactly once.
    if (rotate && !piece.half) {
      batch_tile = (batch_tile + j) % batch_tiles;
    }
    piece.col0 =
        batch_tile * kBlockN + (piece.half ? (cta % 2) * (kBlockN / 2) : 0);
    return piece;
  }
};

// Named barriers: 1 and 2 = consumer 0 / 1 epilogue (128 threads); 3 and 4 =
// the hand-off into consumer 0 / 1's next item (256: one side arrives, the
// other waits); 5 = the last piece's accumulators are staged for the other
// consumer, 6 = the other consumer's wgmmas are done (256 each, the same
// way).
constexpr int kEpilogueBarrier = 1;
constexpr int kHandoffBarrier = 3;
constexpr int kShareBarrier = 5;
constexpr int kRingDrainedBarrier = 6;

// A consumer's main loop over one piece: num_steps ring stages from ring
// sequence number seq0 on, two m64nN wgmmas per k-step (rows 0-63 into
// acc0, 64-127 into acc1), one k-block kept in flight; each stage goes back
// to the producer once its wgmmas are done. On the last stage it lets the
// other consumer start the CTA's next piece (hand_off).
template <typename T, int kN, typename Config, int kStages, int kHalves,
          int kClusterCtas>
__device__ __forceinline__ void MultiplyPiece(
    float (&acc0)[kN / 2], float (&acc1)[kN / 2], uint32_t smem_a_base,
    uint32_t smem_b_base, uint32_t full_bar_base, uint32_t empty_bar_base,
    int num_steps, uint32_t seq0, int hand_off_barrier, int lane, bool shared) {
  // A consumed stage goes back to this CTA's producer and, when the piece
  // is shared with the peer (one operand multicast), to the peer's, whose
  // next load of that stage writes its half of the operand here. The empty
  // barriers count two arrivals per consumer warp either way (a stage of
  // this CTA's own loads arrives twice here).
  const auto release = [empty_bar_base, lane, shared](uint32_t stage) {
    if (lane != 0) return;
    if constexpr (kClusterCtas == 2) {
      if (shared) {
        ptx::MbarrierArrive(empty_bar_base + 8 * stage);
        ptx::MbarrierArriveRemote(empty_bar_base + 8 * stage,
                                  ptx::ClusterCtaRank() ^ 1u);
      } else {
        ptx::MbarrierArriveCount(empty_bar_base + 8 * stage, 2);
      }
    } else {
      ptx::MbarrierArrive(empty_bar_base + 8 * stage);
    }
  };
  FenceAccumulators(acc0);
  FenceAccumulators(acc1);
  // Ring position of the first stage; advanced incrementally (a run-time
  // % kStages per step costs a multiply-shift sequence).
  uint32_t stage = seq0 % kStages;
  uint32_t phase = (seq0 / kStages) & 1;
  uint32_t previous_stage = stage;
  for (int step = 0; step < num_steps; ++step) {
    ptx::MbarrierWait(full_bar_base + 8 * stage, phase);
    if (step == num_steps - 1 && hand_off_barrier >= 0) {
      NamedBarrierArrive(hand_off_barrier, 256);
    }
    ptx::WgmmaFence();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      const uint32_t a_low = ptx::WgmmaDescriptorLow(
          smem_a_base + stage * Config::kStageBytesA + h * Config::kHalfBytesA);
      const uint32_t b_low = ptx::WgmmaDescriptorLow(
          smem_b_base + stage * Config::kStageBytesB + h * Config::kHalfBytesB);
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        // 16 elements of K = 32 bytes = 2 units of the descriptor address;
        // rows 64-127 of the W tile start 64 x 128 bytes later. k-steps
        // stay in order: half 0, then half 1. A kN narrower than the
        // stage's batch rows reads its first kN rows.
        const uint64_t desc_b = ptx::WgmmaDescriptorFromLow(b_low + 2 * kk);
        ptx::Wgmma<T, kN>::Run(
            acc0, ptx::WgmmaDescriptorFromLow(a_low + 2 * kk), desc_b);
        ptx::Wgmma<T, kN>::Run(
            acc1, ptx::WgmmaDescriptorFromLow(a_low + 512 + 2 * kk), desc_b);
      }
    }
    ptx::WgmmaCommit();
    // Keep one k-block in flight; the one before it is finished, so its
    // stage goes back to the producer.
    ptx::WgmmaWait<1>();
    FenceAccumulators(acc0);
    FenceAccumulators(acc1);
    if (step > 0) release(previous_stage);
    previous_stage = stage;
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  ptx::WgmmaWait<0>();
  FenceAccumulators(acc0);
  FenceAccumulators(acc1);
  release(previous_stage);
}

// The first kCount floats of an accumulator array, as an array (the narrow
// wgmma of a half piece fills the same leading n8 blocks).
template <int kCount, int kTotal>
__device__ __forceinline__ float (
    &LeadingAccumulators(float (&acc)[kTotal]))[kCount] {
  static_assert(kCount <= kTotal, "a prefix");
  return *reinterpret_cast<float(*)[kCount]>(&acc[0]);
}

// kMulticast kHidden: H multicast over CTA pairs (2-CTA clusters), for one
// batch tile of kBlockN = 128 columns. Every CTA then multiplies the same H
// with its own W tiles, so each of a pair loads 64 of H's 128 rows of every
// stage into both CTAs' ring, and H leaves L2 once per pair instead of
// twice. Pieces the two do not share (the split round's halves, whose
// columns differ; a last piece without one on the peer) load their own H.
// kWeights: W multicast, for two batch tiles. Items go round-robin and the
// grid is even, so CTAs 2c and 2c + 1 hold the same vocab tile's two batch
// tiles in every round (in the split round, two halves of one batch tile):
// each loads 64 of the W tile's 128 rows into both rings and its own H.
// Either way a stage is refilled once both CTAs' consumers released it.
template <typename T, int kBlockN, int kStages, int kHalves,
          PairMulticast kMulticast>
__global__ void __launch_bounds__(384, 1)
    FusedWgmmaKernel(const __grid_constant__ CUtensorMap tensor_map_w,
                     const __grid_constant__ CUtensorMap tensor_map_w_half,
                     const __grid_constant__ CUtensorMap tensor_map_h,
                     const __grid_constant__ CUtensorMap tensor_map_h_half,
                     FusedArgs args) {
#if FS_SM90A_ENABLED
  using Config = WgmmaKernelConfig<kBlockN, kStages, kHalves>;
  constexpr int kHalf = kBlockN / 2;  // accumulators per m64 wgmma
  constexpr int kClusterCtas = kMulticast == PairMulticast::kNone ? 1 : 2;
  constexpr bool kMulticastH = kMulticast == PairMulticast::kHidden;
  constexpr bool kMulticastW = kMulticast == PairMulticast::kWeights;
  static_assert(!kMulticastH || kBlockN == 128,
                "H multicast: pairs of 128-column tiles");
  // The CTA's last piece ends on an epilogue that no other consumer's
  // wgmmas hide (~15 us at B = 256: docs/performance.md). Its owner stages the
  // accumulators of the piece's last quads (16 columns each) in the drained
  // ring, and the other consumer, done with its own pieces by then, scores
  // those while the owner scores the first ones: the owner keeps half the
  // quads, rounded up (3 of the 5 at kBlockN 80). For kBlockN >= 64
  // (each consumer's share is then 32 columns or more; kBlockN 16 has a short
  // epilogue).
  constexpr bool kShareLastEpilogue = kBlockN >= 64;
  // Quads the owner of a whole piece keeps; the rest, staged per warp, are
  // the most any piece stages (a half piece of a kCanSplit width stages
  // half as many: its columns split evenly).
  constexpr int kOwnerQuads = (kBlockN / 16 + 1) / 2;
  constexpr int kSharedQuads = kBlockN / 16 - kOwnerQuads;
  static_assert(!WorkSchedule<kBlockN>::kCanSplit || kBlockN % 64 == 0,
                "half pieces split into two whole quad halves");
  static_assert(!kShareLastEpilogue ||
                    4 * kSharedQuads * kQuadStagingFloats * sizeof(float) <=
                        kStages * Config::kStageBytesA,
                "the staged half of a piece fits in the ring's W stages");
  extern __shared__ uint8_t smem_raw[];
  // Rounded up to the 1024 bytes the swizzle atoms need by an offset from
  // smem_raw, not through an integer cast, so that the compiler still knows
  // every pointer below is shared memory (otherwise each epilogue access is
  // a generic LD/ST and the base pointer a spilled 64-bit value).
  uint8_t* smem =
      smem_raw + ((1024u - (ptx::SmemAddr(smem_raw) & 1023u)) & 1023u);
  uint8_t* smem_a = smem;
  uint8_t* smem_b = smem + kStages * Config::kStageBytesA;
  uint64_t* full_bar =
      reinterpret_cast<uint64_t*>(smem + Config::kBarrierOffset);
  uint64_t* empty_bar = full_bar + kStages;
  int* last_flags = reinterpret_cast<int*>(empty_bar + kStages);
  const uint32_t smem_a_base = ptx::SmemAddr(smem_a);
  const uint32_t smem_b_base = ptx::SmemAddr(smem_b);
  const uint32_t full_bar_base = ptx::SmemAddr(full_bar);
  const uint32_t empty_bar_base = ptx::SmemAddr(empty_bar);

  // Broadcast from lane 0 so that the compiler knows these are warp-uniform
  // (CUTLASS's canonical_warp_group_idx): everything derived from them --
  // item, ring stage, descriptors -- then lives in uniform registers instead
  // of being moved there before every wgmma.
  const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  const int num_kb = args.hidden_size / kBlockK;
  // Stages per item; the dispatcher only picks kHalves = 2 when D is a
  // multiple of 128, so every stage is full (no data-dependent branch
  // around the wgmmas: ptxas serialises wgmmas under one, warning C7520).
  const int num_steps = num_kb / kHalves;
  const int vocab_tiles =
      static_cast<int>((args.vocab_rows + kTileRows - 1) / kTileRows);
  const int batch_tiles = (args.batch + kBlockN - 1) / kBlockN;
  const WorkSchedule<kBlockN, kClusterCtas == 1> schedule(
      vocab_tiles * batch_tiles, batch_tiles, gridDim.x,
      args.tuning.split_last_round, args.batch);
  // Pieces j < shared_pieces multicast their shared operand; both CTAs of
  // a pair compute the same count. H: whole pieces only (the halves of a
  // split round differ in columns); W: every piece (a pair's piece counts
  // are equal with two batch tiles on an even grid, and halves share W).
  int shared_pieces = 0;
  if constexpr (kClusterCtas == 2) {
    const int mine = schedule.PiecesOf(blockIdx.x);
    const int peer = schedule.PiecesOf(blockIdx.x ^ 1);
    shared_pieces = min(mine, peer);
    if (kMulticastH && schedule.split_tail &&
        shared_pieces > schedule.full_rounds) {
      shared_pieces = schedule.full_rounds;
    }
  }

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::MbarrierInit(ptx::SmemAddr(&full_bar[s]), 1);
      // Two arrivals per consumer warp (MultiplyPiece's release).
      ptx::MbarrierInit(ptx::SmemAddr(&empty_bar[s]), 4 * kClusterCtas);
    }
    ptx::FenceBarrierInit();
  }
  if (threadIdx.x == 32) {
    ptx::PrefetchTensorMap(kMulticastW ? &tensor_map_w_half : &tensor_map_w);
    ptx::PrefetchTensorMap(&tensor_map_h);
    ptx::PrefetchTensorMap(&tensor_map_h_half);
  }
  if constexpr (kClusterCtas == 2) {
    // The peer multicasts into this CTA's ring and arrives on its barriers.
    ptx::ClusterSync();
  } else {
    __syncthreads();
  }

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    // Producer: item after item, k-block after k-block, into ring slot
    // seq % kStages. A slot is refilled once the consumer of its previous
    // contents released it; the first use waits on the "previous phase"
    // parity, which passes at once.
    if (threadIdx.x == 0) {
      uint32_t seq = 0;
      const int pieces = schedule.PiecesOf(blockIdx.x);
      for (int j = 0; j < pieces; ++j) {
        const WorkPiece piece = schedule.PieceAt(j, blockIdx.x, gridDim.x);
        const int32_t row0 = static_cast<int32_t>(piece.tile * kTileRows);
        // A half piece loads a kBlockN / 2-row box of H (the second map)
        // into the start of the stage's H buffer, where its narrower wgmma
        // reads: the split round's pieces are bound by their loads, and a
        // whole kBlockN-row box made them 0.73 of a whole piece's time
        // instead of about half (fs_bench --timeline, llama B = 256).
        const bool half = WorkSchedule<kBlockN>::kCanSplit && piece.half;
        const bool shared = kClusterCtas == 2 && j < shared_pieces;
        const bool shared_h = kMulticastH && shared;
        const bool shared_w = kMulticastW && shared;
        const CUtensorMap* map_h =
            half || shared_h ? &tensor_map_h_half : &tensor_map_h;
        // Multicast: this CTA's 64 rows of the shared operand at their
        // place in both CTAs' stage (the 128-byte swizzle repeats every 8
        // rows, so two 64-row boxes lay out as one 128-row box).
        const uint32_t h_part = shared_h ? ptx::ClusterCtaRank() : 0;
        const uint32_t w_part = shared_w ? ptx::ClusterCtaRank() : 0;
        const uint32_t stage_tx =
            (Config::kHalfBytesA +
             (half ? Config::kHalfBytesB / 2 : Config::kHalfBytesB)) *
            kHalves;
        const int32_t col0 = piece.col0;
        for (int step = 0; step < num_steps; ++step, ++seq) {
          const uint32_t stage = seq % kStages;
          ptx::MbarrierWait(ptx::SmemAddr(&empty_bar[stage]),
                            ((seq / kStages) & 1) ^ 1);
          const uint32_t full = ptx::SmemAddr(&full_bar[stage]);
          ptx::MbarrierArriveExpectTx(full, stage_tx);
#pragma unroll
          for (int h = 0; h < kHalves; ++h) {
            const int k0 = (step * kHalves + h) * kBlockK;
            const uint32_t dst_w =
                ptx::SmemAddr(smem_a + stage * Config::kStageBytesA +
                              h * Config::kHalfBytesA) +
                w_part * (Config::kHalfBytesA / 2);
            LoadBoxToCtaOrPair(
                dst_w, shared_w ? &tensor_map_w_half : &tensor_map_w, k0,
                row0 + static_cast<int32_t>(w_part) * (kTileRows / 2), full,
                shared_w, args.w_cache_hint);
            const uint32_t dst_h =
                ptx::SmemAddr(smem_b + stage * Config::kStageBytesB +
                              h * Config::kHalfBytesB) +
                h_part * (Config::kHalfBytesB / 2);
            LoadBoxToCtaOrPair(
                dst_h, map_h, k0,
                col0 + static_cast<int32_t>(h_part) * (kBlockN / 2), full,
                shared_h, ptx::kL2EvictLast);
          }
        }
      }
      if constexpr (kClusterCtas == 2) {
        // Stay until both CTAs' consumers have released every stage's last
        // use (the waits a next round of loads would make): then the peer
        // has made all its arrivals on this CTA's barriers, and the CTA may
        // exit.
        for (uint32_t end = seq + kStages; seq < end; ++seq) {
          ptx::MbarrierWait(ptx::SmemAddr(&empty_bar[seq % kStages]),
                            ((seq / kStages) & 1) ^ 1);
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int consumer = warpgroup - 1;
  const int thread = threadIdx.x % 128;
  const int warp = __shfl_sync(0xffffffffu, thread / 32, 0);
  const int lane = thread % 32;
  auto& epilogue = *reinterpret_cast<typename Config::Epilogue*>(
      smem + Config::kPipelineBytes + consumer * Config::kEpilogueBytes);
  float* staging = epilogue.staging[warp];
  const int epilogue_barrier = kEpilogueBarrier + consumer;

  // This consumer's pieces are the CTA's pieces j = consumer, consumer + 2,
  // ...; piece j's stages are ring sequence numbers j*num_steps .. +
  // num_steps - 1.
  const int pieces = schedule.PiecesOf(blockIdx.x);
  for (int j = consumer; j < pieces; j += 2) {
    const WorkPiece piece = schedule.PieceAt(j, blockIdx.x, gridDim.x);
    const int64_t tile = piece.tile;
    const int batch_base = piece.col0;
    const int columns = piece.half ? kBlockN / 2 : kBlockN;
    // Safe: this thread's reads of the previous item's parameters ended
    // before its last epilogue barrier.
    LoadColumnParams(args, batch_base, thread, 128, epilogue);

    float acc0[kHalf];
    float acc1[kHalf];
#pragma unroll
    for (int i = 0; i < kHalf; ++i) acc0[i] = acc1[i] = 0.0f;
    // Wait until the other consumer has received every stage of piece j-1:
    // then every earlier ring phase is complete and the parity waits below
    // cannot pass on a stale phase.
    if (j >= 1) ptx::NamedBarrier(kHandoffBarrier + consumer, 256);
    // Profiling (FusedTuning::timeline): thread 0 of the consumer.
    const int timeline_pieces = args.tuning.timeline_pieces;
    const int timeline_slot = (blockIdx.x * 2 + consumer) * timeline_pieces + j;
    uint64_t* timeline =
        args.tuning.timeline != nullptr && j < timeline_pieces && thread == 0
            ? args.tuning.timeline + timeline_slot * 3
            : nullptr;
    if (timeline != nullptr) timeline[0] = ptx::GlobalTimerNs();
    const uint32_t seq0 = static_cast<uint32_t>(j) * num_steps;
    const int hand_off = j + 1 < pieces ? kHandoffBarrier + (1 - consumer) : -1;
    const bool shared = kClusterCtas == 2 && j < shared_pieces;
    if constexpr (WorkSchedule<kBlockN>::kCanSplit) {
      if (piece.half) {
        MultiplyPiece<T, kBlockN / 2, Config, kStages, kHalves, kClusterCtas>(
            LeadingAccumulators<kHalf / 2>(acc0),
            LeadingAccumulators<kHalf / 2>(acc1), smem_a_base, smem_b_base,
            full_bar_base, empty_bar_base, num_steps, seq0, hand_off, lane,
            shared);
      } else {
        MultiplyPiece<T, kBlockN, Config, kStages, kHalves, kClusterCtas>(
            acc0, acc1, smem_a_base, smem_b_base, full_bar_base, empty_bar_base,
            num_steps, seq0, hand_off, lane, shared);
      }
    } else {
      MultiplyPiece<T, kBlockN, Config, kStages, kHalves, kClusterCtas>(
          acc0, acc1, smem_a_base, smem_b_base, full_bar_base, empty_bar_base,
          num_steps, seq0, hand_off, lane, shared);
    }
    if (timeline != nullptr) timeline[1] = ptx::GlobalTimerNs();
    const bool share = kShareLastEpilogue && args.tuning.share_last_epilogue;
    // This consumer's wgmmas are done for good: the other one, owner of
    // the CTA's last piece, may write into the ring (below).
    if (share && j == pieces - 2) {
      NamedBarrierArrive(kRingDrainedBarrier, 256);
    }

    const int64_t row0 = tile * kTileRows + warp * 16;
    if (thread < columns) {
      PrefetchPieceUnitClasses(tile, batch_base + thread, args);
    }
    // Scored here: all columns, or the owner's quads of the last piece.
    int own_columns = columns;
    if (share && j == pieces - 1) {
      own_columns = kBlockN % 32 == 0 ? columns / 2 : 16 * kOwnerQuads;
      // The ring is drained once the other consumer's wgmmas are done too
      // (it handed the ring over on receiving its last stage, before its
      // wgmmas read it): every stage was consumed and the producer has no
      // more loads, so the W stages can hold this warp's staged quads.
      if (pieces >= 2) ptx::NamedBarrier(kRingDrainedBarrier, 256);
      float* shared_staging = reinterpret_cast<float*>(smem_a) +
                              warp * kSharedQuads * kQuadStagingFloats;
      // Quad kOwnerQuads + q of a whole piece, or kSharedQuads / 2 + q of a
      // half piece: a select between two unrolled constants (an index
      // computed from own_columns here, or the same select written for
      // both kinds of widths, made ptxas spill the 128-wide accumulators).
#pragma unroll
      for (int q = 0; q < kSharedQuads; ++q) {
        if (q < (kBlockN % 32 == 0 ? own_columns / 16 : kSharedQuads)) {
          float frags[2][2][4];
          ReadBlockQuad(acc0, acc1,
                        own_columns == kBlockN / 2 || kBlockN % 32 != 0
                            ? kOwnerQuads + q
                            : kSharedQuads / 2 + q,
                        frags);
          StageFragmentQuad(frags, shared_staging + q * kQuadStagingFloats);
        }
      }
      NamedBarrierArrive(kShareBarrier, 256);
    }
    // Each CTA starts its items' scoring at another group of 16 columns
    // (CTAs 2c and 2c + 1 share a start: with two batch tiles they score
    // different rows). Sampled rows publish their candidates as the groups
    // are scored (PublishFloor), so in the CTAs' first items -- scored at
    // the same time everywhere, before any item has finished -- all but the
    // first group already find floors from other CTAs' earlier groups.
    const int quads = own_columns / 16;
    const int first_quad = static_cast<int>((blockIdx.x >> 1) % quads);
    const auto quad_at = [first_quad, quads](int i) {
      return first_quad + i < quads ? first_quad + i : first_quad + i - quads;
    };
    for (int sample = 0; sample < args.num_samples; ++sample) {
      // Units are written with sample 0's scores (LaneUnitClasses).
      uint32_t classes =
          sample == 0 ? LaneUnitClasses(row0, 16 * quad_at(0), batch_base, args)
                      : 0xffffu;
      for (int i = thread; i < kBlockN; i += 128) {
        epilogue.best[i] = IdentityKey();
      }
      LoadFloorKeys(args, sample, batch_base, thread, 128, epilogue);
      FillBlockWords(args, sample, tile, batch_base, thread, 128, epilogue);
      ptx::NamedBarrier(epilogue_barrier, 128);
      // Two n8 blocks (16 batch columns) of both m64 halves per call.
#pragma unroll 1
      for (int i = 0; i < quads; ++i) {
        const int quad = quad_at(i);
        // A column without a key at the item's start (a launch's first
        // items) is read again at its call: by then other CTAs' calls may
        // have published one, and a call without floors costs several with
        // them.
        unsigned long long key =
            epilogue.floor_key[16 * quad + StagedLaneColumn()];
        if (key == 0ull) {
          key = StagedLaneKey(args, sample, batch_base, 16 * quad);
        }
        const float floor = FloorOfKey(key);
        float frags[2][2][4];
        ReadBlockQuad(acc0, acc1, quad, frags);
        // The next quad's classes word, loaded once this quad's key and
        // fragments are read: loaded before them, the key's first use
        // waited for the word's DRAM latency as well, and every
        // control with raw logprobs at qwen B = 256, a row of classes
        // each, took 1.30-1.31x the plain kernel call for call against
        // 1.25-1.26x (1.23-1.24x with the piece's words prefetched into
        // L2 as well; H100, alternating builds in one call).
        const uint32_t next_classes =
            sample == 0 && i + 1 < quads
                ? LaneUnitClasses(row0, 16 * quad_at(i + 1), batch_base, args)
                : 0xffffu;
        ScoreFragmentQuad(frags, row0, quad * 16, sample, sample == 0,
                          batch_base, classes, args, staging, epilogue, floor);
        classes = next_classes;
      }
      ptx::NamedBarrier(epilogue_barrier, 128);
      StoreCandidates(args, tile, sample, batch_base, own_columns, thread, 128,
                      epilogue, epilogue.floor_key);
    }
    if (timeline != nullptr) timeline[2] = ptx::GlobalTimerNs();
  }
  if (kShareLastEpilogue && args.tuning.share_last_epilogue &&
      consumer != (pieces - 1) % 2) {
    // The last columns of the CTA's last piece, which the other consumer
    // owns, from the quads it staged.
    const WorkPiece piece = schedule.PieceAt(pieces - 1, blockIdx.x, gridDim.x);
    const int owner_columns = piece.half ? kBlockN / 4 : 16 * kOwnerQuads;
    const int staged_columns =
        (piece.half ? kBlockN / 2 : kBlockN) - owner_columns;
    const int batch_base = piece.col0 + owner_columns;
    LoadColumnParams(args, batch_base, thread, 128, epilogue);
    const float* shared_staging = reinterpret_cast<const float*>(smem_a) +
                                  warp * kSharedQuads * kQuadStagingFloats;
    const int64_t row0 = piece.tile * kTileRows + warp * 16;
    ptx::NamedBarrier(kShareBarrier, 256);
    for (int sample = 0; sample < args.num_samples; ++sample) {
      for (int i = thread; i < kBlockN; i += 128) {
        epilogue.best[i] = IdentityKey();
      }
      FillBlockWords(args, sample, piece.tile, batch_base, thread, 128,
                     epilogue);
      ptx::NamedBarrier(epilogue_barrier, 128);
#pragma unroll 1
      for (int q = 0; q < staged_columns / 16; ++q) {
        ScoreStagedQuad(
            shared_staging + q * kQuadStagingFloats, row0, q * 16, sample,
            sample == 0, batch_base,
            sample == 0 ? LaneUnitClasses(row0, q * 16, batch_base, args)
                        : 0xffffu,
            args, epilogue,
            FloorOfKey(StagedLaneKey(args, sample, batch_base, q * 16)));
      }
      ptx::NamedBarrier(epilogue_barrier, 128);
      StoreCandidates(args, piece.tile, sample, batch_base, staged_columns,
                      thread, 128, epilogue);
    }
  }
  FinishInKernelReduce(
      args, thread, 128, 2 * gridDim.x, &last_flags[consumer],
      [epilogue_barrier] { ptx::NamedBarrier(epilogue_barrier, 128); });
#endif  // FS_SM90A_ENABLED
}

// cudaOccupancyMaxActiveClusters for kKernel launched with `config`,
// asked once per kernel and device (a kernel's shared memory and cluster
// shape are fixed, and the answer depends on nothing else here). The
// kernel itself is the template argument, so that each one has its own
// cache: every FusedWgmmaKernel has the same type.
template <auto kKernel>
cudaError_t MaxActiveClusters(const cudaLaunchConfig_t& config, int* clusters) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cache[kCachedDevices];  // 0: not asked yet
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  if (device >= 0 && device < kCachedDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached != 0) {
      *clusters = cached - 1;
      return cudaSuccess;
    }
  }
  error = cudaOccupancyMaxActiveClusters(clusters, kKernel, &config);
  if (error != cudaSuccess) return error;
  if (device >= 0 && device < kCachedDevices) {
    cache[device].store(*clusters + 1, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Launches the 2-CTA cluster kernel for `multicast` if the GPU can hold
// every pair of the persistent grid at once; *launched says whether it did
// (where the GPCs cannot hold ctas / 2 pairs, the caller runs the plain
// kernel instead).
template <typename T, int kBlockN, int kStages, int kHalves,
          PairMulticast kMulticast>
cudaError_t LaunchPairKernel(const FusedArgs& args, const CUtensorMap* maps_w,
                             const CUtensorMap* maps_h, int ctas,
                             const cudaAccessPolicyWindow& records_l2,
                             cudaStream_t stream, bool* launched) {
  using Config = WgmmaKernelConfig<kBlockN, kStages, kHalves>;
  *launched = false;
  constexpr auto kernel =
      FusedWgmmaKernel<T, kBlockN, kStages, kHalves, kMulticast>;
  cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Config::kSmemBytes));
  if (error != cudaSuccess) return error;
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = 2;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeAccessPolicyWindow;
  attributes[1].val.accessPolicyWindow = records_l2;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(Config::kThreads);
  config.dynamicSmemBytes = Config::kSmemBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = records_l2.num_bytes > 0 ? 2 : 1;
  int max_clusters = 0;
  error = MaxActiveClusters<kernel>(config, &max_clusters);
  if (error != cudaSuccess || 2 * max_clusters < ctas) return error;
  *launched = true;
  return cudaLaunchKernelEx(&config, kernel, maps_w[0], maps_w[1], maps_h[0],
                            maps_h[1], args);
}

// tensor_map_w and tensor_map_h each point at two maps: boxes of the full
// tile (kTileRows rows of W, kBlockN rows of H), then of half of it (each
// CTA's share of a multicast, and H's rows of the split last round's half
// pieces).
template <typename T, int kBlockN, int kStages, int kHalves>
cudaError_t LaunchWgmmaKernel(const FusedArgs& args, const void* tensor_map_w,
                              const void* tensor_map_h, int grid,
                              cudaStream_t stream) {
  using Config = WgmmaKernelConfig<kBlockN, kStages, kHalves>;
  const cudaAccessPolicyWindow records_l2 = UnitRecordsL2Window(args);
  const int64_t tiles = (args.vocab_rows + kTileRows - 1) / kTileRows;
  const int64_t batch_tiles = (args.batch + kBlockN - 1) / kBlockN;
  const int64_t items = tiles * batch_tiles;
  const int ctas = static_cast<int>(items < grid ? items : grid);
  const CUtensorMap* maps_w = static_cast<const CUtensorMap*>(tensor_map_w);
  const CUtensorMap* maps_h = static_cast<const CUtensorMap*>(tensor_map_h);
  bool launched = false;
  cudaError_t error = cudaSuccess;
  if constexpr (kBlockN == 128) {
    if (args.tuning.multicast_h && batch_tiles == 1 && ctas % 2 == 0) {
      error = LaunchPairKernel<T, kBlockN, kStages, kHalves,
                               PairMulticast::kHidden>(
          args, maps_w, maps_h, ctas, records_l2, stream, &launched);
      if (error != cudaSuccess || launched) return error;
    }
  }
  // The widths where pairs share W (PairsShareWeights in fused_sampler.cc)
  // at their default 64-deep stages (DefaultWgmmaStageK) only: every
  // instantiation of this kernel is ~0.5 MB of each binary that links it.
  if constexpr (kBlockN >= 112 && kHalves == 1) {
    if (args.tuning.multicast_w && batch_tiles == 2 && ctas % 2 == 0) {
      error = LaunchPairKernel<T, kBlockN, kStages, kHalves,
                               PairMulticast::kWeights>(
          args, maps_w, maps_h, ctas, records_l2, stream, &launched);
      if (error != cudaSuccess || launched) return error;
    }
  }
  auto kernel =
      FusedWgmmaKernel<T, kBlockN, kStages, kHalves, PairMulticast::kNone>;
  error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(Config::kSmemBytes));
  if (error != cudaSuccess) return error;
  cudaLaunchAttribute window;
  window.id = cudaLaunchAttributeAccessPolicyWindow;
  window.val.accessPolicyWindow = records_l2;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(Config::kThreads);
  config.dynamicSmemBytes = Config::kSmemBytes;
  config.stream = stream;
  config.attrs = &window;
  config.numAttrs = records_l2.num_bytes > 0 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, maps_w[0], maps_w[1], maps_h[0],
                            maps_h[1], args);
}

// Ring depth per (kBlockN, kHalves): as many stages as fit next to the two
// consumers' epilogue buffers in 227 KB, e.g. 10 x (16 + 2) KB for
// kBlockN = 16 keeps 160 KB of W in flight per SM (HBM needs ~33 GB/s x
// ~2 us per SM).
template <int kBlockN, int kHalves>
struct WgmmaTileConfig {
  static constexpr int kStages =
      (192 * 1024) / ((kTileRows + kBlockN) * kBlockK * 2 * kHalves);
};

template <DType kDType, int kBlockN, int kHalves>
cudaError_t LaunchWgmma(const FusedArgs& args, const void* tensor_map_w,
                        const void* tensor_map_h, int grid,
                        cudaStream_t stream) {
  using T = typename ElementOf<kDType>::Type;
  return LaunchWgmmaKernel<T, kBlockN,
                           WgmmaTileConfig<kBlockN, kHalves>::kStages, kHalves>(
      args, tensor_map_w, tensor_map_h, grid, stream);
}

}  // namespace fused
}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_FUSED_SAMPLER_WGMMA_CUH_
