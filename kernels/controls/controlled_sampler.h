// Host API of the controlled sampler: the exact GPU path for every sampling
// control (bias, bans, bitmask, penalties, min_p, top_k, top_p, n, logprobs)
// over MATERIALIZED fp32 logits [rows, V]. It returns what the CPU reference
// sampler (service/backends/cpu/cpu_sampler.h, "Sampling semantics") returns
// for the same logits, token for token: top_k as a value threshold (ties at
// the k-th value kept), raw logprobs over the masked raw logits, greedy at
// temperature 0 (controlled_types.h). No allocation happens in a launcher.
#ifndef FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_
#define FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/controls/controlled_types.h"

namespace flashsampler {

// Bytes of device workspace a launch over `rows` x `vocab` needs: the
// processed logits x = l / T of the full passes, 4 * rows * vocab bytes
// (0.6 MB a row at V = 151936, kept apart so the raw logits stay for raw
// logprobs), then the candidate path's per-chunk ids and sums (22 KB a row).
size_t ControlledSampleWorkspaceSize(int rows, int64_t vocab);

// Samples every row: first from the row's candidates (each 2048-token
// chunk's 64 highest logits), and where that cannot be proven to give the
// full passes' result, by the full passes (ControlledSampleParams::certified
// says which). Returns cudaErrorInvalidValue for bad arguments (null
// required pointers, workspace too small, rows < 0, vocab out of range) and
// the launch error otherwise; per-row problems go to `status`.
cudaError_t LaunchControlledSample(const ControlledSampleParams& params,
                                   void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream);

// Self-check of the top-p masses: out[i] = the device's FixedMass(x[i],
// x_max) (kernels/controls/controlled_math.h), for comparing its exp with
// the host's.
cudaError_t LaunchControlledFixedMassProbe(const float* x, int64_t count,
                                           float x_max, uint64_t* out,
                                           cudaStream_t stream);

}  // namespace flashsampler

#endif  // FLASHSAMPLER_KERNELS_CONTROLS_CONTROLLED_SAMPLER_H_
