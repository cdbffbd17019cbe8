// Step 4 of the vLLM order: x = l * (1 / T), with 1 / T rounded to fp32 once
// per row, as every backend does (docs/design.md#invariance). Greedy rows
// (SamplingParams::greedy(): T < 1e-5, T = 0 included) use 1 / T = 1: their
// logprobs are those of T = 1, and a tiny T never scales logits to inf.
#ifndef FLASHSAMPLER_SERVICE_BACKENDS_CPU_TEMPERATURE_H_
#define FLASHSAMPLER_SERVICE_BACKENDS_CPU_TEMPERATURE_H_

#include "service/backends/sampling_params.h"

namespace flashsampler {
namespace cpu {

// 1 / T in fp32; 1 for greedy rows.
float InverseTemperature(const SamplingParams& params);

// l * inv_t, with -0 folded into +0 (one value of the sampling order).
inline float ScaleLogit(float l, float inv_t) {
  float x = l * inv_t;
  if (x == 0.0f) x = 0.0f;
  return x;
}

}  // namespace cpu
}  // namespace flashsampler

#endif  // FLASHSAMPLER_SERVICE_BACKENDS_CPU_TEMPERATURE_H_
